"""The GPU parts of ``benchmarks/iteration.py``'s table: memory per worker group, the device-wide
peak, the rollout against plain vLLM, and the scaling against another run.

- :class:`DeviceMemorySampler` polls ``nvidia-smi`` (every process on each GPU) in a thread and
  keeps each GPU's peak; it does nothing where ``nvidia-smi`` is missing.
- :func:`memory_lines` reads the ranks' ``perf/mem/*`` metrics (``ppoflow.workers.device_memory``:
  one rank's torch caching allocator, in GiB, the engine's sleep-mode pool counted while awake).
- :func:`summary` is the run in one JSON-able dict; another run's summary is the ``--baseline`` of
  :func:`comparison_lines` (e.g. the 1-GPU run's for the 2-GPU run).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
from collections.abc import Callable

__all__ = ["DeviceMemorySampler", "memory_lines", "summary", "comparison_lines", "load_baseline"]


class DeviceMemorySampler:
    """Peak ``memory.used`` per GPU (MiB) while running, from ``nvidia-smi -lms``."""

    def __init__(self, period_ms: int = 200):
        self.period_ms = period_ms
        self.peaks: dict[int, tuple[float, float]] = {}  # index -> (peak used MiB, total MiB)
        self._proc: subprocess.Popen | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> DeviceMemorySampler:
        exe = shutil.which("nvidia-smi")
        if exe is None:
            return self
        self._proc = subprocess.Popen(
            [
                exe,
                "--query-gpu=index,memory.used,memory.total",
                "--format=csv,noheader,nounits",
                f"--loop-ms={self.period_ms}",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self._thread = threading.Thread(target=self._read, name="nvidia-smi", daemon=True)
        self._thread.start()
        return self

    def _read(self) -> None:
        for line in self._proc.stdout:
            try:
                index, used, total = (float(x) for x in line.split(","))
            except ValueError:
                continue
            peak = self.peaks.get(int(index), (0.0, total))[0]
            self.peaks[int(index)] = (max(peak, used), total)

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=10)
            self._thread.join(timeout=5)

    def lines(self) -> list[str]:
        if not self.peaks:
            return []
        parts = [
            f"GPU{i} {used / 1024:.1f} of {total / 1024:.1f} GiB"
            for i, (used, total) in sorted(self.peaks.items())
        ]
        return [f"  device peak over the run (nvidia-smi, every process): {', '.join(parts)}"]


Mean = Callable[[list[dict], str], float]


def memory_lines(rows: list[dict], mean: Mean) -> list[str]:
    """Per-rank memory of the actor group (actor + ref + engine) and the critic group."""

    def g(key: str) -> str:
        v = mean(rows, f"perf/mem/{key}")
        return f"{v:.1f}" if v == v else "-"

    if mean(rows, "perf/mem/update_actor_gib") != mean(rows, "perf/mem/update_actor_gib"):
        return []
    return [
        "GPU memory per rank, GiB (torch's caching allocator of each group's rank; vLLM's pool counted while awake):",
        f"  actor group (actor + ref + engine): resident {g('actor_group_resident_gib')}; peaks: generation "
        f"{g('generate_gib')} (engine awake: weights {g('engine_weights_gib')} + KV cache "
        f"{g('engine_kv_cache_gib')}), old log-probs {g('old_log_prob_gib')}, actor update {g('update_actor_gib')}",
        f"  critic group: resident {g('critic_group_resident_gib')}; peak: critic update {g('update_critic_gib')}",
    ]


def summary(args, rows: list[dict], mean: Mean, resp_tokens: float, all_tokens: float) -> dict:
    """The run's headline figures (what ``--baseline`` reads)."""
    gen_s, it_s = mean(rows, "rollout/generate_s"), mean(rows, "timing_s/iteration")
    return {
        "preset": args.preset,
        "device": args.device,
        "ranks": args.ranks,
        "tp": args.tp,
        "prompts": args.prompts,
        "n": args.n,
        "prompt_len": args.prompt_len,
        "response_len": args.response_len,
        "iteration_s": it_s,
        "tokens_per_s": all_tokens / it_s if it_s > 0 else None,
        "generation_s": gen_s,
        "generation_tokens_per_s": resp_tokens / gen_s if gen_s > 0 else None,
        "weight_sync_s": mean(rows, "weight_sync_s"),
    }


def load_baseline(text: str | None) -> dict | None:
    """A summary dict from a JSON literal or a file holding one (None passes through)."""
    if not text:
        return None
    if os.path.exists(text):
        with open(text) as f:
            text = f.read()
    data = json.loads(text)
    return data.get("summary", data)


def comparison_lines(args, run: dict, baseline: dict | None) -> list[str]:
    """The rollout against plain vLLM (``--reference-tokens-per-s``) and the scaling against ``baseline``."""
    lines = []
    gen = run.get("generation_tokens_per_s") or 0.0
    dp = max(1, args.ranks // max(1, args.tp))
    if args.reference_tokens_per_s:
        ref = args.reference_tokens_per_s
        lines.append(
            f"generation vs plain vLLM (one engine, one GPU, {ref:.0f} sampled tokens/s): ppoflow {gen:.0f} "
            f"tokens/s over {dp} engine replica(s) = {gen / ref:.2f}x; per replica {gen / dp / ref:.2f}x"
        )
    if baseline:
        r = baseline.get("ranks") or 1
        scale = args.ranks / r

        def ratio(key: str) -> str:
            a, b = run.get(key), baseline.get(key)
            return f"{a / b:.2f}x" if a and b else "-"

        (base_s, base_tps), (run_s, run_tps) = steady(baseline), steady(run)
        lines.append(
            f"scaling vs the {r}-rank run ({baseline.get('prompts')} prompts, {base_s:.1f} s between "
            f"commits): {args.ranks} ranks ({scale:.0f}x the GPUs), {args.prompts} prompts, {run_s:.1f} s "
            f"between commits; tokens/s {run_tps / base_tps:.2f}x, generation tokens/s "
            f"{ratio('generation_tokens_per_s')} (ideal {scale:.2f}x)"
        )
    return lines


def steady(run: dict) -> tuple[float, float]:
    """Seconds per iteration and tokens/s in the steady state: between consecutive commits (the
    iterations overlap, so one iteration's start-to-commit latency undercounts the throughput),
    else the latency (a run of one warm iteration has no interval)."""
    latency, tps = run.get("iteration_s") or float("nan"), run.get("tokens_per_s") or float("nan")
    interval = run.get("iteration_between_commits_s")
    if not interval or interval != interval:
        return latency, tps
    return interval, tps * latency / interval  # the same tokens per iteration, over the interval
