"""Environments by name or import path (the registry and the one user-object loader, with errors
that name the setting and the fix), and a user's environment from a file: the multi-turn example."""

from __future__ import annotations

import os

import pytest

from ppoflow.infra.envs import EnvSettings, ToolEnv, build_tool, env_class


def test_environment_names_and_import_paths(tmp_path):
    assert env_class("tools") is ToolEnv
    assert env_class("tests.support.multiturn_envs:ScriptedEnv").__name__ == "ScriptedEnv"
    f = tmp_path / "my_env.py"
    f.write_text("from ppoflow.infra.envs import ToolEnv\nclass Mine(ToolEnv):\n    pass\nnot_env = 3\n")
    assert env_class(f"{f}:Mine").__name__ == "Mine"
    with pytest.raises(KeyError, match="not registered.*register_env"):
        env_class("nope")
    with pytest.raises(TypeError, match="not a subclass of ppoflow.infra.envs.Environment"):
        env_class(f"{f}:not_env")
    # import paths go through the one loader: its errors name the setting and the fix
    with pytest.raises(
        ImportError, match=r"^rollout.multi_turn.environment='no_such_mod:Env': cannot import"
    ):
        env_class("no_such_mod:Env")


def test_examples_parse_and_the_guessing_environment_rewards_each_turn():
    from ppoflow.infra.config import load_config
    from tests.support.paths import ROOT

    for name in ("gpu.yaml", "cpu.yaml"):
        cfg = load_config(os.path.join(ROOT, "examples", "multiturn", name))
        assert cfg.rollout.multi_turn.enable and cfg.rollout.multi_turn.tools == ["python"]
    path = os.path.join(ROOT, "examples", "multiturn", "guess_env.py")
    cls = env_class(f"{path}:GuessEnv")
    env = cls(EnvSettings(tools=(build_tool(f"{path}:hint"),)), wrong_guess_reward=-0.2)
    env.reset({"ground_truth": "42"})
    out = env.step('<tool_call>{"name": "hint", "arguments": {"number": "1"}}</tool_call>')
    assert out.messages[0]["content"] == "even" and out.reward == 0.0 and not out.done
    out = env.step("50")
    assert (out.messages[0]["content"], out.reward, out.done) == ("lower", -0.2, False)
    out = env.step("It is 42")
    assert (out.reward, out.done) == (1.0, True)
