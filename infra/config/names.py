"""The config's shared pieces: the section base (unknown keys are errors), dtypes, and string fields
whose allowed values are a registry's names (the algorithms', the rollout engines')."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Annotated, Any, Literal, cast

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, JsonValue

from ppoflow.infra.config.recipes import RECIPES
from ppoflow.infra.rollout_engines import engine_names

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
]

Dtype = Literal["float32", "bfloat16", "float16"]


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
EngineName = one_of("rollout engine", engine_names)  # ppoflow.infra.rollout_engines


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
