"""Hybrid sharding (HSDP, the seed's missing section 3): 4 CPU ranks on a 2 x 2 mesh
(``fsdp_size=2``: shard inside pairs of ranks, replicate across the pairs) compute the same
log-probs and make the same actor update as 2 ranks of plain FSDP, and both equal a plain
single-process update.

The update is one mini-batch (all 16 rows) for 2 PPO epochs, so both layouts put the same rows in
each optimizer step (with several mini-batches the row grouping depends on the rank count);
micro-batch 3 gives unequal micro-batches on both layouts (3+1 rows per rank on 4 ranks,
3+3+2 on 2). The HSDP group finally loads the FSDP group's checkpoint through the worker
(2 ranks 1-D -> 4 ranks 2-D) and must hold exactly its weights.
"""

from __future__ import annotations

import time

import pytest
import torch

from ppoflow.infra.checkpoint.sharded import load_full_state_dict
from ppoflow.infra.data.dataproto import DataProto
from tests.support.fsdp.ppo_reference import (
    ACTOR,
    WEIGHT_TOL,
    make_config,
    max_weight_diff,
    mini_batch_groups,
    reference_actor_update,
    save_batch,
    start_group,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

HSDP_TOL = 5e-6  # 4-rank HSDP vs 2-rank FSDP, log-probs and weights (fp32): only summation order differs


def _run(
    cfg, nprocs: int, data_url: str, tmp, tag: str, reload: str | None = None
) -> tuple[dict, torch.Tensor, dict, float]:
    """init -> compute_log_prob -> update_actor -> save_checkpoint on one group (then, with
    ``reload``, load that checkpoint and save it again as ``ckpt_reloaded``); returns (rank-0 init
    info, log-probs, full weights from the checkpoint, seconds)."""
    t0 = time.perf_counter()
    with start_group(ACTOR, cfg, nprocs, role="actor") as group:
        info = group.call("init_model")[0]["actor"]
        log_probs = DataProto.load(group.call("compute_log_prob", data_url)).batch["old_log_probs"]
        metrics = group.call("update_actor", data_url)
        assert metrics[0]["actor/optimizer_steps"] == 2 and metrics[0]["actor/skipped_steps"] == 0
        ckpt = str(tmp / f"ckpt_{tag}")
        group.call("save_checkpoint", ckpt, extra={"tag": tag})
        if reload:
            assert group.call("load_checkpoint", reload) == [{"tag": "fsdp2"}] * nprocs
            group.call("save_checkpoint", str(tmp / "ckpt_reloaded"))
    return info, log_probs, load_full_state_dict(ckpt), time.perf_counter() - t0


def test_hsdp_2x2_matches_plain_fsdp_and_single_process(tiny):
    batch, tmp = tiny["batch"], tiny["tmp"]
    data_url = save_batch(batch, str(tmp / "rollout_hsdp.arrow"))
    cfg_fsdp = make_config(tiny["dir"], nprocs=2, mini_batch=8, epochs=2)
    cfg_hsdp = make_config(tiny["dir"], nprocs=4, fsdp_size=2, mini_batch=8, epochs=2)

    info2, lp2, w2, s2 = _run(cfg_fsdp, 2, data_url, tmp, "fsdp2")
    info4, lp4, w4, s4 = _run(cfg_hsdp, 4, data_url, tmp, "hsdp4", reload=str(tmp / "ckpt_fsdp2"))

    assert info2["mesh_shape"] == [2] and info2["mesh_dim_names"] == ["fsdp"]
    assert info4["mesh_shape"] == [2, 2] and info4["mesh_dim_names"] == ["replicate", "shard"]
    assert info4["placements"] == ["Replicate()", "Shard(dim=0)"]
    # each rank of a pair holds half of the parameters, as with 2-rank FSDP
    assert info4["num_params"] == info2["num_params"] and info4["local_numel"] == info2["local_numel"]

    mask = batch["response_mask"].bool()
    lp_diff = (lp4 - lp2)[mask].abs().max().item()
    w_diff = max_weight_diff(w4, w2)
    want = reference_actor_update(tiny["dir"], batch, cfg_fsdp, mini_batch_groups(16, 2, 8, 2))
    ref_diff = max(max_weight_diff(w2, want), max_weight_diff(w4, want))
    print(
        f"\nHSDP 2x2 vs FSDP 2: log-prob diff {lp_diff:.2e}, weight diff {w_diff:.2e}, vs single process "
        f"{ref_diff:.2e}; groups {s2:.1f}s (2 ranks), {s4:.1f}s (4 ranks)"
    )
    # the 2-rank FSDP checkpoint loads into the 2 x 2 HSDP actor exactly (saved again, bit for bit)
    assert max_weight_diff(load_full_state_dict(str(tmp / "ckpt_reloaded")), w2) == 0.0
    assert lp_diff < HSDP_TOL
    assert w_diff < HSDP_TOL
    assert ref_diff < WEIGHT_TOL
