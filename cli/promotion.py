"""Promotion, the human side: ``ppoflow promote EXPERIMENT --iteration N`` (or ``--rollback``).

    ppoflow promote runs/exp --iteration 12      # publish iteration 12 at runs/exp/promoted
    ppoflow promote runs/exp --rollback          # the promotion before the current one, again
    ppoflow promote runs/exp                     # print the current promotion and the log

The record and layout are :mod:`ppoflow.infra.experiment.promotion`'s; the policy it publishes is
written by :func:`ppoflow.flows.export.export_iteration` (the retraining flow's too).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from ppoflow.cli.commands import CLIError, experiment_config, read_state

__all__ = ["cmd_promote", "add_promote_command"]


def cmd_promote(args: argparse.Namespace) -> int:
    from ppoflow.flows.export import export_iteration
    from ppoflow.infra.config import ConfigError
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
    except (PromotionError, ConfigError) as err:
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
