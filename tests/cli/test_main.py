"""``ppoflow`` commands on the small demo experiment of tests/scenarios/test_demo.py (built once per session),
and the errors for bad arguments and missing experiments."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from ppoflow.cli.main import main


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# ------------------------------------------------------------------------------ bad arguments


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["bogus"],
        ["run"],
        ["demo", "--iterations", "-1"],
        ["demo", "--iterations", "many"],
        ["export-hf", "x"],
        ["tensorboard"],
    ],
)
def test_bad_command_lines_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "usage: ppoflow" in capsys.readouterr().err


def test_missing_things_are_clear_errors(capsys, tmp_path):
    code, _, err = run_cli(capsys, "status", str(tmp_path / "nowhere"))
    assert code == 1 and "no experiment at" in err and "no such directory" in err
    code, _, err = run_cli(capsys, "status", str(tmp_path))
    assert code == 1 and "holds no manifest.json" in err
    code, _, err = run_cli(capsys, "run", str(tmp_path / "missing.yaml"))
    assert code == 2 and "does not exist" in err
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {path: x}\ndata: {train_files: [x]}\nrollout: {n: lots}\n")
    code, _, err = run_cli(capsys, "run", str(bad))
    assert code == 2 and "rollout.n" in err
    code, _, err = run_cli(capsys, "run", str(bad), "--set", "novalue")
    assert code == 2 and "KEY=VALUE" in err


def test_console_script_is_installed():
    exe = os.path.join(os.path.dirname(sys.executable), "ppoflow")
    assert os.path.exists(exe), "the ppoflow console script is not installed (pip install -e .)"
    out = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "demo" in out.stdout and "export-hf" in out.stdout


def test_a_bad_config_is_told_before_anything_starts(tmp_path):
    """The console script, as a user runs it: the config's error, exit 2, and no temporary Prefect
    server started and stopped for it (it used to be, which took ~10 s and printed its stop line)."""
    exe = os.path.join(os.path.dirname(sys.executable), "ppoflow")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {path: x}\ndata: {train_files: [x], train_batch_size: 4}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    out = subprocess.run([exe, "run", str(bad)], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2, out.stderr
    assert "train_batch_size=4 must be a multiple of actor.ppo_mini_batch_size" in out.stderr
    assert "temporary server" not in out.stdout + out.stderr and "Traceback" not in out.stderr


# ------------------------------------------------------------------------------ on the demo


@pytest.mark.slow
def test_run_continues_a_copy_of_the_experiment(demo, capsys, tmp_path):
    """``ppoflow run CONFIG --iterations 1`` on a copy of the demo (so the shared one stays at 2)."""
    root = str(tmp_path / "copy")
    shutil.copytree(demo["root"], root)
    cfg_path = os.path.join(root, "config.yaml")
    code, out, err = run_cli(capsys, "run", cfg_path, "--iterations", "1", "--set", f"storage.root={root}")
    assert code == 0, err
    assert "iteration    3 |" in out and "iteration 1:" in out and "iteration 3:" in out
    # the way on, with the run's override: the config file alone would train the original experiment
    assert f"ppoflow run {cfg_path} --iterations 20 --set storage.root={root}" in out
    line = next(x for x in out.splitlines() if "deployment run ppo/iteration" in x)
    suggested = line.split("-p config=")[1].split()[0]
    assert suggested.startswith(os.path.join(root, "larger-digit", "configs")), line
    assert "--set overrides" in line
    from ppoflow.infra.config import load_config

    assert load_config(suggested).storage.experiment_url == os.path.join(root, "larger-digit")
    assert load_config(cfg_path).storage.experiment_url != os.path.join(root, "larger-digit")
    code, out, _ = run_cli(capsys, "status", os.path.join(root, "larger-digit"), "--json")
    assert json.loads(out)["manifest"]["iteration"] == 3
