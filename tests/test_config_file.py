"""Every role's config as a TOML file (hat_split.files.config_file, docs/CONFIG.md): a round trip of each, unknown keys,
wrong types and bad values refused with the key and the file named, flags typed on a command line over the file's
keys, and the doc listing every key.

The configs are built with their required arguments and then every simple field that validates is moved off its
default, so the tests follow the configs as fields are added, nested or renamed.

    python -m tests.test_config_file    prints docs/CONFIG.md's key tables from the configs' field comments
"""
from __future__ import annotations

import dataclasses
import inspect
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

from cloud_runtime.config import CloudConfig
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


def field_docs(cls: type) -> Dict[str, str]:
    """Each field's trailing comment (with its continuation lines) from the class source: its unit and why."""
    lines, _ = inspect.getsourcelines(cls)
    out: Dict[str, str] = {}
    last = None
    for line in lines:
        m = re.match(r"\s+(\w+): [^#]*?(?:#\s*(.*))?$", line)
        if m and not line.strip().startswith(("def ", "@", "#")):
            last = m[1]
            out[last] = (m[2] or "").strip()
        elif last and re.match(r"\s+#\s", line):
            out[last] += " " + line.strip()[1:].strip()
        elif line.strip():
            last = None
    return out


def tables() -> str:
    """docs/CONFIG.md's key tables: one per role, every key with its default and its comment."""
    out = []
    for role, (cls, _) in ROLES.items():
        out.append(f"### {role}: `{cls.__module__}.{cls.__name__}`\n\n| key | default | unit, meaning |\n|---|---|---|")
        out += [f"| `{key}` | {default} | {doc} |" for key, default, doc in _rows(cls)]
        out.append("")
    return "\n".join(out)


def _rows(cls: type, prefix: str = "") -> Iterator[Tuple[str, str, str]]:
    """(dotted key, default, comment) of every key of `cls`; a nested config's keys in its table."""
    docs, hints = field_docs(cls), _hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _rows(hints[f.name], f"{prefix}{f.name}.")
            continue
        default = "required" if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING \
            else f"`{f.default if f.default is not dataclasses.MISSING else f.default_factory()!r}`"
        yield prefix + f.name, default, docs.get(f.name, "").replace("|", "\\|")


def test_the_doc_lists_every_key_of_every_role():
    text = DOC.read_text()
    for role, (cls, required) in ROLES.items():
        missing = [key for key, _ in keys(cls) if f"`{key}`" not in text]
        assert not missing, f"docs/CONFIG.md lacks {role}'s keys {missing}: `python -m tests.test_config_file`"
        assert f"{cls.__module__}.{cls.__name__}" in text


def test_the_doc_examples_load():
    """Each ```toml block of docs/CONFIG.md starts with `# ROLE.toml` and is a valid config of that role."""
    blocks = re.findall(r"```toml\n# (\w+)\.toml[^\n]*\n(.*?)```", DOC.read_text(), re.S)
    assert sorted(role for role, _ in blocks) == sorted(ROLES)
    for role, text in blocks:
        config_from_dict(ROLES[role][0], tomllib.loads(text), source=f"docs/CONFIG.md ({role})")


def test_every_field_says_its_unit_or_meaning():
    for role in ("export", "link", "flash"):
        silent = [key for key, _, doc in _rows(ROLES[role][0]) if not doc]
        assert not silent, f"{role}: no comment on {silent}"


if __name__ == "__main__":
    print(tables())
