"""The cloud and the device on a CUDA GPU (gpu-marked: skipped without CUDA; scripts/gpu_check.sh runs them on a lent
GPU machine). Tiny random models are enough here: each test compares a path with the same model run alone, in
float32, on the same GPU."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from cloud_runtime.runner import KvLayout, StageRunner
from hat_split.math.sampling import SamplingParams
from hat_split.models.adapter import Adapter
from hat_split.models.feature_drafter import FeatureDrafter
from hat_split.models.lm import CausalLM
from hat_split.models.partition import SplitModel
from tests.conftest import serving, tiny_model

CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (scripts/gpu_check.sh)")]


def test_greedy_protocols_on_cuda_equal_the_model_alone(pd_driven):
    """sd, hlm, llm (token protocols) and ushape, hat (split; hat with Λ, and with the feature drafter drafting
    sequentially and in parallel) on a CUDA cloud (slots + graphs: the defaults there) with the device's model on the
    same GPU: the target's own greedy tokens."""
    from tests.test_generation import PROMPT, _run
    from tests.test_hat import PROMPT as SPLIT_PROMPT
    from tests.test_hat import _run_split

    draft, target = CausalLM(tiny_model(1, 1).cuda()), CausalLM(tiny_model(2, 2).cuda())
    ref, split_ref = target.greedy(PROMPT, 24), target.greedy(SPLIT_PROMPT, 24)  # each helper's own prompt
    with serving(target, device="cuda") as server:
        runner = server.work.engine.executor.runner
        assert runner.slots is not None and runner.graphs.enabled
        for protocol in ("sd", "hlm", "llm"):
            assert _run(server, draft, protocol, SamplingParams(0.0))[0].tokens == ref, protocol
        adapter = Adapter(target.model, 1).eval().requires_grad_(False).cuda()
        for protocol in ("ushape", "hat"):
            res = _run_split(server, target.model, protocol, SamplingParams(0.0), n=24, chunk_tokens=3,
                             draft_stop_prob=0.0, draft_len=4, adapter=adapter if protocol == "hat" else None)
            assert res.tokens == split_ref, protocol
        feature = FeatureDrafter(target.model).eval().requires_grad_(False).cuda()
        for parallel in (False, True):  # the feature drafter (deep features off the wire onto the GPU), both ways
            res = _run_split(server, target.model, "hat", SamplingParams(0.0), n=24, chunk_tokens=3,
                             draft_stop_prob=0.0, draft_len=4, adapter=feature, parallel_draft=parallel, pd_topk=2)
            assert res.tokens == split_ref and res.drafted > 0, ("feature", parallel)
        assert runner.graphs.replays > 0 and not runner.graphs.failure, runner.graphs.report()


def test_draft_trees_on_captured_cuda_steps_equal_the_model_alone():
    """Draft trees (issue 47) on a CUDA cloud with slots and graphs: sd with a tree of the draft model, hat with Λ's
    trees and with the feature drafter's trees. Every tree verify is a decode step there (the cloud captures up to
    max_tree_nodes + 1 positions per session), so the trees' masks go through replayed graphs: the target's own
    greedy tokens, each round replayed, none run eagerly, no capture fallen back."""
    from tests.test_feature_drafter import _perturbed
    from tests.test_hat import PROMPT as SPLIT_PROMPT
    from tests.test_hat import _run_split
    from tests.test_tree_protocol import PROMPT, _run

    draft, target = CausalLM(tiny_model(1, 1).cuda()), CausalLM(tiny_model(2, 2).cuda())
    ref, split_ref = target.greedy(PROMPT, 24), target.greedy(SPLIT_PROMPT, 24)
    adapter = Adapter(target.model, 1).eval().requires_grad_(False).cuda()
    feature = _perturbed(SplitModel(target.model, 1), seed=9).requires_grad_(False).cuda()
    shape = dict(tree_nodes=14, tree_depth=5, tree_width=3)
    with serving(target, device="cuda", max_message_bytes=1 << 20) as server:
        runner = server.work.engine.executor.runner
        assert runner.slots is not None and runner.graphs.enabled
        assert runner.layout.decode_limit > shape["tree_nodes"], runner.layout  # a tree's verify is captured
        runs = [("sd", lambda: _run(server, draft, SamplingParams(0.0), n=24, **shape)[0], ref)]
        for name, drafter in (("hat", adapter), ("hat feature", feature)):
            runs.append((name, lambda d=drafter: _run_split(server, target.model, "hat", SamplingParams(0.0), n=24,
                                                            adapter=d, parallel_draft=False, **shape), split_ref))
        for name, run, want in runs:
            before = dict(runner.graphs.report())
            res = run()
            after = runner.graphs.report()
            assert res.tokens == want, name
            assert res.drafted > res.rounds, (name, res.drafted, res.rounds)  # trees, not single tokens
            assert after["replays"] - before["replays"] >= res.rounds, (name, before, after)
            assert after["eager"] == before["eager"] and not after["failure"], (name, after)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_graph_captured_steps_equal_eager_steps(family):
    """The script of prefill chunks, decodes, verifies, crops and closes (tests/test_slots.py): replayed CUDA graphs
    give the eager growing caches' outputs, float32."""
    from tests.test_hat import _family
    from tests.test_slots import _replay

    model = _family(family).cuda()
    base = _replay(StageRunner(model), model)
    runner = StageRunner(model, layout=KvLayout(slots=4, length=64, graphs=True, decode_limit=5, max_rows=4))
    outs = _replay(runner, model)
    for a, b in zip(base, outs):
        for x, y in zip(a, b):
            torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-4)
    assert runner.graphs.captures > 0 and runner.graphs.replays > 0


def tiny_model_dir(path: Path) -> Path:
    """A tiny random Llama with SmolLM2's vocabulary and tokenizer, saved as a Hugging Face directory (processes load
    it by path). The tokenizer: $HATSPEC_GPU_TOKENIZER (scripts/gpu_kit.sh carries it), else the local cache's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    source = Path(os.environ.get("HATSPEC_GPU_TOKENIZER", Path.home() / ".cache/hatspec/hf/smollm2-135m"))
    if not (source / "tokenizer.json").is_file():
        pytest.skip(f"no tokenizer at {source} (run scripts/gpu_kit.sh)")
    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(path)
    for f in source.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, path / f.name)
    return path


def test_cloud_and_device_processes_on_cuda_equal_the_model_alone(tmp_path):
    """`hat-cloud serve --device cuda` and `hat-edge generate` (device auto: the GPU) as processes over loopback:
    ushape, hat, sd, llm and auto (its rounds priced from a CUDA cloud's cost report) give the model's own greedy
    tokens (float32, the model alone on the GPU)."""
    import json

    from hat_split.models.loading import load_model
    from tests.test_hat import _split_across_processes

    loaded = load_model(tiny_model_dir(tmp_path / "tiny"), dtype="float32", device="cuda")
    loaded.name = str(tmp_path / "tiny")
    info = _split_across_processes(loaded, tmp_path, ["--device", "cuda"], ("ushape", "hat", "sd", "llm", "auto"))
    assert "device=cuda:0" in info and "graphs=on" in info, info
    auto = json.loads((tmp_path / "out.json").read_text())["results"][-1]["auto"]
    assert sum(s["tokens"] for s in auto) == 16 and any(s["reason"].startswith("predicted") for s in auto), auto


def test_two_pipeline_stages_need_two_gpus(tmp_path):
    """`--pipeline 2 --device cuda` on one GPU: refused in one line (NCCL needs one GPU per rank); on two or more GPUs
    the stages serve and a device process gets the model's tokens."""
    import subprocess
    import sys

    if torch.cuda.device_count() >= 2:
        from hat_split.models.loading import load_model
        from tests.test_hat import _split_across_processes

        loaded = load_model(tiny_model_dir(tmp_path / "tiny"), dtype="float32", device="cuda")
        loaded.name = str(tmp_path / "tiny")
        assert "pipeline=2" in _split_across_processes(loaded, tmp_path, ["--device", "cuda", "--pipeline", "2"])
        return
    r = subprocess.run([sys.executable, "-m", "cloud_runtime.cli", "serve", "--model", "unused", "--pipeline", "2",
                        "--device", "cuda", "--plaintext"], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    assert "NCCL needs one GPU per stage" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
