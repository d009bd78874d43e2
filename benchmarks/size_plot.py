"""How an iteration's cost grows with the model: seconds per iteration and per 1k tokens against
the parameter count, each measured point beside its floor, from a JSON table of points.

    python benchmarks/size_plot.py docs/bench/size_ladder_points.json --plot docs/bench/size_ladder.png

A point is one measured run of ``benchmarks/iteration.py`` (the table names its log):

    {"label": "8B GRPO LoRA r32", "params": 8.19e9, "sequences": 256, "tokens": 1024,
     "seconds": 62.2, "passes": {"generate": 2, "log_probs": 2, "update": 4}, "log": "..."}

``seconds`` is the mean of the warm iterations' seconds between commits; ``tokens`` the prompt and
response tokens of one sequence. The floor is the point's model FLOPs at a given MFU (0.40 unless
``--mfu``) of the card's bf16 peak (``--peak-tflops``, measured in the runs' calls):
``params x sequences x tokens x sum(passes)``, where a forward pass counts 2 FLOPs per parameter and
token, an update 6 (4 with LoRA: no weight gradients for the frozen base), a critic adds its values
pass and update, and generation counts as one forward over every token (prefill and decode).
Attention's own FLOPs and recompute's extra forward are left out: the floor is the useful work.
Prints the table; ``--plot`` writes the figure.
"""

from __future__ import annotations

import argparse
import json


def flops(point: dict) -> float:
    """The point's model FLOPs per iteration (see the module docstring)."""
    return float(point["params"]) * point["sequences"] * point["tokens"] * sum(point["passes"].values())


def rows(points: list[dict], peak_tflops: float, mfu: float) -> list[dict]:
    out = []
    for p in sorted(points, key=lambda q: q["params"]):
        floor = flops(p) / (mfu * peak_tflops * 1e12)
        tokens = p["sequences"] * p["tokens"]
        out.append(
            {
                "label": p["label"],
                "params_b": p["params"] / 1e9,
                "seconds": p["seconds"],
                "s_per_1k_tokens": p["seconds"] / tokens * 1e3,
                "floor_s": floor,
                "floor_per_1k_tokens": floor / tokens * 1e3,
                "x_floor": p["seconds"] / floor,
                "card": p.get("card", ""),
            }
        )
    return out


def table(out: list[dict], mfu: float) -> str:
    head = (
        f"{'point':<34}{'params':>8}{'s/iter':>9}{'s/1k tok':>10}{f'floor@{mfu:.0%}':>11}{'x floor':>9}  card"
    )
    lines = [head]
    for r in out:
        lines.append(
            f"{r['label']:<34}{r['params_b']:>7.2f}B{r['seconds']:>9.2f}{r['s_per_1k_tokens']:>10.3f}"
            f"{r['floor_s']:>11.2f}{r['x_floor']:>9.2f}  {r['card']}"
        )
    return "\n".join(lines)


def plot(out: list[dict], path: str, mfu: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    x = [r["params_b"] for r in out]
    for ax, key, floor_key, title in (
        (axes[0], "seconds", "floor_s", "seconds per iteration"),
        (axes[1], "s_per_1k_tokens", "floor_per_1k_tokens", "seconds per 1k tokens"),
    ):
        ax.plot(x, [r[key] for r in out], "o-", label="measured (warm mean)")
        ax.plot(x, [r[floor_key] for r in out], "s--", color="grey", label=f"model FLOPs at {mfu:.0%} MFU")
        for r in out:
            ax.annotate(
                r["label"], (r["params_b"], r[key]), fontsize=7, xytext=(4, 4), textcoords="offset points"
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks([t for t in (0.5, 1, 2, 4, 8, 16, 32) if min(x) / 1.5 <= t <= max(x) * 1.5])
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlim(min(x) / 1.3, max(x) * 2.2)  # room for the last point's label
        ax.set_xlabel("parameters (billions)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("points", help="a JSON file: {'peak_tflops': ..., 'points': [...]}")
    p.add_argument("--peak-tflops", type=float, default=None, help="the card's bf16 peak (else the file's)")
    p.add_argument("--mfu", type=float, default=0.40)
    p.add_argument("--plot", default=None, help="write the figure here (PNG)")
    args = p.parse_args(argv)
    with open(args.points) as f:
        data = json.load(f)
    peak = args.peak_tflops or float(data["peak_tflops"])
    out = rows(data["points"], peak, args.mfu)
    print(f"floor: model FLOPs at {args.mfu:.0%} of {peak:.0f} TFLOP/s")
    print(table(out, args.mfu))
    if args.plot:
        plot(out, args.plot, args.mfu)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
