"""The cloud's config as a TOML file (`hat-cloud serve --config FILE`), and its handlers without torch."""
from __future__ import annotations

import subprocess
import sys

try:
    import tomllib
except ImportError:  # Python < 3.11 (a GPU machine's): the backport
    import tomli as tomllib

import pytest

from cloud_runtime.cli import build_parser, cloud_config
from cloud_runtime.config import CloudConfig
from hat_split.files.config_file import ConfigError, config_from_dict, dump_toml, load_config
from hat_split.net.security import LinkSecurity


def _config(argv):
    parser = build_parser()
    return cloud_config(parser, parser.parse_args(argv), argv)


def test_a_config_round_trips_through_toml():
    config = CloudConfig(model="qwen2.5-coder-1.5b", bind="tcp://0.0.0.0:6000", max_draft_len=8, pipeline=2,
                         security=LinkSecurity.plaintext())
    text = dump_toml(config)
    assert "[security]" in text
    assert config_from_dict(CloudConfig, tomllib.loads(text)) == config


def test_the_file_is_read_and_typed_flags_override_it(tmp_path):
    path = tmp_path / "cloud.toml"
    path.write_text('model = "smollm2-135m"\nmax_draft_len = 8\nsession_timeout_s = 30\n\n'
                    '[security]\nmode = "plaintext"\n')
    config = _config(["serve", "--config", str(path)])
    assert (config.model, config.max_draft_len, config.session_timeout_s) == ("smollm2-135m", 8, 30.0)
    assert config.security.mode == "plaintext" and config.bind == CloudConfig.bind  # defaults where the file is silent
    config = _config(["serve", "--config", str(path), "--max-draft-len", "4", "--session-timeout", "9"])
    assert (config.model, config.max_draft_len, config.session_timeout_s) == ("smollm2-135m", 4, 9.0)
    assert _config(["serve", "--model", "m", "--plaintext"]) == CloudConfig(model="m",
                                                                            security=LinkSecurity.plaintext())
    quotas = _config(["serve", "--config", str(path), "--kv-memory", "8GiB", "--device-sessions", "4",
                      "--device-kv-memory", "25%", "--device-prompt-tokens-per-min", "9000"])
    assert (quotas.kv_memory, quotas.device_sessions, quotas.device_kv_memory, quotas.device_in_flight,
            quotas.device_prompt_tokens_per_min) == ("8GiB", 4, "25%", 16, 9000)


@pytest.mark.parametrize("text, key", [
    ('model = "m"\nmax_draft_lenn = 4\n[security]\nmode = "plaintext"\n', "max_draft_lenn"),
    ('model = "m"\nmax_draft_len = "four"\n[security]\nmode = "plaintext"\n', "max_draft_len"),
    ('model = "m"\n[security]\nmode = "plaintext"\nallow = "x"\n', "security.allow"),
    ('model = "m"\nsession_timeout_s = 0\n[security]\nmode = "plaintext"\n', "session_timeout_s"),
    ('model = "m"\ntoken_budget = 8\n[security]\nmode = "plaintext"\n', "token_budget"),
    ('max_draft_len = 4\n[security]\nmode = "plaintext"\n', "model"),
])
def test_unknown_keys_and_bad_values_are_refused_with_the_key(tmp_path, text, key):
    path = tmp_path / "cloud.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=key):
        load_config(CloudConfig, path)


def test_serve_needs_a_model_from_a_flag_or_the_file(capsys):
    with pytest.raises(SystemExit):
        _config(["serve", "--plaintext"])
    assert "--model is required" in capsys.readouterr().err


def test_the_handlers_import_no_torch():
    code = ("import sys, cloud_runtime.handlers, cloud_runtime.sessions, hat_split.math.target_state; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
