"""hat_split.files.settings on toy configs: a field's one declaration gives its flag, what a command line typed lands
under the field's dotted key (and nothing else does), bools take --x / --no-x, tuples a comma-separated list or one
flag per item, old flag and key spellings work and name the new one, and a field without a meaning is caught."""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Optional, Tuple

import pytest

from hat_split.files.config_file import ConfigError, config_from_dict, config_from_flags, dump_toml
from hat_split.files.settings import add_flags, key_rows, overrides, setting, undocumented


@dataclass(frozen=True)
class Link:
    timeout_s: float = setting(2.0, "s a reply may take", aliases=("--wait",))
    retries: int = setting(3, "attempts before giving up", old_keys=("tries",))


@dataclass(frozen=True)
class Toy:
    name: str = setting(help="what the toy is called")
    verbose: bool = setting(False, "say more")
    sizes: Tuple[int, ...] = setting((1, 2), "bytes of each block")
    options: Tuple[str, ...] = setting((), "ssh -o options", flag="--option", short="-o", append=True)
    mode: str = setting("safe", "run without the checks", flag="--fast", const="fast")
    level: str = setting("low", "how hard", choices=("low", "high"), flag="--effort")
    seed: Optional[int] = setting(None, "seed; None: a fresh one")
    secret: str = setting("", "a key of the file only", flag="")
    link: Link = setting(help="the link", factory=Link)


def parse(argv, cls=Toy, **kwargs):
    parser = argparse.ArgumentParser(prog="toy")
    keys = add_flags(parser, cls, **kwargs)
    return parser, overrides(parser.parse_args(argv), keys)


def test_a_typed_flag_lands_under_its_dotted_key_and_an_untyped_one_does_not():
    _, typed = parse(["--timeout", "0.5", "--name", "t", "--seed", "7"])
    assert typed == {"link.timeout_s": 0.5, "name": "t", "seed": 7}
    _, typed = parse(["--retries", "3"])  # typed at its default value: still typed, so it wins over a file
    assert typed == {"link.retries": 3}
    _, typed = parse([])
    assert typed == {}


def test_flag_names_follow_the_rule_and_a_file_only_key_has_none():
    parser, _ = parse([])
    flags = {s for a in parser._actions for s in a.option_strings}
    assert {"--name", "--timeout", "--retries", "--sizes", "--effort", "--fast", "-o", "--option"} <= flags
    assert not {"--timeout-s", "--secret", "--level", "--mode", "--options"} & flags
    with pytest.raises(SystemExit):
        parse(["--secret", "x"])


def test_prefix_and_skip():
    parser = argparse.ArgumentParser(prog="toy")
    keys = add_flags(parser, Toy, prefix="request.", skip=("name", "link.retries"))
    assert "request.link.timeout_s" in keys and "request.name" not in keys and "request.link.retries" not in keys
    assert overrides(parser.parse_args(["--timeout", "1"]), keys) == {"request.link.timeout_s": 1.0}
    with pytest.raises(SystemExit):
        parser.parse_args(["--name", "t"])


def test_a_bool_takes_x_and_no_x():
    assert parse(["--verbose"])[1] == {"verbose": True}
    assert parse(["--no-verbose"])[1] == {"verbose": False}
    assert parse(["--verbose", "--no-verbose"])[1] == {"verbose": False}  # the last one wins
    with pytest.raises(SystemExit):
        parse(["--verbose", "yes"])


def test_a_tuple_takes_a_comma_separated_list(capsys):
    assert parse(["--sizes", "4, 5,,6"])[1] == {"sizes": (4, 5, 6)}
    with pytest.raises(SystemExit):
        parse(["--sizes", "4,five"])
    assert "comma-separated list" in capsys.readouterr().err


def test_an_append_tuple_takes_one_item_a_flag_commas_kept():
    assert parse(["-o", "Ciphers=a,b", "--option", "LogLevel=ERROR"])[1] == {"options": ["Ciphers=a,b",
                                                                                         "LogLevel=ERROR"]}
    assert "options" not in parse([])[1]
    config = config_from_flags(Toy, None, parse(["--name", "t", "-o", "A", "-o", "B"])[1])
    assert config.options == ("A", "B")


def test_typed_flags_go_on_top_of_the_file_or_of_the_defaults(tmp_path):
    path = tmp_path / "toy.toml"
    path.write_text(dump_toml(Toy(name="file", options=("X",), link=Link(retries=9))))
    config = config_from_flags(Toy, path, parse(["--timeout", "4", "-o", "Y"])[1])
    assert (config.name, config.options, config.link.retries, config.link.timeout_s) == ("file", ("Y",), 9, 4.0)
    assert config_from_flags(Toy, "", parse(["--name", "flags"])[1]) == Toy(name="flags")
    with pytest.raises(ConfigError, match="missing key 'name'"):
        config_from_flags(Toy, "", parse([])[1])


def test_a_deprecated_alias_works_and_names_the_new_flag(capsys):
    _, typed = parse(["--wait", "1.5"])
    assert typed == {"link.timeout_s": 1.5}
    assert "toy: --wait is deprecated: use --timeout" in capsys.readouterr().err
    parse(["--timeout", "1.5"])
    assert "deprecated" not in capsys.readouterr().err


def test_a_const_flag_sets_its_key_without_a_value():
    assert parse(["--fast"])[1] == {"mode": "fast"}
    with pytest.raises(SystemExit):
        parse(["--fast", "slow"])
    parser, _ = parse([])
    (action,) = [a for a in parser._actions if "--fast" in a.option_strings]
    assert action.help == "mode = 'fast' (run without the checks)"


def test_choices_are_enforced():
    assert parse(["--effort", "high"])[1] == {"level": "high"}
    with pytest.raises(SystemExit):
        parse(["--effort", "max"])


def test_an_old_key_is_read_as_the_new_one_and_both_are_refused(capsys):
    config = config_from_dict(Toy, {"name": "t", "link": {"tries": 5}}, source="toy.toml")
    assert config.link.retries == 5
    assert "toy.toml: key 'tries' is deprecated: use 'retries'" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="both 'tries' \\(its old name\\) and 'retries'"):
        config_from_dict(Toy, {"name": "t", "link": {"tries": 5, "retries": 6}}, source="toy.toml")


def test_undocumented_reports_a_field_without_help():
    assert undocumented(Toy) == []
    planted = dataclasses.make_dataclass("Planted", [("ok", int, setting(1, "a number")), ("bare", int, 2),
                                                     ("blank", str, setting("", "  ")),
                                                     ("link", Link, setting(factory=Link))], frozen=True)
    assert undocumented(planted) == ["bare", "blank"]  # a nested config's own help is not a key's


def test_key_rows_give_the_docs_each_key_its_flag():
    rows = {key: (default, flag, meaning) for key, default, flag, meaning in key_rows(Toy)}
    assert rows["name"] == ("required", "`--name`", "what the toy is called")
    assert rows["link.timeout_s"] == ("`2.0`", "`--timeout`", "s a reply may take")
    assert rows["options"][1] == "`-o`, `--option` (repeatable)"
    assert rows["mode"][1] == "`--fast` (= `'fast'`)"
    assert rows["secret"][1] == ""
