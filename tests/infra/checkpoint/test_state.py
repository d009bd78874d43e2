"""The JSON part of a checkpoint and each rank's RNG states: plain data round trips exactly (tuples
kept), anything else is refused by name, and restored RNGs draw what they drew after the save."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from ppoflow.infra.checkpoint.marker import CheckpointError
from ppoflow.infra.checkpoint.state import dec, enc, hf_key_prefix, rng_file, rng_state, set_rng_state


def test_plain_data_round_trips_through_json_and_tensors_are_refused():
    obj = {
        "betas": (0.9, 0.999),
        "steps": [1, (2, 3)],
        "lr": np.float64(0.5),
        "on": np.bool_(True),
        "k": None,
    }
    back = dec(json.loads(json.dumps(enc(obj, "optimizer"))))
    assert back == {"betas": (0.9, 0.999), "steps": [1, (2, 3)], "lr": 0.5, "on": True, "k": None}
    assert isinstance(back["betas"], tuple) and type(back["lr"]) is float
    with pytest.raises(CheckpointError, match="optimizer: a Tensor cannot be stored as JSON"):
        enc({"t": torch.zeros(1)}, "optimizer")


def test_restored_rngs_draw_what_they_drew_after_the_save():
    state = json.loads(json.dumps(rng_state()))  # as the checkpoint stores it
    first = (random.random(), np.random.rand(), torch.rand(2).tolist())
    random.seed(123), np.random.seed(123), torch.manual_seed(123)
    set_rng_state(state)
    assert (random.random(), np.random.rand(), torch.rand(2).tolist()) == first
    assert rng_file(3) == "rng/rank_00003.json"


def test_hf_names_drop_a_wrapper_s_prefix():
    from transformers import AutoModelForCausalLM

    from ppoflow.demo.tiny_models import build_char_tokenizer, tiny_config

    hf = AutoModelForCausalLM.from_config(tiny_config(len(build_char_tokenizer())))

    class Wrapper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.head = hf, torch.nn.Linear(2, 2)

    class Declared(torch.nn.Module):
        hf_key_prefix = "hf."

    assert (
        hf_key_prefix(hf) == ""
        and hf_key_prefix(Wrapper()) == "inner."
        and hf_key_prefix(Declared()) == "hf."
    )
