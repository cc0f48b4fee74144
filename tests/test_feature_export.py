"""The feature drafter in a bundle (hat-export onnx --parts hat-feature): the feature part (fusion, decoder layer,
norm and the draft-vocabulary head) and an output part that also gives the features, validated against torch; a
device holding only the bundle drafts as the torch device does, token for token; what does not fit is refused in one
line. Tiny random models (exactness), and the real SmolLM2 cut through the command."""
from __future__ import annotations

import json
import types

import numpy as np
import pytest

from edge_runtime.backends.split_parts import TorchSplitParts
from export.config import ExportConfig
from hat_split.files import bundle as M
from hat_split.math.sampling import SamplingParams
from hat_split.models.partition import SplitModel
from tests.test_feature_drafter import _perturbed
from tests.test_hat import V

ort = pytest.importorskip("onnxruntime", reason="the export extra (onnx, onnxscript, onnxruntime) is not installed")
PROMPTS = [[int(t) for t in np.random.default_rng(s).integers(0, V, 30)] for s in range(2)]
IDS = np.sort(np.random.default_rng(3).choice(V, 160, replace=False)).astype(np.int64)  # a draft vocabulary


@pytest.fixture(scope="module")
def feature_bundle(tmp_path_factory, tiny_pair):
    """The tiny server's target cut at 1 with a (perturbed, untrained) feature drafter over IDS, fp32 and int8."""
    from export.onnx_export import export_bundle

    model = tiny_pair[1].model
    drafter = _perturbed(SplitModel(model, 1), seed=11)
    out = tmp_path_factory.mktemp("feature-bundle")
    man = export_bundle(types.SimpleNamespace(model=model, tokenizer=None, name="tiny-target"),
                        ExportConfig("tiny-target", str(out), "hat-feature", m=1, precisions=("fp32", "int8"),
                                     draft_vocab=len(IDS)),
                        drafter, prompts=PROMPTS, progress=False, draft_ids=IDS)
    return out, model, drafter, man


def _bundle_parts(out, precision="fp32"):
    from edge_runtime.backends.onnx_backend import OrtPart
    from edge_runtime.backends.split_parts import BundleSplitParts

    parts = {k: OrtPart(out / f"{k}.{precision}.onnx", ["CPUExecutionProvider"])
             for k in ("input", "feature", "output")}
    return BundleSplitParts(parts["input"], parts["output"], None, M.load(out).model, feature=parts["feature"],
                            draft_ids=np.load(out / M.DRAFT_VOCAB))


def test_the_feature_parts_are_exported_validated_and_recorded(feature_bundle):
    out, _, drafter, man = feature_bundle
    man = M.load(out)  # checksums, the vocabulary file's among them
    got = {(a.part, a.precision): a for a in man.artifacts}
    assert set(got) == {(p, q) for p in ("input", "feature", "output") for q in ("fp32", "int8")}
    assert all(a.status == "validated" for a in got.values()), [a.validation["reason"] for a in got.values()]
    feature = got[("feature", "fp32")]
    assert [o["name"] for o in feature.outputs][:2] == [M.LOGITS, M.FEATURES]
    assert [i["name"] for i in feature.inputs][:3] == [M.X, M.POSITION_IDS, M.TOKENS]
    assert feature.outputs[0]["shape"][-1] == len(IDS)  # the draft-vocabulary head
    assert [o["name"] for o in got[("output", "fp32")].outputs][:2] == [M.LOGITS, M.FEATURES]
    assert M.DRAFT_VOCAB in feature.files and man.model["draft_vocab"] == len(IDS)
    np.testing.assert_array_equal(np.load(out / M.DRAFT_VOCAB), IDS)
    for regime in ("prefill", "chunks", "steps"):
        assert feature.validation["regimes"][regime]["mean_tv"] < 1e-3
        assert got[("feature", "int8")].validation["regimes"][regime]["positions"] > 0


def test_feature_validation_refuses_another_drafter(tiny_pair):
    """The validation can fail: the same graphs over another drafter's weights miss fp32's thresholds."""
    from export.graphs import TorchPart, part_specs
    from export.validate import Schedule, compare, validation_chain, verdict
    from hat_split.models.partition import head_rows

    model = tiny_pair[1].model
    specs = part_specs(["input", "feature", "output"], model.config.num_hidden_layers, 1, 0)

    def chain(drafter):
        return validation_chain([TorchPart(model, s, drafter, head_rows(model, IDS) if s.drafter else None)
                                 for s in specs], V, None)

    split = SplitModel(model, 1)
    same = compare(chain(_perturbed(split, seed=11)), chain(_perturbed(split, seed=11)), PROMPTS, Schedule())
    other = compare(chain(_perturbed(split, seed=11)), chain(_perturbed(split, seed=12)), PROMPTS, Schedule())
    assert all(verdict(f, "fp32", True)[0] for f in same)
    ok, reason = verdict(other[1], "fp32", True)
    assert not ok and "max |Δ|" in reason
    assert verdict(other[2], "fp32", True)[0]  # the output part does not depend on the drafter


@pytest.mark.parametrize("parallel", [False, True])
def test_hat_on_the_exported_feature_drafter_gives_torchs_tokens(tiny_server, tiny_pair, feature_bundle, parallel,
                                                                 pd_driven):
    """A device holding only the bundle drafts with the feature part through a torch cloud: greedy, the target's
    tokens; sampled (chunked prefill, parallel drafting driven), token for token the torch device's with the same
    drafter and draft vocabulary."""
    from tests.test_hat import _greedy, _run_split

    out, model, drafter, _ = feature_bundle
    kw = dict(adapter=drafter, draft_stop_prob=0.3, draft_len=4, chunk_tokens=5, parallel_draft=parallel, pd_topk=2)
    greedy = _run_split(tiny_server, model, "hat", SamplingParams(0.0), parts=_bundle_parts(out), **kw)
    assert greedy.tokens == _greedy(model, 20) and greedy.drafted > 0
    sampled = [_run_split(tiny_server, model, "hat", SamplingParams(1.0), seed=9, parts=parts, **kw)
               for parts in (_bundle_parts(out), TorchSplitParts(SplitModel(model, 1), drafter, IDS))]
    assert sampled[0].tokens == sampled[1].tokens and sampled[0].prefill_chunks > 1
    assert sampled[0].drafted == sampled[1].drafted > 0


def test_a_bundle_device_picks_its_draft_part_and_refuses_what_it_lacks(feature_bundle, tmp_path):
    """split.adapter names the kind wanted (it must be in the bundle); none: the best the bundle holds; a draft
    vocabulary other than the exported one is refused, naming both."""
    from edge_runtime.backends.loader import Bundle
    from edge_runtime.config import EdgeConfig, EngineConfig, SplitConfig
    from edge_runtime.engine import BundleEngine
    from hat_split.models.adapter import Adapter, save_adapter

    out, model, drafter, _ = feature_bundle
    config = EdgeConfig(model="tiny", engine=EngineConfig(backend="onnxruntime", bundle=str(out)))
    bundle = Bundle(M.load(out), None, out, config)
    engine = BundleEngine(None, None, 0, "tiny", "", frozenset(), bundle=bundle)
    assert bundle.drafters() == ["feature"]
    parts = engine.split_parts(True, SplitConfig(m=1))
    assert parts.kind == "feature" and parts.token_input == "shallow"
    np.testing.assert_array_equal(parts.draft_ids, IDS)
    assert engine.split_parts(True, SplitConfig(m=1, draft_vocab=len(IDS))) is parts
    assert engine.split_parts(False, SplitConfig(m=1)).kind == ""
    with pytest.raises(ValueError, match=f"split.draft_vocab is 50, but the bundle's feature part drafts over "
                                         f"{len(IDS)} tokens"):
        engine.split_parts(True, SplitConfig(m=1, draft_vocab=50))
    save_adapter(tmp_path / "lam", Adapter(model, 1), SplitModel(model, 1), "tiny", {"steps": 0})
    with pytest.raises(ValueError, match="holds no Λ: export it with hat-export onnx --parts hat --adapter DIR"):
        engine.split_parts(True, SplitConfig(m=1, adapter=str(tmp_path / "lam")))


def test_the_export_refuses_a_draft_module_of_the_other_kind(tiny_pair, tmp_path):
    from export.cli import _draft_module
    from hat_split.models.adapter import Adapter, save_adapter
    from hat_split.models.feature_drafter import FeatureDrafter, save_feature_drafter

    model = tiny_pair[1].model
    split = SplitModel(model, 1)
    save_adapter(tmp_path / "lam", Adapter(model, 1), split, "tiny", {"steps": 0})
    save_feature_drafter(tmp_path / "fd", FeatureDrafter(model), split, "tiny", {"steps": 0})
    with pytest.raises(ValueError, match=r"holds Λ \(an adapter\): export it with --parts hat$"):
        _draft_module(str(tmp_path / "lam"), split, feature=True)
    with pytest.raises(ValueError, match="holds a feature drafter: export it with --parts hat-feature$"):
        _draft_module(str(tmp_path / "fd"), split, feature=False)
    assert isinstance(_draft_module(str(tmp_path / "fd"), split, feature=True), FeatureDrafter)
    with pytest.raises(ValueError, match="draft_vocab is the feature part's head: it needs parts hat-feature"):
        ExportConfig("tiny", str(tmp_path / "b"), "hat", draft_vocab=8)
    from export.onnx_export import export_bundle

    loaded = types.SimpleNamespace(model=model, tokenizer=None, name="tiny")
    with pytest.raises(ValueError, match="pairs features with token embeddings, which would need the embedding table"):
        export_bundle(loaded, ExportConfig("tiny", str(tmp_path / "b"), "hat-feature", m=1, precisions=("fp32",)),
                      FeatureDrafter(model, "embedding"), prompts=PROMPTS, progress=False)
    assert not (tmp_path / "b").exists()  # refused before anything is written


@pytest.mark.real_models
def test_hat_export_writes_a_validated_feature_bundle_of_the_real_smollm2_cut(smollm2, tmp_path, capsys):
    """`hat-export onnx --parts hat-feature` on SmolLM2-135M cut at 2 with a feature drafter over a 4096-token draft
    vocabulary: every artifact validated against torch, and the bundle's parts draft what the torch parts draft."""
    from export.cli import main
    from hat_split.models.adapter import save_draft_vocab
    from hat_split.models.feature_drafter import save_feature_drafter
    from hat_split.prompt_sets import validation_prompts

    split = SplitModel(smollm2.model, 2)
    drafter = _perturbed(split, seed=2)
    fd = tmp_path / "fd"
    save_feature_drafter(fd, drafter, split, "smollm2-135m", {"steps": 0})
    ids = np.random.default_rng(0).permutation(smollm2.model.config.vocab_size)[:8192]
    save_draft_vocab(fd, ids.tolist())
    out = tmp_path / "bundle"
    rc = main(["onnx", "--model", "smollm2-135m", "--parts", "hat-feature", "--m", "2", "--adapter", str(fd),
               "--draft-vocab", "4096", "--precision", "fp32", "--prompts", "2", "--out", str(out), "--quiet"])
    assert rc == 0, capsys.readouterr().err
    man = json.loads((out / M.MANIFEST).read_text())
    assert {a["part"]: a["status"] for a in man["artifacts"]} == {"input": "validated", "feature": "validated",
                                                                   "output": "validated"}
    assert man["model"]["draft_vocab"] == 4096
    bundle = _bundle_parts(out)
    np.testing.assert_array_equal(bundle.draft_ids, np.sort(ids[:4096]))
    torch_parts = TorchSplitParts(split, drafter, np.sort(ids[:4096]))
    prompt = validation_prompts(smollm2.tokenizer, 1)[0][:40]
    runs = []
    for parts in (torch_parts, bundle):
        cache, fcache = parts.new_cache(), parts.new_cache()
        shallow = parts.run_input(cache, prompt)
        logits, feats = parts.run_output_features(parts.new_cache(), shallow, 1)
        pairs = parts.cat([parts.zeros(1), feats[:, :-1]])
        draft, fhat = parts.run_feature(fcache, pairs, shallow, prompt)
        runs.append((logits, draft, np.asarray(parts.to_wire(fhat))))
    (l0, d0, f0), (l1, d1, f1) = runs
    np.testing.assert_allclose(l1, l0, atol=2e-3 * np.abs(l0).max())
    np.testing.assert_allclose(d1, d0, atol=2e-3 * np.abs(d0).max())
    assert d1.shape == (1, 4096) and d1.argmax() == d0.argmax()
    np.testing.assert_allclose(f1, f0, atol=2e-3 * np.abs(f0).max())
