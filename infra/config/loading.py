"""Configs in and out: YAML from a path or fsspec URL, dotted overrides, and one readable error."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import ValidationError

from ppoflow.infra.config.experiment import ExperimentConfig

if TYPE_CHECKING:
    from ppoflow.infra.config.verl import Translation

__all__ = [
    "ConfigError",
    "format_validation_error",
    "parse_config",
    "apply_overrides",
    "load_config",
    "read_config_data",
    "with_verl",
    "dump_config",
]


def format_validation_error(err: ValidationError, source: str = "config") -> str:
    """One readable message: every bad field with its dotted path, what was given and what is allowed."""
    lines = [f"invalid {source}:"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        given = e.get("input")
        given_s = "" if isinstance(given, dict) else f" (got {given!r})"
        lines.append(f"  {loc}: {e['msg']}{given_s}")
    return "\n".join(lines)


class ConfigError(ValueError):
    """A config that cannot run; the message names each bad field and the allowed values."""


def parse_config(data: dict[str, Any], source: str = "config") -> ExperimentConfig:
    try:
        return ExperimentConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, source)) from None


def apply_overrides(data: dict[str, Any], overrides: dict[str, Any] | None) -> dict[str, Any]:
    """Set dotted keys (``{"rollout.n": 4, "actor.optim.lr": 3e-6}``) in a config mapping, in
    place, creating the sections on the way; returns ``data``."""
    for key, value in (overrides or {}).items():
        node = data
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return data


def load_config(path_or_url: str, overrides: dict[str, Any] | None = None) -> ExperimentConfig:
    """Read a YAML config from a path or fsspec URL; ``overrides`` are dotted keys (``{"rollout.n": 4}``).
    A ``verl:`` section is translated (:func:`with_verl`) under the file's own sections.

    A file that is not valid YAML is a :class:`ConfigError` naming the file, the line and the
    column, with that line shown."""
    data, _ = with_verl(read_config_data(path_or_url))
    return parse_config(apply_overrides(data, overrides), source=path_or_url)


def with_verl(data: dict[str, Any], verl: Sequence[str] = ()) -> tuple[dict[str, Any], Translation | None]:
    """A config mapping with its ``verl:`` section (a mapping of veRL's keys, or a list of
    ``KEY=VALUE`` strings) and then ``verl`` (a command's overrides) translated, the file's own
    sections over the translation; and the translation (None without either). A veRL key ppoflow
    cannot honour is a :class:`ConfigError` naming every such key (docs/verl.md)."""
    from ppoflow.infra.config.verl import VerlError, translate, under

    data = dict(data)
    section = data.pop("verl", None)
    if section is None and not verl:
        return data, None
    if section is not None and not isinstance(section, (dict, list)):
        raise ConfigError(
            f"verl: expected a mapping of veRL's keys or a list of KEY=VALUE strings, got {section!r}"
        )
    try:
        translation = translate(section or {}, list(verl))
        translation.check()
    except VerlError as err:
        raise ConfigError(str(err)) from None
    return under(translation.config, data), translation


def read_config_data(path_or_url: str) -> dict[str, Any]:
    """The mapping a YAML config file holds (ConfigError for a file that is not one)."""
    from ppoflow.infra.data import storage

    text = storage.read_bytes(path_or_url).decode()
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as err:
        raise ConfigError(yaml_problem(path_or_url, text, err)) from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path_or_url}: the top level of a config must be a mapping, got {type(data).__name__}"
        )
    return data


def yaml_problem(source: str, text: str, err: yaml.YAMLError) -> str:
    """``source:LINE:COLUMN: <what yaml found>`` and the line with a caret under the column."""
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    what = " ".join(str(p) for p in (getattr(err, "context", None), getattr(err, "problem", None)) if p)
    what = what or str(err)
    if mark is None:
        return f"{source}: not valid YAML: {what}"
    lines = text.splitlines()
    shown = lines[mark.line] if mark.line < len(lines) else ""
    return (
        f"{source}:{mark.line + 1}:{mark.column + 1}: not valid YAML: {what}\n"
        f"  {mark.line + 1:>4} | {shown}\n"
        f"       | {' ' * mark.column}^\n"
        "fix the YAML there (indentation, a ':' after each key, quotes around values with ':' or '#')"
    )


def dump_config(cfg: ExperimentConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
