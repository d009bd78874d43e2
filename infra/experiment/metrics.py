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
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "finite_scalars",
    "compute_data_metrics",
    "reduce_rank_metrics",
    "throughput_metrics",
    "metrics_table",
    "trend_markdown",
    "headline_line",
    "evaluation_line",
    "headline",
    "HEADLINES",
    "TREND_KEYS",
    "Headline",
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


def finite_scalars(record: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a ``metrics.json`` record (not ``iteration`` / ``timestamp``, not
    booleans): what a tracker plots."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if (
            key in ("iteration", "timestamp")
            or isinstance(value, bool)
            or not isinstance(value, (int, float))
        ):
            continue
        if math.isfinite(float(value)):
            out[key] = float(value)
    return out


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
    """True for metrics that measure time, or how a run went (a state rebuilt by replay): they
    differ between runs that commit the same iteration."""
    return (
        key.startswith(("timing_s/", "perf/", "replay/"))
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


@dataclass(frozen=True)
class Headline:
    """One headline metric: a short name, the metric keys that can carry it (the first one present
    in an iteration's metrics is shown), how to print it, and where it is plotted."""

    name: str
    series: tuple[tuple[str, str], ...]  # (metric key, legend label), in order of preference
    fmt: str
    panel: tuple[str, str] | None = None  # (plot panel title, y label); None: not plotted
    sometimes: bool = False  # present in some iterations only: the line shows it only there

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(key for key, _ in self.series)

    def key_in(self, metrics: dict[str, Any]) -> str | None:
        """The first of :attr:`keys` present in ``metrics``."""
        return next((k for k in self.keys if k in metrics), None)

    def value(self, metrics: dict[str, Any]) -> Any:
        key = self.key_in(metrics)
        return None if key is None else metrics[key]


_REWARD_PANEL = ("Reward", "mean per response")
#: The one spec of what a person sees of an iteration: the terminal line of ``ppoflow run`` /
#: ``ppoflow demo`` and the flow's log line (:func:`headline_line`), the UI's trend table
#: (:func:`trend_markdown`), the manifest's trend (``TREND_KEYS``), ``ppoflow status`` and the plot.
#: ``score`` is what the reward function / reward model gave; ``reward`` is the score after the KL
#: penalty (equal to the score unless the KL is in the reward).
HEADLINES: tuple[Headline, ...] = (
    Headline("score", (("critic/score/mean", "score (reward function / RM)"),), ".3f", _REWARD_PANEL),
    Headline("reward", (("critic/rewards/mean", "reward (after the KL penalty)"),), ".3f", _REWARD_PANEL),
    Headline(
        "kl",
        (
            ("actor/reward_kl_penalty", "KL in the reward"),
            ("actor/kl_loss", "KL loss"),
            ("actor/ppo_kl", "PPO KL (old || new)"),
        ),
        ".4f",
        ("KL to the reference policy", "nats per token"),
    ),
    Headline("entropy", (("actor/entropy", "entropy"),), ".3f"),
    Headline(
        "response length",
        (("response_length/mean", "mean"), ("response_length/max", "max")),
        ".2f",
        ("Response length", "tokens"),
    ),
    # with the engine's log-probs: how far the sampler's token probabilities are from the trainer's
    # (NeMo-RL's token_mult_prob_error, mean exp|d log p|; 1 = identical; algos/mismatch.py)
    Headline(
        "mismatch",
        (("mismatch/token_mult_prob_error", "sampler vs trainer: mean exp|Δ log p|"),),
        ".4f",
        sometimes=True,
    ),
    # with a rejection (rollout_correction.mis) that removed more than warn_rejected_share
    Headline(
        "REJECTED",
        (("correction/rejected_over_limit", "share rejected by the rollout correction"),),
        ".1%",
        sometimes=True,
    ),
    Headline(
        "val",
        (("val/score", "held-out score (evaluation)"),),
        ".3f",
        ("Held-out score", "mean score per response"),
        sometimes=True,
    ),
    # multi-turn rollouts only: policy turns per episode, and the engine's sampling speed
    Headline("turns", (("rollout/turns_mean", "policy turns per episode"),), ".2f", sometimes=True),
    Headline(
        "tok/s", (("rollout/policy_tokens_per_s", "policy tokens sampled per second"),), ".0f", sometimes=True
    ),
    Headline("vf loss", (("critic/vf_loss", "value loss"),), ".4g", ("Value loss", "critic loss")),
    Headline("seconds", (("timing_s/iteration", "seconds"),), ".1f"),
)

#: Every metric key the headlines may show (kept per iteration in the manifest's trend).
TREND_KEYS: tuple[str, ...] = tuple(key for h in HEADLINES for key in h.keys)


def headline(name: str) -> Headline:
    """The headline metric called ``name``."""
    return next(h for h in HEADLINES if h.name == name)


def _shown(h: Headline, metrics: dict[str, Any]) -> str:
    value = h.value(metrics)
    return format(value, h.fmt) if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"


def headline_line(n: int, metrics: dict[str, Any]) -> str:
    """One line per committed iteration (terminal and flow log): the headlines but the value loss
    (those present only in some iterations, as the held-out score, only where they are)."""
    parts = [
        f"{h.name} {_shown(h, metrics)}"
        for h in HEADLINES
        if h.name not in ("vf loss", "seconds") and (not h.sometimes or h.key_in(metrics))
    ]
    return f"iteration {n:4d} | " + " | ".join(parts) + f" | {_shown(headline('seconds'), metrics)} s"


def evaluation_line(n: int, metrics: dict[str, Any], note: str = "") -> str:
    """One line for an evaluation that is not part of a commit (iteration 0, ``ppoflow eval``)."""
    prompts = int(metrics.get("val/prompts", 0))
    extra = "".join(
        f" | {k.split('/', 1)[1]} {v:.3f}"
        for k, v in sorted(metrics.items())
        if k.startswith(("val/pass@", "val/best@"))
    )
    return f"iteration {n:4d} | val {metrics.get('val/score', float('nan')):.3f}{extra} | {prompts} prompts{note}"


def trend_markdown(experiment: str, rows: list[dict[str, Any]], last: int = 20) -> str:
    """A markdown summary: the experiment's last ``last`` iterations, one line each."""
    shown = rows[-last:]
    cols = [h for h in HEADLINES if any(h.key_in(r) for r in shown)]
    lines = [
        f"# PPO experiment `{experiment}`",
        "",
        f"{len(rows)} committed iteration(s); the last {len(shown)}:",
        "",
        "| iteration | " + " | ".join(h.name for h in cols) + " |",
        "|---:|" + "---:|" * len(cols),
    ]
    for r in shown:
        cells = [_fmt(h.value(r)) if h.key_in(r) else "" for h in cols]
        lines.append(f"| {r.get('iteration')} | " + " | ".join(cells) + " |")
    for h in (headline("score"), headline("reward"), headline("val")):
        having = [r for r in rows if h.key_in(r)]  # the held-out score is there only when it ran
        if len(having) >= 2:
            first, end = having[0], having[-1]
            lines += [
                "",
                f"{h.name}: {_fmt(h.value(first))} (iteration {first.get('iteration')}) → "
                f"{_fmt(h.value(end))} (iteration {end.get('iteration')})",
            ]
    return "\n".join(lines)
