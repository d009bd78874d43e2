"""Per-iteration metrics: the batch statistics, rank reduction, and the text the UI shows.

Metric names are flat ``section/name`` strings (as in veRL and CleanRL):

    critic/score/mean|max|min      sequence score (rm + rule, before the KL penalty)
    critic/rewards/mean|max|min    sequence reward (after the KL penalty, if in the reward)
    critic/advantages/mean|max|min, critic/returns/mean|max|min   over response tokens
    critic/values/mean|max|min, critic/vf_explained_var           (with a critic)
    response_length/mean|max|min, response_length/clip_ratio, prompt_length/mean
    perf/total_num_tokens, perf/throughput (tokens / s / rank over the iteration)
    timing_s/<task>, timing_s/iteration
    actor/*, critic/* from the updates (mean over ranks), weight_sync_s from the rollout
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

__all__ = [
    "compute_data_metrics",
    "reduce_rank_metrics",
    "throughput_metrics",
    "metrics_table",
    "trend_markdown",
    "summary_line",
    "is_timing_key",
]


def _masked_stats(prefix: str, values: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    sel = values[mask.bool()].double()
    if sel.numel() == 0:
        return {f"{prefix}/mean": 0.0, f"{prefix}/max": 0.0, f"{prefix}/min": 0.0}
    return {
        f"{prefix}/mean": sel.mean().item(),
        f"{prefix}/max": sel.max().item(),
        f"{prefix}/min": sel.min().item(),
    }


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    v = values.double()
    return {
        f"{prefix}/mean": v.mean().item(),
        f"{prefix}/max": v.max().item(),
        f"{prefix}/min": v.min().item(),
    }


def compute_data_metrics(batch: dict[str, torch.Tensor]) -> dict[str, float]:
    """Statistics of one iteration's training batch.

    Args:
        batch: tensors by column name: ``response_mask``, ``attention_mask`` (B, P+R),
            ``responses`` (B, R), and when present ``token_level_scores``,
            ``token_level_rewards``, ``advantages``, ``returns``, ``values`` (B, R).
    """
    mask = batch["response_mask"].bool()
    resp_len = mask.sum(-1).double()
    max_resp = batch["responses"].shape[-1]
    prompt_len = batch["attention_mask"].sum(-1).double() - resp_len
    out: dict[str, float] = {}
    if "token_level_scores" in batch:
        out.update(_stats("critic/score", (batch["token_level_scores"] * mask).sum(-1)))
    if "token_level_rewards" in batch:
        out.update(_stats("critic/rewards", (batch["token_level_rewards"] * mask).sum(-1)))
    for key in ("advantages", "returns", "values"):
        if key in batch:
            out.update(_masked_stats(f"critic/{key}", batch[key], mask))
    if "values" in batch and "returns" in batch:
        ret = batch["returns"][mask].double()
        val = batch["values"][mask].double()
        var_ret = ret.var(unbiased=False) if ret.numel() else torch.tensor(0.0)
        ev = 1.0 - (ret - val).var(unbiased=False) / (var_ret + 1e-5) if ret.numel() else torch.tensor(0.0)
        out["critic/vf_explained_var"] = ev.item()
    out.update(_stats("response_length", resp_len))
    out["response_length/clip_ratio"] = (resp_len >= max_resp).double().mean().item()
    out["prompt_length/mean"] = prompt_len.mean().item()
    out["perf/total_num_tokens"] = float(batch["attention_mask"].sum().item())
    return out


def _mean(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, (list, tuple)):
        nums = [v for v in (_mean(x) for x in value) if v is not None]
        return sum(nums) / len(nums) if nums else None
    return None


def reduce_rank_metrics(per_rank: Iterable[dict[str, Any] | None]) -> dict[str, float]:
    """Mean over ranks of each numeric metric (a list value counts as its own mean)."""
    sums: dict[str, list[float]] = {}
    for metrics in per_rank:
        for key, value in (metrics or {}).items():
            v = _mean(value)
            if v is not None:
                sums.setdefault(key, []).append(v)
    return {k: sum(v) / len(v) for k, v in sums.items()}


def throughput_metrics(total_tokens: float, seconds: float, nprocs: int) -> dict[str, float]:
    """``perf/throughput``: tokens per second per rank over the iteration's wall time."""
    if seconds <= 0:
        return {"perf/throughput": 0.0}
    return {"perf/throughput": total_tokens / seconds / max(1, nprocs)}


def is_timing_key(key: str) -> bool:
    """True for metrics that measure time (they differ between otherwise identical runs)."""
    return (
        key.startswith(("timing_s/", "perf/"))
        or key.endswith("_s")
        or "tokens_per_s" in key
        or key.endswith("/throughput")
    )


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        return f"{value:.4g}"
    return str(value)


def metrics_table(metrics: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows ``{metric, value}`` for a Prefect table artifact, sorted by name."""
    return [{"metric": k, "value": _fmt(v)} for k, v in sorted(metrics.items())]


TREND_COLUMNS = (
    ("reward", "critic/rewards/mean"),
    ("score", "critic/score/mean"),
    ("kl", "actor/ppo_kl"),
    ("entropy", "actor/entropy"),
    ("resp len", "response_length/mean"),
    ("vf loss", "critic/vf_loss"),
    ("seconds", "timing_s/iteration"),
)


def trend_markdown(experiment: str, rows: list[dict[str, Any]], last: int = 20) -> str:
    """A markdown summary: the experiment's last ``last`` iterations, one line each."""
    shown = rows[-last:]
    cols = [(name, key) for name, key in TREND_COLUMNS if any(key in r for r in shown)]
    head = "| iteration | " + " | ".join(name for name, _ in cols) + " |"
    sep = "|---:|" + "---:|" * len(cols)
    lines = [
        f"# PPO experiment `{experiment}`",
        "",
        f"{len(rows)} committed iteration(s); the last {len(shown)}:",
        "",
        head,
        sep,
    ]
    for r in shown:
        lines.append(
            f"| {r.get('iteration')} | "
            + " | ".join(_fmt(r[key]) if key in r else "" for _, key in cols)
            + " |"
        )
    if len(rows) >= 2:
        first, end = rows[0], rows[-1]
        for name, key in cols[:2]:
            if key in first and key in end:
                lines += [
                    "",
                    f"{name}: {_fmt(first[key])} (iteration {first.get('iteration')}) → "
                    f"{_fmt(end[key])} (iteration {end.get('iteration')})",
                ]
    return "\n".join(lines)


def summary_line(n: int, metrics: dict[str, Any]) -> str:
    """One log line per iteration: reward, KL, response length, entropy, seconds."""

    def g(key: str) -> str:
        return _fmt(metrics[key]) if key in metrics else "-"

    kl_key = next(
        (k for k in ("actor/ppo_kl", "actor/kl_loss", "actor/reward_kl_penalty") if k in metrics),
        "actor/ppo_kl",
    )
    return (
        f"iteration {n}: reward {g('critic/rewards/mean')} score {g('critic/score/mean')} "
        f"kl {g(kl_key)} response_length {g('response_length/mean')} "
        f"entropy {g('actor/entropy')} in {g('timing_s/iteration')} s"
    )
