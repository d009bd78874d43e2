"""ppoflow.cli.console: what the terminal says while nothing is committed, and the way on that the
summary of a run suggests."""

from __future__ import annotations

from ppoflow.cli.console import _Progress, deployment_config, print_summary
from ppoflow.infra.data import storage
from ppoflow.infra.experiment.manifest import ExperimentPaths
from tests.support.configs import make_config


def _notes(progress: _Progress, seconds: range) -> dict[int, str]:
    """The notes the progress printer gives at each second of ``seconds`` after the last news. The
    last news is moved to a whole second, so that ``(t0 + s) - t0`` is exactly ``s`` in floating
    point (from an arbitrary ``time.monotonic()`` it can come out a hair under, and a note due at
    630 s would be seen at 631)."""
    progress.last_news = t0 = float(int(progress.last_news))
    return {s: line for s in seconds if (line := progress.note(t0 + s)) is not None}


def test_while_the_run_starts_it_says_so_at_a_rising_interval(tmp_path):
    """A cold start (groups, models, on a GPU vLLM's compile and graph capture) is not a stall: one
    note at 90 s that says what starting is, the next at 270 s, then 630 s; none says "no
    iteration committed"."""
    cfg = make_config(tmp_path, str(tmp_path / "model"), ["x.parquet"])
    progress = _Progress(cfg, print, quiet_s=90)
    notes = _notes(progress, range(0, 700))
    assert sorted(notes) == [90, 270, 630]
    for line in notes.values():
        assert line.startswith("... ") and "iteration 1, its first, is starting" in line
        assert "compiles and captures its graphs" in line and "device slots" in line
        assert "no iteration committed" not in line
    assert notes[90].startswith("... 90 s into the run") and notes[270].startswith("... 270 s into the run")

    paths = ExperimentPaths.of(cfg)
    for task in ("generate", "advantage"):
        storage.write_json_atomic(paths.receipt(1, task), {"task": task})
    line = progress.quiet_line(100)
    assert line.startswith(
        "... 100 s into the run: iteration 1, its first, has finished advantage, generate;"
    )
    assert "no iteration committed" not in line


def test_after_a_commit_a_silence_is_a_stall_note_every_quiet_s(tmp_path):
    cfg = make_config(tmp_path, str(tmp_path / "model"), ["x.parquet"])
    lines: list[str] = []
    progress = _Progress(cfg, lines.append, quiet_s=90)
    paths = ExperimentPaths.of(cfg)
    storage.write_json_atomic(paths.file(1, "metrics.json"), {})
    storage.write_json_atomic(paths.manifest, {"iteration": 1})
    progress.poll()
    assert lines and lines[0].startswith("iteration    1 |") and not progress.starting
    notes = _notes(progress, range(0, 300))
    assert sorted(notes) == [90, 180, 270]
    assert notes[90] == (
        "... no iteration committed for 90 s: iteration 2 has no finished task yet (the Prefect UI "
        "shows the running task)"
    )
    for task in ("generate", "advantage"):
        storage.write_json_atomic(paths.receipt(2, task), {"task": task})
    line = progress.quiet_line()
    assert line.startswith(
        "... no iteration committed for 90 s: iteration 2 has finished advantage, generate;"
    )
    assert "background writes" in line and "device slots" not in line


def test_the_deployment_is_given_a_config_it_can_read(tmp_path, monkeypatch):
    """``prefect deployment run ppo/iteration`` without ``-p config=`` trains the embedded demo, not
    the user's experiment: the summary names the config, as a path the deployment's process can
    read (absolute: it runs in the directory ``prefect deploy`` ran in)."""
    cfg = make_config(tmp_path, str(tmp_path / "model"), ["x.parquet"])
    monkeypatch.chdir(tmp_path)
    source, note = deployment_config(cfg, "exp.yaml")
    assert source == str(tmp_path / "exp.yaml") and note == ""
    assert deployment_config(cfg, "s3://bucket/exp.yaml") == ("s3://bucket/exp.yaml", "")
    # --set overrides: the file alone lacks them; the config the experiment recorded holds them
    recorded = str(tmp_path / "runs" / "exp" / "configs" / "abc.yaml")
    source, note = deployment_config(cfg, "exp.yaml", ["rollout.n=4"], recorded)
    assert source == recorded and "--set overrides" in note
    source, note = deployment_config(cfg, "memory://configs/exp.yaml")
    assert source is None and "cannot read" in note and "memory://configs/exp.yaml" in note
    relative = make_config(tmp_path, "model", ["x.parquet"], **{"storage.root": "runs"})
    source, note = deployment_config(relative, "exp.yaml")
    assert source == str(tmp_path / "exp.yaml") and "storage.root 'runs' is relative" in note

    lines: list[str] = []
    print_summary(cfg, {"wall_s": 1.0, "flow_run_id": None}, config_path="exp.yaml", out=lines.append)
    text = "\n".join(lines)
    assert f"deployment run ppo/iteration -p config={tmp_path / 'exp.yaml'} -p iterations=20" in text
    assert "ppoflow run exp.yaml --iterations 20" in text
