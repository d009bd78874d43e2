"""``measure_and_correct``, what the ``advantage`` task adds for the sampler/trainer mismatch: the
``mismatch/*`` metrics when the rollout has the engine's log-probs, the correction's columns and
``correction/*`` metrics by config, nothing to compare under the bypass."""

from __future__ import annotations

import pytest
import torch

from ppoflow.algos import mismatch_metrics, rejection_mask, truncated_is_weights
from ppoflow.infra.data.dataproto import DataProto
from ppoflow.tasks.mismatch import measure_and_correct
from tests.support.configs import make_config


def _batch(with_sampler: bool = True) -> DataProto:
    gen = torch.Generator().manual_seed(0)
    mask = (torch.rand(6, 5, generator=gen) < 0.8).long()
    mask[5] = 0  # an empty row
    old = torch.randn(6, 5, generator=gen) - 2.0
    tensors = {"old_log_probs": old, "response_mask": mask}
    if with_sampler:
        tensors["rollout_log_probs"] = old + 0.4 * torch.randn(6, 5, generator=gen)
    return DataProto.from_dict(tensors)


def test_metrics_only_by_default_and_columns_by_config(tmp_path):
    batch = _batch()
    cfg = make_config(tmp_path, "m", ["x.parquet"])
    m = measure_and_correct(cfg, batch)
    b = batch.batch
    want = mismatch_metrics(b["old_log_probs"], b["rollout_log_probs"], b["response_mask"])
    assert m == {f"mismatch/{k}": v for k, v in want.items()}
    assert "rollout_is_weights" not in b and "rollout_rs_mask" not in b

    over = {
        "algorithm.rollout_correction.tis": "sequence",
        "algorithm.rollout_correction.tis_cap": 1.5,
        "algorithm.rollout_correction.mis": "token",
    }
    cfg = make_config(tmp_path, "m", ["x.parquet"], **over)
    m = measure_and_correct(cfg, batch)
    w = truncated_is_weights(b["old_log_probs"], b["rollout_log_probs"], b["response_mask"], "sequence", 1.5)
    keep = rejection_mask(b["old_log_probs"], b["rollout_log_probs"], b["response_mask"], "token", 0.5, 2.0)
    assert torch.equal(b["rollout_is_weights"], w) and torch.equal(b["rollout_rs_mask"], keep)
    assert torch.equal(b["response_mask"], _batch().batch["response_mask"])  # left as it was
    dropped = float(((b["response_mask"] != 0) & (keep == 0)).sum() / (b["response_mask"] != 0).sum())
    assert m["correction/masked_token_share"] == pytest.approx(dropped)
    assert {"correction/weight_mean", "correction/capped_token_share"} <= set(m)


def test_nothing_to_compare_without_the_engines_log_probs_or_under_the_bypass(tmp_path):
    cfg = make_config(tmp_path, "m", ["x.parquet"])
    assert measure_and_correct(cfg, _batch(with_sampler=False)) == {}
    bypass = make_config(
        tmp_path, "m", ["x.parquet"], **{"algorithm.rollout_correction.behaviour": "sampler"}
    )
    batch = _batch()
    assert measure_and_correct(bypass, batch) == {} and "rollout_is_weights" not in batch.batch


def test_a_rejection_over_the_stated_share_is_a_metric_a_warning_and_a_console_mark(tmp_path):
    from ppoflow.infra.experiment.metrics import headline_line
    from ppoflow.tasks.mismatch import rejection_warning

    geometric = {"algorithm.rollout_correction.mis": "geometric"}  # [0.999, 1.001]: 0.4 noise rejects all
    cfg = make_config(tmp_path, "m", ["x.parquet"], **geometric)
    m = measure_and_correct(cfg, _batch())
    b = _batch().batch
    d = (b["old_log_probs"] - b["rollout_log_probs"]) * b["response_mask"]
    rows = b["response_mask"].sum(-1) > 0
    geo = torch.exp(d.sum(-1)[rows] / b["response_mask"].sum(-1)[rows])
    share = float(((geo < 0.999) | (geo > 1.001)).double().mean())
    assert share > 0.5 and m["correction/masked_seq_share"] == pytest.approx(share)
    assert m["correction/rejected_over_limit"] == pytest.approx(
        max(share, m["correction/masked_token_share"])
    )
    text = rejection_warning(cfg, m)
    assert text is not None and "mis: geometric, band [0.999, 1.001]" in text
    assert "warn_rejected_share=0.1" in text and "mismatch/*" in text
    assert "REJECTED" in headline_line(3, m)

    calm = make_config(
        tmp_path, "m", ["x.parquet"], **geometric, **{"algorithm.rollout_correction.warn_rejected_share": 1.0}
    )
    m = measure_and_correct(calm, _batch())
    assert "correction/rejected_over_limit" not in m and rejection_warning(calm, m) is None
    assert "REJECTED" not in headline_line(3, m)
