"""Which policy sampled each token, and how stale that makes a batch.

Every row of a batch carries ``token_versions`` (B, R) int32: the policy version that sampled each
response token (-1 off the response mask). The staleness of a token of batch n (consumed by
iteration n, which trains version n-1) is ``(n - 1) - version``; the bound ``max_staleness`` = s
holds when every token's staleness is at most s, i.e. every version is >= n - 1 - s (and none is
newer than n - 1: version n needs batch n).

Both sides keep it: a producer starts batch n only once version n - 1 - s is published
(:func:`admissible_batches`, so every token it samples is at least that new), and the trainer
refuses a batch whose recorded versions break it (:func:`check_bound`).
"""

from __future__ import annotations

import torch

from ppoflow.infra.data.prompts import DataError

__all__ = ["StalenessBoundBroken", "tag_versions", "staleness_metrics", "check_bound", "admissible_batches"]


class StalenessBoundBroken(DataError):
    """A batch holds a token sampled by a policy older than the bound allows (or newer than the
    trainer's): consuming it would break ``asynchronous.max_staleness``."""


def tag_versions(response_mask: torch.Tensor, version: int) -> torch.Tensor:
    """``token_versions`` (B, R) int32 of a rollout sampled entirely by ``version``."""
    out = torch.full(response_mask.shape, -1, dtype=torch.int32)
    out[response_mask.bool()] = int(version)
    return out


def _sampled(token_versions: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    return token_versions[response_mask.bool()].long()


def staleness_metrics(
    token_versions: torch.Tensor, response_mask: torch.Tensor, n: int, max_staleness: int
) -> dict[str, float]:
    """``async/*`` metrics of batch ``n``: staleness mean and max over its tokens, the tokens at each
    staleness 0..``max_staleness``, the oldest and newest version, and the sequences sampled by
    more than one version (partial rollouts across a weight update)."""
    versions = _sampled(token_versions, response_mask)
    out: dict[str, float] = {}
    if versions.numel() == 0:
        return {"async/staleness_mean": 0.0, "async/staleness_max": 0.0}
    stale = (n - 1) - versions
    out["async/staleness_mean"] = float(stale.float().mean())
    out["async/staleness_max"] = float(stale.max())
    for d in range(max_staleness + 1):
        out[f"async/tokens_staleness_{d}"] = float((stale == d).sum())
    out["async/version_min"] = float(versions.min())
    out["async/version_max"] = float(versions.max())
    mask = response_mask.bool()
    low = torch.where(mask, token_versions.long(), torch.iinfo(torch.int64).max).min(dim=1).values
    high = torch.where(mask, token_versions.long(), -1).max(dim=1).values
    out["async/mixed_version_sequences"] = float(((high > low) & mask.any(dim=1)).sum())
    return out


def check_bound(
    token_versions: torch.Tensor, response_mask: torch.Tensor, n: int, max_staleness: int
) -> None:
    """Raise :class:`StalenessBoundBroken` unless every token of batch ``n`` was sampled by a version
    in ``[n - 1 - max_staleness, n - 1]`` (versions below 0 do not exist: the bound starts at 0)."""
    versions = _sampled(token_versions, response_mask)
    if versions.numel() == 0:
        return
    low, high = max(0, n - 1 - max_staleness), n - 1
    oldest, newest = int(versions.min()), int(versions.max())
    if oldest < low or newest > high:
        raise StalenessBoundBroken(
            f"batch {n} holds tokens sampled by policy versions {oldest}..{newest}, but iteration {n} "
            f"may train only on versions {low}..{high} (asynchronous.max_staleness={max_staleness}). "
            "A producer sampled it with other settings or from another experiment's queue: delete "
            f"the batch (queue/batches/{n:06d}/) so it is sampled again, or raise max_staleness"
        )


def admissible_batches(
    committed: int, latest: int | None, max_staleness: int, until: int | None = None
) -> range:
    """The batches a producer may start now: those after the ``committed`` iteration whose oldest
    allowed version (n - 1 - ``max_staleness``) is published (``latest``: the newest version, None
    before the first), up to ``until``."""
    if latest is None:
        return range(0)
    last = latest + 1 + max_staleness
    if until is not None:
        last = min(last, until)
    return range(committed + 1, last + 1)
