"""Draft trees over the link (issue 47): `sd` with tree_nodes > 0 drafts a tree on the device, the cloud verifies it in
one masked forward on growing caches and keeps the accepted path. Tiny random models (plumbing): greedy output equals
the target's own, seeded sampling is reproducible, malformed trees are refused and the session goes on, and a cloud
that cannot verify trees says so in its Welcome."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from edge_runtime.client import CloudClient, CloudError
from edge_runtime.config import EdgeConfig, LinkConfig, SplitConfig
from edge_runtime.drafter import Drafter
from edge_runtime.protocols import new_session
from edge_runtime.request import GenerationRequest
from hat_split.math.sampling import SamplingParams
from hat_split.models.tree_lm import TreeLM
from hat_split.net.security import LinkSecurity
from hat_split.wire import dist_codec
from hat_split.wire import messages as P
from tests.conftest import serving

PROMPT = [5, 17, 99, 3, 250, 7]


def _client(server):
    return CloudClient(LinkConfig(server.endpoint, security=LinkSecurity.plaintext()),
                       P.Hello("t", "tiny", 512, "tiny-vocab"))


def _run(server, draft_lm, params, n=24, seed=0, **tree):
    with _client(server) as client:
        config = EdgeConfig(model="tiny", **tree)
        session = new_session(config, GenerationRequest(PROMPT, "sd", params, n, seed=seed),
                              Drafter(TreeLM(draft_lm.model), params), client, frozenset(), 1)
        return session.run(PROMPT, lambda toks: ""), session


def _hf_greedy(lm, n):
    out = lm.model.generate(torch.tensor([PROMPT]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                            pad_token_id=0, eos_token_id=None)
    return out[0, len(PROMPT):].tolist()


@pytest.mark.parametrize("nodes,depth,width", [(1, 1, 1), (8, 4, 2), (16, 6, 3), (12, 8, 1)])
def test_greedy_tree_sd_equals_the_targets_greedy_tokens(tiny_server, tiny_pair, nodes, depth, width):
    draft, target = tiny_pair
    result, session = _run(tiny_server, draft, SamplingParams(0.0), tree_nodes=nodes, tree_depth=depth,
                           tree_width=width)
    assert result.tokens == _hf_greedy(target, 24)
    assert result.finish_reason == "length"
    assert result.drafted <= result.rounds * nodes
    assert session.drafter.kv.length <= len(session.drafter.tokens)  # no dropped branch stays in the device's cache
    assert result.up_bytes > 0


def test_tree_and_chain_agree_on_the_draft_models_own_tokens(tiny_pair):
    """A target equal to the draft accepts every drafted level: a chain-shaped tree (width 1) commits depth + 1 tokens
    per round, as a chain of that length does."""
    draft, _ = tiny_pair
    with serving(draft, max_message_bytes=1 << 20) as server:
        result, _ = _run(server, draft, SamplingParams(0.0), n=20, tree_nodes=4, tree_depth=4, tree_width=1)
        assert result.tokens == _hf_greedy(draft, 20)
        assert result.rounds == 4  # 5 tokens per round
        wide, _ = _run(server, draft, SamplingParams(0.0), n=20, tree_nodes=12, tree_depth=4, tree_width=3)
        assert wide.tokens == result.tokens and wide.rounds == 4


def test_sampled_tree_sd_is_seeded_and_stays_in_step(tiny_server, tiny_pair):
    params = SamplingParams(1.0, top_k=50)
    a, sa = _run(tiny_server, tiny_pair[0], params, seed=11, tree_nodes=10, tree_depth=4, tree_width=2)
    b, _ = _run(tiny_server, tiny_pair[0], params, seed=11, tree_nodes=10, tree_depth=4, tree_width=2)
    c, _ = _run(tiny_server, tiny_pair[0], params, seed=12, tree_nodes=10, tree_depth=4, tree_width=2)
    assert a.tokens == b.tokens and a.tokens != c.tokens
    assert len(a.tokens) == 24 and a.finish_reason == "length"  # the close compared both sides' digests
    assert sa.drafter.kv.length <= len(sa.drafter.tokens)


def _verify(step, position, tokens, parents, rows=None, vocab=512):
    dist = (dist_codec.pack(np.zeros((0, vocab), np.float16), "sparse") if rows is None else
            dist_codec.pack(dist_codec.quantize(np.asarray(rows, np.float32)), "dense"))
    return P.Verify(1, step, position, np.zeros(0, np.int32), np.asarray(tokens, np.int32), dist,
                    parents=np.asarray(parents, np.int16))


@pytest.mark.parametrize("tokens,parents,match", [
    ([4, 5, 6], [-1, 1, 0], "not an earlier node"),  # a cycle: 1 → 1
    ([4, 5], [-1, 7], "not an earlier node"),  # out of range
    ([4, 5], [-1, -2], "not an earlier node"),
    ([4, 4], [-1, -1], "repeats the token"),
    (list(range(3, 3 + 9)), list(range(-1, 8)), "deep"),  # the cloud below allows 8 levels
    (list(range(3, 3 + 40)), [-1] * 40, "tokens, allowed"),  # more nodes than max_tree_nodes = 32
    ([4, 5], [-1], "parents has 1 entries"),
])
def test_malformed_trees_are_refused_and_the_session_goes_on(tiny_pair, tokens, parents, match):
    with serving(tiny_pair[1], max_tree_nodes=32, max_tree_depth=8) as server, _client(server) as client:
        assert (client.welcome.max_tree_nodes, client.welcome.max_tree_depth) == (32, 8)
        client.request(P.OpenSession(1, "sd", np.asarray(PROMPT, np.int32), P.Sampling(0.0), 0))
        with pytest.raises(CloudError, match=match):
            client.request(_verify(1, len(PROMPT), tokens, parents))
        verdict = client.request(_verify(1, len(PROMPT), [4, 9, 11], [-1, -1, 0]))
        assert isinstance(verdict, P.Verdict) and verdict.n_accepted == len(verdict.path)


def test_a_sampled_tree_needs_its_distributions(tiny_pair):
    V = 512
    with serving(tiny_pair[1]) as server, _client(server) as client:
        client.request(P.OpenSession(1, "sd", np.asarray(PROMPT, np.int32), P.Sampling(1.0), 0))
        with pytest.raises(CloudError, match="dist"):  # no rows, where root and node 0 need theirs
            client.request(_verify(1, len(PROMPT), [4, 9, 11], [-1, -1, 0]))
        rows = np.full((2, V), 1.0 / V)
        rows[1, 11] = 0.0
        rows[1] /= rows[1].sum()
        with pytest.raises(CloudError, match="zero probability"):
            client.request(_verify(1, len(PROMPT), [4, 9, 11], [-1, -1, 0], rows))
        rows = np.full((2, V), 1.0 / V)
        verdict = client.request(_verify(1, len(PROMPT), [4, 9, 11], [-1, -1, 0], rows))
        assert isinstance(verdict, P.Verdict) and verdict.position == len(PROMPT) + verdict.n_accepted + 1


@pytest.mark.parametrize("nodes,depth,width", [(8, 4, 2), (14, 6, 3)])
def test_trees_on_kv_slots_equal_the_targets_greedy_tokens(tiny_pair, nodes, depth, width):
    """The slot layout (CUDA's default; here on the CPU) verifies a tree eagerly with its own mask on the session's
    slot and moves the accepted path into place there."""
    draft, target = tiny_pair
    with serving(target, kv_layout="slots", kv_positions=4096, max_message_bytes=1 << 20) as server:
        assert "slots" in server.work.engine.executor.runner.layout.describe()
        result, _ = _run(server, draft, SamplingParams(0.0), n=32, tree_nodes=nodes, tree_depth=depth,
                         tree_width=width)
        assert result.tokens == _hf_greedy(target, 32)


def test_a_cloud_that_takes_no_trees_says_so(tiny_pair):
    """max_tree_nodes = 0 (and llama.cpp, whose model runs on its own caches): the Welcome states 0 nodes, a tree is
    refused with the reason, and a device asking for trees gets a clear error before it sends one."""
    with serving(tiny_pair[1], max_tree_nodes=0) as server, _client(server) as client:
        assert client.welcome.max_tree_nodes == 0
        client.request(P.OpenSession(1, "sd", np.asarray(PROMPT, np.int32), P.Sampling(0.0), 0))
        with pytest.raises(CloudError, match="max_tree_nodes = 0"):
            client.request(_verify(1, len(PROMPT), [4, 9], [-1, -1]))
        with pytest.raises(ValueError, match="verifies no draft trees"):
            _run(server, tiny_pair[0], SamplingParams(0.0), tree_nodes=8)


def test_a_step_budget_below_the_tree_limit_caps_it(tiny_pair):
    """token_budget bounds one step, and a tree's verify is one segment: a cloud with a budget of 32 positions takes
    trees of 31 nodes (the Welcome says so) whatever max_tree_nodes says, and refuses larger ones with the reason."""
    with serving(tiny_pair[1], token_budget=32, prefill_floor=16) as server, _client(server) as client:
        assert client.welcome.max_tree_nodes == 31
        client.request(P.OpenSession(1, "sd", np.asarray(PROMPT, np.int32), P.Sampling(0.0), 0))
        with pytest.raises(CloudError, match="allowed 1..31"):
            client.request(_verify(1, len(PROMPT), list(range(3, 35)), [-1] * 32))


def test_tree_settings_are_checked():
    with pytest.raises(ValueError, match="tree_nodes"):
        EdgeConfig(model="tiny", tree_nodes=-1)
    engine = EdgeConfig.__dataclass_fields__["engine"].default.__class__
    with pytest.raises(ValueError, match="torch and llamacpp backends' draft model"):  # Λ's token draft in torch
        EdgeConfig(model="tiny", tree_nodes=8, engine=engine(token_draft="adapter"), split=SplitConfig(adapter="a"))
    EdgeConfig(model="tiny", tree_nodes=8, engine=engine(backend="llamacpp"))
    for draft in ("model", "adapter"):  # a bundle's draft graphs run trees (tests/test_bundle_trees.py)
        EdgeConfig(model="tiny", tree_nodes=8, engine=engine(backend="onnxruntime", bundle="b", token_draft=draft))
