"""Rewards: what scores a response, by ``data_source`` or by the config's own reward.

    @register_reward("my_org/my_dataset")
    def my_rule(data_source, solution_str, ground_truth, extra_info=None) -> float | dict: ...

    scores = score_batch(data_sources, solution_strs, ground_truths, extra_infos)          # (B,) float32
    scores = score_batch(..., custom_function="my_pkg.rewards:score")  # one reward for every row

A reward function gets the decoded response (``solution_str``, special tokens removed), the row's
``ground_truth`` and ``extra_info`` and returns a float, or a dict with a ``"score"`` float and
any other numbers (reported by :func:`score_batch_with_info`). A :class:`BatchScorer` scores many
rows in one call instead (a reward service, a batched verifier). ``reward.custom_function`` names
one by import path (``"package.module:function"`` or ``"path/to/file.py:function"``), which then
scores every row.

- :mod:`~ppoflow.infra.rewards.registry`: ``RewardFn``, ``BatchScorer``, ``ScoreRequest``,
  ``RewardError``; ``register_reward``, ``get_reward_fn``, ``known_sources``,
  ``load_custom_function``;
- :mod:`~ppoflow.infra.rewards.scoring`: ``score_requests``, ``score_batch``,
  ``score_batch_with_info``, ``score_answer`` (one row: how environments score an answer);
- :mod:`~ppoflow.infra.rewards.rules`: the rules built in (GSM8K, MATH; answers compared by
  math-verify), registered on import;
- :mod:`~ppoflow.infra.rewards.reasoning_gym`: ``reasoning_gym/<task>`` rows, scored by the
  task's own scorer from the entry the row carries (registered on import; reasoning-gym itself is
  imported when a row is scored);
- :mod:`~ppoflow.infra.rewards.remote`: ``RemoteScorer``, a reward service over HTTP
  (``reward.remote``); :func:`~ppoflow.infra.rewards.remote.run_reward` is the reward a run's
  config names;
- :mod:`~ppoflow.infra.rewards.rollout_batch`: a rollout batch decoded and scored (responses, or
  multi-turn episodes by their environment's rewards), and a score placed on the last response
  token; imported on its own (torch, DataProto).

A reward named by import path loads through :mod:`ppoflow.infra.plugins` (``load_object``), as
environments, tools and admission policies do.

The flow's tasks score here (``advantage``, dynamic sampling in ``generate``, ``evaluate``), the
ranks' environments too (:mod:`ppoflow.infra.envs`); the reward model, a model in ranks of its own,
is a worker (``ppoflow.workers.reward_model_worker``) that places its score as
:func:`~ppoflow.infra.rewards.rollout_batch.on_last_token` does.
"""

from ppoflow.infra.rewards.reasoning_gym import reasoning_gym_score
from ppoflow.infra.rewards.registry import (
    BatchScorer,
    Reward,
    RewardError,
    RewardFn,
    RewardTypeError,
    ScoreRequest,
    get_reward_fn,
    known_sources,
    load_custom_function,
    register_reward,
)
from ppoflow.infra.rewards.rules import extract_gsm8k_answer, gsm8k_score, math_score, math_verify_score
from ppoflow.infra.rewards.scoring import score_answer, score_batch, score_batch_with_info, score_requests

__all__ = [
    "register_reward",
    "get_reward_fn",
    "known_sources",
    "load_custom_function",
    "score_batch",
    "score_batch_with_info",
    "score_requests",
    "score_answer",
    "gsm8k_score",
    "extract_gsm8k_answer",
    "math_score",
    "math_verify_score",
    "reasoning_gym_score",
    "RewardFn",
    "Reward",
    "BatchScorer",
    "ScoreRequest",
    "RewardError",
    "RewardTypeError",
]
