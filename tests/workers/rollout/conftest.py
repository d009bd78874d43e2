"""The vLLM rollout scenarios (tests/support/rollout/vllm_scenario.py), each run once per session
whichever of the rollout's test modules asks first."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    from ppoflow.demo.tiny_models import save_tiny_model

    return save_tiny_model(str(tmp_path_factory.mktemp("rollout") / "tiny"), seed=0)


@pytest.fixture(scope="session")
def dp2(tiny_model, tmp_path_factory):
    """The scenario on TP=1, DP=2 engines (:func:`~tests.support.rollout.vllm_scenario.run_dp2`)."""
    from tests.support.rollout.vllm_scenario import run_dp2

    return run_dp2(tiny_model, str(tmp_path_factory.mktemp("dp2")))


@pytest.fixture(scope="session")
def tp2(tiny_model, dp2, tmp_path_factory):
    """The scenario on one TP=2 engine (:func:`~tests.support.rollout.vllm_scenario.run_tp2`)."""
    from tests.support.rollout.vllm_scenario import run_tp2

    return run_tp2(tiny_model, dp2, str(tmp_path_factory.mktemp("tp2")))
