"""MultiTurnRollout: episodes of policy turns and environment turns in one rollout row.

Wraps the rank's engine when ``rollout.multi_turn.enable`` (an engine with the ``multi_turn``
capability: ``VLLMRollout``, ``HFRollout``), which samples each turn (``Rollout.sample_turn``).
Every episode of the rank's batch (``B * n``) starts from its environment's ``reset``; then, turn
by turn, the episodes still running are sampled together in the engine (token-id prompts: the
whole history, so vLLM's prefix cache reuses it), each turn is handed to its environment
(``step``, on a thread pool), and the environment's answer is appended as tokens
(``chat_turns.ChatFormat``). An episode ends when its environment says done, after
``max_turns`` policy turns, or when the next turn could not sample a single token within the
budget (``rollout.response_length`` tokens after the prompt, policy and environment together).

Token-in/token-out: the policy's tokens are kept exactly as sampled; only the environment's
text is tokenized. The output row is the whole episode in the usual columns
(``ppoflow.workers.rollout.base``), with these differences:

    responses          (B*n, R)  the episode after the prompt: policy and environment tokens
    response_mask      (B*n, R)  1 on the policy's own tokens only (the loss mask)
    attention_mask     (B*n, P+R) prompt mask ++ 1 on every episode token
    turn_ids           (B*n, R)  int64: turn t (0-based) on the policy's tokens of turn t and on
                                 the environment's tokens that follow it; -1 on padding
    env_scores         (B*n, R)  float32: each step's reward on the last token of its policy turn
    num_turns          (B*n,)    int64: policy turns of the episode
    budget_ended       (B*n,)    int64: 1 when the budget ended the episode (its next turn did not fit)
    prompts            (B*n, P)  the first prompt as the environment's reset rendered it (with the
                                 tools), left-padded to the input's width

Old/ref log-probs and values are computed on every position (one forward over the episode);
``response_mask`` keeps environment tokens out of the losses, the KL terms and the advantage
estimators, which skip masked positions (GAE carries the next policy token's value across an
environment span: the environment's tokens are not actions).

Seeds: each turn's request carries ``request_seed(seed, dp_rank, meta seed, episode, turn)``
(vLLM), or the HF engine's per-call seed from (meta seed, turn), so a retried ``generate``
samples the same episodes, as long as the environment answers the same (a tool stopped at its
time limit under load may not).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ppoflow.infra.config import RolloutConfig
from ppoflow.infra.envs import EnvSettings, StepOutcome, build_tool, env_class
from ppoflow.workers.rollout.base import (
    Rollout,
    SamplingSettings,
    check_prompts,
    prompt_token_lists,
)
from ppoflow.workers.rollout.chat_turns import ChatFormat
from ppoflow.workers.rollout.episodes import Episode, assemble, episode_metrics, last_turn

__all__ = ["MultiTurnRollout"]


class MultiTurnRollout(Rollout):
    """Multi-turn episodes on ``engine`` (see the module docstring)."""

    def __init__(
        self, engine: Rollout, config: RolloutConfig, tokenizer: Any, reward_function: str | None = None
    ):
        spec = engine.spec
        if not spec.can("multi_turn"):  # the config refuses this first; kept for engines built by hand
            raise ValueError(f"rollout.engine={spec.name!r} cannot sample multi-turn episodes")
        self.engine, self.spec = engine, spec
        self.tp_size, self.tp_rank = engine.tp_size, engine.tp_rank
        self.dp_size, self.dp_rank = engine.dp_size, engine.dp_rank
        self.config, self.mt = config, config.multi_turn
        self.tokenizer = tokenizer
        self.format = ChatFormat(tokenizer, self.mt.tool_format)
        self.env_cls = env_class(self.mt.environment)
        tools = tuple(
            build_tool(
                t,
                timeout_s=self.mt.tool_timeout_s,
                memory_mb=self.mt.tool_memory_mb,
                max_chars=self.mt.tool_output_chars,
            )
            for t in self.mt.tools
        )
        self.settings = EnvSettings(tools=tools, reward_function=reward_function, max_turns=self.mt.max_turns)
        self.pad_token_id = int(getattr(engine, "pad_token_id", 0))
        self.calls = 0

    def __getattr__(self, name: str) -> Any:  # the sharding manager and the worker talk to the engine
        if name == "engine":
            raise AttributeError(name)
        return getattr(self.engine, name)

    def shutdown(self) -> None:
        self.engine.shutdown()

    # ------------------------------------------------------------------ episodes
    def _start(self, prompts, n: int) -> list[Episode]:
        nt = prompts.non_tensor_batch
        given = prompt_token_lists(prompts.batch["input_ids"], prompts.batch["attention_mask"])
        episodes = []
        for i in range(len(prompts)):
            row = {k: _plain(v[i]) for k, v in nt.items()}
            for _ in range(n):
                env = self.env_cls(self.settings, **self.mt.env_kwargs)
                reset = env.reset(dict(row))
                schemas = [t.schema() for t in reset.tools]
                if reset.messages is None:
                    tokens = list(given[i])
                else:
                    tokens = self.format.prompt_tokens(reset.messages, schemas)
                episodes.append(Episode(env=env, schemas=schemas, prompt=tokens))
        width = prompts.batch["input_ids"].shape[1]
        longest = max((len(e.prompt) for e in episodes), default=0)
        if longest > width:
            raise ValueError(
                f"a multi-turn prompt rendered with its tools is {longest} tokens, longer than "
                f"rollout.prompt_length={width}: raise rollout.prompt_length"
            )
        return episodes

    def _step_envs(
        self, pool: ThreadPoolExecutor, running: list[Episode], texts: list[str]
    ) -> list[StepOutcome]:
        def one(ep: Episode, text: str) -> StepOutcome:
            try:
                return ep.env.step(text)
            except Exception as exc:
                raise RuntimeError(
                    f"environment {self.mt.environment!r} raised in step(): {type(exc).__name__}: {exc}. "
                    "An environment must answer every turn (tools return their errors as output)"
                ) from exc

        return list(pool.map(one, running, texts))

    def generate_sequences(self, prompts):
        """Run this rank's episodes; columns in the module docstring."""
        if getattr(self.engine, "sleeping", False):
            raise RuntimeError("the vLLM engine is asleep: generate inside the sharding manager's context")
        s = SamplingSettings.resolve(self.config, prompts.meta_info)
        check_prompts(prompts)
        meta_seed = prompts.meta_info.get("seed")
        call = self.calls
        self.calls += 1
        budget = s.response_length
        per_turn = min(self.mt.max_turn_tokens or budget, budget)
        t0 = time.perf_counter()
        episodes = self._start(prompts, s.n)
        sample_s = env_s = 0.0
        sampled = 0
        with ThreadPoolExecutor(max_workers=self.mt.env_workers) as pool:
            for turn in range(self.mt.max_turns):
                running = [i for i, e in enumerate(episodes) if not e.done]
                if not _any_rank(bool(running), self.engine):
                    break
                limits = [min(per_turn, budget - len(episodes[i].tokens)) for i in running]
                t1 = time.perf_counter()
                outs = self.engine.sample_turn(
                    [episodes[i].prompt + episodes[i].tokens for i in running],
                    limits,
                    running,
                    turn,
                    s,
                    meta_seed,
                    call,
                )
                sample_s += time.perf_counter() - t1
                texts = []
                for i, (toks, lps) in zip(running, outs):
                    ep = episodes[i]
                    ep.turns += 1
                    ep.add(toks, True, lps)
                    sampled += len(toks)
                    texts.append(self.tokenizer.decode(toks, skip_special_tokens=True))
                t1 = time.perf_counter()
                results = self._step_envs(pool, [episodes[i] for i in running], texts)
                env_s += time.perf_counter() - t1
                for i, res in zip(running, results):
                    self._apply(episodes[i], res, turn, budget)
        for ep in episodes:
            if not ep.done:
                ep.done, ep.ended_by = True, ep.ended_by or "turn_limit"
            ep.env.close()
        generate_s = time.perf_counter() - t0
        metrics = episode_metrics(episodes, generate_s, sample_s, env_s, sampled)
        with_lp = self.config.calculate_log_probs or self.spec.can("always_log_probs")
        return assemble(prompts, episodes, s, metrics, self.pad_token_id, with_lp)

    def _apply(self, ep: Episode, res: StepOutcome, turn: int, budget: int) -> None:
        """Put a step's reward on the turn's last token, record its tool calls, append its
        messages unless the episode ends here."""
        last = len(ep.tokens) - 1
        ep.rewards[last] = ep.rewards.get(last, 0.0) + float(res.reward)
        for r in res.tool_results:
            counts = ep.tool_calls.setdefault(r.name, [0, 0])
            counts[0] += 1
            counts[1] += int(not r.ok)
        if res.done:
            ep.done, ep.ended_by = True, "done"
            return
        if turn + 1 >= self.mt.max_turns:
            ep.done, ep.ended_by = True, "turn_limit"
            return
        env = self.format.env_tokens(last_turn(ep), res.messages, ep.schemas)
        if len(ep.tokens) + len(env) + 1 > budget:
            ep.done, ep.ended_by = True, "budget"
            return
        ep.add(env, False)


def _plain(value: Any) -> Any:
    """A numpy scalar as the Python value it holds; anything else as it is."""
    return value.item() if isinstance(value, np.generic) else value


def _any_rank(local: bool, engine: Any) -> bool:
    """An engine whose generate is a collective (``collective_generate``) on several ranks: whether
    any rank still has episodes (they all keep sampling until none has); else ``local``."""
    if (
        not engine.spec.can("collective_generate")
        or not (dist.is_available() and dist.is_initialized())
        or dist.get_world_size() == 1
    ):
        return local
    flag = torch.tensor([int(local)], dtype=torch.long, device=engine.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())
