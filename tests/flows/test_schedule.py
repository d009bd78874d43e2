"""ppoflow.flows.schedule: where each iteration starts (the updates' checkpoints, the rollout's with
one-step overlap, the data cursor, the KL coefficient), from a manifest and from receipts: what
keeps a resumed run with overlap committing what an uninterrupted one commits; and the start's
fields are the ones the table's rows may name."""

from __future__ import annotations

import dataclasses
from typing import get_args

from ppoflow.flows.schedule import Start
from ppoflow.infra.experiment.manifest import ExperimentPaths, Manifest
from ppoflow.tasks.graph import STEPS, StartField
from ppoflow.tasks.receipts import AdvantageReceipt, GenerateReceipt, IterationReceipts, Receipt


def _receipts(n: int, paths: ExperimentPaths, critic: bool = True) -> IterationReceipts:
    gen = GenerateReceipt(task="generate", iteration=n, next_cursor={"epoch": 0, "offset": 4 * n}, seed=1)
    adv = AdvantageReceipt(task="advantage", iteration=n, kl_coef=0.1 * n)
    updates = [Receipt(task="update_actor", iteration=n, checkpoints={"actor": paths.checkpoint("actor", n)})]
    if critic:
        updates.append(
            Receipt(task="update_critic", iteration=n, checkpoints={"critic": paths.checkpoint("critic", n)})
        )
    return IterationReceipts.of([gen, adv, *updates])


def _manifest(rollout: dict | None) -> Manifest:
    return Manifest(
        experiment="exp",
        iteration=4,
        actor_checkpoint="checkpoints/actor/000004",
        critic_checkpoint="checkpoints/critic/000004",
        config_hash="h",
        identity={},
        data_cursor={"epoch": 0, "offset": 16},
        kl_coef=0.4,
        created_at="t",
        committed_at="t",
        rollout_checkpoints=rollout,
    )


def test_where_iterations_start_with_and_without_one_step_overlap():
    paths = ExperimentPaths("/x/exp")
    ck = paths.checkpoint
    manifest = _manifest({"actor": "checkpoints/actor/000003", "critic": "checkpoints/critic/000003"})
    plain, overlap = Start.of(paths, manifest, one_step=False), Start.of(paths, manifest, one_step=True)
    # without overlap the rollout uses the newest weights; with it, the ones manifest 4 recorded
    assert (plain.rollout_actor, plain.rollout_critic) == (ck("actor", 4), ck("critic", 4))
    assert (overlap.rollout_actor, overlap.rollout_critic) == (ck("actor", 3), ck("critic", 3))
    assert plain.actor == overlap.actor == ck("actor", 4) and plain.rollout_record() is None
    assert plain.cursor == {"epoch": 0, "offset": 16} and plain.kl_coef == 0.4

    nxt = overlap.after(_receipts(5, paths), one_step=True)
    assert (nxt.iteration, nxt.actor, nxt.rollout_actor, nxt.rollout_critic) == (
        5,
        ck("actor", 5),
        ck("actor", 4),
        ck("critic", 4),
    )
    assert nxt.cursor == {"epoch": 0, "offset": 20} and nxt.kl_coef == 0.5
    assert nxt.rollout_record() == {"actor": ck("actor", 4), "critic": ck("critic", 4)}

    # a run without a critic keeps the critic it had; without overlap rollout = update weights
    nxt = plain.after(_receipts(5, paths, critic=False), one_step=False)
    assert nxt.rollout_actor == nxt.actor == ck("actor", 5)
    assert nxt.critic == nxt.rollout_critic == ck("critic", 4)


def test_a_manifest_written_without_overlap_starts_overlap_on_policy():
    paths = ExperimentPaths("/x/exp")
    switched = Start.of(paths, _manifest(None), one_step=True)
    assert switched.rollout_actor == switched.actor == paths.checkpoint("actor", 4)
    assert switched.rollout_critic == paths.checkpoint("critic", 4) and switched.rollout_record() is None


def test_the_rows_state_names_the_starts_fields():
    """A row's ``state`` (typed :data:`StartField`) names fields of :class:`Start` the schedule reads
    by name: the type lists exactly the start's fields, and every row names only those."""
    fields = {f.name for f in dataclasses.fields(Start)} - {"iteration"}
    assert set(get_args(StartField)) == fields
    for row in STEPS:
        assert set(row.state) <= fields and row.at_start in fields | {None}, row.name
