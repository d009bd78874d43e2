"""The preflight's checks of storage, models and checkpoints, and the preflight itself (the data and
reward checks are in :mod:`ppoflow.infra.preflight.data`): report every problem at once.

    report = preflight(cfg, load_tokenizer)     # PreflightError listing each problem, else a report

A config can be valid and still unable to run: a parquet without the prompt column, a model
directory without weights, a reward function that returns NaN, credentials that cannot write the
storage root, a committed checkpoint that lost its files. Found by the first task, they cost the
start of every worker group and vLLM (tens of seconds on a CPU, minutes on a GPU); found here
they cost about a second. Each problem names the file or field, what was found, and the fix.

What is checked, and what it costs (independent of the dataset's size):

- resources: what this machine can hold of the run's ranks (GPUs, memory, cores;
  ``preflight.resources``);
- storage: the experiment directory is writable (one small file written, read back, removed), and
  is an experiment's or new: a directory at ``<root>/<experiment>`` that holds other files and no
  ``manifest.json`` is someone else's (one listing); on a local filesystem, room for the run's
  snapshots (``preflight.disk``: a new experiment with room for less than one is refused);
- models: ``model.path`` and the critic's, reward model's and teacher's paths are model directories (a
  ``config.json`` and weight files) or hub ids transformers can resolve; the tokenizer loads; with
  a hub id, one connection to the hub first (``ppoflow.infra.models.hf_hub``): where it cannot be reached the
  problem is said at once, not after a minute of ``huggingface_hub``'s retries;
- data: each of ``data.train_files`` and ``data.val_files`` is a readable parquet whose schema has
  ``data.prompt_key``, ``data_source`` and, with rule rewards, ``reward_model.ground_truth`` (the
  footer only); the first :data:`~ppoflow.infra.preflight.data.SAMPLE_ROWS` rows of each file hold
  prompts of the right shape, a data source with a registered reward, a ground truth, and prompts
  that fit ``rollout.prompt_length`` under ``data.truncation`` (those rows are read and tokenized);
  each problem names the list, the file and the row;
- reward: ``reward.custom_function`` imports, and the reward function returns a finite score on
  :data:`~ppoflow.infra.preflight.data.REWARD_ROWS` sample rows of each list (for an empty
  response and for the ground truth as response);
- multi-turn: ``rollout.multi_turn``'s environment and tools load (``preflight.multiturn``);
- architectures: each local model's ``config.json`` against the model matrix: what cannot run
  (packing a hybrid model, a logit soft-cap, ...) is a problem, a model outside it a note
  (``preflight.architecture``);
- teacher: its tokenizer is the student's, vocabulary and special tokens (``preflight.teacher``);
- tracking: with ``tracking.wandb`` on, the ``wandb`` package is installed, an online run has
  ``WANDB_API_KEY`` in the environment, and a ``dir`` can be written (the package is looked up,
  not imported: :func:`~ppoflow.infra.experiment.wandb_tracking.wandb_problems`);
- checkpoints: the checkpoints the manifest points at are complete and every file's size and
  content hash match the marker (:func:`checkpoint_problem`; each file read once: this one grows
  with the model, about 0.2-0.4 s per GB).

Rows past the sample are checked where they are used: ``generate`` raises :class:`DataError` on a
bad row, the ``advantage`` task :class:`~ppoflow.infra.rewards.RewardError` on a bad score; both
fail the task at once (no retries).
"""

from __future__ import annotations

import glob
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

from ppoflow.infra.checkpoint.sharded import CheckpointError, verify_checkpoint
from ppoflow.infra.config import ExperimentConfig, ModelConfig
from ppoflow.infra.data import storage
from ppoflow.infra.experiment.manifest import LAYOUT, ExperimentPaths, read_manifest
from ppoflow.infra.experiment.wandb_tracking import wandb_problems
from ppoflow.infra.models.hf_hub import cached_on_this_machine, hub_unreachable, is_hub_id
from ppoflow.infra.preflight.architecture import check_architectures
from ppoflow.infra.preflight.data import check_data, check_reward
from ppoflow.infra.preflight.disk import check_disk
from ppoflow.infra.preflight.multiturn import check_multi_turn
from ppoflow.infra.preflight.report import Checks, PreflightError, PreflightReport
from ppoflow.infra.preflight.resources import check_resources
from ppoflow.infra.preflight.teacher import check_teacher

__all__ = ["preflight", "checkpoint_problem", "rollback_hint"]

_WEIGHTS = ("*.safetensors", "*.bin", "*.pt", "*.safetensors.index.json")


def rollback_hint(paths: ExperimentPaths, n: int) -> str:
    """How to move the experiment back to its last good iteration before ``n``."""
    if n <= 0:
        return f"start the experiment again: remove {paths.root} (or pick another storage.experiment)"
    return (
        f"move the experiment back to iteration {n - 1}: ppoflow rollback {paths.root} --to {n - 1} "
        f"(it verifies iteration {n - 1}'s checkpoints first), then run again"
    )


def checkpoint_problem(url: str) -> str | None:
    """Why the checkpoint at ``url`` cannot be loaded, or None when it is complete.

    The one place that judges a committed checkpoint before a run uses it: its publish marker (an
    interrupted save has none) and every file the marker lists, at its recorded size and content
    hash (each file read once, at storage speed: flipped bytes fail here, in seconds, instead of
    in ``generate`` after a worker group started).
    """
    try:
        verify_checkpoint(url, deep=True)
    except (CheckpointError, FileNotFoundError, ValueError) as exc:
        return str(exc)
    return None


def _foreign(url: str) -> list[str]:
    """The entries of ``url`` no experiment holds, when it has no manifest (else none)."""
    try:
        names = storage.listdir(url)
    except (FileNotFoundError, NotADirectoryError):
        return []
    if "manifest.json" in names:
        return []
    return [name for name in names if name not in LAYOUT and not name.startswith(".")]


def _check_storage(cfg: ExperimentConfig, c: Checks) -> None:
    url = ExperimentPaths.of(cfg).root
    where = f"storage.experiment={cfg.storage.experiment}"
    try:
        foreign = _foreign(url)
    except Exception:  # noqa: BLE001 - an unreadable store is the write probe's to report
        foreign = []
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        c.problem(
            where,
            f"{url} holds files that are not an experiment's ({shown}) and no manifest.json: it is "
            "something else kept at the storage root",
            "name the experiment otherwise (storage.experiment), or move those files away",
        )
        return
    probe = storage.join(url, f".preflight{storage.TEMP_MARKER}{uuid.uuid4().hex[:12]}")
    data = b"ppoflow preflight\n"
    try:
        storage.write_bytes_atomic(probe, data)
        back = storage.read_bytes(probe)
        storage.rm(probe)
    except Exception as exc:  # noqa: BLE001 - any storage failure is reported the same way
        c.problem(
            f"storage.root={cfg.storage.root}",
            f"cannot write {url} ({type(exc).__name__}: {exc})",
            "make the directory writable, or for s3:// check the bucket and the credentials "
            "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_ENDPOINT_URL or storage.storage_options)",
        )
        return
    if back != data:
        c.problem(f"storage.root={cfg.storage.root}", f"{probe} read back different bytes", "check the store")
        return
    c.ok(f"storage: {url} is writable")


def _model_paths(cfg: ExperimentConfig) -> list[tuple[str, ModelConfig]]:
    out = [("model.path", cfg.model)]
    if cfg.critic.enable and cfg.critic.model is not None:
        out.append(("critic.model.path", cfg.critic.model))
    if cfg.reward.reward_model.enable and cfg.reward.reward_model.model is not None:
        out.append(("reward.reward_model.model.path", cfg.reward.reward_model.model))
    if cfg.teacher is not None:
        out.append(("teacher.model.path", cfg.teacher.model))
    return out


def _hub_problem(where: str, path: str, unreachable: str) -> tuple[str, str, str]:
    """The problem of hub id ``path`` when the hub cannot be reached (instead of a minute of retries)."""
    if cached_on_this_machine(path):
        return (
            where,
            f"a hub id, and {unreachable}; it is in this machine's Hugging Face cache",
            "set HF_HUB_OFFLINE=1 to load it from the cache without asking the hub "
            "(transformers retries each file for ~25 s first)",
        )
    return (
        where,
        f"a hub id that is not in this machine's Hugging Face cache, and {unreachable}",
        "download it where the hub is reachable (`hf download ORG/NAME --local-dir DIR`) and point "
        "the path at that directory, or set HTTPS_PROXY",
    )


def _check_models(cfg: ExperimentConfig, c: Checks, unreachable: str | None) -> None:
    fix = "point it at a Hugging Face model directory (config.json and weight files) or a hub id"
    for name, model in _model_paths(cfg):
        path = model.path
        if os.path.isdir(path):
            if not os.path.isfile(os.path.join(path, "config.json")):
                c.problem(f"{name}={path}", "the directory has no config.json", fix)
            elif not any(glob.glob(os.path.join(path, pattern)) for pattern in _WEIGHTS):
                c.problem(f"{name}={path}", "the directory has no weight files (*.safetensors, *.bin)", fix)
            else:
                c.ok(f"{name}: {path}")
            continue
        if not is_hub_id(path):
            c.problem(f"{name}={path}", "no such directory", fix)
            continue
        if unreachable is not None:
            c.problem(*_hub_problem(f"{name}={path}", path, unreachable))
            continue
        try:
            from transformers import AutoConfig

            AutoConfig.from_pretrained(path, trust_remote_code=model.trust_remote_code)
            c.ok(f"{name}: hub id {path}")
        except Exception as exc:  # noqa: BLE001 - transformers raises OSError, ValueError, ...
            c.problem(f"{name}={path}", f"not a local directory and not resolvable as a hub id ({exc})", fix)


def _check_checkpoints(cfg: ExperimentConfig, c: Checks) -> None:
    paths = ExperimentPaths.of(cfg)
    try:
        manifest = read_manifest(paths)
    except Exception as exc:  # noqa: BLE001 - a manifest that cannot be read is the problem itself
        c.problem(
            paths.manifest, f"cannot be read ({type(exc).__name__}: {exc})", "restore it from iterations/"
        )
        return
    if manifest is None:
        c.ok("checkpoints: a new experiment (no manifest yet)")
        return
    n = manifest.iteration
    for role in ("actor", "critic"):
        url = paths.url(manifest.snapshot(role))  # the written state the run loads (and replays from)
        if url is None:
            continue
        why = checkpoint_problem(url)
        if why is not None:
            c.problem(f"{paths.manifest} ({role} checkpoint of iteration {n})", why, rollback_hint(paths, n))
        for entry in manifest.replay.get(role, []):
            batch = paths.url(entry["batch"])
            if not storage.exists(batch):
                first = int(entry["previous"].rstrip("/").rsplit("/", 1)[-1])
                c.problem(
                    f"{paths.manifest} ({role} state of iteration {n})",
                    f"it is rebuilt by replaying the updates since iteration {first}, and the batch {batch} "
                    f"of iteration {entry['iteration']} is missing",
                    rollback_hint(paths, first + 1),
                )
                break
    if not any(p.where.startswith(paths.manifest) for p in c.problems):
        c.ok(f"checkpoints: iteration {n}'s are complete")


def _check_tracking(cfg: ExperimentConfig, c: Checks) -> None:
    wb = cfg.tracking.wandb
    if wb is None or wb.mode == "disabled":
        return
    problems = wandb_problems(cfg)
    for problem in problems:
        c.problem(*problem)
    if not problems:
        c.ok(f"tracking: W&B {wb.mode}, project {wb.project}")


def preflight(cfg: ExperimentConfig, load_tokenizer: Callable[[], Any]) -> PreflightReport:
    """Run every check (module docstring); raise :class:`PreflightError` listing all problems.

    ``load_tokenizer``: returns the policy's tokenizer (the caller may cache it for the run).
    """
    t0 = time.perf_counter()
    c = Checks()
    check_resources(cfg, c)
    _check_storage(cfg, c)
    check_disk(cfg, c)
    uses_hub = is_hub_id(cfg.model.tokenizer) or any(is_hub_id(m.path) for _, m in _model_paths(cfg))
    unreachable = hub_unreachable() if uses_hub else None
    _check_models(cfg, c, unreachable)
    check_architectures(cfg, c)
    tokenizer = None
    try:
        if unreachable is not None and is_hub_id(cfg.model.tokenizer):
            if cfg.model.tokenizer != cfg.model.path:  # else model.path's problem says it all
                c.problem(
                    *_hub_problem(
                        f"model.tokenizer_path={cfg.model.tokenizer}", cfg.model.tokenizer, unreachable
                    )
                )
        else:
            tokenizer = load_tokenizer()
            c.ok(f"tokenizer: {cfg.model.tokenizer}")
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds
        c.problem(
            f"model.tokenizer_path={cfg.model.tokenizer}",
            f"the tokenizer does not load ({type(exc).__name__}: {exc})",
            "point model.tokenizer_path (or model.path) at a directory with the tokenizer's files",
        )
    rows = check_data(cfg, tokenizer, c)
    check_reward(cfg, rows, c)
    check_multi_turn(cfg, c)
    if unreachable is None or cfg.teacher is None or not is_hub_id(cfg.teacher.model.tokenizer):
        check_teacher(cfg, tokenizer, c)  # else the hub's problem is teacher.model.path's
    _check_tracking(cfg, c)
    _check_checkpoints(cfg, c)
    c.report.seconds = time.perf_counter() - t0
    if c.problems:
        raise PreflightError(c.problems, c.report.seconds)
    return c.report
