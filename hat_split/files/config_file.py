"""Every role's config (EdgeConfig, CloudConfig, ExportConfig, LinkConfig, ...) as a TOML file.

A config is a frozen dataclass; a nested dataclass field is a TOML table (`[link]`). Reading checks every key against
the dataclass and every value against its annotation, and names the dotted key and the file in the error:

    unknown key 'link.timout_s' in edge.toml; known keys of [link]: backoff_s, heartbeat_s, ...
    'draft_len' in edge.toml must be an integer, got 'four'

Values are then checked by the dataclass's own `__post_init__` (ranges, choices), whose message is kept.
A command line takes `--config FILE`; flags the user typed override the file (`config_from_flags`, with the flags
that hat_split.files.settings generates).

Stdlib only (tomllib, or tomli before Python 3.11): the device reads its config on Python 3.8.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from pathlib import Path
from typing import Any, Dict, Mapping, Set, Type, TypeVar, Union

from hat_split.files.settings import renamed_keys

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.8-3.10 (JetPack 5 and 6)
    import tomli as tomllib

T = TypeVar("T")


class ConfigError(ValueError):
    """A config file or override that cannot be read: the message names the key and the file."""


def _where(source: str) -> str:
    return f" in {source}" if source else ""


# a scalar annotation: what to call it in an error, and which TOML values it accepts (a bool is no number)
_SCALARS = {
    bool: ("true or false", lambda v: isinstance(v, bool)),
    int: ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    float: ("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)),
    str: ("a string", lambda v: isinstance(v, str)),
}


def _check(key: str, tp: Any, value: Any, source: str) -> Any:
    """`value` as the annotation `tp` wants it, or a ConfigError naming `key`."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin is Union:
        if value is None and type(None) in args:
            return None
        errors = []
        for arm in (a for a in args if a is not type(None)):
            try:
                return _check(key, arm, value, source)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{key!r}{_where(source)}: no accepted type fits "
                          f"{value!r}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key!r}{_where(source)} must be a table, got {value!r}")
        return _build(tp, value, source, prefix=key + ".")
    if origin in (tuple, list) or tp in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key!r}{_where(source)} must be a list, got {value!r}")
        if args and not (len(args) == 2 and args[1] is Ellipsis) and origin is tuple:
            if len(args) != len(value):
                raise ConfigError(f"{key!r}{_where(source)} must have {len(args)} items, got {len(value)}")
            items = [_check(f"{key}[{i}]", a, v, source) for i, (a, v) in enumerate(zip(args, value))]
        else:
            arm = args[0] if args else Any
            items = [_check(f"{key}[{i}]", arm, v, source) for i, v in enumerate(value)]
        return tuple(items) if (origin or tp) is tuple else items
    if origin in (dict, Mapping) or tp in (dict,):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key!r}{_where(source)} must be a table, got {value!r}")
        return dict(value)
    if tp in _SCALARS:
        what, ok = _SCALARS[tp]
        if not ok(value):
            raise ConfigError(f"{key!r}{_where(source)} must be {what}, got {value!r}")
        return float(value) if tp is float else value
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(f"{key!r}{_where(source)} must be {tp.__name__}, got {value!r}")
    return value


def _hints(cls: type) -> Dict[str, Any]:
    return typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))


def _build(cls: Type[T], data: Mapping[str, Any], source: str, prefix: str = "") -> T:
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        table = f"[{prefix[:-1]}]" if prefix else "the top level"
        raise ConfigError(f"unknown key {prefix + unknown[0]!r}{_where(source)}; known keys of {table}: "
                          f"{', '.join(sorted(fields))}")
    hints = _hints(cls)
    kwargs = {name: _check(prefix + name, hints[name], value, source) for name, value in data.items()}
    missing = [n for n, f in fields.items() if n not in kwargs and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"missing key {prefix + missing[0]!r}{_where(source)}")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as exc:
        table = f" [{prefix[:-1]}]" if prefix else ""
        raise ConfigError(f"{source or 'config'}{table}: {exc}") from exc


def config_from_dict(cls: Type[T], data: Mapping[str, Any], source: str = "") -> T:
    """Build the dataclass `cls` from a (TOML) mapping; nested dataclass fields come from sub-tables. A key's old
    spelling (its Setting's old_keys, hat_split.files.settings) is read as the new one, said on stderr."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    try:
        data = renamed_keys(cls, dict(data), source)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return _build(cls, data, source)


def config_to_dict(obj: Any) -> Dict[str, Any]:
    """The mapping `config_from_dict` reads back to an equal config (None values are left out: TOML has no null)."""
    out: Dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        if not f.init:
            continue
        value = getattr(obj, f.name)
        if value is None:
            continue
        out[f.name] = config_to_dict(value) if dataclasses.is_dataclass(value) else _plain(value)
    return out


def _plain(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, Path):
        return str(value)
    return value


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        if isinstance(value, float) and value != value:
            return "nan"
        if isinstance(value, float) and value in (float("inf"), float("-inf")):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t")
        return f'"{escaped}"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{_key(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise ConfigError(f"cannot write {value!r} to TOML")


def _key(name: str) -> str:
    return name if name.replace("_", "").replace("-", "").isalnum() else _toml_value(name)


def dump_toml(obj: Any) -> str:
    """A config as TOML text: scalars first, then one table per nested config."""
    lines, tables = [], []

    def walk(data: Mapping[str, Any], prefix: str) -> None:
        scalars = {k: v for k, v in data.items() if not (isinstance(v, Mapping) and k in nested)}
        del_lines = [f"{_key(k)} = {_toml_value(v)}" for k, v in scalars.items()]
        (lines if not prefix else tables).extend(([f"\n[{prefix}]"] if prefix else []) + del_lines)
        for k, v in data.items():
            if isinstance(v, Mapping) and k in nested:
                walk(v, f"{prefix}.{k}" if prefix else k)

    data = config_to_dict(obj)
    nested = _nested_names(obj)
    walk(data, "")
    return "\n".join(lines + tables).lstrip("\n") + "\n"


def _nested_names(obj: Any) -> Set[str]:
    """Field names that hold nested configs, at any depth (their values become TOML tables)."""
    names: Set[str] = set()
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            names.add(f.name)
            names |= _nested_names(value)
    return names


def read_toml(path: Union[str, Path]) -> Dict[str, Any]:
    """A TOML file as a mapping, or a ConfigError naming the file."""
    p = Path(path)
    try:
        with p.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {p} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p} is not valid TOML: {exc}") from None


def _set_dotted(data: Dict[str, Any], key: str, value: Any) -> None:
    *tables, last = key.split(".")
    for t in tables:
        data = data.setdefault(t, {})
        if not isinstance(data, dict):
            raise ConfigError(f"override {key!r}: {t!r} is not a table")
    data[last] = _plain(value)


def load_config(cls: Type[T], path: Union[str, Path], overrides: Mapping[str, Any] = {}) -> T:
    """`cls` from the TOML file at `path`, with `overrides` (dotted keys, e.g. {"link.timeout_s": 3.0}) applied on
    top: what a command line typed explicitly wins over the file."""
    data = read_toml(path)
    for key, value in overrides.items():
        _set_dotted(data, key, value)
    return config_from_dict(cls, data, source=str(path))


def with_overrides(config: T, overrides: Mapping[str, Any], source: str = "") -> T:
    """A copy of `config` with dotted-key overrides applied and everything checked again."""
    data = config_to_dict(config)
    for key, value in overrides.items():
        _set_dotted(data, key, value)
    return config_from_dict(type(config), data, source=source)


def config_from_flags(cls: Type[T], path: Union[str, Path, None], typed: Mapping[str, Any]) -> T:
    """A role's config from its command line: the TOML file at `path` (none: the defaults) with the flags the user
    typed on top (`typed`: dotted key → value, hat_split.files.settings.overrides)."""
    if path:
        return load_config(cls, path, typed)
    data: Dict[str, Any] = {}
    for key, value in typed.items():
        _set_dotted(data, key, value)
    return config_from_dict(cls, data, source="the command line")


def add_config_argument(parser: argparse.ArgumentParser, role: str = "") -> None:
    """`--config FILE`: the role's config as TOML; flags given on the command line override its keys."""
    parser.add_argument("--config", default="", metavar="FILE",
                        help=f"TOML file with the {role + ' ' if role else ''}config (docs/CONFIG.md); flags given "
                             "here override its keys")
