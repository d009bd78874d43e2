"""Sampling a batch in chunks, so that a policy published meanwhile reaches the engine
(``asynchronous.max_staleness`` >= 1; the bookkeeping is
:class:`~ppoflow.infra.queue.inflight.InFlight`'s).

Each round: load the newest published version if it is newer than the engine's (with
``in_flight: requeue`` the unfinished rows then start again from their prompt), ask the engine for
at most ``asynchronous.chunk_tokens`` more tokens of every unfinished row (rows with the same
budget in one call, with a seed of the batch, the round and the call), and publish the rows that
finished as a part of the batch. Rows are never dropped: the batch is done when every row is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ppoflow.infra.data import storage
from ppoflow.infra.data.dataproto import DataProto
from ppoflow.infra.queue.batches import publish_part
from ppoflow.infra.queue.inflight import InFlight
from ppoflow.infra.queue.layout import QueuePaths
from ppoflow.infra.runtime import faults
from ppoflow.tasks.run.inputs import iteration_seed

__all__ = ["sample_in_chunks", "stop_token_ids"]


def stop_token_ids(tokenizer: Any, model_path: str) -> list[int]:
    """The tokens that end a response: the tokenizer's end-of-sequence token and the model's
    generation config's (as the engine stops on both)."""
    ids: list[int] = []
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(int(tokenizer.eos_token_id))
    try:
        from transformers import GenerationConfig

        extra = GenerationConfig.from_pretrained(model_path).eos_token_id
        ids += [int(i) for i in ([extra] if isinstance(extra, int) else (extra or []))]
    except (OSError, ValueError):
        pass
    return sorted(set(ids))


def _wait_for_newer(group: Any, poll_s: float, timeout_s: float = 300.0) -> None:
    """Wait until a version newer than the engine's is published (or ``timeout_s`` passed)."""
    try:
        group.versions.wait((group.version or 0) + 1, poll_s=poll_s, timeout_s=timeout_s)
    except TimeoutError as exc:
        group.logger.warning(f"stall drill: {exc}; going on")


def _call_seed(batch_seed: int, round_: int, call: int) -> int:
    return int(np.random.SeedSequence([batch_seed, round_, call]).generate_state(1)[0] >> 1)


def sample_in_chunks(
    group: Any, queue: QueuePaths, k: int, prompts: DataProto, have: set[int], check: Callable[[], None]
) -> int:
    """Sample the rows of batch ``k`` not in ``have`` (module docstring) with ``group`` (a
    :class:`~ppoflow.flows.asynchronous.produce.ProducerGroup`), publishing parts as rows finish; ``check()``
    before each write (the lease). Returns the tokens thrown away by requeues."""
    ctx = group.ctx
    cfg = ctx.cfg
    r, a = cfg.rollout, cfg.asynchronous
    rows = [i for i in range(len(prompts) * r.n) if i not in have]
    sampling = {"n": r.n, "temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k}
    sampling.update(do_sample=True, response_length=r.response_length)
    stops = stop_token_ids(ctx.inputs.tokenizer, cfg.model.path)
    flight = InFlight(prompts, r.n, r.response_length, rows, stops, sampling)
    seed = iteration_seed(cfg.seed, r.seed, k)
    requeued, round_ = 0, 0
    scratch = storage.join_inside(queue.batch_dir(k), "call")
    while flight.unfinished():
        if group.newest(k) and a.in_flight == "requeue":
            requeued += flight.requeue(group.version)
        for call, (budget, members) in enumerate(sorted(flight.calls(a.chunk_tokens).items())):
            meta = {"iteration": k, "n": 1, "response_length": budget, "seed": _call_seed(seed, round_, call)}
            flight.contexts(members, meta).save(scratch + ".arrow")
            out = group.sample(scratch + ".arrow", scratch + "-out.arrow")
            flight.absorb(members, out, budget, group.version)
        part = flight.take_finished()
        if part is not None:
            check()
            publish_part(queue, k, part)
        if round_ == 0 and faults.stalls("chunk", k):  # drill: a straggler spans a weight update
            _wait_for_newer(group, a.poll_s)
        round_ += 1
    if storage.exists(scratch + ".arrow"):
        storage.rm(scratch + ".arrow")
    return requeued
