"""Each config field declared once: its default, its meaning with its unit, and its command-line flag.

    draft_len: int = setting(4, "γ, drafts per round for `sd`", flag="--draft-len")

A role's command line (`add_flags`), its `--config FILE` (hat_split.files.config_file) and docs/CONFIG.md's key tables
(`key_rows`) all come from that one declaration. A field's flag is `--` and its name with dashes unless it names
another (`flag=`), or none (`flag=""`: a key of the file only). Old spellings stay usable for a while: `aliases` (old
flags) and `old_keys` (old TOML keys in the same table) work and print their new name. A field may also take a
one-dash spelling beside its flag (`short="-i"`), and a tuple field a flag given once per item (`append=True`: `-o A
-o B`) instead of one comma-separated list (for items that may hold commas).

Flags are added with their defaults suppressed, so the parsed namespace holds exactly what the user typed, under the
field's dotted key: `overrides(args)` is what a command line sets on top of the file (or of the defaults).

Stdlib only: the device reads its config and parses its flags on Python 3.8.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

MISSING = dataclasses.MISSING
META = "hatspec.setting"


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET = _Unset()  # a Setting without a const (dataclasses.MISSING cannot be a field's default)


@dataclasses.dataclass(frozen=True)
class Setting:
    """What a config field declares besides its type and default."""

    help: str  # its meaning, with its unit
    flag: Optional[str] = None  # None: "--" + name with dashes; "": no flag (a key of the file only)
    aliases: Tuple[str, ...] = ()  # old flag spellings: they work and print the new one
    old_keys: Tuple[str, ...] = ()  # old TOML key spellings in the same table ("../name": in the table above, moved
    # down into this one): they work and print the new one
    metavar: Optional[str] = None
    choices: Optional[Tuple[Any, ...]] = None
    const: Any = UNSET  # a flag that takes no value and sets this one (--plaintext sets security.mode)
    short: str = ""  # a one-dash spelling beside the flag ("-i" for --identity); "": none
    append: bool = False  # a tuple field: its flag is given once per item (-o A -o B), not as a comma-separated list


def setting(default: Any = MISSING, help: str = "", *, factory: Any = MISSING, flag: Optional[str] = None,
            aliases: Sequence[str] = (), old_keys: Sequence[str] = (), metavar: Optional[str] = None,
            choices: Optional[Sequence[Any]] = None, const: Any = UNSET, short: str = "",
            append: bool = False) -> Any:
    """A dataclass field declaring its Setting (a dataclasses.field: use it as the field's default)."""
    meta = {META: Setting(help, flag, tuple(aliases), tuple(old_keys), metavar,
                          tuple(choices) if choices is not None else None, const, short, append)}
    if factory is not MISSING:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def setting_of(f: dataclasses.Field) -> Optional[Setting]:
    return f.metadata.get(META)


def _hints(cls: type) -> Dict[str, Any]:
    return typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))


def _plain_type(tp: Any) -> Any:
    """Optional[X] → X."""
    if typing.get_origin(tp) is Union:
        arms = [a for a in typing.get_args(tp) if a is not type(None)]
        return arms[0] if len(arms) == 1 else str
    return tp


def fields_of(cls: type, prefix: str = "") -> Iterator[Tuple[str, dataclasses.Field, Any]]:
    """(dotted key, field, annotation) of every leaf field of a config, nested configs walked."""
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        tp = _plain_type(hints[f.name])
        if dataclasses.is_dataclass(tp):
            yield from fields_of(tp, f"{prefix}{f.name}.")
        else:
            yield prefix + f.name, f, tp


def flag_of(key: str, s: Setting) -> str:
    """The declared flag, else "--" + the field's name with dashes, its unit suffix "_s" (seconds) left off."""
    if s.flag is not None:
        return s.flag
    name = key.rsplit(".", 1)[-1]
    return "--" + (name[:-2] if name.endswith("_s") else name).replace("_", "-")


def default_of(f: dataclasses.Field) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return MISSING


class _Deprecated(argparse.Action):
    """An old spelling of a flag: does what the new one does, and says the new name on stderr."""

    def __init__(self, *args, new: str = "", inner: argparse.Action = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.new, self.inner = new, inner

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{parser.prog}: {option_string} is deprecated: use {self.new}", file=sys.stderr)
        self.inner(parser, namespace, values, self.new)


class _Bool(argparse.Action):
    """--flag sets True, --no-flag False (argparse.BooleanOptionalAction is Python 3.9+)."""

    def __init__(self, option_strings, dest, **kwargs):
        kwargs.pop("type", None)
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, not option_string.startswith("--no-"))


def _parse_tuple(item: Callable[[str], Any]) -> Callable[[str], tuple]:
    def parse(text: str) -> tuple:
        return tuple(item(p.strip()) for p in text.split(",") if p.strip())
    parse.__name__ = "comma-separated list"
    return parse


def _item_type(tp: Any) -> Callable[[str], Any]:
    """A tuple annotation's item type (int, float or str)."""
    args = [a for a in typing.get_args(tp) if a is not Ellipsis]
    return args[0] if args and args[0] in (int, float, str) else str


def _type_of(tp: Any) -> Callable[[str], Any]:
    if typing.get_origin(tp) is tuple or tp is tuple:
        return _parse_tuple(_item_type(tp))
    return tp if tp in (int, float, str) else str


def add_flags(parser: argparse.ArgumentParser, cls: type, prefix: str = "", skip: Sequence[str] = (),
              sections: Optional[Dict[str, str]] = None) -> List[str]:
    """A flag for every field of `cls` (nested configs included) that declares one. `prefix`: the dotted key of `cls`
    within the role's config (the generate command's request defaults: "request."); `skip`: keys (dotted, within
    `cls`) a command line leaves out or handles itself; `sections`: help sections by table ("qs.": its title).
    Returns the dotted keys that got a flag: `overrides(args, keys)` reads what was typed."""
    groups: Dict[str, Any] = {}
    added = []
    for key, f, tp in fields_of(cls):
        s = setting_of(f)
        if s is None or s.flag == "" or key in skip:
            continue
        table = max((t for t in (sections or {}) if key.startswith(t)), key=len, default=None)
        if table is not None and table not in groups:
            groups[table] = parser.add_argument_group(sections[table])
        target = groups[table] if table is not None else parser
        flag = flag_of(key, s)
        default = default_of(f)
        shown = "" if default in (MISSING, "", None, ()) or s.const is not UNSET else f" (default {default!r})"
        text = s.help + shown if s.const is UNSET else f"{key} = {s.const!r} ({s.help})"
        text += "; give the flag once per item" if s.append else ""
        kwargs: Dict[str, Any] = dict(dest=prefix + key, default=argparse.SUPPRESS, help=text.replace("%", "%%"))
        names = ([s.short] if s.short else []) + [flag]
        if s.const is not UNSET:
            kwargs.update(action="store_const", const=s.const)
        elif tp is bool:
            kwargs.update(action=_Bool)
            names.append("--no-" + flag[2:])
        else:
            name = key.rsplit(".", 1)[-1].upper()
            name = name[:-2] if name.endswith("_S") else name
            kwargs.update(type=_item_type(tp) if s.append else _type_of(tp),
                          metavar=s.metavar or (None if s.choices else name))
            if s.append:
                kwargs["action"] = "append"  # from nothing (the default is suppressed): a list of what was typed
            if s.choices is not None:
                kwargs["choices"] = s.choices
        action = target.add_argument(*names, **kwargs)
        for old in s.aliases:
            extra = dict(nargs=0) if action.nargs == 0 else dict(type=action.type, choices=action.choices,
                                                                   metavar=action.metavar)
            target.add_argument(old, dest=prefix + key, default=argparse.SUPPRESS, help=argparse.SUPPRESS,
                                action=_Deprecated, new=flag, inner=action, **extra)
        added.append(prefix + key)
    return added


def overrides(args: argparse.Namespace, keys: Sequence[str]) -> Dict[str, Any]:
    """What the user typed among the flags of `keys` (add_flags' return): dotted key → value."""
    return {k: getattr(args, k) for k in keys if hasattr(args, k)}


def renamed_keys(cls: type, data: Dict[str, Any], source: str = "", warn: Callable[[str], None] = None) -> Dict:
    """`data` (a role's TOML mapping) with old key spellings (Setting.old_keys) renamed, each said through `warn`."""
    warn = warn or (lambda text: print(text, file=sys.stderr))
    hints = _hints(cls)
    out = dict(data)
    for f in dataclasses.fields(cls):
        tp = _plain_type(hints.get(f.name, Any))
        if dataclasses.is_dataclass(tp):
            for g in dataclasses.fields(tp):  # a key that moved down into this table ("../old" in its old_keys)
                for old in (setting_of(g).old_keys if setting_of(g) else ()):
                    if old.startswith("../") and old[3:] in out:
                        table = out.setdefault(f.name, {})
                        if g.name in table:
                            raise ValueError(f"{source or 'config'}: both {old[3:]!r} (its old name) and "
                                             f"[{f.name}] {g.name!r} are given")
                        warn(f"{source or 'config'}: key {old[3:]!r} is deprecated: use [{f.name}] {g.name!r}")
                        table[g.name] = out.pop(old[3:])
            if isinstance(out.get(f.name), dict):
                out[f.name] = renamed_keys(tp, out[f.name], source, warn)
        s = setting_of(f)
        for old in (o for o in (s.old_keys if s else ()) if not o.startswith("../")):
            if old in out:
                if f.name in out:
                    raise ValueError(f"{source or 'config'}: both {old!r} (its old name) and {f.name!r} are given")
                warn(f"{source or 'config'}: key {old!r} is deprecated: use {f.name!r}")
                out[f.name] = out.pop(old)
    return out


def undocumented(cls: type) -> List[str]:
    """Dotted keys of `cls` that declare no Setting or an empty help (a test fails on any)."""
    return [key for key, f, _ in fields_of(cls) if setting_of(f) is None or not setting_of(f).help.strip()]


def key_rows(cls: type) -> Iterator[Tuple[str, str, str, str]]:
    """(dotted key, default, flag, meaning) of every key of `cls`: docs/CONFIG.md's tables."""
    for key, f, _ in fields_of(cls):
        s = setting_of(f)
        default = default_of(f)
        shown = "required" if default is MISSING else f"`{default!r}`"
        flag = "" if s is None or s.flag == "" else f"`{flag_of(key, s)}`"
        if flag and s.short:
            flag = f"`{s.short}`, {flag}"
        if flag and s.append:
            flag += " (repeatable)"
        if s is not None and s.const is not UNSET and flag:
            flag = f"{flag} (= `{s.const!r}`)"
        yield key, shown, flag, (s.help if s else "").replace("|", "\\|")
