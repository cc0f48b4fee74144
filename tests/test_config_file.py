"""Every role's config as a TOML file (hat_split.files.config_file, docs/CONFIG.md): a round trip of each, unknown keys,
wrong types and bad values refused with the key and the file named, flags typed on a command line over the file's
keys, and the doc listing every key.

The configs are built with their required arguments and then every simple field that validates is moved off its
default, so the tests follow the configs as fields are added, nested or renamed.

    python -m tests.test_config_file    prints docs/CONFIG.md's key tables from the configs' declarations
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import typing
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

try:
    import tomllib
except ImportError:  # Python < 3.11 (a GPU machine's): the backport
    import tomli as tomllib

import pytest
import yaml

from cloud_runtime import cli as cloud_cli
from cloud_runtime.config import CloudConfig
from edge_runtime import cli as edge_cli
from edge_runtime.api.agent import AgentConfig
from edge_runtime.config import EdgeConfig
from export import cli as export_cli
from export.config import ExportConfig, TensorRTConfig
from export.deploy import flash_cli, fleet
from export.deploy.flash import FlashConfig
from export.validate import THRESHOLDS
from hat_split.files import bundle
from hat_split.net.security import LinkSecurity
from hat_split.files.config_file import ConfigError, config_from_dict, config_to_dict, dump_toml, load_config
from hat_split.files.settings import fields_of, key_rows, setting, undocumented
from testbed import link_cli
from testbed.link_cli import LinkEmulatorConfig

DOC = Path(__file__).resolve().parents[1] / "docs" / "CONFIG.md"

# role -> (config class, its required arguments)
ROLES: Dict[str, Tuple[type, Dict[str, Any]]] = {
    "edge": (EdgeConfig, {"model": "smollm2-135m"}),
    "agent": (AgentConfig, {"edge": EdgeConfig(model="smollm2-135m")}),
    "cloud": (CloudConfig, {"model": "qwen2.5-coder-1.5b", "security": LinkSecurity.plaintext()}),
    "export": (ExportConfig, {"model": "smollm2-135m", "out": "bundles/smollm2"}),
    "link": (LinkEmulatorConfig, {"upstream": "127.0.0.1:5555"}),
    "flash": (FlashConfig, {"bundle": "bundles/smollm2", "devices": ("root@10.0.0.7:2222:/opt/hatspec/bundle",)}),
}


def _hints(cls: type) -> Dict[str, Any]:
    return typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))


def _moved(value: Any, tp: Any) -> List[Any]:
    """Candidate non-default values of a simple field."""
    if tp is bool:
        return [not value]
    if tp is int and isinstance(value, int):
        return [value + 1, value * 2 + 3]
    if tp is float and isinstance(value, float):
        return [value * 0.5 + 0.25, value + 1.0]
    if tp is str and isinstance(value, str) and value == "":
        return ["somewhere.toml"]
    return []


def varied(config: Any) -> Any:
    """`config` with every simple field (bool, int, float, an empty string) moved off its default where the config
    still validates, nested configs too."""
    hints = _hints(type(config))
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            candidates = [varied(value)]
        else:
            candidates = _moved(value, hints[f.name])
        for candidate in candidates:
            try:
                config = dataclasses.replace(config, **{f.name: candidate})
                break
            except (ValueError, TypeError):
                continue
    return config


def build(role: str) -> Any:
    cls, required = ROLES[role]
    return varied(cls(**required))


def keys(cls: type, prefix: str = "") -> Iterator[Tuple[str, Any]]:
    """(dotted key, annotation) of every key a config file of `cls` may hold."""
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from keys(tp, f"{prefix}{f.name}.")
        else:
            yield prefix + f.name, tp


@pytest.mark.parametrize("role", ROLES)
def test_every_role_round_trips_through_toml(role):
    config = build(role)
    assert config != ROLES[role][0](**ROLES[role][1])  # something moved off its default
    text = dump_toml(config)
    assert config_from_dict(type(config), tomllib.loads(text)) == config, text


@pytest.mark.parametrize("role", ROLES)
def test_unknown_keys_and_wrong_types_are_refused_by_name(role, tmp_path):
    config = build(role)
    path = tmp_path / f"{role}.toml"
    data = config_to_dict(config)
    data["draft_lenght"] = 4
    with pytest.raises(ConfigError, match=rf"unknown key 'draft_lenght' in {re.escape(str(path))}"):
        config_from_dict(type(config), data, source=str(path))
    tables = [k for k, v in data.items() if isinstance(v, dict) and dataclasses.is_dataclass(getattr(config, k))]
    for table in tables:
        data = config_to_dict(config)
        data[table]["no_such_key"] = 1
        with pytest.raises(ConfigError, match=rf"unknown key '{table}\.no_such_key'"):
            config_from_dict(type(config), data, source=str(path))
    for key, tp in keys(type(config)):
        wrong = {int: "four", float: "fast", bool: "yes", str: 12}.get(tp)
        if wrong is None:
            continue
        path.write_text(dump_toml(config))
        with pytest.raises(ConfigError, match=rf"'{re.escape(key)}' in {re.escape(str(path))} must be"):
            load_config(type(config), path, {key: wrong})


@pytest.mark.parametrize("role", ROLES)
def test_bad_values_are_reported_with_the_file(role, tmp_path):
    """Negative numbers where the config refuses them: __post_init__'s reason, with the file named."""
    config = build(role)
    path = tmp_path / f"{role}.toml"
    path.write_text(dump_toml(config))
    numbers = [(key, tp) for key, tp in keys(type(config)) if tp in (int, float)]
    if not numbers:
        pytest.skip(f"{role}'s config has no numbers (its bad values: test_a_bad_value_names_the_file...)")
    refused = []
    for key, tp in numbers:
        try:
            load_config(type(config), path, {key: -7 if tp is int else -7.5})
        except ConfigError as exc:
            refused.append(key)
            assert str(path) in str(exc), exc
    assert refused, f"no negative value was refused in {role}'s config"


def test_a_bad_value_names_the_file_and_keeps_the_reason(tmp_path):
    path = tmp_path / "export.toml"
    path.write_text('model = "smollm2-135m"\nout = "b"\nprecisions = ["fp32", "fp8"]\n[tensorrt]\nmax_chunk = 64\n')
    with pytest.raises(ConfigError, match=rf"{re.escape(str(path))}: unknown precision\(s\) fp8 in precisions"):
        load_config(ExportConfig, path)
    path.write_text('model = "m"\nout = "b"\n[tensorrt]\nprecisions = ["int4"]\n')
    with pytest.raises(ConfigError, match=r"\[tensorrt\]: unknown precision\(s\) int4.*cannot parse"):
        load_config(ExportConfig, path)
    path.write_text('bundle = "b"\ndevices = ["two words"]\n')
    with pytest.raises(ConfigError, match=rf"{re.escape(str(path))}: bad device 'two words'"):
        load_config(FlashConfig, path)
    path.write_text('upstream = "127.0.0.1"\n')
    with pytest.raises(ConfigError, match="upstream: expected HOST:PORT"):
        load_config(LinkEmulatorConfig, path)


def test_a_fleet_inventory_names_one_config_file_per_host(tmp_path):
    """hatspec_config: `--config FILE` on that host's command, and only the variables the inventory sets as flags (the
    fleet's defaults would otherwise override the file); what the file holds may be left out of the inventory."""
    inventory = {"all": {"children": {
        "cloud": {"hosts": {"gpu": {"ansible_host": "10.0.0.1", "hatspec_config": "/etc/hatspec/cloud.toml"}}},
        "edge": {"hosts": {
            "orin-1": {"ansible_host": "10.0.0.11", "hatspec_config": "/opt/hatspec/agent.toml",
                       "hatspec_protocol": "hat"},
            "orin-2": {"ansible_host": "10.0.0.12", "hatspec_plaintext": True, "hatspec_server": "tcp://10.0.0.1:5555",
                       "hatspec_model": "smollm2-135m"}}}}}}
    path = tmp_path / "inventory.yml"
    path.write_text(yaml.safe_dump(inventory))
    inv = fleet.load_inventory(str(path))
    cloud = fleet.cloud_argv(inv.cloud)
    assert cloud[4:6] == ["--config", "/etc/hatspec/cloud.toml"] and "--bind" not in cloud and "--model" not in cloud
    with_file, without = (fleet.edge_argv(d) for d in inv.devices)
    assert with_file[4:6] == ["--config", "/opt/hatspec/agent.toml"]
    assert with_file[with_file.index("--protocol") + 1] == "hat"
    assert not {"--port", "--report-interval", "--server", "--model", "--plaintext"} & set(with_file)
    assert without[without.index("--port") + 1] == "8642" and "--config" not in without


def test_bundle_precisions_are_the_validated_ones():
    assert tuple(THRESHOLDS) == bundle.PRECISIONS


def test_hat_link_flags_typed_override_the_file(tmp_path):
    path = tmp_path / "link.toml"
    path.write_text('upstream = "10.0.0.1:5555"\nprofile = "lte"\nlisten = "0.0.0.0:5601"\nstats_interval_s = 2.0\n'
                    'seed = 3\n')
    parser = link_cli._serve_parser()
    argv = ["--config", str(path), "--profile", "wifi-far", "--listen", "127.0.0.1:5601"]
    config = link_cli.link_config(parser, parser.parse_args(argv), argv)
    # typed: profile, listen (even at the flag's default value); from the file: the rest, not the flags' defaults
    assert config == LinkEmulatorConfig(upstream="10.0.0.1:5555", profile="wifi-far", listen="127.0.0.1:5601",
                                stats_interval_s=2.0, seed=3)
    argv = ["--upstream", "10.0.0.2:5555", "--control", "127.0.0.1:0"]
    assert link_cli.link_config(parser, parser.parse_args(argv), argv) == LinkEmulatorConfig(
        upstream="10.0.0.2:5555", control="127.0.0.1:0")


def test_hat_export_flags_typed_override_the_file_and_its_tables(tmp_path):
    path = tmp_path / "export.toml"
    path.write_text(dump_toml(ExportConfig(model="smollm2-135m", out="b", parts="hat", m=3, adapter="lambda",
                                           precisions=("fp32", "int4"), tensorrt=TensorRTConfig(max_chunk=128))))
    parser = export_cli._parser()
    argv = ["onnx", "--config", str(path), "--m", "2", "--precision", "fp16"]
    config = export_cli.export_config(parser, parser.parse_args(argv), argv)
    assert (config.m, config.precisions, config.parts, config.adapter) == (2, ("fp16",), "hat", "lambda")
    argv = ["tensorrt", "other-bundle", "--config", str(path), "--max-context", "4096"]
    config = export_cli.export_config(parser, parser.parse_args(argv), argv)
    assert (config.out, config.tensorrt.max_context, config.tensorrt.max_chunk) == ("other-bundle", 4096, 128)
    argv = ["tensorrt", "b", "--model", "smollm2-135m", "--max-chunk", "64"]
    config = export_cli.export_config(parser, parser.parse_args(argv), argv)
    assert config.tensorrt.max_chunk == 64 and config.tensorrt.precisions == ("fp16",)
    assert export_cli.main(["onnx", "--config", str(tmp_path / "missing.toml")]) == 2


def test_hat_flash_reads_its_config_and_flags_replace_its_keys(tmp_path, capsys):
    path = tmp_path / "flash.toml"
    path.write_text(dump_toml(FlashConfig(bundle=str(tmp_path / "no-bundle"), devices=("root@10.9.9.9",),
                                          identity="key", ssh_options=("ConnectTimeout=1",))))
    parser = flash_cli._parser()
    argv = ["--config", str(path), "-o", "LogLevel=ERROR"]
    config = flash_cli.flash_config(parser, parser.parse_args(argv), argv)
    assert config.ssh_options == ("LogLevel=ERROR",) and config.identity == "key"
    target = config.targets()[0]
    assert target.ssh("true")[:3] == ["ssh", "-o", "BatchMode=yes"] and ["-i", "key"] == \
        target.ssh("true")[target.ssh("true").index("-i"):][:2]
    assert flash_cli.main(["--config", str(path)]) == 2  # the bundle is checked before anything is sent
    assert "no-bundle is not a bundle" in capsys.readouterr().err


def tables() -> str:
    """docs/CONFIG.md's key tables: one per role, every key with its default, its flag and its meaning, all from the
    fields' own declarations (hat_split.files.settings)."""
    out = []
    for role, (cls, _) in ROLES.items():
        out.append(f"### {role}: `{cls.__module__}.{cls.__name__}`\n\n| key | default | flag | unit, meaning |\n"
                   f"|---|---|---|---|")
        out += [f"| `{key}` | {default} | {flag} | {doc} |" for key, default, flag, doc in key_rows(cls)]
        out.append("")
    return "\n".join(out)


def test_the_doc_tables_are_the_configs_own():
    """docs/CONFIG.md's tables are exactly what the declarations give (`python -m tests.test_config_file`)."""
    assert tables() in DOC.read_text(), "docs/CONFIG.md's key tables are stale: `python -m tests.test_config_file`"


def test_every_field_declares_its_meaning():
    for role, (cls, _) in ROLES.items():
        assert undocumented(cls) == [], f"{role}: no help declared for {undocumented(cls)}"


def test_a_planted_undocumented_field_is_caught():
    planted = dataclasses.make_dataclass("Planted", [("ok", int, setting(1, "a number")), ("silent", int, 2),
                                                     ("blank", int, setting(3, " "))], frozen=True)
    assert undocumented(planted) == ["silent", "blank"]


# command line → (its parser, the config it builds, keys it leaves out on purpose, why)
COMMAND_LINES = {
    "hat-edge generate": (lambda: _sub(edge_cli.build_parser(), "generate"), EdgeConfig, edge_cli.NOT_ON_THE_DEVICE),
    "hat-edge serve": (lambda: _sub(edge_cli.build_parser(), "serve"), AgentConfig,
                       tuple("edge." + k for k in edge_cli.NOT_ON_THE_DEVICE)),
    "hat-cloud serve": (lambda: _sub(cloud_cli.build_parser(), "serve"), CloudConfig, cloud_cli.NOT_IN_THE_CLOUD),
    "hat-export onnx": (lambda: _sub(export_cli._parser(), "onnx"), ExportConfig,
                        tuple(k for k, _, _ in fields_of(ExportConfig) if k.startswith("tensorrt."))),
    "hat-export tensorrt": (lambda: _sub(export_cli._parser(), "tensorrt"), ExportConfig,  # its positional: `out`
                            tuple(k for k, _, _ in fields_of(ExportConfig)
                                  if not k.startswith("tensorrt.") and k not in export_cli.TENSORRT_KEYS)),
    "hat-link serve": (link_cli._serve_parser, LinkEmulatorConfig, ()),
    "hat-flash": (flash_cli._parser, FlashConfig, ("bundle", "devices")),  # its positionals
}


def _sub(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices[name]


@pytest.mark.parametrize("command", sorted(COMMAND_LINES))
def test_every_field_has_exactly_one_flag_and_the_doc_names_it(command):
    make, cls, left_out = COMMAND_LINES[command]
    parser, text = make(), DOC.read_text()
    shown = {}  # dest → the flags that set it and are listed in --help (deprecated spellings are not)
    for action in parser._actions:
        if action.help != argparse.SUPPRESS and action.option_strings:
            shown.setdefault(action.dest, []).append(action.option_strings[0])
    for key, _, _ in fields_of(cls):
        if key in left_out:
            assert key not in shown, f"{command}: {key} is left out, yet has {shown[key]}"
            continue
        assert len(shown.get(key, [])) == 1, f"{command}: {key} has flags {shown.get(key)}"
        assert f"`{shown[key][0]}`" in text, f"docs/CONFIG.md does not name {command}'s {shown[key][0]}"


def test_old_flag_spellings_work_and_name_the_new_one(capsys):
    argv = ["generate", "--model", "m", "--plaintext", "--hat-eta", "0.2", "--max-draft", "5", "--retries", "2",
            "--eta", "0.01", "--engine", "torch", "x"]
    parser = edge_cli.build_parser()
    config = edge_cli._configs(parser, parser.parse_args(argv), argv)
    assert (config.split.draft_stop_prob, config.split.draft_len, config.link.connect_retries, config.qs.eta) == \
        (0.2, 5, 2, 0.01)
    err = capsys.readouterr().err
    for old, new in [("--hat-eta", "--hat-draft-stop-prob"), ("--max-draft", "--hat-draft-len"),
                     ("--retries", "--connect-retries"), ("--eta", "--csqs-eta"), ("--engine", "--backend")]:
        assert f"{old} is deprecated: use {new}" in err, err


def test_old_key_spellings_are_read_and_named(tmp_path, capsys):
    path = tmp_path / "edge.toml"
    path.write_text('model = "m"\n[split]\neta = 0.3\nmax_draft = 6\n')
    config = load_config(EdgeConfig, path)
    assert (config.split.draft_stop_prob, config.split.draft_len) == (0.3, 6)
    err = capsys.readouterr().err
    assert "key 'eta' is deprecated: use 'draft_stop_prob'" in err and "'max_draft' is deprecated" in err
    path.write_text('model = "m"\n[split]\neta = 0.3\ndraft_stop_prob = 0.4\n')
    with pytest.raises(ConfigError, match="both 'eta'"):
        load_config(EdgeConfig, path)
    path = tmp_path / "agent.toml"  # a key that moved into a table of its own
    path.write_text('default_protocol = "llm"\n[edge]\nmodel = "m"\n')
    assert load_config(AgentConfig, path).request.protocol == "llm"
    assert "key 'default_protocol' is deprecated: use [request] 'protocol'" in capsys.readouterr().err


def test_the_doc_examples_load():
    """Each ```toml block of docs/CONFIG.md starts with `# ROLE.toml` and is a valid config of that role."""
    blocks = re.findall(r"```toml\n# (\w+)\.toml[^\n]*\n(.*?)```", DOC.read_text(), re.S)
    assert sorted(role for role, _ in blocks) == sorted(ROLES)
    for role, text in blocks:
        config_from_dict(ROLES[role][0], tomllib.loads(text), source=f"docs/CONFIG.md ({role})")


if __name__ == "__main__":
    print(tables())
