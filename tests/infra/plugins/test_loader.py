"""ppoflow.infra.plugins.loader: the one loader of the objects a config names by import path.
Module paths and file paths load; a file is run once however many settings name it; every
failure (a malformed spec, a missing file, module, dependency or name, a module that fails as it
runs) is one error that names the setting, the problem and the fix."""

from __future__ import annotations

import sys
import warnings

import pytest

from ppoflow.infra.plugins.loader import load_object

SETTING = "rollout.multi_turn.tools"
FORMS = "write it as 'package.module:name' or 'path/to/file.py:name'"

VALUE = object()


def test_a_module_path_and_a_file_path(tmp_path):
    assert load_object("tests.infra.plugins.test_loader:VALUE", SETTING) is VALUE
    f = tmp_path / "user_objects.py"
    f.write_text(
        "import dataclasses\nCOUNT = [0]\nCOUNT[0] += 1\n@dataclasses.dataclass\nclass Thing:\n    x: int = 1\n"
    )
    thing = load_object(f"{f}:Thing", "rollout.multi_turn.environment", "Class")
    assert thing().x == 1 and sys.modules[thing.__module__].__file__ == str(f)
    # a second setting naming the same file gets the same module: it ran once
    count = load_object(f"{f}:COUNT", SETTING)
    assert count == [1] and sys.modules[thing.__module__].COUNT is count


def test_a_moved_module_loads_with_a_deprecation_warning(monkeypatch):
    from ppoflow.infra.plugins import loader
    from tests.support.rewards import always_nan

    # (the real entries name top-level ``infra``, importable from a checkout's root as it is)
    monkeypatch.setitem(loader.MOVED_MODULES, "old_layout_xyz.rewards", "tests.support.rewards")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn = load_object("old_layout_xyz.rewards:always_nan", "reward.custom_function", "function")
    assert fn is always_nan
    (warning,) = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert "reward.custom_function='old_layout_xyz.rewards:always_nan'" in str(warning.message)
    assert "write 'tests.support.rewards:always_nan' in the config" in str(warning.message)


@pytest.mark.parametrize(
    "spec, problem",
    [
        ("tests.support.rewards", "the module or the name is missing (a ':' separates them)"),
        ("tests.support.rewards:", "the module or the name is missing (a ':' separates them)"),
        (":always_nan", "the module or the name is missing (a ':' separates them)"),
        ("tests.support.rewards:1fn", "'1fn' (after the last ':') is not a Python name"),
        ("tests.support.rewards:a.b", "'a.b' (after the last ':') is not a Python name"),
        ("my-pkg.rewards:score", "'my-pkg.rewards' is neither a dotted module name"),
        ("tests/support/rewards:always_nan", "'tests/support/rewards' is neither a dotted module name"),
        ("pkg:mod:fn", "'pkg:mod' is neither a dotted module name"),
        (" tests.support.rewards:always_nan", "spaces around the spec"),
        (None, "expected a string"),
    ],
)
def test_a_malformed_spec_names_the_setting_the_problem_and_the_fix(spec, problem):
    with pytest.raises(ValueError) as err:
        load_object(spec, SETTING)
    text = str(err.value)
    assert text.startswith(f"{SETTING}={spec!r}: ") and problem in text and FORMS in text


def test_a_missing_file_module_dependency_or_name(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        load_object("no/such/file.py:fn", SETTING)
    assert str(err.value).startswith(f"{SETTING}='no/such/file.py:fn': file no/such/file.py does not exist")
    assert "relative paths resolve against" in str(err.value) and "check the path" in str(err.value)

    with pytest.raises(ImportError) as err:
        load_object("no_such_pkg.mod:fn", SETTING)
    assert str(err.value).startswith(
        f"{SETTING}='no_such_pkg.mod:fn': cannot import module 'no_such_pkg.mod'"
    )
    assert "install the package or put its directory on PYTHONPATH" in str(err.value)

    f = tmp_path / "needs_dep.py"
    f.write_text("import no_such_dependency_xyz\ndef fn():\n    pass\n")
    with pytest.raises(ImportError) as err:
        load_object(f"{f}:fn", SETTING)
    assert "imports 'no_such_dependency_xyz', which is not installed here; install it" in str(err.value)
    assert str(err.value).startswith(f"{SETTING}=")

    with pytest.raises(AttributeError) as err:
        load_object("tests.support.rewards:missing", "reward.custom_function", "function")
    text = str(err.value)
    assert text.startswith("reward.custom_function='tests.support.rewards:missing': module")
    assert "has no 'missing'" in text and "always_nan" in text and "name one of them" in text


def test_a_module_that_fails_as_it_runs(tmp_path):
    f = tmp_path / "broken.py"
    f.write_text("def fn(:\n    pass\n")
    with pytest.raises(ImportError) as err:
        load_object(f"{f}:fn", SETTING)
    text = str(err.value)
    assert text.startswith(f"{SETTING}=") and "raised SyntaxError" in text and "fix the module" in text
    assert isinstance(err.value.__cause__, SyntaxError)
    assert not [m for m in sys.modules.values() if getattr(m, "__file__", None) == str(f)]
    f2 = tmp_path / "raises.py"
    f2.write_text("raise RuntimeError('no config here')\n")
    with pytest.raises(ImportError, match=r"raised RuntimeError: no config here; fix the module"):
        load_object(f"{f2}:fn", SETTING)
