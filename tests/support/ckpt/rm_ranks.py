"""torchrun script for tests/workers/test_reward_model_worker.py: RewardModelWorker on real gloo ranks.

    torchrun --nproc-per-node=2 rm_ranks.py WORK

WORK/cases.json lists ``{"name", "config", "data"}`` (an ExperimentConfig dict and a DataProto file
name). For each case every rank builds the worker, calls ``init_model`` and ``compute_rm_score`` on
its contiguous share of the rows (as DP_COMPUTE_PROTO would) and saves the result as
``out_<name>_<rank>.arrow``; rank 0 writes ``init_<name>.json`` with the per-rank init result.
"""

from __future__ import annotations

import gc
import json
import os
import sys

import torch
import torch.distributed as dist

from ppoflow.infra.data.dataproto import DataProto
from ppoflow.workers.reward_model_worker import RewardModelWorker


def main() -> None:
    work = sys.argv[1]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    with open(os.path.join(work, "cases.json")) as f:
        cases = json.load(f)
    for case in cases:
        data = DataProto.load(os.path.join(work, case["data"]))
        worker = RewardModelWorker({"config": case["config"], "role": "reward_model"})
        info = worker.init_model()
        out = worker.compute_rm_score(data.chunk(world)[rank])
        out.save(os.path.join(work, f"out_{case['name']}_{rank}.arrow"))
        if rank == 0:
            with open(os.path.join(work, f"init_{case['name']}.json"), "w") as f:
                json.dump(info, f)
        worker.shutdown()
        del worker
        gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
