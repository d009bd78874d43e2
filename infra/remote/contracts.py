"""The typed contracts between the driver and the ranks: what each worker group's methods take and
return as the driver calls them, what a group's worker builds, and which class it runs.

The flow's process imports this module, never the worker classes (no torch, no worker code): each
worker class has a ``typing.Protocol`` here whose methods are its ``@register`` methods as the
driver sees them, tagged with the same dispatch mode:

    ONE_TO_ALL        the rank's arguments; returns the list of the per-rank results
    RANK_ZERO         the rank's arguments; returns rank 0's result
    DP_COMPUTE_PROTO  the DataProto argument is its URL; keyword-only ``out_url`` and ``dp_blocks``
                      (``WorkerGroup.call``); returns the URL of the merged output, or the
                      per-rank JSON results

A :class:`Role` binds a group's name (``actor``, ``critic``, ``reward_model``: what tasks and the
step table say) to its worker class's import path, its Protocol and the :class:`WorkerMode`\\ s its
worker can be built in. ``RunGroups.worker("critic", ...)`` and ``WorkerGroup.typed(CRITIC_ROLE)``
return an object typed as the Protocol, so mypy checks every call's method name and keywords; at
run time the handle binds each call's arguments to the Protocol's signature before it leaves the
driver, and a group whose ranks' method table differs from its Protocol fails its start.
``tests/infra/remote/test_contracts.py`` checks every Protocol against its worker class: method
names, parameters (names, kinds, defaults, types) and dispatch modes.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from ppoflow.infra.remote.dispatch import Dispatch, register, registered_methods

__all__ = [
    "WorkerMode",
    "Build",
    "TEACHER_FLAG",
    "WorkerContract",
    "TrainedContract",
    "TeacherContract",
    "ActorContract",
    "CriticContract",
    "RewardModelContract",
    "UpdateCall",
    "Role",
    "ACTOR_ROLE",
    "CRITIC_ROLE",
    "REWARD_MODEL_ROLE",
    "ROLES",
    "TRAINED_ROLES",
    "trained_role",
    "update_of",
]

#: The suffix of a worker mode whose group also holds the teacher (on-policy distillation).
TEACHER_FLAG = "+teacher"


class WorkerMode(enum.StrEnum):
    """What a group's worker builds (sent as its config's ``role``); the group's name is apart."""

    ACTOR_ROLLOUT_REF = "actor_rollout_ref"  # trained actor + rollout engine + frozen reference
    ACTOR_ROLLOUT = "actor_rollout"  # trained actor + rollout engine
    ACTOR_REF = "actor_ref"  # trained actor + frozen reference (another group samples)
    ACTOR = "actor"  # trained actor only
    ROLLOUT = "rollout"  # rollout engine + an FSDP copy of the policy for old log-probs
    REF = "ref"  # frozen reference only
    CRITIC = "critic"  # the value model and its optimizer
    REWARD_MODEL = "reward_model"  # a sequence-classification reward model

    @property
    def builds_actor(self) -> bool:
        """A trained actor (FSDP policy + optimizer)."""
        return self in (
            WorkerMode.ACTOR_ROLLOUT_REF,
            WorkerMode.ACTOR_ROLLOUT,
            WorkerMode.ACTOR_REF,
            WorkerMode.ACTOR,
        )

    @property
    def builds_rollout(self) -> bool:
        """A rollout engine."""
        return self in (WorkerMode.ACTOR_ROLLOUT_REF, WorkerMode.ACTOR_ROLLOUT, WorkerMode.ROLLOUT)

    @property
    def builds_ref(self) -> bool:
        """A frozen reference policy."""
        return self in (WorkerMode.ACTOR_ROLLOUT_REF, WorkerMode.ACTOR_REF, WorkerMode.REF)


@dataclass(frozen=True)
class Build:
    """A group's worker mode, and whether its worker also holds the teacher."""

    mode: WorkerMode
    teacher: bool = False

    @property
    def wire(self) -> str:
        """As the worker's config says it: the mode's value, ``+teacher`` appended when flagged."""
        return self.mode.value + (TEACHER_FLAG if self.teacher else "")

    @classmethod
    def parse(cls, value: Build | WorkerMode | str) -> Build:
        """A build from its wire form (``actor_rollout_ref+teacher``) or a mode; ValueError naming
        the modes there are for one that is not a mode."""
        if isinstance(value, Build):
            return value
        text = str(value)
        teacher = text.endswith(TEACHER_FLAG)
        name = text.removesuffix(TEACHER_FLAG)
        try:
            return cls(WorkerMode(name), teacher)
        except ValueError:
            known = ", ".join(m.value for m in WorkerMode)
            raise ValueError(
                f"unknown worker mode {text!r}: one of {known} (an actor mode may end in {TEACHER_FLAG})"
            ) from None


J = dict[str, Any]  # a JSON object as a rank returns it


# ---------------------------------------------------------------------- the workers' methods
class WorkerContract(Protocol):
    """What every worker group has: building the worker's models."""

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> list[J]:
        """Build what the worker's mode needs; each rank's summary of its layout."""
        ...


class TrainedContract(WorkerContract, Protocol):
    """A worker that trains one model (``workers/checkpointing.py``'s ``CheckpointMethods``)."""

    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(
        self,
        url: str,
        extra: J | None = None,
        background: bool = False,
        weights_only: bool = False,
        dtype: str | None = None,
    ) -> list[J]:
        """A sharded checkpoint at ``url`` (``background``: staged, the write goes on); per-rank timings."""
        ...

    @register(Dispatch.ONE_TO_ALL)
    def wait_checkpoint(self) -> list[J | None]:
        """Wait for the background write; per rank its result (``{url, error}`` if it failed)."""
        ...

    @register(Dispatch.ONE_TO_ALL)
    def checkpoint_write_status(self) -> list[J | None]:
        """The background write, not waiting: per rank None or ``{url, running}`` (+ ``error``)."""
        ...

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, url: str, with_optimizer: bool = True) -> list[J]:
        """Load checkpoint ``url`` (verified); per rank the checkpoint's ``extra``."""
        ...


class TeacherContract(Protocol):
    """The teacher of on-policy distillation (``workers/teacher.py``'s ``TeacherMethods``)."""

    @register(Dispatch.DP_COMPUTE_PROTO)
    def compute_teacher_log_prob(
        self, data: str, *, out_url: str | None = None, dp_blocks: int | None = None
    ) -> str:
        """``teacher_log_prob`` of the rollout at ``data``; the output's URL."""
        ...


class ActorContract(TrainedContract, TeacherContract, Protocol):
    """``ActorRolloutRefWorker``: actor, rollout engine, reference (and teacher), by its mode."""

    @register(Dispatch.DP_COMPUTE_PROTO)
    def generate_sequences(
        self, prompts: str, *, out_url: str | None = None, dp_blocks: int | None = None
    ) -> str:
        """The rollout of the prompts at ``prompts`` with ``old_log_probs``; the output's URL."""
        ...

    @register(Dispatch.DP_COMPUTE_PROTO)
    def generate_responses(
        self, prompts: str, *, out_url: str | None = None, dp_blocks: int | None = None
    ) -> str:
        """Responses only (evaluation, the asynchronous producer); the output's URL."""
        ...

    @register(Dispatch.DP_COMPUTE_PROTO)
    def compute_log_prob(
        self,
        data: str,
        calculate_entropy: bool = False,
        *,
        out_url: str | None = None,
        dp_blocks: int | None = None,
    ) -> str:
        """``old_log_probs`` (+ ``entropys``) under the actor; the output's URL."""
        ...

    @register(Dispatch.DP_COMPUTE_PROTO)
    def compute_ref_log_prob(
        self, data: str, *, out_url: str | None = None, dp_blocks: int | None = None
    ) -> str:
        """``ref_log_prob`` under the frozen reference; the output's URL."""
        ...

    @register(Dispatch.DP_COMPUTE_PROTO)
    def update_actor(
        self, data: str, *, out_url: str | None = None, dp_blocks: int | None = None
    ) -> list[dict[str, float]]:
        """The PPO update on the batch at ``data``; per rank the (globally reduced) metrics."""
        ...

    @register(Dispatch.ONE_TO_ALL)
    def load_policy(self, url: str) -> list[None]:
        """Sample from the weights of checkpoint ``url`` from the next rollout on."""
        ...


class CriticContract(TrainedContract, Protocol):
    """``CriticWorker``: the value model."""

    @register(Dispatch.DP_COMPUTE_PROTO)
    def compute_values(self, data: str, *, out_url: str | None = None, dp_blocks: int | None = None) -> str:
        """``values`` of the rollout at ``data``; the output's URL."""
        ...

    @register(Dispatch.DP_COMPUTE_PROTO)
    def update_critic(
        self, data: str, *, out_url: str | None = None, dp_blocks: int | None = None
    ) -> list[dict[str, float]]:
        """The value update on the batch at ``data``; per rank the (globally reduced) metrics."""
        ...


class RewardModelContract(WorkerContract, Protocol):
    """``RewardModelWorker``: a reward model scoring rollouts."""

    @register(Dispatch.DP_COMPUTE_PROTO)
    def compute_rm_score(self, data: str, *, out_url: str | None = None, dp_blocks: int | None = None) -> str:
        """``rm_scores`` of the rollout at ``data``; the output's URL."""
        ...


class UpdateCall(Protocol):
    """A trained worker's update method, bound (``update_actor``, ``update_critic``)."""

    def __call__(
        self, data: str, *, out_url: str | None = None, dp_blocks: int | None = None
    ) -> list[dict[str, float]]: ...


# ---------------------------------------------------------------------- the roles
C = TypeVar("C", covariant=True)


@dataclass(frozen=True)
class Role(Generic[C]):
    """A worker group as the flow names it: ``name`` (the group's), ``worker`` (its class as
    ``module:Class``, imported in the ranks only), ``protocol`` (``C``: how the driver calls it),
    the ``modes`` its worker can be built in (``default`` first) and whether a mode of it may
    carry the teacher flag. A ``Role[C]`` is what a typed accessor takes: ``RunGroups.worker(
    CRITIC_ROLE)`` is a ``CriticContract``."""

    name: str
    worker: str
    protocol: type
    modes: tuple[WorkerMode, ...]
    teacher: bool = False

    @property
    def default(self) -> Build:
        """What the group's worker builds unless a run says otherwise (training's full set)."""
        return Build(self.modes[0])

    def build(self, value: Build | WorkerMode | str) -> Build:
        """``value`` as a build of this role's worker; ValueError naming the modes it has."""
        build = Build.parse(value)
        if build.mode not in self.modes:
            known = ", ".join(m.value for m in self.modes)
            raise ValueError(
                f"the {self.name} group's worker builds one of {known}, not {build.mode.value!r}"
            )
        if build.teacher and not (self.teacher and build.mode.builds_actor):
            raise ValueError(
                f"{build.wire!r}: the teacher is built beside a trained actor, in the actor group "
                "(a mode with the actor: actor_rollout_ref, actor_rollout, actor_ref, actor)"
            )
        return build

    def methods(self) -> dict[str, Dispatch]:
        """The Protocol's methods and their dispatch modes (the table its worker must send)."""
        return registered_methods(self.protocol)

    def mismatch(self, table: Mapping[str, Dispatch]) -> str | None:
        """How a method table the ranks sent differs from the Protocol's (None: it does not)."""
        want = self.methods()
        problems = [f"{m} is missing" for m in sorted(set(want) - set(table))]
        problems += [f"{m} is not in the contract" for m in sorted(set(table) - set(want))]
        problems += [
            f"{m} is {table[m].value}, the contract says {want[m].value}"
            for m in sorted(set(want) & set(table))
            if table[m] is not want[m]
        ]
        return "; ".join(problems) or None


ACTOR_ROLE = Role[ActorContract](
    "actor",
    "ppoflow.workers.actor_rollout_ref_worker:ActorRolloutRefWorker",
    ActorContract,
    (
        WorkerMode.ACTOR_ROLLOUT_REF,
        WorkerMode.ACTOR_ROLLOUT,
        WorkerMode.ACTOR_REF,
        WorkerMode.ACTOR,
        WorkerMode.ROLLOUT,
        WorkerMode.REF,
    ),
    teacher=True,
)
CRITIC_ROLE = Role[CriticContract](
    "critic", "ppoflow.workers.critic_worker:CriticWorker", CriticContract, (WorkerMode.CRITIC,)
)
REWARD_MODEL_ROLE = Role[RewardModelContract](
    "reward_model",
    "ppoflow.workers.reward_model_worker:RewardModelWorker",
    RewardModelContract,
    (WorkerMode.REWARD_MODEL,),
)
#: Every worker group of a run, by its name.
ROLES: dict[str, Role[Any]] = {r.name: r for r in (ACTOR_ROLE, CRITIC_ROLE, REWARD_MODEL_ROLE)}

#: The roles whose groups train a model (their workers have the checkpoint methods), and the
#: update method of each.
TRAINED_ROLES: dict[str, Role[TrainedContract]] = {"actor": ACTOR_ROLE, "critic": CRITIC_ROLE}
_UPDATES = {"actor": "update_actor", "critic": "update_critic"}


def trained_role(name: str) -> Role[TrainedContract]:
    """The role of the group named ``name`` as a trained one; ValueError naming them for any other."""
    if name not in TRAINED_ROLES:
        raise ValueError(f"{name!r} is not a trained role: one of {', '.join(TRAINED_ROLES)}")
    return TRAINED_ROLES[name]


def update_of(worker: TrainedContract, method: str) -> UpdateCall:
    """The update method ``method`` (the step table's: ``update_actor``, ``update_critic``) of
    ``worker``, typed; ValueError naming them for any other name."""
    if method not in _UPDATES.values():
        raise ValueError(f"{method!r} is not an update method: one of {', '.join(_UPDATES.values())}")
    call: UpdateCall = getattr(worker, method)
    return call
