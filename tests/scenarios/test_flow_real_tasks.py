"""Real tasks and reward services in the real flow (2 CPU ranks, the tiny policy):

- files written from two reasoning-gym tasks train an iteration and are evaluated, each held-out
  response scored by the task's own scorer (checked by calling reasoning-gym by hand);
- a reward service on 127.0.0.1 (tests/support/reward_server.py) scores training and evaluation
  alike: the evaluation's scores are the service's rule applied to its responses;
- a service that answers malformed JSON (after a retry: a RewardError, not retried by the task)
  or stalls (retried by the scorer and the task, then the run fails) leaves nothing committed.

Transformers generates, on the actor's own module (``rollout.engine: hf``): the claims are about
tasks and scoring, not the engine, and a group starts in about half vLLM's time.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.ipc
import pytest

from ppoflow.infra.experiment.manifest import ExperimentPaths, read_manifest
from tests.support.configs import LIGHT_HF
from tests.support.prefect_runs import attempts
from tests.support.reward_server import calls, serve

pytestmark = pytest.mark.slow

EVAL = {"evaluation.before_training": True, "evaluation.at_end": True, "evaluation.every": 0}


def _generations(url: str) -> dict[str, list]:
    with pa.OSFile(url) as f:
        return pyarrow.ipc.open_file(f).read_all().to_pydict()


@pytest.fixture(scope="module")
def service():
    from tests.support.ports import free_port

    with serve(free_port()) as url:
        yield url


def test_a_flow_trains_and_evaluates_on_reasoning_gym_tasks(prefect_harness, flow_config, tmp_path):
    rg = pytest.importorskip("reasoning_gym")
    from reasoning_gym.utils import extract_answer

    from ppoflow.flows.ppo import ppo
    from ppoflow.infra.datasets.reasoning_gym import TaskMix, TaskSpec, write_task_mix

    mix = TaskMix(
        tasks=[TaskSpec(name="basic_arithmetic"), TaskSpec(name="leg_counting")],
        train=8,
        test=4,
        system_prompt=None,
    )
    files = write_task_mix(mix, str(tmp_path / "data"))
    cfg = flow_config(
        str(tmp_path / "runs"),
        "rg",
        **LIGHT_HF,
        **EVAL,
        **{
            "data.train_files": [files["train"]],
            "data.val_files": [files["test"]],
            "rollout.prompt_length": 32,
        },
    )
    assert ppo(cfg, iterations=1)["iteration"] == 1
    paths = ExperimentPaths.of(cfg)
    metrics = json.loads(open(paths.file(1, "metrics.json")).read())
    for task in ("basic_arithmetic", "leg_counting"):
        assert f"val/reasoning_gym/{task}/score/mean@1" in metrics
    gen = _generations(paths.file(1, "eval/val/generations.arrow"))
    rows = pq_rows(files["test"])
    by_hand = []
    for i, text in zip(gen["index"], gen["response"]):
        info = rows[i]["extra_info"]
        entry = json.loads(info["reasoning_gym_entry"])
        by_hand.append(rg.get_score_answer_fn(info["task"])(extract_answer(text), entry))
    assert gen["score"] == pytest.approx(by_hand)


def pq_rows(url: str) -> list[dict]:
    import pyarrow.parquet as pq

    return pq.read_table(url).to_pylist()


def test_a_reward_service_scores_training_and_evaluation(
    prefect_harness, flow_config, flow_assets, tmp_path, service
):
    from ppoflow.flows.ppo import ppo

    before = calls(service)["calls"].get("score", 0)
    cfg = flow_config(
        str(tmp_path / "runs"),
        "remote",
        **LIGHT_HF,
        **EVAL,
        **{
            "data.val_files": [flow_assets["data"]],
            "evaluation.max_prompts": 4,
            "reward.rule": False,
            "reward.remote": {"endpoint": f"{service}/score", "batch_size": 3, "token_env": None},
        },
    )
    assert ppo(cfg, iterations=1)["iteration"] == 1
    paths = ExperimentPaths.of(cfg)
    for n in (0, 1):  # before training and after: scored by the service, as its rule says
        gen = _generations(paths.file(n, "eval/val/generations.arrow"))
        assert gen["score"] == pytest.approx([sum(c.isdigit() for c in t) / 10 for t in gen["response"]])
    # two evaluations of 4 rows (2 requests each) and the training batch's 8 responses (3 requests)
    assert calls(service)["calls"]["score"] - before == 2 * 2 + 3


@pytest.mark.parametrize(
    "route, error, tries",
    [("malformed", "RewardError", 1), ("stall", "RewardServiceError", 3)],
)
def test_a_failing_service_commits_nothing(
    prefect_harness, flow_config, tmp_path, service, route, error, tries
):
    from ppoflow.flows.ppo import ppo

    remote = {
        "endpoint": f"{service}/{route}",
        "timeout_s": 0.5,
        "retries": 1,
        "backoff_s": 0.05,
        "token_env": None,
    }
    cfg = flow_config(
        str(tmp_path / "runs"), route, **LIGHT_HF, **{"reward.rule": False, "reward.remote": remote}
    )
    state = ppo(cfg, iterations=1, return_state=True)
    assert state.is_failed()
    result = state.result(raise_on_failure=False)
    assert error in repr(result) and f"reward service {service}/{route}" in str(result)
    assert attempts(state)["advantage"] == tries  # malformed answers: not retried; a stall: retried
    manifest = read_manifest(ExperimentPaths.of(cfg))
    assert manifest is None or manifest.iteration == 0
