"""A multi-turn rollout against an OpenEnv environment server (OpenEnv's own server, started on
127.0.0.1 by the test; tests/support/openenv_server.py): the rollout's episodes are what the
server saw and said. The policy turns the server received are the row's sampled policy tokens,
decoded; the rewards on each row are the server's rewards for its episode; each observation the
server returned is in the episode between two policy turns; the adapter's errors name the
setting to fix."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("openenv.core")
pytestmark = pytest.mark.slow

P, R, TURN, ROWS = 48, 72, 6, 4


@pytest.fixture(scope="module")
def server():
    from tests.support.openenv_server import serve
    from tests.support.ports import free_port

    with serve(free_port()) as url:
        yield url


@pytest.fixture(scope="module")
def rollout(server, tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ppoflow.demo.tiny_models import save_tiny_model
    from ppoflow.infra.config import RolloutConfig
    from ppoflow.infra.data.dataproto import DataProto
    from ppoflow.infra.models.rollout_engines import engine_spec
    from ppoflow.workers.rollout.hf_rollout import HFRollout
    from ppoflow.workers.rollout.multiturn import MultiTurnRollout
    from tests.support.openenv_server import records

    path = save_tiny_model(str(tmp_path_factory.mktemp("oe") / "tiny"), seed=0)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    cfg = RolloutConfig.model_validate(
        {
            "engine": "hf",
            "prompt_length": P,
            "response_length": R,
            "multi_turn": {
                "enable": True,
                "environment": "openenv",
                "tools": [],
                "max_turns": 3,
                "max_turn_tokens": TURN,
                "env_kwargs": {"base_url": server, "reset_from_row": {"target": "target"}},
            },
        }
    )
    engine = HFRollout(cfg, model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    engine.spec = engine_spec("hf")  # what build_rollout sets on the engines it builds
    mt = MultiTurnRollout(engine, cfg, tok)
    prompts = DataProto.from_dict(
        {
            "input_ids": torch.ones((ROWS, P), dtype=torch.long),
            "attention_mask": torch.ones((ROWS, P), dtype=torch.long),
        },
        {
            "raw_prompt": np.array(
                [[{"role": "user", "content": f"guess {i}"}] for i in range(ROWS)], dtype=object
            ),
            "extra_info": np.array([{"target": i} for i in range(ROWS)], dtype=object),
        },
        meta_info={"seed": 0},
    )
    before = len(records(server))
    out = mt.generate_sequences(prompts)
    return {"out": out, "tok": tok, "log": records(server)[before:]}


def _episodes(log):
    """The server's records by the target its episode was reset with."""
    by_id = {}
    for episode, kind, what, reward, done in log:
        by_id.setdefault(episode, []).append((kind, what, reward, done))
    return {steps[0][1]["target"]: steps[1:] for steps in by_id.values()}


def test_the_rollout_is_what_the_server_saw(rollout):
    out, tok = rollout["out"], rollout["tok"]
    episodes = _episodes(rollout["log"])
    assert sorted(episodes) == list(range(ROWS))
    b = out.batch
    assert int(b["num_turns"].max()) > 1  # multi-turn: the server's observations went back to the policy
    for row in range(ROWS):
        steps = episodes[row]
        turns = int(b["num_turns"][row])
        assert len(steps) == turns >= 1
        # the policy's tokens of turn t, decoded as the rollout hands them over, are the action
        policy = b["response_mask"][row].bool()
        for t, (_, action, _, _) in enumerate(steps):
            toks = b["responses"][row][policy & (b["turn_ids"][row] == t)].tolist()
            assert tok.decode(toks, skip_special_tokens=True) == action
        # the server's rewards are the row's
        assert float(b["env_scores"][row].sum()) == pytest.approx(sum(s[2] for s in steps))
        # every observation the episode went on after is in it, as the next message
        text = tok.decode(b["responses"][row][b["attention_mask"][row, -R:].bool()].tolist())
        assert text.count('"hint": ') == sum(not s[3] for s in steps[: turns - 1])


def test_errors_name_the_setting(server):
    from ppoflow.infra.envs import EnvSettings
    from ppoflow.infra.envs.openenv import OpenEnvEnvironment, observation_text
    from tests.support.ports import free_port

    with pytest.raises(ValueError, match="env_kwargs.base_url is missing"):
        OpenEnvEnvironment(EnvSettings())
    env = OpenEnvEnvironment(EnvSettings(), base_url=server, reset_from_row={"target": "goal"})
    with pytest.raises(
        KeyError, match=r"extra_info\['goal'\], which the row does not have \(it has: target\)"
    ):
        env.reset({"raw_prompt": "x", "extra_info": {"target": 1}})
    env.close()
    down = OpenEnvEnvironment(EnvSettings(), base_url=f"http://127.0.0.1:{free_port()}", connect_timeout_s=2)
    with pytest.raises(ConnectionError, match="OpenEnv server http://127.0.0.1:.*is it running"):
        down.reset({"raw_prompt": "x"})
    with pytest.raises(KeyError, match="no field 'text' .fields: hint, tries"):
        observation_text({"hint": "h", "tries": 1}, "text")
    assert observation_text({"hint": "h", "done": False, "reward": 1, "metadata": {}}) == "h"
