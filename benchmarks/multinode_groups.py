"""Multi-node worker groups on one host: N ``ppoflow agent`` processes as N nodes (on CUDA each
sees only its own GPUs), the driver here. Prints what a group costs and how fast failure is seen:

    python benchmarks/multinode_groups.py [--nodes 2] [--device cpu|cuda] [--scratch URL]

- group start (agents -> torchrun c10d rendezvous -> ranks connected and built), shutdown;
- a JSON round trip to every rank (ms), the all-reduce of (rank + 1) over the process group
  (gloo on CPU, nccl on CUDA: across the nodes' separate torchruns), a DP call on 4,096 rows
  checked against the plain function;
- an agent SIGKILLed during a call: seconds until the call fails naming the node, until no
  process of the group is left, and a rebuilt group's start on a new agent.

The ranks run ``benchmarks/bench_worker.py``'s worker (the repository root goes on their
``PYTHONPATH``).
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.bench_worker import double_plus  # noqa: E402
from ppoflow.infra.data.dataproto import DataProto  # noqa: E402
from ppoflow.infra.remote.driver.group import WorkerGroup  # noqa: E402
from ppoflow.infra.remote.driver.hub import ClusterHub  # noqa: E402
from ppoflow.infra.remote.driver.rendezvous import RendezvousLauncher  # noqa: E402
from ppoflow.infra.remote.errors import RankFailure  # noqa: E402
from ppoflow.infra.remote.procs import processes_with_env  # noqa: E402


def start_agent(hub: ClusterHub, node: int, device: str, env: dict[str, str], logs: str) -> subprocess.Popen:
    env = dict(env)
    if device == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = str(node)
    cmd = [sys.executable, "-m", "ppoflow.cli", "agent", "--driver", hub.control_address]
    cmd += ["--node-rank", str(node), "--advertise-addr", "127.0.0.1"]
    out = open(os.path.join(logs, f"agent-{node}.log"), "ab")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


def group(hub: ClusterHub, gid: str, scratch: str, device: str) -> WorkerGroup:
    launcher = RendezvousLauncher(hub, 1, gid, f"{scratch.rstrip('/')}/{gid}", join_timeout_s=120)
    return WorkerGroup(
        "benchmarks.bench_worker:BenchWorker",
        nprocs=hub.nnodes,
        config={},
        device=device,
        launcher=launcher,
        grace_s=1.0,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--scratch", default=None, help="storage URL for DP chunks (default: a temp dir)")
    args = ap.parse_args()
    tag = secrets.token_hex(8)
    env = {**os.environ, "PPOFLOW_CLUSTER_KEY": secrets.token_hex(32), "PPOFLOW_BENCH_TAG": tag}
    os.environ["PPOFLOW_CLUSTER_KEY"] = env["PPOFLOW_CLUSTER_KEY"]
    logs = tempfile.mkdtemp(prefix="multinode-bench-")
    scratch = args.scratch or logs
    rows: list[tuple[str, str]] = []
    hub = ClusterHub(
        env["PPOFLOW_CLUSTER_KEY"].encode(), args.nodes, "127.0.0.1", "127.0.0.1", 0, 0, log=lambda line: None
    )
    agents = {n: start_agent(hub, n, args.device, env, logs) for n in range(args.nodes)}
    try:
        t0 = time.perf_counter()
        hub.wait_for_agents(120)
        rows.append(("agents connected", f"{time.perf_counter() - t0:.2f} s"))
        g = group(hub, "bench-1", scratch, args.device)
        t0 = time.perf_counter()
        g.start()
        rows.append((f"group start ({args.nodes} nodes x 1 rank)", f"{time.perf_counter() - t0:.2f} s"))
        t0 = time.perf_counter()
        for i in range(50):
            g.call("echo", i)
        rows.append(("JSON round trip to every rank", f"{(time.perf_counter() - t0) / 50 * 1e3:.2f} ms"))
        info = g.call("device_allreduce")
        expect = args.nodes * (args.nodes + 1) / 2
        ok = all(r["sum"] == expect for r in info)
        rows.append(
            (
                "all-reduce of rank+1 across nodes",
                f"{info[0]['sum']:.0f} (expect {expect:.0f}) {info[0]['backend']} {'ok' if ok else 'WRONG'}",
            )
        )
        x = torch.randn(4096, 64, generator=torch.Generator().manual_seed(0))
        data_url = f"{scratch.rstrip('/')}/in.arrow"
        names = np.array([f"r{i}" for i in range(4096)], dtype=object)
        DataProto.from_dict(tensors={"x": x, "id": torch.arange(4096)}, non_tensors={"name": names}).save(
            data_url
        )
        t0 = time.perf_counter()
        out = DataProto.load(g.call("double", data_url, out_url=f"{scratch.rstrip('/')}/out.arrow"))
        same = torch.equal(out.batch["y"], double_plus(x))
        rows.append(
            (
                "DP call, 4,096 x 64 rows",
                f"{time.perf_counter() - t0:.2f} s, equal to the plain function: {same}",
            )
        )
        t0 = time.perf_counter()
        g.shutdown()
        rows.append(("shutdown", f"{time.perf_counter() - t0:.2f} s"))

        g = group(hub, "bench-2", scratch, args.device).start()
        victim = args.nodes - 1
        died: dict[str, float] = {}

        def kill() -> None:
            agents[victim].send_signal(signal.SIGKILL)
            agents[victim].wait()
            died["t"] = time.perf_counter()

        threading.Timer(1.0, kill).start()
        try:
            g.call("sleep", 120.0)
            rows.append(("lost node", "NOT DETECTED"))
        except RankFailure as err:
            failed = time.perf_counter()
            rows.append((f"call failed after node {victim}'s agent died", f"{failed - died['t']:.2f} s"))
            rows.append(("  its message starts", str(err).splitlines()[0][:90]))
            while processes_with_env(PPOFLOW_BENCH_TAG=tag, PPOFLOW_GROUP_ID="bench-2"):
                time.sleep(0.05)
            rows.append(("  no process of the group left", f"{time.perf_counter() - died['t']:.2f} s"))
        agents[victim] = start_agent(hub, victim, args.device, env, logs)
        t0 = time.perf_counter()
        with group(hub, "bench-3", scratch, args.device) as g3:
            rows.append(("rebuilt group start (new agent)", f"{time.perf_counter() - t0:.2f} s"))
            g3.call("echo", 1)
    finally:
        hub.close()
        for proc in agents.values():
            proc.terminate()
        for proc in agents.values():
            proc.wait(timeout=30)
    width = max(len(k) for k, _ in rows)
    print(f"\nmulti-node worker groups on one host ({args.device}, {args.nodes} agents; logs in {logs})")
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")


if __name__ == "__main__":
    main()
