"""Dispatch modes: how a driver-side ``WorkerGroup.call`` maps onto the ranks of a group.

A worker method is made callable from the driver by tagging it with ``@register(mode)``:

    class MyWorker(Worker):
        @register(Dispatch.ONE_TO_ALL)
        def init_model(self) -> dict | None: ...

        @register(Dispatch.DP_COMPUTE_PROTO)
        def compute_values(self, data: DataProto) -> DataProto | dict | None: ...

The tag is a plain attribute on the function (``__ppoflow_dispatch__``); nothing is wrapped, so a
registered method can still be called directly inside the rank. ``registered_methods(cls)`` lists
the tagged methods of a class (the rank entry sends this table to the driver, so the driver never
has to import the worker module), ``dispatch_mode_of(cls, name)`` looks one up.

The driver side of DP_COMPUTE_PROTO lives here too: ``split_proto`` pads and chunks the input
DataProto into per-dp-rank files, ``merge_results`` concatenates the output ranks' DataProtos in
dp_rank order, drops the padding in proportion and saves the result.

This module imports nothing from the layers above ``infra`` (DataProto is imported lazily).
"""

from __future__ import annotations

import enum
import math
import os
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

_ATTR = "__ppoflow_dispatch__"


class Dispatch(enum.Enum):
    """How one driver call is spread over the ranks and how the results come back.

    ONE_TO_ALL:       every rank gets the same JSON args; the driver returns a list of the per-rank
                      JSON results, in rank order.
    RANK_ZERO:        like ONE_TO_ALL (every rank runs the method, so collectives work), but the
                      driver returns only rank 0's result. For save / metrics style methods.
    DP_COMPUTE_PROTO: the driver splits a DataProto (given by URL) into ``dp_size`` chunks, the
                      rank(s) with ``dp_rank == i`` receive chunk ``i`` as a DataProto; DataProto
                      results of the output ranks are concatenated, unpadded and saved at
                      ``out_url``; JSON results come back as a list, one per rank.
    """

    ONE_TO_ALL = "ONE_TO_ALL"
    RANK_ZERO = "RANK_ZERO"
    DP_COMPUTE_PROTO = "DP_COMPUTE_PROTO"


def register(dispatch_mode: Dispatch) -> Callable[[F], F]:
    """Decorator: tag a worker method with its dispatch mode (the function is returned unchanged)."""
    if not isinstance(dispatch_mode, Dispatch):
        raise TypeError(f"register() takes a Dispatch member, got {dispatch_mode!r}")

    def deco(fn: F) -> F:
        setattr(fn, _ATTR, dispatch_mode)
        return fn

    return deco


def registered_methods(cls: type) -> dict[str, Dispatch]:
    """All methods of ``cls`` (including inherited ones) tagged with ``@register``, by name."""
    out: dict[str, Dispatch] = {}
    for name in dir(cls):
        if name.startswith("__"):
            continue
        mode = getattr(getattr(cls, name, None), _ATTR, None)
        if isinstance(mode, Dispatch):
            out[name] = mode
    return out


def dispatch_mode_of(cls: type, method_name: str) -> Dispatch:
    """The dispatch mode of ``cls.method_name``; ``AttributeError`` if it is missing or unregistered."""
    fn = getattr(cls, method_name, None)
    if fn is None:
        known = ", ".join(sorted(registered_methods(cls))) or "none"
        raise AttributeError(
            f"{cls.__qualname__} has no method {method_name!r} (registered methods: {known})"
        )
    mode = getattr(fn, _ATTR, None)
    if not isinstance(mode, Dispatch):
        raise AttributeError(
            f"{cls.__qualname__}.{method_name} is not callable from the driver: decorate it with "
            f"@register(Dispatch.ONE_TO_ALL | Dispatch.RANK_ZERO | Dispatch.DP_COMPUTE_PROTO)"
        )
    return mode


# ---------------------------------------------------------------------- DP_COMPUTE_PROTO, driver side
class ProtoSplit:
    """How one DP_COMPUTE_PROTO input was split: per-rank chunk URLs and the padding added."""

    def __init__(self, in_urls: list[str], pad_size: int, padded_len: int, dp_size: int):
        self.in_urls, self.pad_size, self.padded_len, self.dp_size = (in_urls, pad_size, padded_len, dp_size)


def split_proto(data_url: str, world_size: int, layout: list[dict[str, Any]], out_dir: str) -> ProtoSplit:
    """Load the DataProto at ``data_url``, pad it to a multiple of ``world_size`` (and of dp_size),
    split it into ``dp_size`` chunks and save chunk ``i`` as ``out_dir/in-<i>.arrow``.

    ``layout[r]`` is rank r's ``{dp_rank, dp_size, ...}``; every rank must report the same dp_size.
    Returns the chunk URL of each rank (ranks with the same dp_rank share a chunk).
    """
    from ppoflow.infra.data.dataproto import DataProto

    sizes = {int(entry["dp_size"]) for entry in layout}
    if len(sizes) != 1:
        raise ValueError(f"ranks disagree on dp_size: {[e['dp_size'] for e in layout]}")
    dp_size = sizes.pop()
    data = DataProto.load(data_url)
    padded, pad_size = data.pad_to_divisor(math.lcm(world_size, dp_size))
    urls = [os.path.join(out_dir, f"in-{i}.arrow") for i in range(dp_size)]
    for url, chunk in zip(urls, padded.chunk(dp_size)):
        chunk.save(url)
    return ProtoSplit([urls[int(e["dp_rank"])] for e in layout], pad_size, len(padded), dp_size)


def merge_results(
    method: str, replies: list[dict[str, Any]], layout: list[dict[str, Any]], split: ProtoSplit, out_url: str
) -> Any:
    """Merge the per-rank replies of a DP_COMPUTE_PROTO call.

    DataProto outputs (replies of kind "dataproto", i.e. from output ranks) are loaded in dp_rank
    order, concatenated (meta_info of dp rank 0), and the padding is removed in proportion: with
    ``k = output rows / padded input rows`` the last ``pad_size * k`` rows go. The result is saved
    atomically at ``out_url``, which is returned. JSON outputs come back as the per-rank list.
    """
    kinds = {r["kind"] for r in replies}
    if "dataproto" not in kinds:
        if "dropped" in kinds:
            raise ValueError(f"{method}: no rank with is_output_rank returned a DataProto")
        return [r["result"] for r in replies]
    if "json" in kinds and any(r["result"] is not None for r in replies if r["kind"] == "json"):
        raise TypeError(f"{method}: some ranks returned a DataProto and others JSON")
    from ppoflow.infra.data.dataproto import DataProto

    outs = sorted(
        (int(layout[rank]["dp_rank"]), rank) for rank, r in enumerate(replies) if r["kind"] == "dataproto"
    )
    if [dp for dp, _ in outs] != list(range(split.dp_size)):
        raise ValueError(
            f"{method}: output ranks must cover each dp_rank once, got dp_ranks "
            f"{[dp for dp, _ in outs]} for dp_size {split.dp_size} (set "
            "is_output_rank=False on all but one rank of each dp replica)"
        )
    merged = DataProto.concat([DataProto.load(replies[rank]["result"]) for _, rank in outs])
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
