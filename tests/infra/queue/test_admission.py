"""ppoflow.infra.queue.admission: the default keeps the staleness bound, the config swaps in a
class of its own (built with the section), and a class without ``admissible`` is refused with
the setting named."""

from __future__ import annotations

import pytest

from ppoflow.infra.config import parse_config
from ppoflow.infra.queue.admission import BoundedStaleness, admission_of


def _settings(tmp_path, **over):
    return parse_config(
        {
            "model": {"path": "m"},
            "data": {"train_files": ["train.parquet"]},
            "storage": {"root": str(tmp_path), "experiment": "exp"},
            "asynchronous": {"enable": True, "max_staleness": 2, **over},
        }
    ).asynchronous


def test_the_default_admits_batch_k_once_version_k_minus_1_minus_s_is_published(tmp_path):
    admission = admission_of(_settings(tmp_path))
    assert isinstance(admission, BoundedStaleness)
    assert list(admission.admissible(3, None, None)) == []  # no version yet
    assert list(admission.admissible(3, 3, None)) == [4, 5, 6]  # up to 3 + 1 + 2
    assert list(admission.admissible(3, 5, 6)) == [4, 5, 6]  # never past until


def test_the_config_names_another_class_and_a_class_without_the_method_is_refused(tmp_path):
    module = tmp_path / "my_admission.py"
    module.write_text(
        "class OneAhead:\n"
        "    def __init__(self, settings):\n"
        "        self.settings = settings\n"
        "    def admissible(self, committed, latest, until):\n"
        "        return [] if latest is None else [committed + 1]\n"
        "class NoMethod:\n"
        "    def __init__(self, settings):\n"
        "        pass\n"
    )
    settings = _settings(tmp_path, admission=f"{module}:OneAhead")
    admission = admission_of(settings)
    assert admission.settings is settings  # type: ignore[attr-defined]
    assert list(admission.admissible(3, 9, None)) == [4]
    with pytest.raises(TypeError, match=r"asynchronous.admission=.*NoMethod has no admissible"):
        admission_of(_settings(tmp_path, admission=f"{module}:NoMethod"))
