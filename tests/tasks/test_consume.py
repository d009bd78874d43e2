"""ppoflow.tasks.consume without ranks: a batch sampled from other prompts than the trainer's data
cursor holds is refused, saying what to delete. Consuming batches on a trainer's run:
tests/flows/test_asynchronous.py."""

from __future__ import annotations

import pytest
import torch

from ppoflow.infra.data.dataproto import DataProto
from ppoflow.infra.data.prompts import DataError
from ppoflow.tasks.consume import _check_prompts


def test_a_batch_of_other_prompts_is_refused():
    prompts = DataProto.from_dict({"input_ids": torch.tensor([[1, 2, 3], [4, 5, 6]])})
    same = DataProto.from_dict({"prompts": torch.tensor([[1, 2, 3], [1, 2, 3], [4, 5, 6], [4, 5, 6]])})
    _check_prompts(3, same, prompts, samples=2)  # two samples per prompt, in the prompts' order
    swapped = DataProto.from_dict({"prompts": same.batch["prompts"][[2, 3, 0, 1]]})
    with pytest.raises(
        DataError, match=r"batch 3 of the rollout queue .* Delete the queue's batches from 3 on"
    ):
        _check_prompts(3, swapped, prompts, samples=2)
    with pytest.raises(DataError, match="other prompts"):
        _check_prompts(3, same, prompts, samples=1)  # a batch of another rollout.n
