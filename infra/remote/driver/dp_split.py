"""The driver's side of a DP_COMPUTE_PROTO call: the input DataProto split into one Arrow file per
data-parallel rank, and the ranks' outputs merged back into one.

``split_proto`` pads the input to a multiple of the world size (and of ``dp_size``) and saves
chunk ``i`` for the ranks whose ``dp_rank`` is ``i``; ``merge_results`` concatenates the output
ranks' DataProtos in dp_rank order, removes the padding in proportion (an output may be ``k``
times the input, e.g. ``n`` samples per prompt), merges their metrics by the rules the ranks sent
with them (this side knows no metric names) and saves the result.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ppoflow.infra.data import storage
from ppoflow.infra.data.dataproto import DataProto
from ppoflow.infra.remote.metric_merge import merge_metrics
from ppoflow.infra.remote.protocol import Call, Layout, Reply

__all__ = ["ProtoSplit", "split_proto", "merge_results", "remove_chunks"]


@dataclass(frozen=True)
class ProtoSplit:
    """How one DP_COMPUTE_PROTO input was split: per-rank chunk URLs and the padding added."""

    in_urls: list[str]
    pad_size: int
    padded_len: int
    dp_size: int
    by_blocks: bool = False

    def calls(
        self, cid: int, method: str, args: list[Any], kwargs: dict[str, Any], call_dir: str
    ) -> list[Call]:
        """The command each rank gets: its chunk, and where it saves its output."""
        return [
            Call(
                id=cid,
                method=method,
                args=args,
                kwargs=kwargs,
                in_url=url,
                out_url=storage.join(call_dir, f"out-rank{rank}.arrow"),
            )
            for rank, url in enumerate(self.in_urls)
        ]


def split_proto(
    data_url: str, world_size: int, layout: list[Layout], out_dir: str, blocks: int | None = None
) -> ProtoSplit:
    """Load the DataProto at ``data_url``, pad it to a multiple of ``world_size`` (and of dp_size),
    split it into ``dp_size`` chunks and save chunk ``i`` as ``out_dir/in-<i>.arrow``.

    ``layout[r]`` is rank r's layout; every rank must report the same dp_size. Returns the chunk
    URL of each rank (ranks with the same dp_rank share a chunk).

    ``blocks``: instead of consecutive chunks, every rank gets its ``1/dp_size`` of each block of
    ``blocks`` consecutive rows, in block order (no padding; the last block may be shorter when it
    still divides among the ranks, else the split falls back to consecutive chunks). A PPO update
    passes its mini-batch size, so mini-batch j holds the same rows whatever the number of ranks:
    an update made on N ranks is the same step on M (up to the order of float sums).
    """
    sizes = {entry.dp_size for entry in layout}
    if len(sizes) != 1:
        raise ValueError(f"ranks disagree on dp_size: {[e.dp_size for e in layout]}")
    dp_size = sizes.pop()
    data = DataProto.load(data_url)
    urls = [os.path.join(out_dir, f"in-{i}.arrow") for i in range(dp_size)]
    if blocks is not None and blocks % dp_size == 0 and len(data) % blocks % dp_size == 0:
        for url, chunk in zip(urls, _block_shares(data, blocks, dp_size)):
            chunk.save(url)
        return ProtoSplit([urls[e.dp_rank] for e in layout], 0, len(data), dp_size, by_blocks=True)
    padded, pad_size = data.pad_to_divisor(math.lcm(world_size, dp_size))
    for url, chunk in zip(urls, padded.chunk(dp_size)):
        chunk.save(url)
    return ProtoSplit([urls[e.dp_rank] for e in layout], pad_size, len(padded), dp_size)


def _block_shares(data: DataProto, blocks: int, dp_size: int) -> list[DataProto]:
    """Each data-parallel rank's share of every block of ``blocks`` rows (see :func:`split_proto`)."""
    shares: list[list[int]] = [[] for _ in range(dp_size)]
    for start in range(0, len(data), blocks):
        share = (min(blocks, len(data) - start)) // dp_size
        for dp in range(dp_size):
            shares[dp].extend(range(start + dp * share, start + (dp + 1) * share))
    return [data[rows] for rows in shares]


def merge_results(
    method: str, replies: list[Reply], layout: list[Layout], split: ProtoSplit, out_url: str
) -> Any:
    """Merge the per-rank replies of a DP_COMPUTE_PROTO call.

    DataProto outputs (replies of kind "dataproto", i.e. from output ranks) are loaded in dp_rank
    order, concatenated (meta_info of dp rank 0, but ``meta_info["metrics"]`` merged over the dp
    ranks by the replies' ``metric_rules``: :func:`~ppoflow.infra.remote.metric_merge.merge_metrics`),
    and the padding is removed in proportion: with ``k = output rows / padded input rows`` the last
    ``pad_size * k`` rows go. The result is saved atomically at ``out_url``, which is returned. JSON
    outputs come back as the per-rank list.
    """
    kinds = {r.kind for r in replies}
    if "dataproto" not in kinds:
        if "dropped" in kinds:
            raise ValueError(f"{method}: no rank with is_output_rank returned a DataProto")
        return [r.result for r in replies]
    if "json" in kinds and any(r.result is not None for r in replies if r.kind == "json"):
        raise TypeError(f"{method}: some ranks returned a DataProto and others JSON")
    if split.by_blocks:
        raise TypeError(f"{method}: the outputs of a split by blocks are not in the input's row order")
    outs = sorted((layout[rank].dp_rank, rank) for rank, r in enumerate(replies) if r.kind == "dataproto")
    if [dp for dp, _ in outs] != list(range(split.dp_size)):
        raise ValueError(
            f"{method}: output ranks must cover each dp_rank once, got dp_ranks "
            f"{[dp for dp, _ in outs]} for dp_size {split.dp_size} (set "
            "is_output_rank=False on all but one rank of each dp replica)"
        )
    parts = [DataProto.load(str(replies[rank].result)) for _, rank in outs]
    merged = DataProto.concat(parts)
    if any(p.meta_info.get("metrics") for p in parts):  # the whole batch's, not dp rank 0's
        rules = {replies[rank].metric_rules for _, rank in outs}
        if len(rules) != 1:
            raise ValueError(f"{method}: the output ranks sent different metric rules: {rules}")
        merged.meta_info["metrics"] = merge_metrics([p.meta_info.get("metrics") for p in parts], rules.pop())
    if split.pad_size:
        k, rem = divmod(len(merged), split.padded_len)
        if rem:
            raise ValueError(
                f"{method}: {len(merged)} output rows for {split.padded_len} padded "
                f"input rows; cannot remove {split.pad_size} padding rows in proportion"
            )
        merged = merged.unpad(split.pad_size * k)
    merged.save(out_url)
    return out_url


def remove_chunks(url: str, log: Callable[[str], None]) -> None:
    """Delete one call's chunks; a failure is only disk space left over, so it is said, not raised."""
    try:
        if storage.exists(url):
            storage.rm(url, recursive=True)
    except (OSError, ValueError) as err:
        log(f"[ppoflow] could not remove {url}: {err}")
