"""Room on the storage for the run's snapshots, known before anything starts.

    check_disk(cfg, c)        # a line, a note, or a problem into the preflight's Checks

A snapshot (``checkpoint.snapshot_every``, and the last iteration of a run) holds each trained
model's whole state: its weights in the model dtype and AdamW's two moments, three times the
weights (12 bytes a parameter with float32 master weights; with LoRA the adapters only, float32).
While one is written, the retention (``checkpoint.keep_last``) still holds the last ones: the
storage holds up to ``keep_last + 1`` at once. On a local filesystem the free space is compared
with that: for a new experiment less than one snapshot is a problem (the first snapshot would fail
mid-write, minutes or hours into the run), less than ``keep_last + 1`` a note. A resumed
experiment gets a note either way: its own snapshots are on that disk and the user may be freeing
room as it runs; a write that meets the full disk still ends the run with the disk named and
nothing half-written published. Remote storage (``s3://``, ...) is not measured. Nothing else a run
writes (batches, generations, metrics) comes near a snapshot's size.
"""

from __future__ import annotations

from ppoflow.infra.config import ExperimentConfig, LoRAConfig, ModelConfig
from ppoflow.infra.data import storage
from ppoflow.infra.experiment.manifest import ExperimentPaths
from ppoflow.infra.preflight.memory_fixes import model_shapes
from ppoflow.infra.preflight.memory_plan import DTYPE_BYTES, GIB
from ppoflow.infra.preflight.model_shape import ModelShape
from ppoflow.infra.preflight.report import Checks

__all__ = ["snapshot_bytes", "check_disk"]


def _state_bytes(shape: ModelShape, model: ModelConfig, lora: LoRAConfig, head: str) -> int:
    """One trained model's snapshot: weights and AdamW's two moments (module docstring)."""
    if lora.enabled:
        trained = shape.lora_params(lora) + (shape.hidden + 1 if head == "value" else 0)
        return 3 * 4 * trained
    return 3 * DTYPE_BYTES[model.dtype] * shape.params("value" if head == "value" else "lm")


def snapshot_bytes(cfg: ExperimentConfig, shapes: dict[str, ModelShape]) -> dict[str, int]:
    """Bytes of one snapshot per trained role (``actor``, and ``critic`` where it runs)."""
    out = {"actor": _state_bytes(shapes["policy"], cfg.model, cfg.actor.lora, "lm")}
    if cfg.critic.enable:
        out["critic"] = _state_bytes(shapes["critic"], cfg.critic_model, cfg.critic.lora, "value")
    return out


def _gb(n: int) -> str:
    """``n`` bytes in GiB, or MiB below 1 GiB."""
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


def check_disk(cfg: ExperimentConfig, c: Checks, free: int | None = None) -> None:
    """The snapshots against the free space of a local storage root (module docstring); ``free``:
    bytes free instead of what is measured here."""
    paths = ExperimentPaths.of(cfg)
    url = paths.root
    free = storage.local_free_bytes(url) if free is None else free
    shapes = model_shapes(cfg)
    if free is None or shapes is None:
        return
    sizes = snapshot_bytes(cfg, shapes)
    one = sum(sizes.values())
    kept = cfg.checkpoint.keep_last
    held = one * ((kept or 1) + 1)
    parts = " + ".join(f"{role} {_gb(n)}" for role, n in sizes.items())
    where = f"storage.root={cfg.storage.root}"
    resumed = storage.exists(paths.manifest)
    if free < one and resumed:
        c.report.notes.append(
            f"storage: {url} has {_gb(free)} free and a snapshot of this run is {_gb(one)} ({parts}): "
            "its next snapshot will not fit unless space is freed there"
        )
    elif free < one:
        c.problem(
            where,
            f"a snapshot of this run is {_gb(one)} ({parts}: weights and AdamW moments) and {url} "
            f"has {_gb(free)} free: the first snapshot would fail while it is written",
            "free space there or point storage.root at a larger filesystem (or s3://); LoRA "
            "(actor.lora.rank) keeps only the adapters",
        )
    elif free < held:
        keep = "every snapshot" if kept is None else f"keep_last {kept}"
        c.report.notes.append(
            f"storage: {url} has {_gb(free)} free; a snapshot is {_gb(one)} ({parts}) and "
            f"{keep} + the one being written need {_gb(held)}: the run may fill it "
            "(checkpoint.keep_last: 1 keeps the fewest)"
        )
    else:
        c.ok(f"storage: {_gb(free)} free for snapshots of {_gb(one)} ({parts})")
