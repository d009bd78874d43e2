"""The config's shared pieces: the section base (unknown keys are errors), dtypes, string fields
whose allowed values are a registry's names (the algorithms', the rollout engines'), and the rule
for names that become a path or key component (:data:`NAME_RULE`)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Annotated, Any, Literal, cast

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, JsonValue

from ppoflow.infra.config.recipes import RECIPES
from ppoflow.infra.models.rollout_engines import engine_names

__all__ = [
    "Dtype",
    "Section",
    "AdvEstimatorName",
    "LossAggMode",
    "PolicyLossName",
    "RecipeName",
    "EngineName",
    "KLPenaltyKind",
    "KLControllerKind",
    "one_of",
    "registry",
    "NAME_PATTERN",
    "NAME_RULE",
    "name_problem",
    "given_auto",
]

Dtype = Literal["float32", "bfloat16", "float16"]

#: A name that becomes one path or key component (``storage.experiment``: a directory, or an S3
#: key prefix, under ``storage.root``). Starting with a letter or digit, it is never ``.``, ``..``,
#: a hidden or temporary name; with no ``/`` nor backslash it is one component on every store.
NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
#: :data:`NAME_PATTERN` in words (error messages and docs/configuration.md say this).
NAME_RULE = (
    "1-128 characters: letters, digits, '.', '_' and '-', the first a letter or digit "
    "(so no '/', no '.' or '..', nothing hidden)"
)


def name_problem(value: object, what: str) -> str | None:
    """Why ``value`` is not a name by :data:`NAME_RULE` (``what`` says which name), or None."""
    if isinstance(value, str) and re.fullmatch(NAME_PATTERN, value):
        return None
    fixed = re.sub(r"[^A-Za-z0-9._-]+", "-", str(value)).strip("._-")[:128] or "my-experiment"
    return f"{value!r} is not a valid {what}: it must be {NAME_RULE}; e.g. {fixed!r}"


def registry(name: str) -> Callable[[], Iterable[str]]:
    """The names in ``ppoflow.algos.<name>`` (imported when a config is validated)."""

    def names() -> Iterable[str]:
        import ppoflow.algos

        return getattr(ppoflow.algos, name)

    return names


def one_of(what: str, names: Callable[[], Iterable[str]]) -> Any:
    """A ``str`` field whose allowed values are a registry's names. The registry is the only list:
    an estimator registered with ``@register_adv_estimator`` is valid at once, and the JSON schema
    (the Prefect UI's form) offers the names registered when it is generated."""

    def check(value: str) -> str:
        allowed = sorted(names())
        if value not in allowed:
            raise ValueError(f"unknown {what} {value!r}; allowed: {', '.join(allowed)}")
        return value

    return Annotated[
        str,
        AfterValidator(check),
        Field(json_schema_extra=lambda schema: schema.update(enum=cast(list[JsonValue], sorted(names())))),
    ]


AdvEstimatorName = one_of("advantage estimator", registry("ADV_ESTIMATORS"))
PolicyLossName = one_of("policy loss", registry("POLICY_LOSSES"))
LossAggMode = one_of("loss aggregation mode", registry("LOSS_AGG_MODES"))
KLPenaltyKind = one_of("KL penalty kind", registry("KL_PENALTY_KINDS"))
RecipeName = one_of("recipe", lambda: RECIPES)
KLControllerKind = one_of("KL controller", registry("KL_CONTROLLERS"))
EngineName = one_of("rollout engine", engine_names)  # ppoflow.infra.models.rollout_engines


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    def model_post_init(self, context: Any, /) -> None:
        """Note which fields hold ``auto`` as the section was given (written or by default), before
        a whole config resolves them (:func:`given_auto`). The note sits beside the fields, where
        pydantic leaves a name that is not a field out of dumps and comparisons: a config and its
        dump read back stay equal (a ``PrivateAttr`` would not do: ``==`` compares those)."""
        auto = frozenset(n for n in type(self).model_fields if self.__dict__.get(n) == "auto")
        if auto:
            self.__dict__[_GIVEN_AUTO] = auto


_GIVEN_AUTO = "_given_auto"


def given_auto(section: BaseModel) -> frozenset[str]:
    """The fields of ``section`` that were ``auto`` when it was built (a config's own resolution
    replaces them with numbers: ``actor.ppo_max_token_len_per_gpu``, which the memory plan may
    raise on GPUs). A section read back from a resolved dump has none."""
    return cast(frozenset[str], section.__dict__.get(_GIVEN_AUTO, frozenset()))
