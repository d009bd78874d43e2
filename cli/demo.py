"""``ppoflow demo``: PPO learns to name the larger of two digits on a CPU, end to end, in minutes.

:func:`run_demo` builds what is missing of the demo experiment (``ppoflow.demo.experiment``:
tiny model, prompts, format warm start, ``config.yaml``), runs the real ``ppo`` flow on it with a
line per iteration, and prints where everything is and how to go on. A second call continues the
same experiment.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from ppoflow.cli.console import command, print_summary, run_with_progress
from ppoflow.cli.failure import print_failure
from ppoflow.demo.experiment import (
    CONTINUE_ITERATIONS,
    DEFAULT_ITERATIONS,
    DEFAULT_SPEC,
    DemoSpec,
    local_dir,
    prepare,
)

__all__ = ["run_demo"]


def run_demo(
    location: str = "runs/demo",
    iterations: int | None = None,
    spec: DemoSpec = DEFAULT_SPEC,
    out: Callable[[str], None] = print,
    verbose: bool = False,
) -> dict[str, Any]:
    """Prepare the demo under ``location`` and train it (see the module docstring).

    ``iterations`` None: :data:`DEFAULT_ITERATIONS` on a new experiment, :data:`CONTINUE_ITERATIONS`
    more on one that has already run. Returns :func:`run_with_progress`'s dict. A failed run
    prints the error block of ``ppoflow.cli.failure`` (with the traceback when ``verbose``).
    """
    from ppoflow.infra.experiment.manifest import ExperimentPaths, read_manifest

    started = time.time()
    out(
        f"ppoflow demo: PPO teaches a tiny Qwen2 to name the larger of two digits, on {os.cpu_count()} CPU cores"
    )
    cfg = prepare(location, spec, log=out)
    manifest = read_manifest(ExperimentPaths.of(cfg))
    done = manifest.iteration if manifest else 0
    if iterations is None:
        iterations = CONTINUE_ITERATIONS if done else DEFAULT_ITERATIONS
    if done:
        out(
            f"continuing the experiment at {cfg.storage.experiment_url} after iteration {done}: "
            f"{iterations} more (models, data and config.yaml reused)"
        )
    out(
        f"running the ppo flow for {iterations} iterations: {cfg.data.train_batch_size} prompts x "
        f"{cfg.rollout.n} samples each, {cfg.resources.nprocs} ranks, vLLM rollouts, critic + GAE "
        f"(starting Prefect and the worker groups takes a little while)"
    )
    run = run_with_progress(cfg, iterations, out)
    if not run["ok"]:
        print_failure(
            cfg, run, rerun=f"{command('ppoflow')} demo --storage {location}", verbose=verbose, out=out
        )
        return run
    print_summary(
        cfg,
        run,
        config_path=os.path.join(local_dir(location), "config.yaml"),
        wall_s=time.time() - started,
        out=out,
    )
    return run
