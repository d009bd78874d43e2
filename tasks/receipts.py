"""Receipts: what a finished task leaves on storage, and how a rerun finds it.

A task's receipt (``iterations/{n:06d}/tasks/<task>.json``) is written after its outputs are
complete. Paths in it are stored relative to the experiment root (so an experiment directory can
be copied or moved) and resolved to URLs when read. A task that finds its receipt, and every output
it lists still complete (an Arrow file: it exists, as writes are atomic; a checkpoint: its
completion marker), returns the receipt instead of working again. That is how a retried or rerun
flow resumes at the first unfinished task: storage, not Prefect's result cache, is the record.

Receipts are reused even if the config changed in between (say, a smaller micro-batch after an
out-of-memory failure does not redo the rollout); the config that commits the iteration is the one
recorded in its manifest. They are *not* reused when the task's inputs differ (:func:`input_stamps`:
the checkpoints it starts from, the stamps of the receipts it consumes), e.g. a rollout sampled
with ``algorithm.overlap: one_step`` from an older checkpoint than a plain run would use; a task
that runs again gets a new stamp, so the tasks after it run again too.

Each task has its receipt type: :class:`Receipt` holds what every task reports; the subclasses
add the typed values later steps need (``GenerateReceipt.next_cursor``, ``AdvantageReceipt.kl_coef``).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any, TypeVar, cast

from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny

from ppoflow.infra.checkpoint.sharded import is_complete
from ppoflow.infra.data import storage
from ppoflow.infra.data.prompts import DataCursor
from ppoflow.infra.experiment.manifest import ExperimentPaths
from ppoflow.tasks.graph import writers

__all__ = [
    "Receipt",
    "GenerateReceipt",
    "ConsumeReceipt",
    "AdvantageReceipt",
    "IterationReceipts",
    "find_receipt",
    "write_receipt",
    "input_stamps",
    "R",
]


class Receipt(BaseModel):
    """What every task reports: its outputs (Arrow files by name), the checkpoints it wrote (by
    role), its metrics and its wall time."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    task: str
    iteration: int
    outputs: dict[str, str] = Field(default_factory=dict, description="Arrow files by name (URLs)")
    checkpoints: dict[str, str] = Field(
        default_factory=dict, description="the state each update left, by role (a checkpoint's URL)"
    )
    replay: dict[str, dict[str, str]] = Field(
        default_factory=dict,
        description="roles whose state was not written (not a snapshot iteration): how to rebuild it, "
        "{previous: state URL, batch: URL, method: the worker's update method}",
    )
    metrics: dict[str, float] = Field(default_factory=dict)
    timing_s: float = 0.0
    finished_at: str = ""
    stamp: str = Field("", description="unique per computation: what later tasks record as their input")
    inputs: dict[str, str] = Field(default_factory=dict, description="what the result was computed from")
    resumed: bool = Field(False, description="True when read back from storage instead of computed")

    def output(self, name: str) -> str:
        """The URL of output ``name``; a clear error naming what the task did write."""
        try:
            return self.outputs[name]
        except KeyError:
            raise KeyError(
                f"the {self.task} receipt of iteration {self.iteration} has no output {name!r} "
                f"(it has {sorted(self.outputs)})"
            ) from None

    def checkpoint(self, role: str) -> str:
        """The URL of the checkpoint of ``role`` this task wrote."""
        try:
            return self.checkpoints[role]
        except KeyError:
            raise KeyError(
                f"the {self.task} receipt of iteration {self.iteration} has no {role} checkpoint "
                f"(it has {sorted(self.checkpoints)})"
            ) from None


class GenerateReceipt(Receipt):
    """``generate``: where the data cursor goes next, the iteration's sampling seed, and how many
    prompts were truncated to ``rollout.prompt_length``."""

    next_cursor: DataCursor
    seed: int
    truncated_prompts: int = 0


class ConsumeReceipt(GenerateReceipt):
    """``consume`` (asynchronous training): the generate receipt's fields, and the record of the
    queue's batch the iteration took (``ppoflow.infra.queue.batches``: its file relative to the
    experiment, content hash, size, rows, the versions that sampled it), which ``commit`` stores in
    the manifest."""

    batch: dict[str, Any] = Field(default_factory=dict)


class AdvantageReceipt(Receipt):
    """``advantage``: the KL controller's coefficient after this iteration (None: no KL in the
    reward), which ``commit`` stores in the manifest."""

    kl_coef: float | None = None


R = TypeVar("R", bound=Receipt)


def _map_urls(receipt: R, convert) -> R:
    return receipt.model_copy(
        update={
            "outputs": {k: convert(v) for k, v in receipt.outputs.items()},
            "checkpoints": {k: convert(v) for k, v in receipt.checkpoints.items()},
            "replay": {
                role: {**entry, "previous": convert(entry["previous"]), "batch": convert(entry["batch"])}
                for role, entry in receipt.replay.items()
            },
        }
    )


def _complete(receipt: Receipt) -> bool:
    """Every output exists, and every state is a complete checkpoint or can be rebuilt (its batch
    is on storage: the state it started from was the previous iteration's)."""
    return all(storage.exists(u) for u in receipt.outputs.values()) and all(
        storage.exists(receipt.replay[role]["batch"]) if role in receipt.replay else is_complete(u)
        for role, u in receipt.checkpoints.items()
    )


def _stamp(paths: ExperimentPaths, value: Any) -> str:
    if isinstance(value, Receipt):
        return f"{value.task}:{value.stamp}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_stamp(paths, v) for v in value) + "]"
    if isinstance(value, str):
        return paths.ref(value) or ""
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)
    return json.dumps(value, sort_keys=True, default=str)


def input_stamps(paths: ExperimentPaths, args: tuple, kwargs: dict[str, Any]) -> dict[str, str]:
    """A task's inputs as strings: receipts by their stamps, URLs relative to the experiment,
    other values as JSON (positional arguments by position)."""
    out = {str(i): _stamp(paths, v) for i, v in enumerate(args)}
    out.update({k: _stamp(paths, v) for k, v in kwargs.items()})
    return out


def find_receipt(
    paths: ExperimentPaths,
    n: int,
    task: str,
    kind: type[R],
    inputs: dict[str, str] | None = None,
    settle: Callable[[str], None] | None = None,
) -> R | None:
    """The receipt of ``task`` for iteration ``n`` if it and all its outputs are complete.

    ``inputs``: the current inputs; a receipt computed from other ones is not reused (a receipt
    that recorded none, from an older ppoflow, is). ``settle(url)`` is called for each checkpoint
    first (to wait for a write of it still running in this flow run).
    """
    url = paths.receipt(n, task)
    if not storage.exists(url):
        return None
    receipt = _map_urls(kind.model_validate(storage.read_json(url)), paths.url)
    if inputs is not None and receipt.inputs and receipt.inputs != inputs:
        return None
    if settle is not None:
        for checkpoint in receipt.checkpoints.values():
            settle(checkpoint)
    return receipt.model_copy(update={"resumed": True}) if _complete(receipt) else None


def write_receipt(paths: ExperimentPaths, receipt: R) -> R:
    """Record ``receipt`` (call after its outputs are complete); paths stored relative. Returns it
    with a new stamp unless it had one."""
    if not receipt.stamp:
        receipt = receipt.model_copy(update={"stamp": uuid.uuid4().hex[:16]})
    stored = _map_urls(receipt, paths.ref)
    storage.write_json_atomic(paths.receipt(receipt.iteration, receipt.task), stored.model_dump(mode="json"))
    return receipt


#: The outputs whose writers an iteration's receipts must hold: the rollout (its receipt carries
#: the data cursor after the batch) and the advantages (the KL coefficient).
_ROLLOUT, _ADVANTAGES = "rollout", "advantages"


class IterationReceipts(BaseModel):
    """Everything ``commit`` publishes iteration n from: the receipts of its steps by step name
    (the rows of :data:`ppoflow.tasks.graph.STEPS` that ran). The rollout's and the advantages'
    receipts are found by the rows' ``output``, whichever step wrote them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    by_step: dict[str, SerializeAsAny[Receipt]]

    @classmethod
    def of(cls, receipts: list[Receipt]) -> IterationReceipts:
        """The iteration's receipts from a list (each names its step)."""
        by_step = {r.task: r for r in receipts}
        missing = [" or ".join(writers(out)) for out in (_ROLLOUT, _ADVANTAGES) if not _writer(by_step, out)]
        if missing:
            raise ValueError(f"an iteration's receipts need {sorted(missing)}; got {sorted(by_step)}")
        return cls(by_step=by_step)

    @property
    def generate(self) -> GenerateReceipt:
        """The receipt of the iteration's rollout: ``generate``'s, or ``consume``'s (asynchronous)."""
        return cast(GenerateReceipt, _writer(self.by_step, _ROLLOUT))

    @property
    def consumed(self) -> dict[str, Any] | None:
        """The record of the queue's batch the iteration consumed (asynchronous training), or None."""
        receipt = self.by_step.get("consume")
        return dict(cast(ConsumeReceipt, receipt).batch) if receipt is not None else None

    @property
    def advantage(self) -> AdvantageReceipt:
        """The receipt of the iteration's advantages (``advantage``'s)."""
        return cast(AdvantageReceipt, _writer(self.by_step, _ADVANTAGES))

    def all(self) -> list[Receipt]:
        return list(self.by_step.values())

    def checkpoint(self, role: str) -> str | None:
        """The state of ``role`` an update of this iteration left (None: no update of it)."""
        update = self.update_of(role)
        return None if update is None else update.checkpoints[role]

    def update_of(self, role: str) -> Receipt | None:
        """The receipt of the update of ``role`` in this iteration (None: none ran)."""
        return next((r for r in self.by_step.values() if role in r.checkpoints), None)


def _writer(by_step: dict[str, Receipt], output: str) -> Receipt | None:
    """The receipt of the step that ran and writes ``output`` (its row's ``output``), if any."""
    return next((by_step[name] for name in writers(output) if name in by_step), None)
