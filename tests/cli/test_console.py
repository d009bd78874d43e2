"""ppoflow.cli.console: what the terminal says while nothing is committed."""

from __future__ import annotations

from ppoflow.cli.console import _Progress
from ppoflow.infra.data import storage
from ppoflow.infra.experiment.manifest import ExperimentPaths
from tests.support.configs import make_config


def test_the_quiet_notice_names_what_the_next_iteration_has_finished(tmp_path):
    cfg = make_config(tmp_path, str(tmp_path / "model"), ["x.parquet"])
    lines: list[str] = []
    progress = _Progress(cfg, lines.append, quiet_s=90)
    assert "iteration 1 has no finished task yet" in progress.quiet_line()
    assert "device slots" in progress.quiet_line()
    paths = ExperimentPaths.of(cfg)
    for task in ("generate", "advantage"):
        storage.write_json_atomic(paths.receipt(1, task), {"task": task})
    line = progress.quiet_line()
    assert line.startswith(
        "... no iteration committed for 90 s: iteration 1 has finished advantage, generate;"
    )
    assert "background writes" in line and "device slots" not in line
