"""ppoflow.infra.models.rollout_engines: ``rollout.engine`` is validated against the registry, the config's
engine checks ask capabilities (a toy engine registered in a test is picked up at once), every
registered spec's import paths resolve to classes that keep the contract, and the flow process
validates engines without importing any of them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ppoflow.infra.config import ConfigError, RolloutConfig, parse_config
from ppoflow.infra.models.rollout_engines import EngineSpec, engine_names, engine_spec
from tests.support.paths import ROOT
from tests.support.toy_engine import register_toy

BASE = {"model": {"path": "m"}, "data": {"train_files": ["d.parquet"]}}


def config(**sections):
    return parse_config({**BASE, **sections})


def test_the_engine_names_are_the_registrys():
    assert engine_names() == ["hf", "vllm"]
    with pytest.raises(
        ConfigError, match=r"rollout\.engine: .*unknown rollout engine 'sglang'; allowed: hf, vllm"
    ):
        config(rollout={"engine": "sglang"})
    schema = RolloutConfig.model_json_schema()
    assert schema["properties"]["engine"]["enum"] == ["hf", "vllm"]  # the Prefect UI's choices
    with pytest.raises(ValueError, match="unknown rollout engine 'nope'; allowed: hf, vllm"):
        engine_spec("nope")


def test_a_registered_toy_engine_is_valid_and_its_capabilities_decide(monkeypatch):
    toy = register_toy(monkeypatch)
    assert config(rollout={"engine": "toy"}).rollout.engine == "toy"
    assert RolloutConfig.model_json_schema()["properties"]["engine"]["enum"] == ["hf", "toy", "vllm"]
    with pytest.raises(
        ConfigError,
        match=r"rollout.tensor_model_parallel_size=2 needs an engine with tensor_parallel .*"
        r"rollout.engine='toy' has no tensor_parallel: set it to 1, or use rollout.engine 'vllm'",
    ):
        config(resources={"nprocs": 2}, rollout={"engine": "toy", "tensor_model_parallel_size": 2})
    multi_turn = {"enable": True, "environment": "tests.support.multiturn_envs:ScriptedEnv", "tools": []}
    assert config(rollout={"engine": "toy", "multi_turn": multi_turn}).rollout.multi_turn.enable
    register_toy(monkeypatch, capabilities=frozenset())
    with pytest.raises(
        ConfigError,
        match=r"rollout.multi_turn.enable needs an engine with multi_turn .*has no multi_turn: turn it off, "
        r"or use rollout.engine 'hf' or 'vllm'",
    ):
        config(rollout={"engine": "toy", "multi_turn": multi_turn})
    # LoRA: an engine without weights of its own generates with the adapters in place (nothing to
    # check); one with weight_push must serve adapters (adapter_sync) for sync=adapter
    lora = {"lora": {"rank": 4, "sync": "adapter"}}
    assert config(rollout={"engine": "toy"}, actor=lora).actor.lora.sync == "adapter"
    register_toy(monkeypatch, capabilities=frozenset({"weight_push"}), max_lora_rank=8)
    with pytest.raises(
        ConfigError,
        match=r"actor.lora.sync=adapter needs an engine with adapter_sync .*'toy' has no adapter_sync: "
        r"use actor.lora.sync=merged, or use rollout.engine 'vllm'",
    ):
        config(rollout={"engine": "toy"}, actor=lora)
    assert config(rollout={"engine": "toy"}, actor={"lora": {"rank": 4}}).actor.lora.sync == "merged"
    with pytest.raises(
        ConfigError, match=r"actor.lora.rank=16: rollout.engine='toy' serves adapters of rank <= 8"
    ):
        config(rollout={"engine": "toy"}, actor={"lora": {"rank": 16}})
    with pytest.raises(ConfigError, match="weight_loader=dtensor"):
        config(rollout={"engine": "toy", "weight_loader": "dtensor"}, actor={"lora": {"rank": 4}})
    assert toy.can("always_log_probs") and not toy.can("sleep")


def test_a_spec_names_known_capabilities_and_import_paths():
    with pytest.raises(
        ValueError, match=r"unknown capabilities \['lora'\]; known: adapter_sync, always_log_probs"
    ):
        EngineSpec(name="x", engine="a.b:C", sharding_manager="a.b:M", capabilities=frozenset({"lora"}))
    with pytest.raises(ValueError, match=r"engine='a.b.C' is not an import path 'package.module:Name'"):
        EngineSpec(name="x", engine="a.b.C", sharding_manager="a.b:M")
    with pytest.raises(KeyError, match="unknown rollout engine capability 'lora'"):
        engine_spec("vllm").can("lora")


_RESOLVE = """
import json, sys
from ppoflow.infra.models.rollout_engines import engine_names, engine_spec
from ppoflow.workers.rollout.base import Rollout

out = {}
for name in engine_names():
    spec = engine_spec(name)
    cls = spec.load()
    managers = [spec.load(p) for p in (spec.sharding_manager, spec.lora_sharding_manager) if p]
    out[name] = {
        "rollout": issubclass(cls, Rollout),
        "from_config": "from_config" in vars(cls),
        "sample_turn": cls.sample_turn is not Rollout.sample_turn,
        "manager": all(
            callable(getattr(m, a, None))
            for m in managers
            for a in ("set_source_checkpoint", "set_source_live", "__enter__", "__exit__")
        ),
        "sleep": all(callable(getattr(m, "sleep", None)) for m in managers),
    }
print(json.dumps(out))
"""


@pytest.mark.slow  # imports vLLM (~10 s)
def test_every_registered_engine_resolves_to_classes_that_keep_the_contract():
    """In a process of its own (as a rank): each spec's engine class is a Rollout that builds itself
    (from_config), implements sample_turn when it declares multi_turn, and its managers have the
    manager methods (and sleep() when it declares sleep)."""
    out = subprocess.run(
        [sys.executable, "-c", _RESOLVE], cwd=ROOT, capture_output=True, text=True, timeout=300, check=True
    )
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert sorted(found) == engine_names()
    for name, got in found.items():
        spec = engine_spec(name)
        assert got["rollout"] and got["from_config"] and got["manager"], (name, got)
        assert got["sample_turn"] == spec.can("multi_turn"), (name, got)
        if spec.can("sleep"):
            assert got["sleep"], (name, got)


def test_the_flow_process_validates_engines_without_importing_them():
    code = (
        "import sys; from ppoflow.infra.config import parse_config; "
        "c = parse_config({'model': {'path': 'm'}, 'data': {'train_files': ['d']}, "
        "'rollout': {'engine': 'vllm', 'tensor_model_parallel_size': 2}, 'resources': {'nprocs': 2}, "
        "'actor': {'lora': {'rank': 4, 'sync': 'adapter'}}}); "
        "print(sorted(m for m in sys.modules if m.startswith('ppoflow.workers') or m.split('.')[0] == 'vllm'))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
