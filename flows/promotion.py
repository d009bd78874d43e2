"""Promotion, the human side: ``ppoflow promote EXPERIMENT --iteration N`` (or ``--rollback``),
and the export of an iteration's policy that promotion publishes (the retraining flow's too).

    ppoflow promote runs/exp --iteration 12      # publish iteration 12 at runs/exp/promoted
    ppoflow promote runs/exp --rollback          # the promotion before the current one, again
    ppoflow promote runs/exp                     # print the current promotion and the log

The record and layout are :mod:`ppoflow.infra.experiment.promotion`'s.
"""

from __future__ import annotations

import argparse
import json
import os
import uuid
from collections.abc import Callable
from typing import Any

from ppoflow.flows.commands import CLIError, experiment_config, read_state

__all__ = ["export_iteration", "cmd_promote", "add_promote_command"]


def export_iteration(cfg: Any, paths: Any, n: int, out_dir: str, say: Callable[[str], None] = print) -> str:
    """Write the actor of committed iteration ``n`` of the experiment at ``paths`` (``cfg``: its
    config) as a Hugging Face directory at local ``out_dir`` (a state that is not a snapshot is
    rebuilt by replay first)."""
    from ppoflow.infra.checkpoint.hf_export import export_hf
    from ppoflow.infra.checkpoint.sharded import is_complete
    from ppoflow.infra.data import storage
    from ppoflow.infra.experiment.manifest import read_manifest

    manifest = read_manifest(paths)
    if manifest is None or n > manifest.iteration or n < 0:
        last = None if manifest is None else manifest.iteration
        raise CLIError(f"iteration {n} is not committed (the last committed iteration is {last})")
    source = (
        manifest.to_json() if n == manifest.iteration else storage.read_json(paths.file(n, "manifest.json"))
    )
    checkpoint = paths.url(source["actor_checkpoint"])
    base = manifest.identity.get("model.path")
    if not base or not os.path.isdir(base):
        raise CLIError(
            f"the experiment's base model {base!r} is not a local directory; export copies config and tokenizer from it"
        )
    scratch = None
    try:
        if not is_complete(checkpoint):
            from ppoflow.tasks.run.materialize import materialize_state

            scratch = storage.join(paths.root, "scratch", f"promote-{uuid.uuid4().hex[:12]}")
            checkpoint = materialize_state(cfg, "actor", checkpoint, storage.join(scratch, "actor"), say=say)
        return export_hf(checkpoint, out_dir, base)
    finally:
        if scratch is not None and storage.exists(scratch):
            storage.rm(scratch, recursive=True)


def cmd_promote(args: argparse.Namespace) -> int:
    from ppoflow.infra.experiment.promotion import (
        PromotionError,
        current_promotion,
        promoted_url,
        promotion_line,
        promotion_log,
        publish_promotion,
        rollback_promotion,
    )

    paths, manifest = read_state(args.experiment)
    try:
        if args.rollback:
            record = rollback_promotion(paths)
        elif args.iteration is not None:
            cfg = experiment_config(args.experiment)
            n = args.iteration
            metrics_url = paths.file(n, "metrics.json")
            from ppoflow.infra.data import storage

            metrics = storage.read_json(metrics_url) if n and storage.exists(metrics_url) else {}
            val = {k: v for k, v in metrics.items() if k.startswith("val/")}
            record = publish_promotion(
                paths,
                n,
                lambda out: export_iteration(cfg, paths, n, out),
                metric="val/score" if "val/score" in val else None,
                metrics=val,
                rule={"rule": "manual"},
            )
        else:
            if args.json:
                print(
                    json.dumps({"current": current_promotion(paths), "log": promotion_log(paths)}, indent=1)
                )
                return 0
            print(f"promoted  {promotion_line(current_promotion(paths))}")
            for r in promotion_log(paths):
                print(
                    f"  #{r['seq']} {r['action']:<8} iteration {r['iteration']}  value {r.get('value')}  {r['at']}"
                )
            return 0
    except PromotionError as err:
        raise CLIError(str(err)) from None
    print(f"{promoted_url(paths)} -> {record['model']}: {promotion_line(record)}")
    return 0


def add_promote_command(sub: Any, positive: Any) -> None:
    p = sub.add_parser(
        "promote",
        help="publish an iteration's policy at <experiment>/promoted, roll a promotion back, or list them",
    )
    p.add_argument("experiment", help="experiment URL/path, or its YAML config")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--iteration", type=positive, default=None, help="the committed iteration to promote")
    what.add_argument("--rollback", action="store_true", help="make the previous promotion current again")
    p.add_argument("--json", action="store_true", help="print {current, log} as JSON (no other option)")
