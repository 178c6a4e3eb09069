"""Config files: TOML tables mapped onto frozen dataclass configs, with ``CROSSDC_*`` overrides.

This is the one place where configuration is read. A table's keys must be fields of the target
dataclass (an unknown key is an error naming it); values are type-checked against the field
annotations; nested dataclasses map to sub-tables; each dataclass validates itself in
``__post_init__``. Environment variables ``CROSSDC_<TABLE>_<FIELD>`` (values in TOML syntax)
override the file; explicit arguments given to :func:`build` override both.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A config that cannot be used; the message names the field."""


def load_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        with p.open("rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {str(p)!r} is not valid TOML: {exc}") from None


def _convert(kind: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(kind)
    args = typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{where}: bad value {value!r}")
    if dataclasses.is_dataclass(kind) and isinstance(kind, type):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where} must be a table")
        return build(kind, value, prefix=where)
    if kind is Any:
        return value
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {value!r}")
        return value
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        return value
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{where} must be a number, got {value!r}")
        return float(value)
    if kind is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be a string, got {value!r}")
        return value
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        item = args[0]
        return tuple(_convert(item, v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where} must be a table")
        return dict(value)
    raise ConfigError(f"{where}: unsupported field type {kind!r}")


def build(cls: type[T], table: Mapping[str, Any], *, prefix: str = "", **explicit: Any) -> T:
    """Build ``cls`` from a table; ``explicit`` keyword values win over the table."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    where = f"{prefix}." if prefix else ""
    unknown = sorted(set(table) - set(fields))
    if unknown:
        raise ConfigError(f"unknown key {where}{unknown[0]} (known: {', '.join(sorted(fields))})")
    values: dict[str, Any] = {}
    for name, value in {**table, **{k: v for k, v in explicit.items() if v is not None}}.items():
        if name not in fields:
            raise ConfigError(f"unknown key {where}{name}")
        values[name] = _convert(hints[name], value, f"{where}{name}")
    try:
        return cls(**values)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    except TypeError as exc:  # a required field is missing
        raise ConfigError(f"{prefix or cls.__name__}: {exc}") from None


def env_overrides(table_name: str, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``CROSSDC_<TABLE>_<FIELD>=<toml value>`` for one table, parsed; dotted nesting via ``__``."""
    env = os.environ if environ is None else environ
    prefix = f"CROSSDC_{table_name.upper()}_"
    out: dict[str, Any] = {}
    for key, raw in env.items():
        if not key.startswith(prefix):
            continue
        path = key[len(prefix) :].lower().split("__")
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw  # a bare string
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return out


def merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """Deep merge of two tables; ``override`` wins."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def load_section(cls: type[T], path: str | Path, section: str, **explicit: Any) -> T:
    """Read ``[section]`` of a TOML file (plus env overrides) into ``cls``."""
    doc = load_toml(path)
    unknown = sorted(set(doc) - {section})
    if unknown:
        raise ConfigError(f"unknown table [{unknown[0]}] in {path} (expected [{section}])")
    table = merge(doc.get(section, {}), env_overrides(section))
    return build(cls, table, prefix=section, **explicit)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def dump_toml(doc: Mapping[str, Any]) -> str:
    """Write nested tables of plain values as TOML (the subset our configs use)."""
    lines: list[str] = []

    def table(path: str, body: Mapping[str, Any]) -> None:
        scalars = {k: v for k, v in body.items() if not isinstance(v, Mapping)}
        if path:
            lines.append(f"[{path}]")
        lines.extend(f"{k} = {_toml_value(v)}" for k, v in scalars.items())
        lines.append("")
        for k, v in body.items():
            if isinstance(v, Mapping):
                table(f"{path}.{k}" if path else k, v)

    table("", doc)
    return "\n".join(lines).lstrip("\n")
