"""A veRL command run as a user runs it: the quickstart's overrides (tests/data/verl_commands/)
with the test's tiny model and data, GRPO-shaped and tiny batches by further overrides, through
``ppoflow run --verl``; its ``total_training_steps=1`` is the run's length."""

from __future__ import annotations

import json
import os

import pytest

from ppoflow.cli.main import main
from tests.infra.config.test_verl import command

pytestmark = pytest.mark.slow


def test_the_quickstart_command_with_tiny_overrides_commits_an_iteration(
    prefect_harness, flow_assets, tmp_path, capsys
):
    swap = {
        "data.train_files": flow_assets["data"],
        "actor_rollout_ref.model.path": flow_assets["model"],
        "critic.model.path": flow_assets["model"],
    }
    items = [
        f"{k}={swap.get(k, v)}"
        for k, _, v in (line.partition("=") for line in command("quickstart_ppo_gsm8k"))
    ]
    items += [
        "~data.val_files",  # the test's data has no held-out split
        "algorithm.adv_estimator=grpo",  # one worker group: no critic, no reference
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.name=hf",  # the rollout engine is not what this test is about
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "data.max_prompt_length=64",
        "data.max_response_length=8",
        "trainer.device=cpu",
        "trainer.total_training_steps=1",
        f"trainer.default_local_dir={tmp_path}/checkpoints/quickstart",
    ]
    code = main(["run", "--verl", *items])
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    ignored = next(
        line
        for line in out.splitlines()
        if line.startswith("veRL: 9 key(s) ignored (no meaning in ppoflow): ")
    )
    assert "trainer.logger" in ignored and "actor_rollout_ref.rollout.gpu_memory_utilization" in ignored
    assert "runs to iteration 1 (trainer.total_training_steps=1); 0 committed, 1 to run" in out
    with open(os.path.join(tmp_path, "checkpoints", "quickstart", "manifest.json")) as f:
        assert json.load(f)["iteration"] == 1
    assert main(["run", "--verl", *items]) == 0  # the same command again: veRL's length is reached
    assert "nothing to run" in capsys.readouterr().out
