"""Preflight of ``resources.*`` (``ppoflow.infra.preflight.resources``): what this machine can hold.

The machine's numbers are read independently here (``/proc/meminfo``, the CPU affinity,
``torch.cuda``) and compared with what the check read; the decisions are checked on the machine
itself and on stated numbers (``cores=``, ``memory_mib=``, ``gpus=``), the refusals' messages
against arithmetic done here from the measured per-rank figures.
"""

from __future__ import annotations

import os

import pytest

from ppoflow.infra.preflight.report import Checks
from ppoflow.infra.preflight.resources import (
    ACTOR_RANK_MIB,
    CRITIC_RANK_MIB,
    RANK_START_CPU_S,
    available_memory_mib,
    check_resources,
    usable_cores,
)
from tests.support.configs import make_config


def config(tmp_path, nprocs: int, **over):
    """A config of ``nprocs`` CPU ranks (batch sizes that divide), an actor with vLLM and a critic."""
    return make_config(
        tmp_path,
        "m",
        ["d.parquet"],
        **{
            "resources.nprocs": nprocs,
            "data.train_batch_size": nprocs,
            "actor.ppo_mini_batch_size": nprocs,
            "critic.ppo_mini_batch_size": nprocs,
            "rollout.engine": "vllm",
            **over,
        },
    )


def run(cfg, **machine) -> Checks:
    c = Checks()
    check_resources(cfg, c, **machine)
    return c


def test_the_machine_is_read_as_the_kernel_reports_it():
    assert usable_cores() == len(os.sched_getaffinity(0))  # no CPU quota on the test machines
    with open("/proc/meminfo") as f:
        fields = {line.split(":")[0]: int(line.split()[1]) for line in f}
    free = available_memory_mib()
    assert free is not None and 0 < free <= fields["MemTotal"] // 1024
    assert abs(free - fields["MemAvailable"] // 1024) < max(512, fields["MemTotal"] // 1024 // 10)


def test_more_ranks_than_memory_holds_are_refused_with_the_numbers_and_the_fix(tmp_path):
    cfg = config(tmp_path, 64)
    c = run(cfg, cores=2, memory_mib=20_000)
    by_where = {p.where: p for p in c.problems}
    (memory,) = [p for p in c.problems if "GiB" in p.found]
    per_set = ACTOR_RANK_MIB + CRITIC_RANK_MIB  # an actor and a critic rank per "set" of ranks
    assert memory.where == "resources.nprocs=64"
    assert f"2 worker group(s) x 64 ranks need at least {64 * per_set / 1024:.1f} GiB" in memory.found
    assert "this process may take 19.5 GiB" in memory.found
    assert memory.fix.startswith(f"lower resources.nprocs to at most {20_000 // per_set}")
    # the run starts both groups at once: 128 ranks x 2.5 CPU-s on 2 cores > the connect timeout
    (start,) = [p for p in c.problems if "connect" in p.found]
    assert f"128 ranks, each spending at least {RANK_START_CPU_S:g} CPU-seconds" in start.found
    assert f"take at least {128 * RANK_START_CPU_S / 2:.0f} s, more than resources.connect_timeout_s=120" in (
        start.found
    )
    assert len(by_where) == 1 and len(c.problems) == 2
    # what fits the same machine passes; a longer connect timeout lifts the start limit only
    assert run(config(tmp_path, 16), cores=16, memory_mib=20_000).problems == []
    slow = run(config(tmp_path, 64, **{"resources.connect_timeout_s": 600}), cores=2, memory_mib=200_000)
    assert slow.problems == [] and len(slow.report.notes) == 1


def test_a_run_without_a_critic_or_vllm_needs_less(tmp_path):
    light = config(
        tmp_path,
        32,
        **{"critic.enable": False, "algorithm.adv_estimator": "grpo", "rollout.n": 2, "rollout.engine": "hf"},
    )
    assert run(light, cores=64, memory_mib=32 * CRITIC_RANK_MIB).problems == []
    (problem,) = run(light, cores=64, memory_mib=32 * CRITIC_RANK_MIB - 1).problems
    assert (
        f"1 worker group(s) x 32 ranks need at least {32 * CRITIC_RANK_MIB / 1024:.1f} GiB" in problem.found
    )
    assert "run fewer groups" not in problem.fix  # there is one already


def test_oversubscribed_cores_warn_once_and_one_rank_per_core_is_quiet(tmp_path):
    c = run(config(tmp_path, 4, **{"resources.threads_per_rank": 2}), cores=4, memory_mib=100_000)
    assert c.problems == []
    (note,) = c.report.notes
    assert note.startswith("resources: 4 ranks x 2 thread(s) per group = 8 threads on the 4 core(s)")
    quiet = run(config(tmp_path, 4, **{"resources.threads_per_rank": 1}), cores=4, memory_mib=100_000)
    assert quiet.problems == [] and quiet.report.notes == []
    assert quiet.report.passed == ["resources: 8 CPU rank(s) in 2 group(s) on 4 core(s)"]


def test_cuda_ranks_need_a_visible_gpu_each(tmp_path):
    import torch

    cfg = config(tmp_path, 2, **{"resources.device": "cuda"})
    (problem,) = run(cfg, gpus=1).problems
    assert problem.where == "resources.nprocs=2" and "this process sees 1 GPU(s)" in problem.found
    assert problem.fix == "lower resources.nprocs to 1"
    assert run(cfg, gpus=2).problems == []
    visible = torch.cuda.device_count()  # this machine, as torch sees it
    real = run(cfg)
    assert (real.problems == []) == (visible >= 2)
    if visible == 0:
        assert "run where a GPU is visible, or set resources.device=cpu" in real.problems[0].fix


def test_a_multi_node_run_is_the_nodes_business(tmp_path):
    cfg = config(
        tmp_path,
        4,
        **{
            "resources.launch": "rendezvous",
            "resources.rendezvous": {"nnodes": 2, "nproc_per_node": 2},
            "storage.root": "s3://bucket/runs",
        },
    )
    c = run(cfg, cores=1, memory_mib=1)
    assert c.problems == [] and c.report.passed == [
        "resources: 4 ranks per group on 2 nodes (their machines')"
    ]


@pytest.mark.parametrize("nprocs", [1, 2])
def test_the_tests_own_runs_fit_this_machine(tmp_path, nprocs):
    """The flow tests' 2-rank configs pass here (else every flow test would be refused)."""
    assert run(config(tmp_path, nprocs)).problems == []
