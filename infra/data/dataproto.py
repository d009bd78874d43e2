"""DataProto: the batch that flows between ppoflow's steps.

A DataProto holds three things:

* ``batch``: ``dict[str, torch.Tensor]``, every tensor with the same size of dim 0 (the rows);
* ``non_tensor_batch``: ``dict[str, np.ndarray]`` with the same dim 0 (``dtype=object`` for str,
  lists and dicts);
* ``meta_info``: a JSON-able dict that belongs to the whole batch.

Operations follow what veRL users know: ``select``, ``pop``, ``union``, ``chunk``, ``concat``,
``repeat``, ``pad_to_divisor``/``unpad`` and indexing. Operations return new DataProtos that
share tensor/array storage where they can (slices are views, like torch's); only ``pop`` changes
``self``. On storage a DataProto is one Arrow IPC file (see :mod:`ppoflow.infra.data.arrow_codec`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ppoflow.infra.data import arrow_codec
from ppoflow.infra.data.arrow_codec import DataProtoFormatError

__all__ = ["DataProto", "DataProtoFormatError"]


def _as_object_array(values: Sequence[Any]) -> np.ndarray:
    """1-D object array holding ``values`` as they are (lists stay list elements)."""
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


def _arrays_equal(a: np.ndarray, b: np.ndarray) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.kind == "O":
        for x, y in zip(a.reshape(-1), b.reshape(-1)):
            try:
                if not (x is y or bool(np.all(x == y))):
                    return False
            except (ValueError, TypeError):
                return False
        return True
    return bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))


def _tensors_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a is b:
        return True
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a, b.to(a.device))


def _values_equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an incomparable pair is a conflict
        return False


def _keys(requested: Iterable[str] | None, available: dict, what: str, default_all: bool) -> list[str]:
    if requested is None:
        return list(available) if default_all else []
    if isinstance(requested, str):
        requested = [requested]
    keys = list(requested)
    missing = [k for k in keys if k not in available]
    if missing:
        raise KeyError(f"DataProto has no {what} key(s) {missing}; available: {list(available)}")
    return keys


@dataclass(eq=False)
class DataProto:
    """A batch of rows: tensors, numpy arrays sharing dim 0, plus JSON-able ``meta_info``.

    Equality is identity (compare contents key by key, e.g. with ``torch.equal``).
    """

    batch: dict[str, torch.Tensor] = field(default_factory=dict)
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.check_consistency()

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_dict(
        cls,
        tensors: dict[str, torch.Tensor] | None = None,
        non_tensors: Mapping[str, np.ndarray | list] | None = None,
        meta_info: dict | None = None,
    ) -> DataProto:
        """Build a DataProto; lists in ``non_tensors`` become 1-D object arrays.

        Raises ValueError naming the key when dim 0 sizes disagree.
        """
        arrays = {}
        for key, value in (non_tensors or {}).items():
            if isinstance(value, torch.Tensor):
                raise TypeError(f"non_tensors[{key!r}] is a torch.Tensor; pass it in tensors=")
            arrays[key] = value if isinstance(value, np.ndarray) else _as_object_array(list(value))
        return cls(batch=dict(tensors or {}), non_tensor_batch=arrays, meta_info=dict(meta_info or {}))

    def check_consistency(self) -> None:
        """Raise TypeError/ValueError unless every column is a tensor/array sharing dim 0."""
        first: tuple[str, int] | None = None
        for group, items, kind in (
            ("batch", self.batch, torch.Tensor),
            ("non_tensor_batch", self.non_tensor_batch, np.ndarray),
        ):
            for key, value in items.items():
                if not isinstance(key, str):
                    raise TypeError(f"DataProto keys must be str, got {key!r} in {group}")
                if not isinstance(value, kind):
                    raise TypeError(
                        f"DataProto.{group}[{key!r}] must be a {kind.__name__}, got {type(value).__name__}"
                    )
                if value.ndim == 0:
                    raise ValueError(
                        f"DataProto.{group}[{key!r}] is 0-dimensional; columns need dim 0 = rows"
                    )
                if first is None:
                    first = (key, value.shape[0])
                elif value.shape[0] != first[1]:
                    raise ValueError(
                        f"DataProto column {key!r} has {value.shape[0]} rows but {first[0]!r} has {first[1]}; "
                        "all tensors and arrays must share dim 0"
                    )
        both = set(self.batch) & set(self.non_tensor_batch)
        if both:
            raise ValueError(f"DataProto keys {sorted(both)} are both in batch and non_tensor_batch")
        if not isinstance(self.meta_info, dict):
            raise TypeError(f"DataProto.meta_info must be a dict, got {type(self.meta_info).__name__}")

    def _new(self, batch: dict, non_tensor: dict, meta_info: dict | None = None) -> DataProto:
        meta = copy.deepcopy(self.meta_info if meta_info is None else meta_info)
        return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)

    def __len__(self) -> int:
        for value in self.batch.values():
            return value.shape[0]
        for array in self.non_tensor_batch.values():
            return array.shape[0]
        return 0

    def __repr__(self) -> str:
        tensors = ", ".join(
            f"{k}: {tuple(v.shape)} {str(v.dtype).removeprefix('torch.')}" for k, v in self.batch.items()
        )
        arrays = ", ".join(f"{k}: {v.shape} {v.dtype}" for k, v in self.non_tensor_batch.items())
        return f"DataProto(len={len(self)}, batch={{{tensors}}}, non_tensor_batch={{{arrays}}}, meta_info keys={list(self.meta_info)})"

    # ------------------------------------------------------------------ selection

    def select(self, batch_keys=None, non_tensor_batch_keys=None, meta_info_keys=None) -> DataProto:
        """New DataProto with the given keys (``None``: all keys of that part); storage is shared."""
        bk = _keys(batch_keys, self.batch, "batch", True)
        nk = _keys(non_tensor_batch_keys, self.non_tensor_batch, "non_tensor_batch", True)
        mk = _keys(meta_info_keys, self.meta_info, "meta_info", True)
        return self._new(
            {k: self.batch[k] for k in bk},
            {k: self.non_tensor_batch[k] for k in nk},
            {k: self.meta_info[k] for k in mk},
        )

    def pop(self, batch_keys=None, non_tensor_batch_keys=None, meta_info_keys=None) -> DataProto:
        """Remove the given keys (``None``: none) from ``self`` and return them as a DataProto."""
        bk = _keys(batch_keys, self.batch, "batch", False)
        nk = _keys(non_tensor_batch_keys, self.non_tensor_batch, "non_tensor_batch", False)
        mk = _keys(meta_info_keys, self.meta_info, "meta_info", False)
        return DataProto(
            batch={k: self.batch.pop(k) for k in bk},
            non_tensor_batch={k: self.non_tensor_batch.pop(k) for k in nk},
            meta_info={k: self.meta_info.pop(k) for k in mk},
        )

    def union(self, other: DataProto) -> DataProto:
        """New DataProto with the keys of both; ``self`` is not modified.

        A key present in both must hold equal values (tensors by ``torch.equal``, arrays
        elementwise, meta_info values by ``==``), else ValueError naming the key.
        """
        both_have_rows = (self.batch or self.non_tensor_batch) and (other.batch or other.non_tensor_batch)
        if both_have_rows and len(self) != len(other):
            raise ValueError(f"cannot union DataProtos of lengths {len(self)} and {len(other)}")
        checks: tuple[tuple[str, dict[str, Any], dict[str, Any], Callable[[Any, Any], bool]], ...] = (
            ("batch", self.batch, other.batch, _tensors_equal),
            ("non_tensor_batch", self.non_tensor_batch, other.non_tensor_batch, _arrays_equal),
            ("meta_info", self.meta_info, other.meta_info, _values_equal),
        )
        for group, mine, theirs, equal in checks:
            for key in mine.keys() & theirs.keys():
                if not equal(mine[key], theirs[key]):
                    raise ValueError(
                        f"cannot union DataProtos: {group} key {key!r} has different values in the two"
                    )
        return self._new(
            {**self.batch, **other.batch},
            {**self.non_tensor_batch, **other.non_tensor_batch},
            {**self.meta_info, **copy.deepcopy(other.meta_info)},
        )

    def __getitem__(self, item: Any) -> DataProto:
        """Rows by slice, int (a one-row DataProto), index list/array/tensor or bool mask."""
        n = len(self)
        if isinstance(item, slice):
            return self._new(
                {k: v[item] for k, v in self.batch.items()},
                {k: v[item] for k, v in self.non_tensor_batch.items()},
            )
        if isinstance(item, (int, np.integer)) and not isinstance(item, (bool, np.bool_)):
            i = int(item)
            if not -n <= i < n:
                raise IndexError(f"row {i} is out of range for a DataProto of length {n}")
            i %= n
            return self[i : i + 1]
        if isinstance(item, torch.Tensor):
            item = item.detach().cpu().numpy()
        if isinstance(item, (list, tuple, np.ndarray)):
            idx = np.asarray(item)
            if idx.dtype == np.bool_:
                if idx.shape != (n,):
                    raise IndexError(f"boolean mask has shape {idx.shape}, expected ({n},)")
                idx = np.flatnonzero(idx)
            elif idx.size == 0:
                idx = idx.astype(np.int64)
            elif idx.dtype.kind not in "iu" or idx.ndim != 1:
                raise IndexError(
                    f"DataProto index arrays must be 1-D int or bool, got {idx.dtype} shape {idx.shape}"
                )
            if idx.size and (idx.max() >= n or idx.min() < -n):
                raise IndexError(f"index out of range for a DataProto of length {n}")
            t_idx = torch.from_numpy(idx.astype(np.int64))
            return self._new(
                {k: v[t_idx.to(v.device)] for k, v in self.batch.items()},
                {k: v[idx] for k, v in self.non_tensor_batch.items()},
            )
        raise TypeError(
            f"DataProto indices must be slices, ints, index arrays or bool masks, not {type(item).__name__}"
        )

    # ------------------------------------------------------------------ reshaping

    def chunk(self, n: int) -> list[DataProto]:
        """Split into ``n`` equal parts (views). The length must be divisible by ``n``."""
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"chunk(n) needs a positive int, got {n!r}")
        if len(self) % n:
            raise ValueError(
                f"cannot split a DataProto of length {len(self)} in {n} equal chunks; "
                f"pad it first with pad_to_divisor({n}) and unpad the result"
            )
        size = len(self) // n
        return [self[i * size : (i + 1) * size] for i in range(n)]

    @staticmethod
    def concat(data: Sequence[DataProto]) -> DataProto:
        """Rows of all parts in order; keys and dtypes must agree; meta_info of the first."""
        data = list(data)
        if not data:
            raise ValueError("DataProto.concat needs at least one DataProto")
        first = data[0]
        for i, part in enumerate(data[1:], start=1):
            if (
                part.batch.keys() != first.batch.keys()
                or part.non_tensor_batch.keys() != first.non_tensor_batch.keys()
            ):
                diff = (set(part.batch) | set(part.non_tensor_batch)) ^ (
                    set(first.batch) | set(first.non_tensor_batch)
                )
                raise ValueError(
                    f"DataProto.concat: part {i} has different keys than part 0 (differing: {sorted(diff)})"
                )
            for key, value in part.batch.items():
                if value.dtype != first.batch[key].dtype:
                    raise ValueError(
                        f"DataProto.concat: column {key!r} is {first.batch[key].dtype} in part 0 and {value.dtype} in part {i}"
                    )
        batch = {k: torch.cat([p.batch[k] for p in data], dim=0) for k in first.batch}
        arrays = {
            k: np.concatenate([p.non_tensor_batch[k] for p in data], axis=0) for k in first.non_tensor_batch
        }
        return first._new(batch, arrays)

    def repeat(self, n: int, interleave: bool = True) -> DataProto:
        """Repeat rows ``n`` times: ``a a b b`` (interleave) or ``a b a b``."""
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"repeat(n) needs a positive int, got {n!r}")
        if interleave:
            batch = {k: v.repeat_interleave(n, dim=0) for k, v in self.batch.items()}
            arrays = {k: np.repeat(v, n, axis=0) for k, v in self.non_tensor_batch.items()}
        else:
            batch = {k: v.repeat(n, *([1] * (v.ndim - 1))) for k, v in self.batch.items()}
            arrays = {k: np.tile(v, (n,) + (1,) * (v.ndim - 1)) for k, v in self.non_tensor_batch.items()}
        return self._new(batch, arrays)

    def pad_to_divisor(self, k: int) -> tuple[DataProto, int]:
        """Pad to a multiple of ``k`` rows by repeating rows from the start (cycling if needed).

        Returns ``(padded, pad_size)``; ``padded`` is ``self`` when no padding is needed.
        """
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"pad_to_divisor(k) needs a positive int, got {k!r}")
        n = len(self)
        pad_size = (-n) % k
        if pad_size == 0:
            return self, 0
        if n == 0:
            raise ValueError("cannot pad an empty DataProto: there are no rows to repeat")
        return DataProto.concat([self, self[np.arange(pad_size) % n]]), pad_size

    def unpad(self, pad_size: int) -> DataProto:
        """Drop the last ``pad_size`` rows (undoes :meth:`pad_to_divisor`)."""
        if pad_size < 0 or pad_size > len(self):
            raise ValueError(f"unpad({pad_size}) on a DataProto of length {len(self)}")
        return self if pad_size == 0 else self[: len(self) - pad_size]

    def to(self, device: str | torch.device) -> DataProto:
        """New DataProto with every tensor moved to ``device`` (arrays and meta_info shared)."""
        return DataProto(
            batch={k: v.to(device) for k, v in self.batch.items()},
            non_tensor_batch=dict(self.non_tensor_batch),
            meta_info=self.meta_info,
        )

    # ------------------------------------------------------------------ storage

    def save(self, url: str, storage_options: dict | None = None, *, compression: str | None = None) -> None:
        """Write this DataProto as one Arrow IPC file at ``url`` (any fsspec URL), atomically."""
        arrow_codec.save(url, self.batch, self.non_tensor_batch, self.meta_info, storage_options, compression)

    @classmethod
    def load(
        cls, url: str, columns: Iterable[str] | None = None, storage_options: dict | None = None
    ) -> DataProto:
        """Read the DataProto at ``url``; ``columns`` restricts to those keys (of either part).

        Raises :class:`DataProtoFormatError` for files that are not DataProtos, truncated files
        and missing columns.
        """
        tensors, arrays, meta_info = arrow_codec.load(url, columns, storage_options)
        return cls(batch=tensors, non_tensor_batch=arrays, meta_info=meta_info)
