"""The state the translation's rules share (:class:`Translator`): the command's values with veRL's
defaults, and what the rules set, refused and found meaningless."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ppoflow.infra.config.verl.hydra import Overrides
from ppoflow.infra.config.verl.keys import VERL_DEFAULTS

__all__ = ["Translator", "UNSET", "DTYPES"]


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


#: What :meth:`Translator.value` returns for a key neither given nor defaulted by veRL.
UNSET: Any = _Unset()

#: veRL's dtype spellings -> ppoflow's.
DTYPES = {
    "fp32": "float32",
    "float32": "float32",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
}


class Translator:
    """The state the rules share: the command's values, and what they set and decided."""

    def __init__(self, overrides: Overrides):
        self.given = overrides.given
        self.deleted = set(overrides.deleted)
        self.out: dict[str, Any] = {}
        self.mapped: dict[str, list[str]] = {}
        self.ignored: dict[str, str] = {}
        self.refused: dict[str, str] = {}
        self.notes: list[str] = []

    def gave(self, key: str) -> bool:
        return key in self.given

    def value(self, key: str, default: Any = UNSET) -> Any:
        """The command's value of ``key``, else veRL's default (:data:`VERL_DEFAULTS`), else
        ``default``; a deleted key (``~key``) has neither."""
        if key in self.given:
            return self.given[key]
        if key in self.deleted:
            return UNSET
        return VERL_DEFAULTS.get(key, default)

    def put(self, target: str, value: Any, *sources: str) -> None:
        """Set ppoflow's ``target`` to ``value`` (nothing when UNSET); the given ``sources`` are mapped."""
        if value is UNSET:
            return
        self.out[target] = value
        for key in sources:
            if key in self.given:
                self.mapped.setdefault(key, [])
                if target not in self.mapped[key]:
                    self.mapped[key].append(target)

    def copy(self, pairs: Mapping[str, str], convert: Callable[[Any], Any] = lambda v: v) -> None:
        """``put(target, convert(value(key)), key)`` for each ``key: target``."""
        for key, target in pairs.items():
            value = self.value(key)
            self.put(target, value if value is UNSET else convert(value), key)

    def refuse(self, key: str, why: str) -> None:
        self.refused[key] = why

    def same(self, key: str, why: str) -> None:
        """``key`` (when given) asks for what ppoflow does anyway, or for nothing: ignored."""
        if key in self.given:
            self.ignored[key] = why

    def dtype(self, key: str, target: str) -> None:
        value = self.value(key)
        if value is None:
            self.same(key, "null: ppoflow picks the dtype (by device, docs/configuration.md)")
        if value is UNSET or value is None:
            return
        if str(value).removeprefix("torch.") not in DTYPES:
            self.refuse(key, f"dtype {value!r}: ppoflow takes {', '.join(sorted(set(DTYPES.values())))}")
            return
        self.put(target, DTYPES[str(value).removeprefix("torch.")], key)
