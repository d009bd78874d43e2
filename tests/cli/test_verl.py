"""``ppoflow run --verl`` without running a flow: ``--print-config``, the refusal error, a config
file's ``verl:`` section with ``--verl`` and ``--set``, and the iterations veRL's length asks for."""

from __future__ import annotations

import argparse

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from ppoflow.cli.main import main
from ppoflow.cli.verl import announce, iterations, run_config
from ppoflow.infra.config import parse_config
from tests.infra.config.test_verl import BASE, command


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_print_config_is_yaml_that_parses_back_to_the_same_config(capsys, tmp_path):
    code, out, err = run_cli(capsys, "run", "--print-config", "--verl", *command("quickstart_ppo_gsm8k"))
    assert code == 0, err
    assert "# veRL keys mapped (18):" in out and "#   trainer.logger: console: ppoflow prints" in out
    assert "#   data.train_batch_size -> data.train_batch_size" in out
    data = yaml.safe_load(out)
    cfg = parse_config(data)
    assert cfg.data.train_batch_size == 256 and cfg.critic.enable and cfg.algorithm.adv_estimator == "gae"
    assert (
        parse_config(yaml.safe_load(yaml.safe_dump(cfg.model_dump(mode="json")))).model_dump()
        == cfg.model_dump()
    )
    path = tmp_path / "plain.yaml"  # without --verl: the config alone
    path.write_text(yaml.safe_dump({"model": {"path": "m"}, "data": {"train_files": ["t.parquet"]}}))
    code, plain, err = run_cli(capsys, "run", str(path), "--print-config")
    assert code == 0 and "veRL" not in plain, err
    assert parse_config(yaml.safe_load(plain)).data.train_batch_size == 16


def test_refused_keys_are_one_error_with_exit_status_2(capsys):
    argv = [
        "actor_rollout_ref.actor.strategy=megatron",
        "actor_rollout_ref.rollout.name=sglang",
        "trainer.nnodes=2",
    ]
    code, out, err = run_cli(capsys, "run", "--verl", *BASE, *argv, "trainer.loger=console")
    assert code == 2 and out == ""
    assert "4 setting(s) ppoflow cannot honour (nothing was started)" in err
    for key in [a.partition("=")[0] for a in argv] + ["trainer.loger"]:
        assert key in err
    assert "the nearest is trainer.logger" in err and "docs/multinode.md" in err


def test_a_config_file_with_a_verl_section_then_verl_then_set(tmp_path, capsys):
    path = tmp_path / "exp.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "verl": ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2", *BASE],
                "data": {"train_batch_size": 8},
            }
        )
    )
    code, out, err = run_cli(
        capsys,
        "run",
        str(path),
        "--print-config",
        "--set",
        "rollout.n=6",
        "--verl",
        "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=3",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
    )
    assert code == 0, err
    cfg = parse_config(yaml.safe_load(out))
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.rollout.n == 6 and cfg.data.train_batch_size == 8
    assert cfg.actor.ppo_mini_batch_size == 8


def _args(*verl: str, n: int | None = None) -> argparse.Namespace:
    return argparse.Namespace(config=None, verl=[*BASE, *verl], overrides=[], iterations=n, run_parser=None)


def test_iterations_run_to_verls_length(tmp_path):
    rows = pa.Table.from_pylist([{"prompt": "x"}] * 10)
    pq.write_table(rows, tmp_path / "a.parquet")
    pq.write_table(rows.slice(0, 3), tmp_path / "b.parquet")
    storage = [f"trainer.default_local_dir={tmp_path}/ckpt/exp", "data.train_batch_size=4"]
    lines: list[str] = []
    files = f"data.train_files=[{tmp_path}/a.parquet,{tmp_path}/b.parquet]"
    args = _args(*storage, files, "trainer.total_epochs=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4")
    cfg, t = run_config(args)
    assert iterations(args, cfg, t, out=lines.append) == 2 * (13 // 4)
    assert "runs to iteration 6" in lines[0] and "13 rows" in lines[0] and "0 committed, 6 to run" in lines[0]
    args = _args(
        *storage, files, "trainer.total_training_steps=5", "actor_rollout_ref.actor.ppo_mini_batch_size=4"
    )
    assert iterations(args, *run_config(args), out=lines.append) == 5
    args.iterations = 2  # an explicit --iterations wins
    assert iterations(args, *run_config(args), out=lines.append) == 2
    plain = argparse.Namespace(iterations=None)
    assert iterations(plain, cfg, None) == 1
    announced: list[str] = []
    announce(run_config(_args("trainer.logger=console", "trainer.experiment_name=a b"))[1], announced.append)
    assert announced[0] == "veRL: 2 key(s) ignored (no meaning in ppoflow): trainer.logger, data.val_files"
    assert "'a-b'" in announced[1]


def test_run_needs_a_config_or_verl(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["run", "--iterations", "1"])
    assert exc.value.code == 2 and "--verl" in capsys.readouterr().err
