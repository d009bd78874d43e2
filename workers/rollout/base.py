"""What every rollout engine shares: its interface, where it is built, the sampling settings of one
call and the output batch.

An engine is declared once, in ``ppoflow.infra.models.rollout_engines`` (its name, its class and sharding
manager by import path, its capabilities); its class implements :class:`Rollout`:
``from_config(config, site, **engine_kwargs)`` builds it for one rank (:class:`EngineSite`),
``generate_sequences(prompts)`` samples, and engines with the ``multi_turn`` capability also
``sample_turn(...)``. ``build_rollout`` sets ``engine.spec`` (its registry entry), which is where
the engine's own code reads its capabilities from.

A rollout turns a DataProto of left-padded prompts into a DataProto of sampled responses with the
columns the rest of the iteration reads (docs/internals.md):

    prompts            (B*n, P)    the prompt, left-padded (as given)
    responses          (B*n, R)    sampled tokens, right-padded with the pad id
    input_ids          (B*n, P+R)  prompts ++ responses
    attention_mask     (B*n, P+R)  prompt mask ++ response_mask
    position_ids       (B*n, P+R)  prompt positions, then last prompt position + 1, + 2, ...
    response_mask      (B*n, R)    1 on generated tokens (EOS included), 0 on padding
    rollout_log_probs  (B*n, R)    the engine's log-prob of each sampled token, after temperature
                                   (0 on padding), float32; vLLM: only with
                                   ``rollout.calculate_log_probs``

Row ``i*n + j`` is sample ``j`` of prompt ``i``; non-tensor columns are repeated the same way
(interleaved). ``meta_info`` carries ``temperature``, ``top_p``, ``top_k``, ``n``, ``do_sample``
and ``metrics`` (``rollout/generate_s``, ``rollout/tokens_per_s``).

Sampling settings come from ``RolloutConfig`` and may be overridden per call through
``prompts.meta_info`` (validation): ``do_sample=False`` (greedy), ``n``, ``temperature``, ``top_p``,
``top_k``, ``response_length``; ``seed`` makes a vLLM rollout repeat exactly (per-request seeds).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ppoflow.infra.config import RolloutConfig
from ppoflow.infra.models.rollout_engines import EngineSpec

__all__ = [
    "Rollout",
    "EngineSite",
    "TurnSamples",
    "eos_token_ids",
    "request_seed",
    "SamplingSettings",
    "assemble_output",
    "check_prompts",
    "generation_metrics",
    "prompt_token_lists",
    "PROMPT_KEYS",
]

PROMPT_KEYS = ("input_ids", "attention_mask", "position_ids")


@dataclass(frozen=True)
class SamplingSettings:
    """The sampling of one ``generate_sequences`` call (config defaults + meta_info overrides)."""

    n: int
    temperature: float
    top_p: float
    top_k: int
    response_length: int
    do_sample: bool

    @classmethod
    def resolve(cls, config: RolloutConfig, meta_info: dict[str, Any] | None) -> SamplingSettings:
        """Config values, overridden by the keys of ``meta_info`` that name a sampling setting.

        ``do_sample=False`` means greedy: temperature 0 for the engine, n=1 unless ``n`` is given,
        and log-probs at temperature 1 (``temperature`` in the output's meta_info is then 1.0).
        """
        meta = meta_info or {}
        do_sample = bool(meta.get("do_sample", True))
        n = int(meta.get("n", config.n if do_sample else 1))
        # Greedy decoding: the engine runs at temperature 0 and reports log-probs at temperature 1,
        # so the output says 1.0 and the actor recomputes its log-probs at the same temperature.
        temperature = float(meta.get("temperature", config.temperature)) if do_sample else 1.0
        top_p = float(meta.get("top_p", config.top_p))
        top_k = int(meta.get("top_k", config.top_k))
        response_length = int(meta.get("response_length", config.response_length))
        if n < 1 or response_length < 1:
            raise ValueError(
                f"rollout needs n >= 1 and response_length >= 1, got n={n}, response_length={response_length}"
            )
        if do_sample and temperature <= 0:
            raise ValueError(
                f"temperature={temperature} must be > 0 when sampling; pass do_sample=False "
                "in meta_info for greedy decoding"
            )
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p={top_p} must be in (0, 1]")
        return cls(
            n=n,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k if top_k > 0 else -1,
            response_length=response_length,
            do_sample=do_sample,
        )

    def meta(self) -> dict[str, Any]:
        """The settings as they go into the output's ``meta_info``."""
        return {
            "n": self.n,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "do_sample": self.do_sample,
            "response_length": self.response_length,
        }


@dataclass(frozen=True)
class EngineSite:
    """Where an engine is built: this rank, and what its worker already holds.

    Attributes:
        model_path: HF model directory the engine is built from.
        tokenizer: the HF tokenizer.
        actor_module: the rank's FSDP policy (engines without ``weight_push`` generate with it).
        device: the rank's compute device ("cpu", "cuda:0", ...).
        rank, world_size: this rank in the worker group.
        pad_token_id: right-padding value of ``responses`` (the tokenizer's pad, else its eos).
    """

    model_path: str
    tokenizer: Any
    actor_module: Any
    device: str
    rank: int
    world_size: int
    pad_token_id: int


#: One turn of each episode: (the sampled tokens, their log-probs or None).
TurnSamples = list[tuple[list[int], list[float] | None]]


class Rollout:
    """Interface of a rollout engine living in one rank.

    Attributes:
        spec: the engine's registry entry (``ppoflow.infra.models.rollout_engines``; set by ``build_rollout``).
        tp_size, tp_rank: tensor-parallel layout of the engine (1, 0 for engines without TP).
        dp_size, dp_rank: data-parallel replicas of the engine (world_size / tp_size) and this one.
    """

    spec: EngineSpec
    tp_size: int = 1
    tp_rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0

    @classmethod
    def from_config(cls, config: Any, site: EngineSite, **engine_kwargs: Any) -> Rollout:
        """The engine of ``config`` (an ``ExperimentConfig``) for ``site``'s rank; ``engine_kwargs``
        are the worker's extras for this engine (e.g. vLLM's ``engine_kwargs``, ``load_format``)."""
        raise NotImplementedError(f"{cls.__name__} does not implement from_config")

    def generate_sequences(self, prompts):  # -> DataProto
        """Sample responses for this rank's prompt rows; see the module docstring for the columns."""
        raise NotImplementedError

    def sample_turn(
        self,
        contexts: list[list[int]],
        limits: list[int],
        episode_ids: list[int],
        turn: int,
        settings: SamplingSettings,
        meta_seed: Any,
        call: int,
    ) -> TurnSamples:
        """One turn of multi-turn episodes (engines with the ``multi_turn`` capability): sample one
        completion of at most ``limits[i]`` tokens after each token list ``contexts[i]`` (episode
        ``episode_ids[i]``) with ``settings``, seeded from (``meta_seed`` or the rank's ``call``
        number, episode, ``turn``) so a retried rollout repeats. Log-probs as the engine returns
        them (``always_log_probs``, else only with ``rollout.calculate_log_probs``). An engine with
        ``collective_generate`` is also called with no contexts, and returns []."""
        raise NotImplementedError(f"{type(self).__name__} cannot sample multi-turn episodes")

    def shutdown(self) -> None:
        """Free the engine (called once when the worker shuts down)."""


def request_seed(*parts: Any) -> int:
    """A 31-bit seed from ``parts`` (blake2b): the same on every TP rank of a replica, different
    across replicas, calls and rows. vLLM gives sample j of an n>1 request the seed ``seed + j``."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (2**31 - 1024)


def eos_token_ids(tokenizer: Any, model_path: str) -> list[int]:
    """EOS ids: the tokenizer's, plus the model's generation config's (as vLLM stops on both)."""
    ids: list[int] = []
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(int(tokenizer.eos_token_id))
    try:
        from transformers import GenerationConfig

        gen = GenerationConfig.from_pretrained(model_path)
        extra = gen.eos_token_id
        for i in [extra] if isinstance(extra, int) else (extra or []):
            if int(i) not in ids:
                ids.append(int(i))
    except (OSError, ValueError):
        pass
    return ids


def check_prompts(prompts) -> None:
    """KeyError unless ``prompts`` has ``input_ids`` and ``attention_mask``; ValueError unless both
    are the same (B, P) shape."""
    missing = [k for k in ("input_ids", "attention_mask") if k not in prompts.batch]
    if missing:
        raise KeyError(f"generate_sequences needs prompt columns {missing}; got {sorted(prompts.batch)}")
    ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]
    if ids.ndim != 2 or ids.shape != mask.shape:
        raise ValueError(
            f"input_ids {tuple(ids.shape)} and attention_mask {tuple(mask.shape)} must be the "
            "same (B, P) shape"
        )


def generation_metrics(
    generate_s: float, generated: int, cpu: Any, extra: dict[str, float] | None = None
) -> dict[str, float]:
    """A rollout's ``meta_info["metrics"]``: ``rollout/generate_s``, ``rollout/tokens_per_s`` (the
    ``generated`` tokens over those seconds), ``extra``, then the CPU the decoding got
    (``perf/rollout_*`` from ``cpu``, an ``infra.runtime.host_cpu.cpu_use`` reading)."""
    return {
        "rollout/generate_s": generate_s,
        "rollout/tokens_per_s": generated / generate_s if generate_s > 0 else 0.0,
        **(extra or {}),
        **cpu.metrics("perf/rollout_"),
    }


def prompt_token_lists(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[list[int]]:
    """The unpadded token ids of each left-padded prompt row (the tokens where the mask is 1)."""
    ids, mask = input_ids.cpu(), attention_mask.cpu().bool()
    out = []
    for row, m in zip(ids, mask):
        toks = row[m].tolist()
        if not toks:
            raise ValueError("a prompt row has no tokens (attention_mask is all zeros)")
        out.append(toks)
    return out


def _position_ids(prompts, n: int) -> torch.Tensor:
    """Prompt position ids (given, else cumsum of the mask - 1 clamped at 0), repeated n times."""
    pos = prompts.batch.get("position_ids")
    if pos is None:
        mask = prompts.batch["attention_mask"].long()
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
    if pos.ndim != 2:
        raise ValueError(
            f"position_ids must be (B, P); got {tuple(pos.shape)} (multi-axis rope is not supported)"
        )
    return pos.cpu().repeat_interleave(n, dim=0)


def _response_tensors(
    responses: Sequence[Sequence[int]],
    log_probs: Sequence[Sequence[float]] | None,
    bsz: int,
    n: int,
    resp_len: int,
    pad_token_id: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(responses, response_mask, log_probs)``, each (B*n, R), right-padded from the token lists
    (log-probs 0 where there are none); ValueError on a count or a length that does not fit."""
    with_lp = log_probs is not None
    if len(responses) != bsz * n or (log_probs is not None and len(log_probs) != bsz * n):
        raise ValueError(
            f"expected {bsz}*{n} responses, got {len(responses)}"
            + (f" (and {len(log_probs)} log-prob rows)" if log_probs is not None else "")
        )
    resp = torch.full((bsz * n, resp_len), pad_token_id, dtype=torch.long)
    resp_mask = torch.zeros((bsz * n, resp_len), dtype=torch.long)
    lp = torch.zeros((bsz * n, resp_len), dtype=torch.float32)
    for i, toks in enumerate(responses):
        k = len(toks)
        lps = log_probs[i] if log_probs is not None else None
        if k > resp_len or (lps is not None and len(lps) != k):
            raise ValueError(
                f"response {i} has {k} tokens"
                + (f" and {len(lps)} log-probs" if lps is not None else "")
                + f" (limit {resp_len})"
            )
        if k:
            resp[i, :k] = torch.as_tensor(toks, dtype=torch.long)
            if with_lp:
                lp[i, :k] = torch.as_tensor(lps, dtype=torch.float32)
            resp_mask[i, :k] = 1
    return resp, resp_mask, lp


def _output_meta(prompts, settings: SamplingSettings, metrics: dict[str, float]) -> dict[str, Any]:
    """The input's ``meta_info`` with the call's sampling settings in place of any given, and
    ``metrics`` merged into its ``metrics``."""
    meta = {
        k: v
        for k, v in prompts.meta_info.items()
        if k not in ("n", "temperature", "top_p", "top_k", "do_sample", "response_length", "metrics")
    }
    meta.update(settings.meta())
    meta["metrics"] = {**prompts.meta_info.get("metrics", {}), **metrics}
    return meta


def assemble_output(
    prompts,
    responses: Sequence[Sequence[int]],
    log_probs: Sequence[Sequence[float]] | None,
    settings: SamplingSettings,
    pad_token_id: int,
    metrics: dict[str, float],
):
    """Build the rollout DataProto from ``B*n`` token lists (sample-major per prompt).

    Args:
        prompts: the input DataProto (B rows): ``input_ids``, ``attention_mask``, optional
            ``position_ids`` and non-tensor columns.
        responses: ``B*n`` lists of generated token ids (row ``i*n + j`` = sample j of prompt i),
            each at most ``settings.response_length`` long (EOS included when it stopped there).
        log_probs: the matching per-token log-probs, or None (no ``rollout_log_probs`` column).
        pad_token_id: right-padding value of ``responses``.
        metrics: merged into ``meta_info["metrics"]``.
    """
    from ppoflow.infra.data.dataproto import DataProto

    check_prompts(prompts)
    n, resp_len = settings.n, settings.response_length
    resp, resp_mask, lp = _response_tensors(responses, log_probs, len(prompts), n, resp_len, pad_token_id)
    prompt_ids = prompts.batch["input_ids"].cpu().long().repeat_interleave(n, dim=0)
    prompt_mask = prompts.batch["attention_mask"].cpu().repeat_interleave(n, dim=0)
    prompt_pos = _position_ids(prompts, n)
    delta = torch.arange(1, resp_len + 1, dtype=prompt_pos.dtype).unsqueeze(0)
    resp_pos = prompt_pos[:, -1:] + delta
    tensors = {
        "prompts": prompt_ids,
        "responses": resp,
        "input_ids": torch.cat([prompt_ids, resp], dim=1),
        "attention_mask": torch.cat([prompt_mask, resp_mask.to(prompt_mask.dtype)], dim=1),
        "position_ids": torch.cat([prompt_pos, resp_pos], dim=1),
        "response_mask": resp_mask,
    }
    if log_probs is not None:
        tensors["rollout_log_probs"] = lp
    non_tensors = {k: np.repeat(v, n, axis=0) for k, v in prompts.non_tensor_batch.items()}
    return DataProto.from_dict(tensors, non_tensors, _output_meta(prompts, settings, metrics))
