"""One request object and one set of defaults (edge_runtime.request): `hat-edge generate`, the agent's
`/hatspec/generate` and its OpenAI endpoint build the same request from the same defaults, `hat-edge serve`'s sampling
flags become the agent's defaults (never dropped), bad requests are refused before anything runs, and what the CLIs
and results/ write is strict JSON."""
from __future__ import annotations

import io
import json
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np
import pytest

from edge_runtime import cli
from edge_runtime.request import DEFAULT_TEMPERATURE, GenerationRequest, RequestDefaults
from hat_split.files import strict_json

ROOT = Path(__file__).resolve().parents[1]
FLAGS = ["--protocol", "llm", "--temperature", "0.7", "--top-k", "5", "--seed", "11", "--max-new-tokens", "3"]


def _parsed(argv):
    parser = cli.build_parser()
    return parser, parser.parse_args(argv)


def test_one_default_temperature_everywhere():
    """OpenAI's 1.0: the request's own default, the defaults', the CLI flag's, the agent's and the OpenAI parse's."""
    from edge_runtime.api import openai_api as O
    from edge_runtime.api.agent import AgentConfig
    from edge_runtime.config import EdgeConfig

    assert DEFAULT_TEMPERATURE == 1.0
    assert GenerationRequest("x").sampling.temperature == RequestDefaults().temperature == 1.0
    _, args = _parsed(["generate", "--model", "m", "x"])
    assert cli._request_defaults(args, "sd") == RequestDefaults()
    assert AgentConfig(EdgeConfig(model="m")).request == RequestDefaults()
    assert O.parse_request({"prompt": "x"}, False, ("sd",), RequestDefaults()).temperature == 1.0


def test_serve_flags_become_the_agents_request_defaults(tmp_path):
    """The flags `hat-edge serve` used to accept and drop: they set AgentConfig.request, also over a --config file."""
    want = RequestDefaults("llm", 0.7, 1.0, 5, 3, 11)
    argv = ["serve", "--model", "m", "--plaintext", *FLAGS]
    parser, args = _parsed(argv)
    assert cli._configs(parser, args, argv).request == want
    (tmp_path / "agent.toml").write_text('[request]\ntemperature = 0.2\ntop_p = 0.9\n\n[edge]\nmodel = "m"\n\n'
                                         '[edge.link.security]\nmode = "plaintext"\n')
    argv = ["serve", "--config", str(tmp_path / "agent.toml"), "--temperature", "0.7"]
    parser, args = _parsed(argv)
    got = cli._configs(parser, args, argv).request
    assert (got.temperature, got.top_p, got.top_k) == (0.7, 0.9, 0)  # the typed flag wins, the file's others stay


def test_serve_refuses_chat_rather_than_dropping_it(capsys):
    assert cli.main(["serve", "--model", "m", "--plaintext", "--chat"]) == 2
    assert "--chat is hat-edge generate's" in capsys.readouterr().err


@pytest.mark.parametrize("flag,value,says", [("--temperature", "-1", "--temperature must be finite and >= 0"),
                                             ("--max-new-tokens", "0", "--max-new-tokens must be an integer"),
                                             ("--seed", "-3", "--seed must be an integer in [0, 2**63)"),
                                             ("--top-p", "0", "--top-p")])
def test_bad_sampling_flags_are_refused_by_name(capsys, flag, value, says):
    assert cli.main(["generate", "--model", "m", "--plaintext", flag, value, "x"]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err, err


def test_bad_requests_are_refused_before_anything_runs():
    for kwargs, says in [(dict(prompt=""), "the prompt is empty"), (dict(prompt=()), "the prompt is empty"),
                         (dict(prompt="x", protocol="telepathy"), "unknown protocol"),
                         (dict(prompt="x", max_new_tokens=0), "max_new_tokens must be an integer"),
                         (dict(prompt="x", max_new_tokens=True), "max_new_tokens must be an integer"),
                         (dict(prompt="x", seed=2**63), "seed must be an integer"),
                         (dict(prompt="x", logprobs=99), "logprobs must be an integer")]:
        with pytest.raises(ValueError, match=says):
            GenerationRequest(**kwargs)
    assert GenerationRequest([3, 4]).prompt == (3, 4)  # token ids kept as a tuple: the request is frozen whole
    assert GenerationRequest("x", seed=5).seeded().seed == 5
    assert 0 <= GenerationRequest("x").seeded().seed < 2**62


def test_cli_json_is_strict_where_a_ratio_has_nothing_to_divide(tmp_path):
    """`hat-edge generate --json -` of a protocol that drafts nothing (slm): the acceptance figures are null, and the
    document parses with a parser that refuses NaN (JavaScript's, jq's)."""
    from tests.bigram_checkpoint import save_bigram

    table = np.full((4, 4), 0.25)
    model = save_bigram(tmp_path / "bigram", table)
    out = io.StringIO()
    with redirect_stdout(out):
        rc = cli.main(["generate", "--model", str(model), "--protocol", "slm", "--max-new-tokens", "3", "--json", "-",
                       "--quiet", "--plaintext", "--dtype", "float32", "w1"])
    assert rc == 0
    doc = strict_json.loads(out.getvalue())
    (result,) = doc["results"]
    assert result["acceptance_rate"] is None and result["accepted_per_round"] is None and result["alpha"] is None
    assert result["n_tokens"] == 3


def test_strict_json_writes_null_for_what_is_not_finite():
    text = strict_json.dumps({"a": float("nan"), "b": [float("inf"), np.float32(2.5)], "c": np.array([1.0, np.nan])})
    assert strict_json.loads(text) == {"a": None, "b": [None, 2.5], "c": [1.0, None]}
    with pytest.raises(ValueError, match="NaN is not JSON"):
        strict_json.loads('{"a": NaN}')
    with pytest.raises(ValueError):
        json.dumps(float("nan"), allow_nan=False)  # what strict_json guards against


def test_every_results_file_is_strict_json():
    bad = []
    for path in sorted((ROOT / "results").rglob("*.json*")):
        lines = path.read_text().splitlines() if path.suffix == ".jsonl" else [path.read_text()]
        for i, line in enumerate(lines):
            if line.strip():
                try:
                    strict_json.loads(line)
                except ValueError as exc:
                    bad.append(f"{path.relative_to(ROOT)}:{i + 1}: {exc}")
    assert not bad, bad[:5]
