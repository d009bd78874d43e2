"""veRL's command line as Hydra reads it: ``KEY=VALUE`` overrides, and a nested mapping of keys.

    key=value      set (the value is YAML: True, null, 1e-6, [a,b], '["console","wandb"]')
    +key=value     add a key the config lacks: here the same as setting it
    ++key=value    add or set: the same
    ~key, ~key=v   delete the key: it is neither given nor defaulted

A later override of a key wins, as in Hydra; ``~key`` also drops what earlier overrides set.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

__all__ = ["Overrides", "parse_overrides", "flatten", "parse_value", "VerlError"]

#: A number as Hydra reads one (YAML 1.1, which PyYAML speaks, reads ``1e-6`` as a string).
_NUMBER = re.compile(r"[-+]?(?:\d[\d_]*\.?[\d_]*|\.\d[\d_]*)(?:[eE][-+]?\d+)?")
_KEY = re.compile(r"[A-Za-z_][\w-]*(?:\.[A-Za-z_0-9][\w-]*)*")


class VerlError(ValueError):
    """A veRL command that ppoflow cannot run as given; the message names every key at fault."""


@dataclass
class Overrides:
    """What a veRL command gives: ``given`` (key -> value, the last override of each key, in the
    order the keys first appeared) and ``deleted`` (the keys ``~key`` removed)."""

    given: dict[str, Any] = field(default_factory=dict)
    deleted: list[str] = field(default_factory=list)
    malformed: dict[str, str] = field(default_factory=dict)

    @property
    def keys(self) -> list[str]:
        """Every key the command names, given or deleted, each once."""
        return list(dict.fromkeys([*self.given, *self.deleted]))

    def set(self, key: str, value: Any) -> None:
        if key in self.deleted:
            self.deleted.remove(key)
        self.given[key] = value

    def delete(self, key: str) -> None:
        for k in [k for k in self.given if k == key or k.startswith(key + ".")]:
            del self.given[k]
        if key not in self.deleted:
            self.deleted.append(key)


def parse_value(text: str) -> Any:
    """A Hydra value: YAML, with numbers such as ``1e-6`` read as numbers and ``key=`` as ''."""
    if text == "":
        return ""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text  # Hydra would reject most of these; the mapping says what it makes of them
    if isinstance(value, str) and _NUMBER.fullmatch(value):
        number = value.replace("_", "")
        is_int = re.fullmatch(r"[-+]?\d+", number) is not None
        return int(number) if is_int else float(number)
    return value


def flatten(mapping: Mapping[str, Any], prefix: str = "", leaves: Iterable[str] = ()) -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``. A key in ``leaves`` (a veRL setting whose value is
    itself a mapping, e.g. ``model.override_config``) and an empty mapping stay whole."""
    keep = set(leaves)
    out: dict[str, Any] = {}
    for k, v in mapping.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, Mapping) and v and key not in keep:
            out.update(flatten(v, key, keep))
        else:
            out[key] = v
    return out


def parse_overrides(
    items: Iterable[str] | Mapping[str, Any], leaves: Iterable[str] = (), into: Overrides | None = None
) -> Overrides:
    """The overrides of a veRL command line (``KEY=VALUE`` strings), or of a nested mapping of
    veRL's keys (a config's ``verl:`` section), added to ``into`` when given (later ones win). A
    mapping value given to a section (``actor_rollout_ref.rollout.val_kwargs={n: 4}``) sets each
    key below it. Items that are not overrides at all are kept in ``malformed`` (item -> why), for
    the caller to refuse."""
    out = Overrides() if into is None else into
    if isinstance(items, Mapping):
        for key, value in flatten(items, leaves=leaves).items():
            out.set(key, value)
        return out
    for item in items:
        text = str(item)
        if text.startswith("~"):
            key = text[1:].partition("=")[0].strip()
            if not _KEY.fullmatch(key):
                out.malformed[text] = "expected ~KEY"
                continue
            out.delete(key)
            continue
        key, sep, raw = text.lstrip("+").partition("=")
        key = key.strip()
        if not sep or not _KEY.fullmatch(key):
            hint = " (a config file goes before --verl)" if text.endswith((".yaml", ".yml")) else ""
            out.malformed[text] = f"expected KEY=VALUE, +KEY=VALUE or ~KEY{hint}"
            continue
        value = parse_value(raw)
        if isinstance(value, Mapping) and value and key not in set(leaves):
            for sub, v in flatten(value, key, leaves).items():
                out.set(sub, v)
        else:
            out.set(key, value)
    return out
