"""The translation of one veRL command: its keys sorted into mapped, ignored and refused, and the
ppoflow config it makes (:func:`translate`). The rules that read the keys are in ``sections``,
``run`` and ``algorithm`` (the state they share in ``translator``); the catalogue of keys in ``keys``."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ppoflow.infra.config.verl import algorithm, run, sections
from ppoflow.infra.config.verl.hydra import Overrides, VerlError, parse_overrides
from ppoflow.infra.config.verl.keys import (
    CHECKED,
    LEAVES,
    ignored_reason,
    is_known,
    matches,
    nearest,
)
from ppoflow.infra.config.verl.translator import UNSET, Translator

__all__ = ["Translation", "translate", "under"]


@dataclass
class Translation:
    """A veRL command's keys, each in exactly one of ``mapped`` (key -> the ppoflow settings it
    set), ``ignored`` (key -> why it means nothing here) and ``refused`` (key -> why ppoflow cannot
    honour it); ``config``: the ppoflow config mapping it makes (valid only when nothing is
    refused); ``notes``: what the translation chose that a user should know; ``steps`` and
    ``epochs``: veRL's ``trainer.total_training_steps`` and ``trainer.total_epochs``;
    ``resume_mode``: ``trainer.resume_mode``."""

    keys: list[str]
    config: dict[str, Any]
    mapped: dict[str, str] = field(default_factory=dict)
    ignored: dict[str, str] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    steps: int | None = None
    epochs: int | None = None
    resume_mode: str = "auto"

    def check(self) -> None:
        """VerlError listing every refused key with its reason, if any is."""
        if self.refused:
            width = max(len(k) for k in self.refused)
            lines = [f"  {k:<{width}}  {why}" for k, why in self.refused.items()]
            raise VerlError(
                f"this veRL command has {len(self.refused)} setting(s) ppoflow cannot honour "
                "(nothing was started):\n" + "\n".join(lines)
            )


def _nested(dotted: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in dotted.items():
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = copy.deepcopy(value)
    return out


def _classify(t: Translator, key: str) -> None:
    """Sort a key no rule decided: checked, ignored, deleted, or not a veRL key."""
    check = next(((ok, why) for spec, (ok, why) in CHECKED.items() if matches(key, spec)), None)
    if key in t.deleted and is_known(key):
        t.ignored[key] = "deleted (~): what it sets keeps ppoflow's default"
    elif check is not None:
        value = t.given[key]
        if any(_same(value, ok) for ok in check[0]):
            t.ignored[key] = f"{value!r} is what ppoflow does"
        else:
            t.refused[key] = f"{value!r}: {check[1]}"
    elif (why := ignored_reason(key)) is not None:
        t.ignored[key] = why
    elif is_known(key):  # a mapped key no rule read: never dropped silently
        t.refused[key] = "ppoflow's veRL mapping does not read this key (a ppoflow bug: please report it)"
    else:
        t.refused[key] = f"not a veRL key; the nearest is {nearest(key)}"


def translate(*sources: Iterable[str] | Mapping[str, Any]) -> Translation:
    """Translate a veRL command: each source ``KEY=VALUE`` strings or a nested mapping of veRL's
    keys, read in order (a later setting of a key wins, as later overrides do in Hydra).

    The result's ``config`` is a ppoflow config mapping; call ``Translation.check()`` before using
    it (it is incomplete where keys were refused)."""
    overrides = Overrides()
    for items in sources:
        parse_overrides(items, leaves=LEAVES, into=overrides)
    t = Translator(overrides)
    for rule in (*sections.RULES, *run.RULES, *algorithm.RULES):
        rule(t)
    for item, why in overrides.malformed.items():
        t.refused[item] = why
    for key in overrides.keys:
        if key not in t.refused and key not in t.mapped and key not in t.ignored:
            _classify(t, key)
    keys = [*overrides.keys, *overrides.malformed]
    return Translation(
        keys=keys,
        config=_nested(t.out),
        mapped={k: ", ".join(v) for k, v in t.mapped.items() if k not in t.refused},
        ignored={k: v for k, v in t.ignored.items() if k not in t.refused and k not in t.mapped},
        refused=dict(t.refused),
        notes=t.notes,
        steps=_int_or_none(t.value("trainer.total_training_steps", None)),
        epochs=_int_or_none(t.value("trainer.total_epochs", None)),
        resume_mode=str(t.value("trainer.resume_mode", "auto")),
    )


def _same(a: Any, b: Any) -> bool:
    """``a == b``, where a bool equals only a bool (``1`` is not ``True`` here)."""
    return a is b if isinstance(a, bool) or isinstance(b, bool) else bool(a == b)


def _int_or_none(value: Any) -> int | None:
    return None if value is None or value is UNSET else int(value)


def under(base: Mapping[str, Any], data: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` over ``base``: every key ``data`` sets wins, mappings merged key by key."""
    out = copy.deepcopy(dict(base))
    for key, value in data.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = under(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out
