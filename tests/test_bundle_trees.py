"""Draft trees on a device that holds only exported graphs (issue 47): a bundle's parts run a tree's nodes with the
tree's mask and their positions by depth, and keep the accepted path, with no graph of their own. Tiny random models
in fp32: a tree's logits on the draft graph equal torch's TreeLM's and the kept cache goes on as torch's; `sd` on the
draft graph, `hat` with Λ (tail layers too) and `hat` with the feature drafter, through a torch cloud, give the target's
greedy tokens, and sampled rounds the torch device's tokens."""
from __future__ import annotations

import types

import numpy as np
import pytest

from edge_runtime.backends.part_lm import PartChainLM, keep_rows
from edge_runtime.backends.split_parts import TorchSplitParts
from edge_runtime.client import CloudClient
from edge_runtime.config import EdgeConfig, LinkConfig
from edge_runtime.drafter import Drafter
from edge_runtime.protocols import new_session
from edge_runtime.request import GenerationRequest
from export.config import ExportConfig
from hat_split.math.sampling import SamplingParams
from hat_split.models.adapter import Adapter
from hat_split.models.lm import CausalLM
from hat_split.models.partition import SplitModel
from hat_split.models.tree_lm import TreeLM
from hat_split.net.security import LinkSecurity
from hat_split.wire import messages as P
from tests.conftest import serving, tiny_model
from tests.test_export import _bundle_parts as lam_parts
from tests.test_export import target_bundle  # noqa: F401  (a fixture)
from tests.test_feature_export import IDS, feature_bundle  # noqa: F401  (a fixture)
from tests.test_feature_export import _bundle_parts as feature_parts
from tests.test_hat import V, _greedy, _run_split
from tests.test_tree_protocol import PROMPT, _hf_greedy

ort = pytest.importorskip("onnxruntime", reason="the export extra (onnx, onnxscript, onnxruntime) is not installed")
EXPORT_PROMPTS = [[int(t) for t in np.random.default_rng(s).integers(0, V, 30)] for s in range(2)]
TREE = dict(tree_nodes=8, tree_depth=4, tree_width=2)


def _export(model, out, parts, m=1, tail=0, adapter=None):
    from export.onnx_export import export_bundle

    man = export_bundle(types.SimpleNamespace(model=model, tokenizer=None, name="tiny"),
                        ExportConfig("tiny", str(out), parts, m=m, tail=tail, precisions=("fp32",)), adapter,
                        prompts=EXPORT_PROMPTS, progress=False)
    assert all(a.status == "validated" for a in man.artifacts), [a.validation for a in man.artifacts]
    return out


@pytest.fixture(scope="module")
def draft_graph(tmp_path_factory, tiny_pair):
    """The tiny pair's draft model as a bundle's draft graph (fp32), run by onnxruntime on the CPU."""
    from edge_runtime.backends.onnx_backend import OrtPart

    out = _export(tiny_pair[0].model, tmp_path_factory.mktemp("draft-bundle"), "draft")
    return PartChainLM([OrtPart(out / "draft.fp32.onnx", ["CPUExecutionProvider"])], tiny_pair[0].vocab_size)


def _tree_steps(lm, start):
    """The prompt, two levels of a tree (three children of the root, then three below two of them), the path [1, 4]
    kept, one more token: every logits row."""
    state = lm.new_state()
    rows = [lm.forward(state, PROMPT, 1)]
    rows.append(lm.forward_tree(state, [-1, -1, -1], [11, 12, 13], start))
    rows.append(lm.forward_tree(state, [-1, -1, -1, 0, 1, 1], [21, 22, 23], start))
    lm.keep(state, start, [1, 4])
    assert state.length == start + 2
    rows.append(lm.forward(state, [31], 1))
    return rows


def test_a_tree_on_the_draft_graph_equals_torchs_and_keeps_its_path(tiny_pair, draft_graph):
    """Every logit row of _tree_steps on the exported draft equals TreeLM's on the same weights."""
    for got, want in zip(_tree_steps(draft_graph, len(PROMPT)), _tree_steps(TreeLM(tiny_pair[0].model), len(PROMPT))):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="needs 1 parents, got 3"):  # the tree so far does not add up
        draft_graph.forward_tree(draft_graph.new_state(), [-1, 0, 0], [1], 0)


def test_a_tree_on_a_sliding_window_graph_equals_torchs(tmp_path):
    """Gemma 3's local layers (window 4) on a tree past the window: the bundle's mask counts positions by depth, as
    torch's does (tests/test_tree.py: torch's equals each path alone)."""
    from edge_runtime.backends.onnx_backend import OrtPart
    from tests.test_hat import _family

    model = _family("gemma3")
    out = _export(model, tmp_path, "draft")
    graph = PartChainLM([OrtPart(out / "draft.fp32.onnx", ["CPUExecutionProvider"])], V,
                        window=model.config.sliding_window)
    for got, want in zip(_tree_steps(graph, len(PROMPT)), _tree_steps(TreeLM(model), len(PROMPT))):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_keep_rows_gathers_the_path_and_refuses_rows_it_lacks():
    a = np.arange(2 * 6 * 3, dtype=np.float32).reshape(1, 2, 6, 3)
    kept = keep_rows([a, -a], 2, 6, [1, 3])
    np.testing.assert_array_equal(kept[0], a[:, :, [0, 1, 3, 5]])
    np.testing.assert_array_equal(kept[1], -a[:, :, [0, 1, 3, 5]])
    with pytest.raises(ValueError, match="cannot keep rows"):
        keep_rows([a], 2, 6, [4])


def _sd(server, lm, params, seed=0):
    link = LinkConfig(server.endpoint, security=LinkSecurity.plaintext())
    with CloudClient(link, P.Hello("t", "tiny", 512, "tiny-vocab")) as client:
        session = new_session(EdgeConfig(model="tiny", **TREE), GenerationRequest(PROMPT, "sd", params, 24, seed=seed),
                              Drafter(lm, params), client, frozenset(), 1)
        return session.run(PROMPT, lambda toks: "")


def test_tree_sd_on_the_draft_graph_gives_the_targets_and_torchs_tokens(tiny_server, tiny_pair, draft_graph):
    greedy = _sd(tiny_server, draft_graph, SamplingParams(0.0))
    assert greedy.tokens == _hf_greedy(tiny_pair[1], 24) and greedy.drafted > greedy.rounds
    sampled = [_sd(tiny_server, lm, SamplingParams(1.0), seed=7) for lm in (draft_graph, TreeLM(tiny_pair[0].model))]
    assert sampled[0].tokens == sampled[1].tokens and sampled[0].drafted == sampled[1].drafted


@pytest.mark.parametrize("kind", ["adapter", "feature"])
def test_hat_trees_on_bundle_parts_give_the_targets_and_torchs_tokens(tiny_server, tiny_pair, target_bundle,  # noqa: F811
                                                                      feature_bundle, kind):  # noqa: F811
    """hat with draft trees on a device holding only the bundle (Λ, or the feature drafter over its draft
    vocabulary): greedy, the target's tokens; sampled, token for token the torch device's."""
    model = tiny_pair[1].model
    if kind == "adapter":
        out, _, drafter = target_bundle
        bundle, torch_parts = (lambda: lam_parts(out)), TorchSplitParts(SplitModel(model, 1), drafter)
    else:
        out, _, drafter, _ = feature_bundle
        bundle, torch_parts = (lambda: feature_parts(out)), TorchSplitParts(SplitModel(model, 1), drafter, IDS)
    kw = dict(adapter=drafter, parallel_draft=False, **TREE)
    greedy = _run_split(tiny_server, model, "hat", SamplingParams(0.0), n=24, parts=bundle(), **kw)
    assert greedy.tokens == _greedy(model, 24) and greedy.drafted > greedy.rounds
    sampled = [_run_split(tiny_server, model, "hat", SamplingParams(1.0), n=24, seed=9, parts=parts, **kw)
               for parts in (bundle(), torch_parts)]
    assert sampled[0].tokens == sampled[1].tokens and sampled[0].drafted == sampled[1].drafted


def test_hat_trees_on_a_bundle_with_tail_layers_give_the_targets_tokens(tmp_path):
    """An output part with tail layers verifies the tree's deep states under the tree's mask in one call (all rows)
    and keeps the accepted path in its cache."""
    from edge_runtime.backends.onnx_backend import OrtPart
    from edge_runtime.backends.split_parts import BundleSplitParts
    from hat_split.files import bundle as M

    model = tiny_model(3, layers=4)
    adapter = Adapter(model, 1).eval().requires_grad_(False)
    out = _export(model, tmp_path, "hat", m=1, tail=2, adapter=adapter)
    parts = {k: OrtPart(out / f"{k}.fp32.onnx", ["CPUExecutionProvider"]) for k in ("input", "adapter", "output")}
    bundle = BundleSplitParts(parts["input"], parts["output"], parts["adapter"], M.load(out).model)
    assert bundle.tail == 2 and bundle.output.io.cached
    with serving(CausalLM(model), max_message_bytes=1 << 20) as server:
        res = _run_split(server, model, "hat", SamplingParams(0.0), n=24, adapter=adapter, parts=bundle, tail=2,
                         parallel_draft=False, **TREE)
    assert res.tokens == _greedy(model, 24) and res.drafted > res.rounds


def _tree_rounds(parts, model, rounds=5):
    """A prompt, then `rounds` draft trees (10 nodes, 4 deep, 3 wide) at T = 1 verified by the torch middle part in
    this process (training.common.local_tree_round's steps, the states crossing as on the wire): every tree's
    shape, tokens and q, every verdict, and the committed tokens."""
    import torch

    from edge_runtime.split_drafter import SplitDrafter
    from hat_split.math.tree import below_chain
    from hat_split.models.partition import PartCache
    from tests.test_hat import PROMPT as SPLIT_PROMPT

    split, middle = SplitModel(model, 1), PartCache()
    up = lambda s: torch.from_numpy(parts.to_wire(s).copy())[None]  # noqa: E731
    down = lambda d: parts.from_wire(d[0].numpy())  # noqa: E731
    dev = SplitDrafter(parts, SamplingParams(1.0), seed=4)
    dev.start(SPLIT_PROMPT)
    shallow = dev.prompt_states(len(SPLIT_PROMPT))
    dev.lam_prefill(shallow)
    deep = split.middle.forward(middle, up(shallow))
    dev.commit([dev.sample_target(dev.target_logits(down(deep), 0, 1))])
    seen = []
    for _ in range(rounds):
        draft = dev.draft_tree(10, 4, 3)
        t = draft.tree
        parents = below_chain(1, t.parents)
        middle.crop(draft.base)
        deep = split.middle.forward_tree(middle, up(draft.shallow), parents)
        logits = dev.target_logits(down(deep), draft.base, len(t.tokens) + 1, tree=parents)
        verdict = dev.verify_tree(draft, logits)
        dev.keep_tree_path(draft, verdict.path, logits)
        middle.keep(draft.base, [0] + [n + 1 for n in verdict.path])
        dev.commit([int(t.tokens[n]) for n in verdict.path] + [verdict.token], len(verdict.path))
        seen.append((t.parents.tolist(), t.tokens.tolist(), t.q, verdict.path, verdict.token))
    return seen, list(dev.tokens)


@pytest.mark.parametrize("kind", ["adapter", "feature"])
def test_the_split_drafters_trees_on_a_bundle_equal_torchs(tiny_pair, target_bundle, feature_bundle,  # noqa: F811
                                                           kind):
    """Round by round, at T = 1: the same trees (shape, tokens, every node's q), the same verdicts and the same
    committed tokens from the bundle's graphs as from the torch parts — a tree drafted under the wrong mask or from
    positions not by depth, or a cache not kept to the path, draws other trees."""
    model = tiny_pair[1].model
    if kind == "adapter":
        out, _, drafter = target_bundle
        runs = [_tree_rounds(lam_parts(out), model),
                _tree_rounds(TorchSplitParts(SplitModel(model, 1), drafter), model)]
    else:
        out, _, drafter, _ = feature_bundle
        runs = [_tree_rounds(feature_parts(out), model),
                _tree_rounds(TorchSplitParts(SplitModel(model, 1), drafter, IDS), model)]
    (got, got_tokens), (want, want_tokens) = runs
    for a, b in zip(got, want):
        assert a[0] == b[0] and a[1] == b[1] and a[3:] == b[3:]
        np.testing.assert_allclose(a[2], b[2], atol=1e-5)
    assert got_tokens == want_tokens
    assert sum(len(r[0]) for r in got) > 10 * 3  # trees, not single nodes
