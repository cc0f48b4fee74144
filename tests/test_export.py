"""Export (issue 7): part graphs, ONNX artifacts of each family against torch, the onnxruntime backend, bundles.

Tiny random models of each family check every graph exactly and fast; smollm2-135m (real, marked) checks the whole
path: export, validation, and generation through the onnxruntime backend token for token equal to torch.
"""
from __future__ import annotations

import json
import types

import numpy as np
import pytest

from edge_runtime.backends.part_lm import PartChainLM
from edge_runtime.drafter import Drafter
from export.config import ExportConfig
from export.graphs import PartSpec, TorchPart
from hat_split.files import bundle as M
from hat_split.math.sampling import SamplingParams
from hat_split.models.adapter import Adapter
from hat_split.models.draft_lm import AdapterLM
from hat_split.models.lm import CausalLM
from hat_split.models.partition import SplitModel
from tests.test_hat import V, _family

FAMILIES = ["llama", "qwen2", "gemma3"]
PROMPTS = [[int(t) for t in np.random.default_rng(s).integers(0, V, 30)] for s in range(2)]

ort = pytest.importorskip("onnxruntime", reason="the export extra (onnx, onnxscript, onnxruntime) is not installed")


def _window(model):
    return getattr(model.config, "sliding_window", None)


def _feed_both(a, b, prompt):
    """The validation schedule on two LMs; yields each pair of logits (prefill, chunks, steps, then after a crop)."""
    sa, sb = a.new_state(), b.new_state()
    for cut in ([0, 18], [18, 22], [22, 26], [26, 27], [27, 28]):
        toks = prompt[cut[0]:cut[1]]
        yield a.forward(sa, toks, n_logits=len(toks)), b.forward(sb, toks, n_logits=len(toks))
    a.crop(sa, 24)
    b.crop(sb, 24)
    yield a.forward(sa, prompt[24:30], n_logits=2), b.forward(sb, prompt[24:30], n_logits=2)
    yield a.forward(sa, [7], n_logits=0), b.forward(sb, [7], n_logits=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_part_graphs_compute_what_the_model_does(family):
    """The export modules run eagerly (TorchPart) equal the model (CausalLM) and the split draft (AdapterLM) through
    prefill, chunks, single steps and crops: the graphs carry nothing but explicit inputs."""
    model = _family(family)
    n = model.config.num_hidden_layers
    whole = PartChainLM([TorchPart(model, PartSpec.of("draft", n))], V, _window(model))
    for ref, got in _feed_both(CausalLM(model), whole, PROMPTS[0]):
        assert ref.shape == got.shape
        np.testing.assert_allclose(got, ref, atol=2e-5)
    split = SplitModel(model, 2)
    adapter = Adapter(model, 2).eval().requires_grad_(False)
    chain = PartChainLM([TorchPart(model, PartSpec.of(k, n, 2), adapter) for k in ("input", "adapter", "output")], V,
                        _window(model))
    for ref, got in _feed_both(AdapterLM(split, adapter), chain, PROMPTS[1]):
        np.testing.assert_allclose(got, ref, atol=2e-5)


def _loaded(model, name):
    return types.SimpleNamespace(model=model, tokenizer=None, name=name)


@pytest.fixture(scope="module")
def llama_bundle(tmp_path_factory):
    """A tiny llama's draft and HAT parts exported in fp32 and int8 (int4 as well for the draft)."""
    from export.onnx_export import export_bundle

    model = _family("llama")
    adapter = Adapter(model, 2).eval().requires_grad_(False)
    out = tmp_path_factory.mktemp("bundle")
    export_bundle(_loaded(model, "tiny-llama"),
                  ExportConfig("tiny-llama", str(out), "draft", precisions=("fp32", "int8", "int4")), prompts=PROMPTS,
                  progress=False)
    export_bundle(_loaded(model, "tiny-llama"), ExportConfig("tiny-llama", str(out), "hat", m=2, precisions=("fp32",)),
                  adapter, prompts=PROMPTS, progress=False)
    return out, model, adapter


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_onnx_parts_of_each_family_match_torch(tmp_path, family):
    """fp32 graphs of the other families (Gemma 3: sliding-window layers, soft-capped logits) validate against torch
    within fp32's thresholds through prefill, chunks and single steps."""
    from export.onnx_export import export_bundle

    model = _family(family)
    adapter = Adapter(model, 2).eval().requires_grad_(False)
    man = export_bundle(_loaded(model, f"tiny-{family}"),
                        ExportConfig(f"tiny-{family}", str(tmp_path), "hat", m=2, precisions=("fp32",)),
                        adapter=adapter, prompts=PROMPTS, progress=False)
    for a in man.artifacts:
        assert a.status == "validated", (a.part, a.validation)
        assert set(a.validation["regimes"]) == {"prefill", "chunks", "steps"}
    names = [i["name"] for i in man.find("adapter", "fp32").inputs]
    assert names[:3] == ["x", "position_ids", "mask"] and names[-2:] == ["past_key_5", "past_value_5"]
    if family == "gemma3":
        assert "mask_sliding" in [i["name"] for i in man.find("input", "fp32").inputs]


def test_a_tied_head_is_untied_in_the_graph_for_quantization_the_same_to_the_bit(tmp_path, monkeypatch):
    """int8 / int4 of a model whose head is its embedding table start from the run's fp32 artifact with the head given
    a copy of its own in the graph (onnx_export.untie_graph), not from a second export of the model: the untied graph
    computes the same logits to the bit, its head is a constant the quantizer reads, and the bundle's int8 draft
    validates as one quantized from a second export did."""
    import onnx
    from transformers import LlamaConfig, LlamaForCausalLM

    from edge_runtime.backends.onnx_backend import OrtPart
    from export import onnx_export

    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2,
                                         tie_word_embeddings=True)).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    exports = []
    real_export = onnx_export.export_graph
    monkeypatch.setattr(onnx_export, "export_graph", lambda *a, **k: exports.append(k.get("untie")) or
                        real_export(*a, **k))
    man = onnx_export.export_bundle(_loaded(model, "tiny-tied"), ExportConfig("tiny-tied", str(tmp_path), "draft",
                                                                               precisions=("fp32", "int8")),
                                    prompts=PROMPTS, progress=False)
    assert exports == [None]  # one export: int8 started from the fp32 artifact
    assert man.find("draft", "int8").status == "validated", man.find("draft", "int8").validation
    untied = tmp_path / "untied.onnx"
    assert onnx_export.untie_graph(tmp_path / "draft.fp32.onnx", untied)
    graph = onnx.load(str(untied), load_external_data=False).graph
    consts = {t.name for t in graph.initializer}
    heads = [n for n in graph.node if n.op_type == "MatMul" and any(x.endswith(".untied") for x in n.input)]
    assert len(heads) == 1 and set(heads[0].input) & consts
    assert not any(n.op_type == "Transpose" and n.input[0] in consts for n in graph.node)
    chains = [PartChainLM([OrtPart(p, ["CPUExecutionProvider"])], V) for p in (tmp_path / "draft.fp32.onnx", untied)]
    for a, b in zip(*[list(_feed_both(c, c, PROMPTS[0])) for c in chains]):
        assert np.array_equal(a[0], b[0])
    assert not onnx_export.untie_graph(untied, tmp_path / "again.onnx")  # nothing tied any more: nothing written
    assert not (tmp_path / "again.onnx").exists()


def test_bundle_manifest_records_and_validates_every_artifact(llama_bundle):
    out, model, _ = llama_bundle
    man = M.load(out)
    assert {(a.part, a.precision) for a in man.artifacts} == {
        ("draft", "fp32"), ("draft", "int8"), ("draft", "int4"), ("input", "fp32"), ("adapter", "fp32"),
        ("output", "fp32")}
    draft = man.find("draft", "fp32")
    assert draft.status == "validated" and draft.opset > 0 and draft.layers == [0, 5]
    regimes = draft.validation["regimes"]
    assert min(r["argmax_agreement"] for r in regimes.values()) == 1.0
    assert max(r["max_rel_diff"] for r in regimes.values()) < 1e-4
    assert any(f.endswith(".data") for f in draft.files)  # weights in external data, also checksummed
    q4 = man.find("draft", "int4")
    assert q4.quantization["bits"] == 4 and q4.sizes[q4.path + ".data"] < 0.5 * draft.sizes[draft.path + ".data"]
    assert man.model["fingerprint"] and man.protocol_version >= 1 and man.hatspec_version
    dims = {i["name"]: i["shape"] for i in draft.inputs}
    assert isinstance(dims["x"][1], str) and isinstance(dims["past_key_0"][2], str)  # dynamic n and past


def test_generation_through_onnxruntime_is_token_identical_to_torch(llama_bundle):
    """Temperature 0, fp32: drafting token by token with the onnxruntime chain (whole draft, and HAT's split draft)
    gives exactly torch's tokens."""
    from edge_runtime.backends.onnx_backend import OrtPart

    out, model, adapter = llama_bundle
    params = SamplingParams(0.0)
    rng = np.random.default_rng(0)

    def tokens(lm):
        d = Drafter(lm, params)
        d.start(PROMPTS[0])
        got = []
        for _ in range(24):
            t = d.sample_local(rng)
            got.append(t)
            d.commit([t])
        return got

    onnx_draft = PartChainLM([OrtPart(out / "draft.fp32.onnx", ["CPUExecutionProvider"])], V)
    assert onnx_draft.providers == [["CPUExecutionProvider"]]
    assert tokens(onnx_draft) == tokens(CausalLM(model))
    chain = PartChainLM([OrtPart(out / f"{k}.fp32.onnx") for k in ("input", "adapter", "output")], V)
    assert tokens(chain) == tokens(AdapterLM(SplitModel(model, 2), adapter))


@pytest.fixture(scope="module")
def target_bundle(tmp_path_factory, tiny_pair):
    """The tiny server's target cut at 1: input part, an (untrained) Λ and norm + head, exported in fp32."""
    from export.onnx_export import export_bundle

    model = tiny_pair[1].model
    adapter = Adapter(model, 1).eval().requires_grad_(False)
    out = tmp_path_factory.mktemp("target-bundle")
    export_bundle(_loaded(model, "tiny-target"),
                  ExportConfig("tiny-target", str(out), "hat", m=1, precisions=("fp32",)), adapter=adapter,
                  prompts=PROMPTS, progress=False)
    return out, model, adapter


def _bundle_parts(out, hat=True):
    from edge_runtime.backends.onnx_backend import OrtPart
    from edge_runtime.backends.split_parts import BundleSplitParts

    parts = {k: OrtPart(out / f"{k}.fp32.onnx", ["CPUExecutionProvider"]) for k in ("input", "adapter", "output")}
    return BundleSplitParts(parts["input"], parts["output"], parts["adapter"] if hat else None, M.load(out).model)


def test_split_drafting_and_forks_on_onnxruntime_equal_torch(target_bundle):
    """The device's HAT machinery on exported parts — prefill, drafting, parallel-drafting forks, verification and
    the crop after it — gives torch's distributions and tokens."""
    from edge_runtime.backends.split_parts import TorchSplitParts
    from edge_runtime.split_drafter import SplitDrafter

    out, model, adapter = target_bundle
    bundle = _bundle_parts(out)
    torch_parts = TorchSplitParts(SplitModel(model, 1), adapter)
    assert (bundle.fingerprint, bundle.m, bundle.stop, bundle.tail) == (torch_parts.fingerprint, 1, 2, 0)
    runs = []
    for parts in (torch_parts, bundle):
        dev = SplitDrafter(parts, SamplingParams(1.0), seed=4)
        dev.start(PROMPTS[0][:12])
        dev.lam_prefill(dev.prompt_states(12))
        dev.commit([5])
        state = dev.draft(5, 0.0)
        cands = dev.candidates(state, 2)
        for c in cands:
            dev.extend(c, 5, 0.0, steps=3)
        deep = parts.from_wire(np.random.default_rng(1).standard_normal((6, parts.hidden_size)).astype(np.float32))
        n, token = dev.verify(state, dev.target_logits(deep, state.base, 6))
        dev.commit(state.drafts[:n] + [token], n)
        again = dev.draft(3, 0.0)
        runs.append((state, cands, (n, token), again, parts.to_wire(dev.upload_states(again))))
    (s0, c0, v0, a0, w0), (s1, c1, v1, a1, w1) = runs
    assert s0.drafts == s1.drafts and v0 == v1 and a0.drafts == a1.drafts
    np.testing.assert_allclose(np.stack(s1.q), np.stack(s0.q), atol=1e-5)
    assert [c.drafts for c in c0] == [c.drafts for c in c1] and len(c0) == 2
    np.testing.assert_allclose(w1, w0, atol=1e-4)


@pytest.mark.parametrize("protocol", ["ushape", "hat"])
def test_split_protocols_on_onnxruntime_give_torchs_tokens(tiny_server, target_bundle, protocol):
    """A device holding only exported parts speaks the split protocols to the torch cloud: greedy, its tokens are the
    target's; sampled (chunked prefill), they are token for token a torch device's."""
    from tests.test_hat import _greedy, _run_split

    out, model, adapter = target_bundle
    hat = protocol == "hat"
    kw = dict(adapter=adapter if hat else None, draft_stop_prob=0.3, draft_len=4, chunk_tokens=5)
    greedy = _run_split(tiny_server, model, protocol, SamplingParams(0.0), parts=_bundle_parts(out, hat), **kw)
    assert greedy.tokens == _greedy(model, 20)
    sampled = [_run_split(tiny_server, model, protocol, SamplingParams(1.0), seed=9, parts=parts, **kw)
               for parts in (_bundle_parts(out, hat), None)]
    assert sampled[0].tokens == sampled[1].tokens and sampled[0].prefill_chunks > 1
    if hat:
        assert greedy.drafted > 0


def test_a_tampered_or_mismatched_bundle_is_refused(llama_bundle, tmp_path):
    import shutil

    src, _, _ = llama_bundle
    out = tmp_path / "b"
    shutil.copytree(src, out)
    M.load(out)
    with pytest.raises(M.BundleError, match="not the expected model"):
        M.load(out, model_fingerprint="0" * 16)
    doc = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps(dict(doc, device_profile="agx-orin-64gb")))
    M.load(out, device_profile="agx-orin-64gb")
    with pytest.raises(M.BundleError, match="targets device profile 'agx-orin-64gb', not 'orin-nano-8gb'"):
        M.load(out, device_profile="orin-nano-8gb")
    (out / "manifest.json").write_text(json.dumps(doc))
    data = out / "draft.int8.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(M.BundleError, match="draft.int8.onnx.data does not match its checksum"):
        M.load(out)
    data.unlink()
    with pytest.raises(M.BundleError, match="missing"):
        M.load(out)
    shutil.copy(src / data.name, data)
    doc = json.loads((out / "manifest.json").read_text())
    doc["protocol_version"] += 1
    (out / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(M.BundleError, match="protocol v"):
        M.load(out)
    doc["protocol_version"] -= 1
    doc["artifacts"][0]["files"] = {"../../etc/passwd": "0" * 64}
    (out / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(M.BundleError, match="outside the bundle"):
        M.load(out)
    doc["format"] = "something-else/9"
    (out / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(M.BundleError, match="format"):
        M.load(out)
    man = M.read(src)
    failed = man.find("draft", "int4")
    failed.status, failed.validation["reason"] = "failed", "steps: mean TV 0.9"
    with pytest.raises(M.BundleError, match="did not pass validation"):
        man.usable("draft", "int4")
    with pytest.raises(M.BundleError, match="no draft/fp16/onnx artifact"):
        man.usable("draft", "fp16")


def test_a_failing_artifact_is_marked_failed_not_good(tmp_path, monkeypatch):
    """Validation that misses its thresholds marks the artifact failed (and the CLI would exit 1)."""
    from export import onnx_export, validate

    monkeypatch.setitem(validate.THRESHOLDS, "int4", {"rel": 1e-9, "tv": 0.0})
    model = _family("llama")
    man = onnx_export.export_bundle(_loaded(model, "tiny-llama"),
                                    ExportConfig("tiny-llama", str(tmp_path), "draft", precisions=("int4",)),
                                    prompts=PROMPTS, progress=False)
    a = man.find("draft", "int4")
    assert a.status == "failed" and "limit" in a.validation["reason"]
    assert not (tmp_path / ".fp32-for-quantization").exists()  # the scratch fp32 graph is gone


class _Recorded:
    """The reference chain run once: its outputs kept by the tokens fed so far, so that every case fed alike compares
    with the same figures without running the reference again (a miss after a replay has no cache to run on)."""

    def __init__(self, chain):
        self.chain, self.parts, self.kept = chain, chain.parts, {}

    def new_state(self):
        return {"fed": (), "inner": self.chain.new_state()}

    def forward(self, state, tokens, n_logits=1):
        state["fed"] += tuple(tokens)
        key = (state["fed"], n_logits)
        if key not in self.kept:
            assert state["inner"] is not None, "a miss after a replay"
            self.chain.forward(state["inner"], tokens, n_logits)
            self.kept[key] = [np.array(x, copy=True) for x in self.chain.last_outputs]
        else:
            state["inner"] = None
        self.last_outputs = self.kept[key]


class _Forgetful:
    """A broken export's chain: every call runs on a fresh cache (the prompt forgotten after the prefill)."""

    def __init__(self, chain):
        self.chain, self.parts = chain, chain.parts

    def new_state(self):
        return self.chain.new_state()

    def forward(self, state, tokens, n_logits=1):
        out = self.chain.forward(self.chain.new_state(), tokens, n_logits)
        self.last_outputs = self.chain.last_outputs
        return out


@pytest.mark.real_models
def test_validation_refuses_broken_exports_by_their_distributions(smollm2):
    """The validation's verdict (mean TV per regime, export.validate) on smollm2-135m: chains broken as an export can
    break refused at every precision (int4's limit is the loosest); one mid-layer MLP lost is refused from int8 up;
    the model itself passes the strictest."""
    import copy

    import torch

    from export.validate import THRESHOLDS, Schedule, compare, verdict
    from hat_split.models.loading import output_size
    from hat_split.prompt_sets import validation_prompts

    model = smollm2.model
    n = model.config.num_hidden_layers
    spec = PartSpec.of("draft", n, 0, 0)

    def chain(m):
        return PartChainLM([TorchPart(m, spec, None)], output_size(m))

    def broken(edit):
        m = copy.deepcopy(model)
        with torch.no_grad():
            edit(m)
        return chain(m)

    prompts = validation_prompts(smollm2.tokenizer, 2)
    ref = _Recorded(chain(model))
    cases = {"forgets the prompt": _Forgetful(chain(model)),
             "layer 0's attention lost": broken(lambda m: m.model.layers[0].self_attn.o_proj.weight.zero_()),
             "MLP scales off by 2": broken(lambda m: [la.mlp.down_proj.weight.mul_(2) for la in m.model.layers]),
             "a mid-layer MLP lost": broken(lambda m: m.model.layers[n // 2].mlp.down_proj.weight.zero_()),
             "intact": chain(model)}
    for name, cand in cases.items():
        fig = compare(ref, cand, prompts, Schedule())[0]
        worst = max(f["mean_tv"] for f in fig.values())
        passed = {prec: verdict(fig, prec, True)[0] for prec in THRESHOLDS}
        print(f"{name}: worst regime mean TV {worst:.3f}; passes {[p for p, ok in passed.items() if ok]}")
        if name == "intact":
            assert all(passed.values()) and worst == 0.0
        elif name == "a mid-layer MLP lost":
            assert passed == {"fp32": False, "fp16": False, "int8": False, "int4": True}, passed
        else:
            assert not any(passed.values()) and worst > THRESHOLDS["int4"]["tv"], (name, fig)


def test_hat_export_tensorrt_says_when_tensorrt_is_absent(llama_bundle, capsys):
    import importlib.util

    if importlib.util.find_spec("tensorrt") is not None:
        pytest.skip("TensorRT is installed here: the absent path cannot be seen")
    from export.cli import main

    assert main(["tensorrt", str(llama_bundle[0]), "--model", "tiny"]) == 2
    assert "TensorRT is not installed" in capsys.readouterr().err


@pytest.mark.real_models
def test_smollm2_bundle_runs_token_identical_on_onnxruntime(smollm2, smollm2_bundle):
    """The real model: its draft exported in fp32 and int4 validates on real prompts, and `hat-edge`'s runtime on the
    onnxruntime backend (the bundle alone: its tokenizer, no torch model) generates torch's tokens at temperature 0."""
    from edge_runtime.config import EdgeConfig, EngineConfig
    from edge_runtime.runtime import EdgeRuntime

    man = M.load(smollm2_bundle)
    fp32, int4 = man.find("draft", "fp32"), man.find("draft", "int4")
    assert fp32.status == "validated", fp32.validation
    assert min(r["argmax_agreement"] for r in fp32.validation["regimes"].values()) == 1.0
    int4_tv = max(r["mean_tv"] for r in int4.validation["regimes"].values())
    assert int4.status == "validated" and 0.05 < int4_tv < 0.4, int4.validation  # real figures: 0.21-0.26 here
    prompt = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
    params = SamplingParams(0.0)
    onnx_cfg = EdgeConfig(model=str(smollm2_bundle), engine=EngineConfig(backend="onnxruntime",
                                                                         bundle=str(smollm2_bundle), precision="fp32"))
    with EdgeRuntime(onnx_cfg) as rt:
        assert not hasattr(rt.engine, "loaded") and rt.engine.lm.providers == [["CPUExecutionProvider"]]
        got = rt.generate(prompt, "slm", params, 24, seed=0)
    with EdgeRuntime(EdgeConfig(model="smollm2-135m"), loaded=smollm2) as rt:
        want = rt.generate(prompt, "slm", params, 24, seed=0)
    assert got.tokens == want.tokens and got.text == want.text


def test_backend_settings_are_checked():
    from edge_runtime.config import EdgeConfig, EngineConfig

    with pytest.raises(ValueError, match="runs a hat-export bundle"):
        EdgeConfig(model="m", engine=EngineConfig(backend="onnxruntime"))
    with pytest.raises(ValueError, match="backend must be one of"):
        EdgeConfig(model="m", engine=EngineConfig(backend="tflite", bundle="b"))
    with pytest.raises(ValueError, match="precision must be one of"):
        EdgeConfig(model="m", engine=EngineConfig(backend="onnxruntime", bundle="b", precision="int2"))
    from edge_runtime.backends.onnx_backend import choose_providers

    assert choose_providers()[-1] == "CPUExecutionProvider"
    with pytest.raises(ValueError, match="not in this onnxruntime build"):
        choose_providers(["NoSuchExecutionProvider"])


def test_tensorrt_profile_shapes_cover_prefill_and_decode():
    """The optimization profiles hat-export tensorrt sets (checked without TensorRT): each input's min / opt / max
    for the new positions n and a cache up to max_context."""
    from export.tensorrt_build import DECODE_MAX, profile_shapes

    prefill, ctx = (1, 128, 256), 2048
    assert profile_shapes("x", (1, "n"), prefill, ctx) == ((1, 1), (1, 128), (1, 256))
    assert profile_shapes("x", (1, "n", 576), prefill, ctx) == ((1, 1, 576), (1, 128, 576), (1, 256, 576))
    assert profile_shapes("tokens", (1, "n", 576), prefill, ctx) == ((1, 1, 576), (1, 128, 576), (1, 256, 576))
    assert profile_shapes("mask", (1, 1, "n", "w"), prefill, ctx) == ((1, 1, 1, 1), (1, 1, 128, 1024),
                                                                      (1, 1, 256, 2048))
    assert profile_shapes("logit_index", ("k",), prefill, ctx) == ((1,), (128,), (256,))
    assert profile_shapes("past_key_3", (1, 3, "p", 64), (1, 1, DECODE_MAX), ctx) == (
        (1, 3, 0, 64), (1, 3, 1024, 64), (1, 3, 2047, 64))


def _greedy_tokens(lm, n=24):
    """n tokens drafted at temperature 0 after PROMPTS[0]."""
    d = Drafter(lm, SamplingParams(0.0))
    d.start(PROMPTS[0])
    rng, got = np.random.default_rng(0), []
    for _ in range(n):
        got.append(d.sample_local(rng))
        d.commit(got[-1:])
    return got


def test_an_opset_17_export_for_tensorrt_8_5_is_opset_17_and_token_identical(tmp_path):
    """`--opset 17` (TensorRT 8.5, JetPack 5): torch's exporter writes 18 and the graph is converted down; the artifact
    imports opset 17 in the default domain, the manifest records 17, it validates, and onnxruntime drafts torch's
    tokens with it."""
    import onnx

    from edge_runtime.backends.onnx_backend import OrtPart
    from export.onnx_export import export_bundle

    model = _family("llama")
    man = export_bundle(_loaded(model, "tiny-llama"),
                        ExportConfig("tiny-llama", str(tmp_path), "draft", precisions=("fp32",), opset=17),
                        prompts=PROMPTS, progress=False)
    draft = man.find("draft", "fp32")
    assert draft.status == "validated", draft.validation
    assert max(r["max_rel_diff"] for r in draft.validation["regimes"].values()) < 1e-4
    graph = onnx.load(str(tmp_path / "draft.fp32.onnx"), load_external_data=False)
    assert [o.version for o in graph.opset_import if o.domain in ("", "ai.onnx")] == [17]
    assert all(not any(a.name == "noop_with_empty_axes" for a in n.attribute)
               for n in graph.graph.node if n.op_type == "ReduceMean")  # opset 17's ReduceMean has axes only
    assert M.load(tmp_path).find("draft", "fp32").opset == 17
    onnx_draft = PartChainLM([OrtPart(tmp_path / "draft.fp32.onnx", ["CPUExecutionProvider"])], V)
    assert _greedy_tokens(onnx_draft) == _greedy_tokens(CausalLM(model))


def test_an_opset_outside_what_the_exporter_writes_is_refused(tmp_path, capsys):
    from export.cli import _parser, export_config, main
    from hat_split.files.config_file import config_from_dict

    for opset in (16, 24):
        with pytest.raises(ValueError, match=r"opset must be in 17\.\.23"):
            ExportConfig("m", "out", precisions=("fp32",), opset=opset)
    with pytest.raises(ValueError, match="use fp32 / fp16 only; int8, int4 use onnxruntime's MatMulNBits"):
        ExportConfig("m", "out", opset=17)  # the default precisions hold int8 and int4
    assert ExportConfig("m", "out", precisions=("fp16",), opset=17).opset == 17
    assert ExportConfig("m", "out").opset == 18
    assert config_from_dict(ExportConfig, {"model": "m", "out": "o", "precisions": ["fp32", "fp16"],
                                           "opset": 17}).opset == 17
    argv = ["onnx", "--model", "m", "--out", str(tmp_path), "--precision", "fp16", "--opset", "17"]
    assert export_config(_parser(), _parser().parse_args(argv), argv).opset == 17
    assert main(["onnx", "--model", "m", "--out", str(tmp_path), "--opset", "12"]) == 2
    assert "opset must be in 17..23" in capsys.readouterr().err


def test_tensorrt_before_10_refuses_artifacts_above_opset_17():
    """TensorRT 8.5 (JetPack 5) and 8.6 parse opsets up to 17 and drop ReduceMean's opset-18 axes input; 10 reads 18."""
    from export.tensorrt_build import check_opset

    for trt, opset in [("8.5.2.2", 18), ("8.5.2.2", 21), ("8.6.2.3", 18)]:
        with pytest.raises(ValueError, match=r"up to 17.*`hat-export onnx --opset 17"):
            check_opset(trt, opset)
    for trt, opset in [("8.5.2.2", 17), ("8.6.2.3", 17), ("10.3.0.30", 18), ("10.7.0", 21), ("11.0.0", 23)]:
        check_opset(trt, opset)


def test_hat_export_tensorrt_checks_the_opset_before_building(llama_bundle, monkeypatch):
    """The opset-18 bundle on a TensorRT 8.5 device is refused before any engine is built (no TensorRT needed here)."""
    from export import tensorrt_build
    from export.config import TensorRTConfig

    out, model, _ = llama_bundle
    monkeypatch.setattr(tensorrt_build, "tensorrt_version", lambda: "8.5.2.2")
    config = ExportConfig("tiny-llama", str(out), precisions=("fp32",), tensorrt=TensorRTConfig(precisions=("fp32",)))
    with pytest.raises(ValueError, match="artifact is opset 18: export the bundle's fp32 / fp16 parts again"):
        tensorrt_build.build_bundle(_loaded(model, "tiny-llama"), config, None, PROMPTS)
