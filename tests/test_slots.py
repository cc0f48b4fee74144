"""The cloud's placement and static KV layout on the CPU: slot steps equal growing caches, bucketed (padded) steps
equal unpadded ones, device names and refusals; what only CUDA can run is in tests/test_gpu.py."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from cloud_runtime.buckets import Buckets, bucket, exact_shape, pad_step, powers_of_two
from cloud_runtime.config import CloudConfig
from cloud_runtime.runner import CLOSE, CROP, KEEP, Job, KvLayout, ModelEnds, StageRunner, kv_layout
from hat_split.models.graphs import StepGraphs
from hat_split.models.placement import check_device, resolve_device
from tests.conftest import tiny_model


# -- buckets (plain Python) ---------------------------------------------------------------------------------------
def test_buckets_round_up_and_stop_at_their_largest():
    assert powers_of_two(1, 17) == (1, 2, 4, 8, 16, 17)
    assert powers_of_two(128, 1024) == (128, 256, 512, 1024)
    assert powers_of_two(1, 1) == (1,)
    assert bucket(5, (1, 2, 4, 8)) == 8 and bucket(9, (1, 2, 4, 8)) is None
    b = Buckets.make(max_rows=64, max_tokens=17, length=1000)
    assert b.rows == (1, 2, 4, 8, 16, 32, 64) and b.tokens[-1] == 17 and b.width == (128, 256, 512, 1000)
    assert b.shape(3, 5, 130) == (4, 8, 256)
    assert b.shape(65, 1, 10) is None and b.shape(1, 18, 10) is None and b.shape(1, 1, 1001) is None
    assert exact_shape([(0, 10, 1), (3, 4, 5)]) == (2, 5, 10 + 1)


def test_padding_writes_only_the_scratch_slot():
    idx = pad_step([(2, 10, 2), (0, 3, 1)], rows=4, tokens=4, scratch=9)
    assert idx.rows == [2, 0, 9, 9]
    assert idx.write_slot[0] == [2, 2, 9, 9] and idx.write_pos[0] == [10, 11, 2, 3]
    assert idx.write_slot[1] == [0, 9, 9, 9] and idx.write_pos[1][0] == 3
    assert idx.write_slot[3] == [9] * 4 and idx.positions[1] == [3, 4, 5, 6]
    with pytest.raises(ValueError, match="do not fit"):
        pad_step([(0, 0, 5)], rows=1, tokens=4, scratch=1)
    # a draft tree's verify (a token, then two children of it): positions by depth, each node sees its ancestors
    tree = pad_step([(2, 10, 3), (0, 3, 1)], rows=2, tokens=4, scratch=9, trees=[(-1, 0, 0), ()])
    assert tree.positions[0] == [10, 11, 11, 13] and tree.write_pos[0] == [10, 11, 12, 3] and tree.past == [10, 3]
    assert tree.ancestors[0].tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 1, 1]]  # padding: a chain
    chain = [[int(j <= i) for j in range(4)] for i in range(4)]
    assert tree.ancestors[1].tolist() == idx.ancestors[0].tolist() == chain
    # arrays, not lists of lists (those made a 2k-position prompt chunk's index cost half a second on the host)
    assert tree.ancestors.dtype == np.uint8 and tree.ancestors.shape == (2, 4, 4)


# -- device names and refusals ------------------------------------------------------------------------------------
def test_device_names_and_the_refusal_without_cuda():
    for ok in ("auto", "cpu", "cuda", "cuda:3"):
        check_device(ok)
    for bad in ("gpu", "cuda:", "CUDA", "cuda:x", ""):
        with pytest.raises(ValueError, match="auto . cpu . cuda . cuda:N"):
            check_device(bad)
    assert resolve_device("cpu") == "cpu"
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal is for machines without")
    assert resolve_device("auto") == "cpu"
    with pytest.raises(ValueError, match="--device cuda:0: (this torch .* without CUDA|no CUDA GPU is visible)"):
        resolve_device("cuda:0")


def test_hat_cloud_serve_refuses_cuda_where_there_is_none(capsys):
    """`hat-cloud serve --device cuda:0` without CUDA: one line, exit status 2, before any model is loaded."""
    from cloud_runtime.cli import main

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(["serve", "--model", "no-such-model", "--device", "cuda:0", "--plaintext"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hat-cloud: --device cuda:0:") and "cannot load" not in err[0], err


def Cloud(**kw):
    from hat_split.net.security import LinkSecurity

    return CloudConfig(security=LinkSecurity.plaintext(), **kw)


def test_config_refusals():
    with pytest.raises(ValueError, match="device must be one of"):
        Cloud(model="m", device="gpu0")
    with pytest.raises(ValueError, match="kv_layout must be slots or auto"):
        Cloud(model="m", graphs="on", kv_layout="dynamic")
    with pytest.raises(ValueError, match="local rank"):
        Cloud(model="m", pipeline=2, device="cuda:1")
    with pytest.raises(ValueError, match="n_gpu_layers"):
        Cloud(model="m", engine="llamacpp", device="cuda")
    from edge_runtime.config import EngineConfig

    assert EngineConfig(device="cuda").device == "cuda"
    with pytest.raises(ValueError, match="device applies to the torch backend"):
        EngineConfig(backend="onnxruntime", bundle="b", device="cpu")
    model = tiny_model(2)
    with pytest.raises(ValueError, match="graphs = on captures CUDA graphs"):
        kv_layout(Cloud(model="m", graphs="on"), model)
    assert kv_layout(Cloud(model="m"), model) == KvLayout()  # CPU: growing caches, as always
    layout = kv_layout(Cloud(model="m", kv_layout="slots", max_context=1024, kv_positions=4096,
                                   max_draft_len=7, max_tree_nodes=0), model)
    assert (layout.slots, layout.length, layout.graphs, layout.decode_limit) == (4, 1024, False, 8)
    trees = kv_layout(Cloud(model="m", kv_layout="slots", max_context=1024, kv_positions=4096, max_draft_len=7,
                            max_tree_nodes=32), model)
    assert trees.decode_limit == 33  # a 32-node tree's verify is a decode step: captured
    assert Buckets.make(4, trees.decode_limit, 1024, also_tokens=(trees.chain_limit,)).tokens == (1, 2, 4, 8, 16,
                                                                                                   32, 33)
    assert Buckets.make(4, 65, 1024, also_tokens=(17,)).tokens == (1, 2, 4, 8, 16, 17, 32, 64, 65)  # γ = 16


def test_pipeline_stages_on_the_cpu_and_refused_cuda():
    from cloud_runtime.pipeline import stage_device

    assert stage_device("cpu", 2) == "cpu"
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert stage_device("auto", 2) == "cpu"
    with pytest.raises(ValueError, match="CUDA"):
        stage_device("cuda", 2)


# -- the slot layout equals growing caches -------------------------------------------------------------------------
class CpuGraphs(StepGraphs):
    """StepGraphs with capture and replay as CUDA has them, on the CPU: capturing runs the step once on the graph's own
    copies of the inputs (as the warm-up does) and keeps the step; a replay re-runs that first step on whatever the
    copies hold now and writes the output in place. So any per-step value the step took from anywhere but its inputs
    would be replayed stale, and a non-idempotent step would corrupt the KV slots: the outputs would differ."""

    def __init__(self):
        super().__init__("cpu")
        self.enabled = True
        self.keys = []

    def run(self, key, fn, inputs):
        self.keys.append(key)
        return super().run(key, fn, inputs)

    def _capture(self, fn, inputs):
        static = [t.clone() for t in inputs]
        out = fn(*static)

        class Replay:
            def replay(self):
                out.copy_(fn(*static))

        return Replay(), static, out


def _script():
    """(jobs per step, cache operations before it): two prompts chunked, decodes, a verify of 5 with a crop after,
    a third session joining, a close, a draft tree's verify (a token, then 4 nodes below it) whose accepted path is
    kept before the next step."""
    return [
        ([(1, 0, 6), (2, 0, 3)], []),
        ([(1, 6, 1), (2, 3, 4)], []),
        ([(1, 7, 5), (2, 7, 1), (3, 0, 9)], []),
        ([(1, 9, 2), (2, 8, 1), (3, 9, 1)], [(CROP, 1, 9)]),
        ([(2, 9, 3), (3, 10, 20)], [(CLOSE, 1, 0)]),
        ([(2, 12, 1), (3, 30, 4)], []),
        ([(2, 13, 5, (-1, 0, 0, 1, 2)), (3, 34, 1)], []),
        ([(2, 16, 2), (3, 35, 1)], [(KEEP, 2, [13, 0, 2, 4])]),
    ]


def _replay(runner, model, layers=(0, None)):
    g = torch.Generator().manual_seed(7)
    hidden = model.config.hidden_size
    outs = []
    for jobs, ops in _script():
        runner.apply(ops)
        js = [Job(sid, layers[0], layers[1] or model.config.num_hidden_layers, pos, n, *tree)
              for sid, pos, n, *tree in jobs]
        xs = [torch.randn(1, n, hidden, generator=g).to(model.device) for _, _, n, *_ in jobs]
        outs.append(runner.run(js, xs)[0])
    return outs


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_slot_steps_equal_growing_caches(family):
    """The same script of prefill chunks, decodes, verifies, crops, closes and a draft tree's verify and kept path on
    the slot layout (eager at exact sizes,
    and bucketed with padding, captured and replayed as CUDA graphs are: CpuGraphs) gives the growing caches' outputs
    (float32); more sessions than slots fall back to growing caches in the same steps."""
    from tests.test_hat import _family

    model = _family(family)
    base = _replay(StageRunner(model), model)
    for slots, graphs in ((4, False), (4, True), (2, True)):
        layout = KvLayout(slots=slots, length=64, graphs=graphs, decode_limit=5, max_rows=4)
        runner = StageRunner(model, layout=layout)
        if graphs:
            runner.graphs = CpuGraphs()
        outs = _replay(runner, model)
        for step, (a, b) in enumerate(zip(base, outs)):
            for x, y in zip(a, b):
                assert x.shape == y.shape
                torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-5, msg=f"step {step}, slots {slots}")
        if graphs:
            keys = runner.graphs.keys
            assert keys and all(shape in {(r, t, 64) for r in (1, 2, 4) for t in (1, 2, 4, 5)} for _, shape in keys)
            assert runner.graphs.replays == len(keys) > runner.graphs.captures > 1
        assert runner.slots.free == {4: 2, 2: 1}[slots]  # session 1 closed; with 2 slots session 3 grew its own


def test_model_ends_return_every_works_rows_from_one_head():
    model = tiny_model(2)
    ends = ModelEnds(model)
    outs = [torch.randn(1, n, model.config.hidden_size) for n in (3, 5, 2)]
    rows = ends.rows([(outs[0], 2, 0), (outs[1], 0, 4), (outs[2], 0, 0), (outs[0], 1, 0)])
    from hat_split.models.partition import head_logits

    np.testing.assert_allclose(rows[0], head_logits(model, outs[0][:, 1:])[0].numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(rows[1], outs[1][0, 1:].numpy())
    assert rows[2] is None and rows[3].shape == (1, model.config.vocab_size)


def test_served_greedy_on_the_slot_layout_equals_the_target(tiny_pair):
    """A cloud with device cpu and the slot layout stated serves sd, hlm and llm, and the split protocols, with the
    target's greedy tokens, and frees its slots when the sessions close."""
    from tests.conftest import serving
    from tests.test_generation import _hf_greedy, _run
    from hat_split.math.sampling import SamplingParams
    from tests.test_hat import _greedy, _run_split

    draft, target = tiny_pair
    ref = _hf_greedy(target, 24)
    with serving(target, device="cpu", kv_layout="slots", kv_positions=4096) as server:
        runner = server.work.engine.executor.runner
        assert runner.slots is not None and runner.slots.slots == 4
        for protocol in ("sd", "hlm", "llm"):
            assert _run(server, draft, protocol, SamplingParams(0.0))[0].tokens == ref, protocol
        assert _run_split(server, target.model, "ushape", SamplingParams(0.0), chunk_tokens=3).tokens == \
            _greedy(target.model, 20)
        assert runner.slots.free == 4


def test_stage_runner_refuses_a_layout_without_room():
    with pytest.raises(ValueError, match="slots >= 1"):
        StageRunner(tiny_model(2), layout=dataclasses.replace(KvLayout(slots=1, length=8), length=0))


def test_hat_bench_gpu_runs_on_the_cpu(tmp_path):
    """`hat-bench gpu` on a tiny shape with --device cpu (no graphs there): every figure measured and written."""
    import json

    from profiles.bench.bench import main

    config = {"model_type": "qwen2", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 1024, "tie_word_embeddings": False}
    (tmp_path / "tiny.json").write_text(json.dumps(config))
    assert main(["gpu", "--models", str(tmp_path / "tiny.json"), "--device", "cpu", "--dtype", "float32",
                 "--context", "32", "--prefill", "64", "--batches", "1,3", "--gammas", "1,4", "--steps", "2",
                 "--out", str(tmp_path / "out")]) == 0
    result = json.loads((tmp_path / "out" / "gpu_bench.json").read_text())
    row = result["models"]["tiny"]
    assert set(row["ways"]) == {"dynamic", "slots"} and row["limit_tok_s"] > 0
    for m in row["ways"].values():
        assert m["decode_tok_s"] > 0 and set(m["verify_ms"]) == {"1", "4"} and set(m["batched_tok_s"]) == {"1", "3"}
        assert m["prefill_tok_s"] > 0 and 0 < m["decode_of_limit"]
    png = tmp_path / "drawn" / "gpu_bench.png"  # drawn here from the JSON, as for a GPU machine's run
    assert main(["gpu", "--plot-from", str(tmp_path / "out" / "gpu_bench.json"), "--out", str(png.parent)]) == 0
    assert png.is_file() and png.stat().st_size > 1000
    assert main(["gpu", "--plot-from", str(tmp_path / "tiny.json"), "--out", str(png.parent)]) == 2


def test_hat_bench_gpu_times_a_drafters_training_on_the_cpu(tmp_path, capsys):
    """`hat-bench gpu --figures distill` on a tiny shape: the teacher's rate and a training step per unroll count,
    without the step figures; arguments that cannot run are refused in one line before any model is built."""
    import json

    from profiles.bench.bench import main

    config = {"model_type": "qwen2", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 1024, "tie_word_embeddings": False}
    (tmp_path / "tiny.json").write_text(json.dumps(config))
    args = ["gpu", "--models", str(tmp_path / "tiny.json"), "--device", "cpu", "--dtype", "float32", "--steps", "8",
            "--figures", "distill", "--distill-batch", "2", "--distill-seq", "32", "--distill-vocab", "64",
            "--distill-unrolls", "1,2", "--out", str(tmp_path / "out")]
    assert main(args) == 0
    row = json.loads((tmp_path / "out" / "gpu_bench.json").read_text())["models"]["tiny"]
    d = row["distill"]
    assert row["ways"] == {} and d["teacher_tok_s"] > 0 and d["timed_steps"] == 2 and set(d["train"]) == {"1", "2"}
    assert all(x["step_ms"] > 0 and x["positions_per_s"] > 0 for x in d["train"].values())
    capsys.readouterr()
    for bad, says in ((["--distill-unrolls", "0"], "--distill-unrolls: comma-separated counts >= 1"),
                      (["--figures", "distil"], "--figures: a comma-separated list of steps, distill")):
        assert main([*args, *bad]) == 2
        assert says in capsys.readouterr().err


def test_graphs_fall_back_to_eager_past_their_limit_and_after_a_failed_capture():
    graphs = CpuGraphs()
    graphs.max_graphs = 1
    x = torch.ones(2)
    assert graphs.run("a", lambda t: t * 2, [x]).tolist() == [2, 2]
    assert graphs.run("a", lambda t: t * 2, [x + 1]).tolist() == [4, 4]  # replayed with the new input
    assert graphs.run("b", lambda t: t * 3, [x]).tolist() == [3, 3]  # past the limit: eager
    assert graphs.report() == {"graphs": 1, "captures": 1, "replays": 2, "eager": 1, "failure": ""}

    class Failing(CpuGraphs):
        def _capture(self, fn, inputs):
            raise RuntimeError("operation not permitted when stream is capturing")

    failing = Failing()
    assert failing.run("a", lambda t: t + 1, [x]).tolist() == [2, 2]
    assert not failing.enabled and "not permitted" in failing.failure and failing.eager == 1
    assert failing.run("a", lambda t: t + 1, [x]).tolist() == [2, 2] and failing.eager == 2
