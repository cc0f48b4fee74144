"""End to end on the real Qwen2.5-Coder pair: a `hat-cloud serve` process and a `hat-edge generate` process on loopback.

With temperature 0, `sd` and `hlm` must produce exactly the target's own greedy tokens (`llm`: the target decoding
alone in the cloud process, one token per forward). Each model is loaded once: the 1.5B target by the cloud process,
the 0.5B draft by each edge process.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import requires_real_pair

pytestmark = [pytest.mark.real_models, requires_real_pair]
DRAFT, TARGET = "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"
N_TOKENS = 16


@pytest.fixture(scope="module")
def cloud():
    from cloud_runtime.process import CloudProcess

    with CloudProcess(TARGET, extra_args=["--dtype", "float32"]) as proc:  # bf16 rounding differs by chunk shape
        yield proc


def _edge(tmp_path, cloud, prompts, *args):
    prompts_file = tmp_path / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    out = tmp_path / "edge.json"
    cmd = [sys.executable, "-m", "edge_runtime.cli", "generate", "--model", DRAFT, "--server", cloud.endpoint,
           "--prompts-file", str(prompts_file), "--json", str(out), "--plaintext", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())["results"], proc.stdout


@pytest.fixture(scope="module")
def greedy_runs(cloud, tmp_path_factory):
    from hat_split.prompt_sets import humaneval_prompts

    # one prompt: each request costs the 1.5B float32 target a 2.5-3.5 s prefill and 0.33 s a token on 2 cores (the
    # five protocols on two prompts took 76 s on AVX-512, about twice that on an AVX2-only machine)
    prompts = [p.to_json() for p in humaneval_prompts(1, offset=10)]
    results, stdout = _edge(tmp_path_factory.mktemp("greedy"), cloud, prompts, "--protocol", "llm,sd,hlm,uhlm,cuhlm",
                            "--max-new-tokens", str(N_TOKENS), "--temperature", "0", "--draft-len", "4")
    by = {}
    for r in results:
        by.setdefault(r["protocol"], {})[r["prompt_index"]] = r
    return by, stdout


@pytest.mark.parametrize("protocol", ["sd", "hlm"])
def test_greedy_hybrid_equals_target_greedy_on_real_pair(greedy_runs, protocol):
    by, _ = greedy_runs
    for i, ref in by["llm"].items():
        got = by[protocol][i]
        assert got["tokens"] == ref["tokens"], f"prompt {i}: {protocol} diverged from the target's greedy tokens"
        assert len(got["tokens"]) == N_TOKENS or got["finish_reason"] == "eos"


def test_real_pair_accepts_drafts_and_counts_bytes(greedy_runs):
    by, stdout = greedy_runs
    sd = list(by["sd"].values())
    drafted = sum(r["drafted"] for r in sd)
    accepted = sum(r["accepted"] for r in sd)
    assert drafted > 0 and 0.3 < accepted / drafted <= 1.0  # the coder pair agrees on most greedy tokens
    assert sum(r["rounds"] for r in sd) < sum(len(r["tokens"]) for r in sd)  # fewer round trips than tokens
    for r in by["hlm"].values():  # hlm: one dense float16 distribution (151,936 entries) per round
        assert r["up_bytes"] >= r["rounds"] * 151936 * 2
    for r in sd:  # greedy drafts are one-hot: tiny uplink
        assert r["up_bytes"] / len(r["tokens"]) < 500
    assert "===" in stdout and "tok/s" in stdout  # text was streamed


def test_uncertainty_protocols_skip_on_real_pair(greedy_runs):
    """uhlm / cuhlm finished with the cloud's sequence equal to the device's (checked at close) and skipped uploads."""
    by, _ = greedy_runs
    for proto in ("uhlm", "cuhlm"):
        rows = list(by[proto].values())
        assert all(len(r["tokens"]) == N_TOKENS or r["finish_reason"] == "eos" for r in rows)
        assert sum(r["skipped"] for r in rows) > 0  # the coder draft is confident on much of the text
    hlm_up = sum(r["up_bytes"] for r in by["hlm"].values())
    assert sum(r["up_bytes"] for r in by["cuhlm"].values()) < 0.05 * hlm_up


def test_sampled_sd_runs_on_real_pair(cloud, tmp_path):
    from hat_split.prompt_sets import humaneval_prompts

    prompts = [p.to_json() for p in humaneval_prompts(1, offset=20)]
    results, _ = _edge(tmp_path, cloud, prompts, "--protocol", "sd", "--max-new-tokens", "8", "--temperature", "0.8",
                       "--top-p", "0.95", "--seed", "5")
    r = results[0]
    assert len(r["tokens"]) == 8 or r["finish_reason"] == "eos"
    assert r["drafted"] > 0 and r["text"]


def test_draft_trees_across_processes_keep_the_targets_greedy_tokens(cloud, greedy_runs, tmp_path):
    """`sd` with a draft tree (issue 47): the cloud process verifies each tree in one masked forward and keeps its
    accepted path; the tokens are the target's greedy ones (the figures per round: hat-bench speculative --trees)."""
    from hat_split.prompt_sets import humaneval_prompts

    by, _ = greedy_runs
    prompts = [p.to_json() for p in humaneval_prompts(1, offset=10)]
    results, _ = _edge(tmp_path, cloud, prompts, "--protocol", "sd", "--max-new-tokens", str(N_TOKENS),
                       "--temperature", "0", "--tree-nodes", "12", "--tree-depth", "4", "--tree-width", "3")
    tree = results[0]
    assert tree["tokens"] == by["llm"][0]["tokens"]
    assert tree["drafted"] > tree["rounds"] * 4  # wider than a chain of the tree's depth
