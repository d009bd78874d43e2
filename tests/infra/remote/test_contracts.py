"""The contracts between the driver and the ranks: every worker class keeps its Protocol (the
``@register`` methods' names, parameters, types and dispatch modes), the worker modes say what each
worker builds, and the handles the driver calls ranks through refuse a call the contract does not
allow before anything is sent."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys
import typing

import pytest

from ppoflow.infra.config import parse_config
from ppoflow.infra.remote.contracts import (
    ACTOR_ROLE,
    CRITIC_ROLE,
    REWARD_MODEL_ROLE,
    ROLES,
    TRAINED_ROLES,
    Build,
    CriticContract,
    TrainedContract,
    UpdateCall,
    WorkerMode,
    trained_role,
    update_of,
)
from ppoflow.infra.remote.dispatch import Dispatch, registered_methods
from ppoflow.infra.remote.driver.group import WorkerGroup
from ppoflow.infra.remote.driver.handle import typed_handle

#: The keyword-only arguments the driver adds to a DP_COMPUTE_PROTO method (``WorkerGroup.call``).
DRIVER_ONLY = [
    ("out_url", inspect.Parameter.KEYWORD_ONLY, None),
    ("dp_blocks", inspect.Parameter.KEYWORD_ONLY, None),
]


def _worker_class(role):
    module, name = role.worker.split(":")
    return getattr(importlib.import_module(module), name)


def _params(fn) -> list[inspect.Parameter]:
    return list(inspect.signature(fn).parameters.values())[1:]  # without self


def _shape(params) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in params]


def _as_driver_sees(mode: Dispatch, returned: object) -> object:
    """What the driver gets from a call whose rank method returns ``returned``."""
    returned = None if returned is type(None) else returned
    if mode is Dispatch.DP_COMPUTE_PROTO and getattr(returned, "__name__", "") == "DataProto":
        return str  # the merged output's URL
    return returned if mode is Dispatch.RANK_ZERO else list[returned]  # type: ignore[valid-type]


@pytest.mark.parametrize("name", sorted(ROLES))
def test_every_worker_class_keeps_its_contract(name):
    """Names and dispatch modes of the ``@register`` methods; each method's parameters (names,
    kinds, defaults, types: a DataProto is its URL to the driver, which adds ``out_url`` and
    ``dp_blocks``) and what the driver gets back."""
    role = ROLES[name]
    worker = _worker_class(role)
    assert registered_methods(worker) == role.methods()
    assert role.mismatch(registered_methods(worker)) is None
    for method, mode in role.methods().items():
        theirs, ours = getattr(worker, method), getattr(role.protocol, method)
        rank, driver = _params(theirs), _params(ours)
        if mode is Dispatch.DP_COMPUTE_PROTO:
            assert _shape(driver[-2:]) == DRIVER_ONLY, method
            driver = driver[:-2]
        assert _shape(driver) == _shape(rank), method
        rank_types, driver_types = typing.get_type_hints(theirs), typing.get_type_hints(ours)
        for i, p in enumerate(rank):
            dataproto = mode is Dispatch.DP_COMPUTE_PROTO and i == 0
            assert driver_types[p.name] == (str if dataproto else rank_types[p.name]), (method, p.name)
        assert driver_types["return"] == _as_driver_sees(mode, rank_types["return"]), method


def test_a_changed_worker_would_fail_the_check():
    """The check above compares: a worker whose keyword was renamed differs from its contract."""

    class Renamed(_worker_class(CRITIC_ROLE)):
        def load_checkpoint(self, url: str, with_optim: bool = True) -> dict:  # renamed keyword
            raise NotImplementedError

    Renamed.load_checkpoint.__ppoflow_dispatch__ = Dispatch.ONE_TO_ALL  # type: ignore[attr-defined]
    assert _shape(_params(Renamed.load_checkpoint)) != _shape(_params(CriticContract.load_checkpoint))
    assert CRITIC_ROLE.mismatch({**registered_methods(Renamed), "extra": Dispatch.RANK_ZERO}) == (
        "extra is not in the contract"
    )


def test_the_modes_say_what_each_worker_builds():
    owners = [mode for role in ROLES.values() for mode in role.modes]
    assert sorted(owners) == sorted(WorkerMode) and len(owners) == len(set(owners))  # one worker each
    for mode in ACTOR_ROLE.modes:
        parts = mode.value.split("_")
        assert (mode.builds_actor, mode.builds_rollout, mode.builds_ref) == (
            "actor" in parts,
            "rollout" in parts,
            "ref" in parts,
        )
    assert (ACTOR_ROLE.default, CRITIC_ROLE.default, REWARD_MODEL_ROLE.default) == (
        Build(WorkerMode.ACTOR_ROLLOUT_REF),
        Build(WorkerMode.CRITIC),
        Build(WorkerMode.REWARD_MODEL),
    )


def test_a_build_reads_and_writes_its_wire_form_and_refuses_what_its_worker_cannot_build():
    assert Build.parse("actor_rollout_ref+teacher") == Build(WorkerMode.ACTOR_ROLLOUT_REF, teacher=True)
    assert Build(WorkerMode.ACTOR_REF, teacher=True).wire == "actor_ref+teacher"
    assert ACTOR_ROLE.build("rollout") == ACTOR_ROLE.build(WorkerMode.ROLLOUT) == Build(WorkerMode.ROLLOUT)
    with pytest.raises(
        ValueError, match=r"unknown worker mode 'actr': one of actor_rollout_ref, .*reward_model"
    ):
        Build.parse("actr")
    with pytest.raises(ValueError, match=r"the critic group's worker builds one of critic, not 'rollout'"):
        CRITIC_ROLE.build("rollout")
    with pytest.raises(ValueError, match=r"'rollout\+teacher': the teacher is built beside a trained actor"):
        ACTOR_ROLE.build("rollout+teacher")
    with pytest.raises(ValueError, match="the teacher is built beside a trained actor"):
        CRITIC_ROLE.build("critic+teacher")


@pytest.mark.parametrize("name", sorted(ROLES))
def test_each_worker_refuses_a_mode_of_another(name, tmp_path):
    cfg = parse_config(
        {
            "model": {"path": "m"},
            "data": {"train_files": ["train.parquet"]},
            "storage": {"root": str(tmp_path), "experiment": "exp"},
        }
    )
    role = ROLES[name]
    other = next(m for m in WorkerMode if m not in role.modes)
    with pytest.raises(ValueError, match=f"unknown role '{other.value}'"):
        _worker_class(role)({"config": cfg.model_dump(mode="json"), "role": other.value})


def test_a_typed_handle_binds_each_call_to_the_contract_before_sending_it():
    calls = []
    methods = registered_methods(CriticContract)
    critic = typed_handle(CRITIC_ROLE, methods, lambda method, *a, **k: calls.append((method, a, k)) or "url")
    assert critic.compute_values("in.arrow", out_url="out.arrow") == "url"
    critic.save_checkpoint("ckpt", extra={"iteration": 1}, background=True)
    assert calls == [
        ("compute_values", ("in.arrow",), {"out_url": "out.arrow"}),
        ("save_checkpoint", ("ckpt",), {"extra": {"iteration": 1}, "background": True}),
    ]
    with pytest.raises(
        TypeError,
        match=r"critic\.load_checkpoint\(url: 'str', with_optimizer: 'bool' = True\): got an unexpected "
        r"keyword argument 'with_optim' \(nothing was sent to the ranks\)",
    ):
        critic.load_checkpoint("ckpt", with_optim=False)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"critic\.compute_values.*missing a required argument: 'data'"):
        critic.compute_values(out_url="out.arrow")  # type: ignore[call-arg]
    with pytest.raises(AttributeError, match="has no @register method 'compute_valeus'"):
        critic.compute_valeus("in.arrow")  # type: ignore[attr-defined]
    assert len(calls) == 2  # none of the refused calls reached the group


def test_ranks_whose_table_differs_from_the_contract_are_refused():
    methods = {**registered_methods(CriticContract), "update_critic": Dispatch.ONE_TO_ALL}
    del methods["compute_values"]
    with pytest.raises(
        TypeError,
        match=r"the critic group's worker \(ppoflow.workers.critic_worker:CriticWorker\) does not keep its "
        r"contract \(CriticContract\): compute_values is missing; update_critic is ONE_TO_ALL, the "
        r"contract says DP_COMPUTE_PROTO",
    ):
        typed_handle(CRITIC_ROLE, methods, lambda *a, **k: None)


def test_a_trained_role_has_its_update_method_typed():
    calls = []
    actor = typed_handle(
        ACTOR_ROLE, registered_methods(ACTOR_ROLE.protocol), lambda m, *a, **k: calls.append((m, a, k))
    )
    update: UpdateCall = update_of(actor, "update_actor")
    update("adv.arrow", dp_blocks=4)
    assert calls == [("update_actor", ("adv.arrow",), {"dp_blocks": 4})]
    for role in TRAINED_ROLES.values():  # each update method is an UpdateCall
        method = {"actor": "update_actor", "critic": "update_critic"}[role.name]
        assert inspect.signature(getattr(role.protocol, method)).replace(
            parameters=_params(getattr(role.protocol, method))
        ) == inspect.signature(UpdateCall.__call__).replace(parameters=_params(UpdateCall.__call__))
    assert trained_role("critic") is CRITIC_ROLE
    with pytest.raises(ValueError, match="'reward_model' is not a trained role: one of actor, critic"):
        trained_role("reward_model")
    with pytest.raises(ValueError, match="'compute_values' is not an update method: one of update_actor"):
        update_of(actor, "compute_values")


def test_call_if_idle_takes_a_contract_method_not_a_name():
    group = WorkerGroup("ppoflow.workers.critic_worker:CriticWorker", nprocs=1)
    with pytest.raises(
        TypeError, match="call_if_idle takes a contract's method, not 'checkpoint_write_status'"
    ):
        group.call_if_idle("checkpoint_write_status")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="unexpected keyword argument 'url'"):
        group.call_if_idle(TrainedContract.checkpoint_write_status, url="x")  # type: ignore[call-arg]


def test_the_flow_process_reads_the_contracts_without_torch_or_worker_code():
    code = (
        "import sys, ppoflow.infra.remote.contracts; "
        "print(sorted(m for m in sys.modules if m.startswith(('ppoflow.workers', 'torch'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
