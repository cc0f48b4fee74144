"""Draft trees' math (hat_split.math.tree): shapes refused with their reason, the tree's attention mask, children drawn
without replacement, greedy verification by hand, and sampled verification whose committed tokens follow the target
over 10^5 trees — where two wrong multi-draft rules do not."""
from __future__ import annotations

import math

import numpy as np
import pytest

from hat_split.math.tree import (ROOT, ancestor_mask, chain, check_tree, children_of, draw_children, path_to,
                                 top_tokens, verify_tree, verify_tree_greedy)


@pytest.mark.parametrize("parents,tokens,message", [
    ([-1, 0, 2], [1, 2, 3], "node 2's parent 2 is not an earlier node"),  # a self-loop
    ([-1, 2, 0], [1, 2, 3], "node 1's parent 2 is not an earlier node"),  # a child listed before its parent
    ([-1, 0, -2], [1, 2, 3], "node 2's parent -2"),
    ([-1] * 9, list(range(9)), "the tree has 9 nodes; at most 8"),
    ([-1, 0, 1, 2], [1, 2, 3, 4], "node 3 is 4 deep; at most 3"),
    ([-1, 0, 0], [1, 5, 5], "node 2 repeats the token 5 of its sibling 1"),
    ([-1, 0], [1], "two lists of one length"),
    ([], [], "at least one node"),
])
def test_a_malformed_tree_is_refused_with_its_reason(parents, tokens, message):
    with pytest.raises(ValueError, match=message):
        check_tree(np.array(parents, dtype=np.int64), np.array(tokens, dtype=np.int64), max_nodes=8, max_depth=3)


def test_depths_children_paths_and_the_mask_by_hand():
    parents = np.array([-1, -1, 0, 2, 0])  # root → 0 → {2 → 3, 4}; root → 1
    tokens = np.array([10, 11, 12, 13, 14])
    assert check_tree(parents, tokens, 8, 3).tolist() == [1, 1, 2, 3, 2]
    assert children_of(parents) == [[0, 1], [2, 4], [], [3], [], []]
    assert path_to(parents, 3) == [0, 2, 3] and path_to(parents, ROOT) == []
    mask = ancestor_mask(parents)
    assert mask.astype(int).tolist() == [[1, 0, 0, 0, 0],
                                         [0, 1, 0, 0, 0],
                                         [1, 0, 1, 0, 0],
                                         [1, 0, 1, 1, 0],
                                         [1, 0, 0, 0, 1]]
    p, t = chain([7, 8, 9])
    assert p.tolist() == [-1, 0, 1] and ancestor_mask(p).all(axis=1).tolist() == [False, False, True]


def test_greedy_verification_follows_the_targets_argmax():
    parents = np.array([-1, -1, 0, 0, 3])
    tokens = np.array([5, 6, 7, 8, 9])
    argmax = np.array([5, 8, 0, 0, 9, 1])  # after root: 5 (node 0); after node 0: 8 (node 3); after 3: 9 (node 4)
    v = verify_tree_greedy(parents, tokens, argmax)
    assert v.path == [0, 3, 4] and v.token == 1
    argmax[0] = 4  # no child of the root is the argmax: nothing accepted, the argmax is the token
    v = verify_tree_greedy(parents, tokens, argmax)
    assert v.path == [] and v.token == 4


def test_children_are_drawn_without_replacement():
    rng = np.random.default_rng(0)
    q = np.array([0.5, 0.3, 0.2, 0.0])
    firsts, pairs = np.zeros(4), {}
    for _ in range(20_000):
        a, b = draw_children(q, 2, rng.random(4))
        firsts[a] += 1
        pairs[(a, b)] = pairs.get((a, b), 0) + 1
    assert np.allclose(firsts / 20_000, q, atol=0.015)
    assert pairs.get((0, 1), 0) / 20_000 == pytest.approx(0.5 * 0.3 / 0.5, abs=0.015)  # q(a) · q(b) / (1 − q(a))
    assert all(a != b and 3 not in (a, b) for a, b in pairs)
    assert draw_children(q, 9, rng.random(4)).tolist() != [] and len(draw_children(q, 9, rng.random(4))) == 3


V = 4
TRIALS = 100_000


def _laws(seed=3):
    """A two-step target and draft over V tokens: p1, q1 after the root; p2[x], q2[x] after the first token x —
    deliberately far apart, so a wrong rule shows."""
    rng = np.random.default_rng(seed)
    p1, q1 = rng.dirichlet(np.ones(V)), rng.dirichlet(np.ones(V) * 0.5)
    p2, q2 = rng.dirichlet(np.ones(V), size=V), rng.dirichlet(np.ones(V) * 0.5, size=V)
    return p1, q1, p2, q2


def _rrs_no_update(parents, tokens, p, q, uniform):
    """A wrong rule: each child tried against the unchanged p and q (no residual update, no removal)."""
    kids = children_of(parents)
    node, path = ROOT, []
    while True:
        accepted = next((c for c in kids[node + 1] if uniform() * q[node + 1][tokens[c]] < p[node + 1][tokens[c]]),
                        None)
        if accepted is None:
            return path, int(np.searchsorted(np.cumsum(p[node + 1]), uniform() * p[node + 1].sum(), side="right"))
        path.append(accepted)
        node = accepted


def _rrs_with_replacement(parents, tokens, p, q, uniform):
    """A wrong rule for children drawn without replacement: SpecInfer's residual update, but against q itself
    (the law of children drawn with replacement), not q with the earlier children removed."""
    kids = children_of(parents)
    node, path = ROOT, []
    while True:
        p_i, q_i = p[node + 1].copy(), q[node + 1]
        accepted = None
        for c in kids[node + 1]:
            x = tokens[c]
            if uniform() * q_i[x] < p_i[x] / p_i.sum():
                accepted = c
                break
            p_i = np.maximum(p_i / p_i.sum() - q_i, 0.0)
        if accepted is None:
            return path, int(np.searchsorted(np.cumsum(p_i), uniform() * p_i.sum(), side="right"))
        path.append(accepted)
        node = accepted


def _first_two(rule, trials=TRIALS, seed=11):
    """Frequencies of the first two committed tokens over `trials` trees: 3 children of the root, 2 below each."""
    p1, q1, p2, q2 = _laws()
    rng = np.random.default_rng(seed)
    counts = np.zeros((V, V))
    uniform = rng.random
    for _ in range(trials):
        top = draw_children(q1, 3, rng.random(V))
        parents, tokens, rows_p, rows_q = [], [], [p1], [q1]
        for x in top:
            parents.append(ROOT)
            tokens.append(int(x))
            rows_p.append(p2[x])
            rows_q.append(q2[x])
        for i, x in enumerate(top):
            for y in draw_children(q2[x], 2, rng.random(V)):
                parents.append(i)
                tokens.append(int(y))
                rows_p.append(p1)  # past the second token: not counted
                rows_q.append(q1)
        parents_a, tokens_a = np.array(parents), np.array(tokens)
        out = rule(parents_a, tokens_a, np.array(rows_p), np.array(rows_q), uniform)
        path, token = (out.path, out.token) if hasattr(out, "path") else out
        seq = [int(tokens_a[n]) for n in path] + [token]
        if len(seq) < 2:  # the second token is the target's draw after the first: one more step, as the cloud does
            seq.append(int(np.searchsorted(np.cumsum(p2[seq[0]]), uniform(), side="right")))
        counts[seq[0], seq[1]] += 1
    return counts, p1[:, None] * p2


def _chi2(counts, law):
    expected = law * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def _chi2_quantile(df: int, z: float = 3.09) -> float:
    """The 0.999 quantile of χ²(df) (Wilson–Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_sampled_verification_follows_the_target_and_wrong_rules_do_not():
    limit = _chi2_quantile(V * V - 1)
    counts, law = _first_two(verify_tree)
    assert _chi2(counts, law) < limit, (counts / TRIALS, law)
    for wrong in (_rrs_no_update, _rrs_with_replacement):  # 30 000 trees show them (χ² 4 550 and 500)
        counts, law = _first_two(wrong, 30_000)
        assert _chi2(counts, law) > 4 * limit, wrong.__name__


def test_sampled_verification_refuses_children_not_drawn_without_replacement():
    parents, tokens = np.array([-1, -1]), np.array([0, 0])  # the same token twice below the root
    p, q = np.array([[0.1, 0.9]] * 3), np.full((3, 2), 0.5)
    with pytest.raises(ValueError, match="not drawn without replacement"):
        verify_tree(parents, tokens, p, q, lambda: 0.99)  # the first is rejected; the second has no q left
    assert verify_tree(np.array([-1]), np.array([1]), p, q, lambda: 0.0).path == [0]


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_a_trees_one_forward_equals_each_path_alone_and_the_kept_path_equals_a_fresh_one(family):
    """Stack.forward_tree on a cache (growing caches, float32): each node's hidden state equals its path run alone as
    a chain on the same prefix (Gemma 3's sliding window of 4 included: a path longer than the window), in one call
    or grown in two; and after
    PartCache.keep of an accepted path, the cache equals the path's own and the next step's output is the same."""
    import torch

    from hat_split.models.partition import PartCache, Stack
    from tests.test_hat import V, _family

    model = _family(family)
    stack = Stack(model, 0, model.config.num_hidden_layers)
    rng = np.random.default_rng(0)
    embed = model.model.embed_tokens

    def h(ids):
        return embed(torch.tensor([list(ids)]))

    prefix = rng.integers(0, V, 7).tolist()
    parents = np.array([-1, -1, 0, 0, 2, 4, 5, 3])  # depths 1 1 2 2 3 4 5 3: a path of 5 > the window
    tokens = rng.integers(0, V, parents.size).tolist()
    base = PartCache()
    stack.forward(base, h(prefix))
    tree_cache = base.fork()
    out = stack.forward_tree(tree_cache, h(tokens), parents)
    assert tree_cache.length == len(prefix) + parents.size
    for i in range(parents.size):
        path = path_to(parents, i)
        alone = base.fork()
        ref = stack.forward(alone, h([tokens[n] for n in path]))
        assert torch.allclose(out[0, i], ref[0, -1], atol=1e-5), (family, i)
    parts = base.fork()  # the same tree in two calls (a tree grown a level at a time): the same states
    first = stack.forward_tree(parts, h(tokens[:4]), parents[:4])
    with pytest.raises(ValueError, match="4 nodes in the cache and 4 new ones needs 8 parents, got 6"):
        stack.forward_tree(parts.fork(), h(tokens[4:]), parents[:6], start=len(prefix))
    second = stack.forward_tree(parts, h(tokens[4:]), parents, start=len(prefix))
    assert torch.allclose(torch.cat([first, second], dim=1), out, atol=1e-5), family
    accepted = path_to(parents, 6)  # [0, 2, 4, 5, 6]
    tree_cache.keep(len(prefix), accepted)
    fresh = base.fork()
    stack.forward(fresh, h([tokens[n] for n in accepted]))
    assert tree_cache.length == fresh.length
    for layer, (k, v) in fresh.kv.items():
        assert torch.allclose(tree_cache.kv[layer][0], k, atol=1e-5) and torch.allclose(tree_cache.kv[layer][1], v,
                                                                                         atol=1e-5)
    nxt = h([int(rng.integers(0, V))])
    assert torch.allclose(stack.forward(tree_cache, nxt), stack.forward(fresh, nxt), atol=1e-5)
    with pytest.raises(ValueError, match="cannot keep rows"):
        fresh.keep(len(prefix), [0, 99])
    with pytest.raises(ValueError, match="not an earlier node"):
        stack.forward_tree(base.fork(), h(tokens[:2]), [0, -1])


def test_a_tree_grows_by_path_probability_within_its_budget_and_depth():
    from hat_split.math.tree import grow_tree

    q1 = np.array([0.6, 0.3, 0.1, 0.0])
    after = {0: np.array([0.1, 0.1, 0.1, 0.7]), 1: np.array([0.25, 0.25, 0.25, 0.25])}
    calls = []

    def q_after(parents, tokens, nodes):  # the draft after a node depends on its token only here
        calls.append(list(nodes))
        return np.array([after.get(tokens[n], np.full(4, 0.25)) for n in nodes])

    # greedy, width 2 (nodes per level), budget 5: the root's top two (0, then 1); on level 2 the best candidates are
    # node 0's best child (0.6 · 0.7) and node 1's (0.3 · 0.25, before node 0's second at 0.06); on level 3 the last
    # node of the budget goes below node 2 (0.42 · 0.25 against 0.075 · 0.7)
    t = grow_tree(q1, q_after, budget=5, max_depth=3, width=2, uniform=None, greedy=True)
    assert t.parents.tolist() == [-1, -1, 0, 1, 2] and t.tokens.tolist() == [0, 1, 3, 0, 0]
    assert t.path_prob == pytest.approx([0.6, 0.3, 0.42, 0.075, 0.105])
    assert t.q.shape == (6, 4) and calls == [[0, 1], [2, 3]] and not t.q[5:].any()  # the last level: no forward
    check_tree(t.parents, t.tokens, 5, 3)
    wide = grow_tree(q1, lambda par, tok, nodes: np.full((len(nodes), 4), 0.25), budget=20, max_depth=2, width=3,
                     uniform=np.random.default_rng(0).random, greedy=False)
    assert check_tree(wide.parents, wide.tokens, 20, 2).max() == 2 and len(wide.parents) == 3 + 3
    # η: the tree ends after the level whose main-line token (the root's first child, q 0.6) is below it
    calls.clear()
    short = grow_tree(q1, q_after, budget=5, max_depth=3, width=2, uniform=None, greedy=True, stop_below=0.7)
    assert short.parents.tolist() == [-1, -1] and calls == [] and not short.q[1:].any()
    assert grow_tree(q1, q_after, budget=5, max_depth=3, width=2, uniform=None, greedy=True,
                     stop_below=0.5).parents.tolist() == t.parents.tolist()
    # a budget below width × depth keeps a node for each level still to come: the main line reaches max_depth
    deep = grow_tree(q1, lambda par, tok, nodes: np.full((len(nodes), 4), 0.25), budget=6, max_depth=4, width=4,
                     uniform=None, greedy=True)
    assert check_tree(deep.parents, deep.tokens, 6, 4).tolist() == [1, 1, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="budget, depth and width"):
        grow_tree(q1, q_after, budget=0, max_depth=2, width=2, uniform=None, greedy=True)
    with pytest.raises(ValueError, match="needs uniforms"):
        grow_tree(q1, q_after, budget=3, max_depth=2, width=2, uniform=None, greedy=False)


@pytest.mark.parametrize("stop_below", [0.0, 0.3])
def test_grown_trees_keep_the_targets_law(stop_below):
    """Trees grown by grow_tree (width 2, budget 5, depth 2: the second level's children go to the first level's
    likeliest nodes, so the shape varies with what was drawn), verified by verify_tree: the first two committed tokens
    follow p(x1)·p(x2 | x1) over 30 000 trees."""
    from hat_split.math.tree import grow_tree

    p1, q1, p2, q2 = _laws()
    rng = np.random.default_rng(5)
    counts = np.zeros((V, V))

    def q_after(parents, tokens, nodes):  # after a root's child: q2 of its token; deeper: not read (leaves)
        return np.array([q2[tokens[n]] if parents[n] == ROOT else q1 for n in nodes])

    for _ in range(30_000):
        t = grow_tree(q1, q_after, budget=5, max_depth=2, width=2, uniform=rng.random, greedy=False,
                      stop_below=stop_below)
        rows_p = np.array([p1] + [p2[x] if par == ROOT else p1 for par, x in zip(t.parents, t.tokens)])
        out = verify_tree(t.parents, t.tokens, rows_p, t.q, rng.random)
        seq = [int(t.tokens[n]) for n in out.path] + [out.token]
        if len(seq) < 2:
            seq.append(int(np.searchsorted(np.cumsum(p2[seq[0]]), rng.random(), side="right")))
        counts[seq[0], seq[1]] += 1
    assert _chi2(counts, p1[:, None] * p2) < _chi2_quantile(V * V - 1)


def test_the_tree_lm_equals_the_model_and_drafts_trees_that_a_fresh_chain_confirms():
    """TreeLM (the model's layers as one Stack) gives CausalLM's logits on a chain; Drafter.draft_tree grows a tree
    on it (one forward per level) whose distributions after each node equal its path run alone, at T = 0 by the
    plain softmax and above through the float wire; commit_tree keeps the accepted path, and the next draft equals a
    fresh drafter's on the same committed tokens."""
    import torch

    from edge_runtime.drafter import Drafter
    from hat_split.math.sampling import SamplingParams, warp
    from hat_split.models.lm import CausalLM
    from hat_split.models.tree_lm import TreeLM
    from hat_split.wire import dist_codec
    from tests.test_hat import V, _family

    model = _family("llama")
    tree_lm, plain = TreeLM(model), CausalLM(model)
    prompt = np.random.default_rng(1).integers(0, V, 9).tolist()
    a, b = tree_lm.forward(tree_lm.new_state(), prompt, 3), plain.forward(plain.new_state(), prompt, 3)
    assert np.allclose(a, b, atol=1e-4)

    def after_path(tokens):  # the draft's logits after prompt + tokens, run alone
        return tree_lm.forward(tree_lm.new_state(), prompt + list(tokens), 1)[0]

    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature)
        d = Drafter(tree_lm, params)
        d.start(prompt)
        tree, rows = d.draft_tree(budget=7, max_depth=4, width=2, rng=np.random.default_rng(2))
        check_tree(tree.parents, tree.tokens, 7, 4)
        assert len(tree.parents) == 7 and d.kv.length == len(prompt) + 6  # 2 per level; the last level (1 node) not fed
        shape = SamplingParams(1.0) if temperature == 0 else params
        for i in range(6):  # every node but the last level's: its row is the draft after its path
            path = [int(tree.tokens[n]) for n in path_to(tree.parents, i)]
            want = warp(after_path(path)[None], shape)[0]
            if temperature:
                want = dist_codec.dequantize(dist_codec.quantize(want[None], "float16"))[0]
            assert np.allclose(tree.q[i + 1], want, atol=1e-3), (temperature, i)
        if temperature == 0:
            assert rows == [] and tree.tokens[:2].tolist() == np.argsort(-tree.q[0])[:2].tolist()
        else:
            assert len(rows) == 8 and not rows[-1].any() and np.allclose(dist_codec.dequantize(rows[0])[0],
                                                                         tree.q[0])
        deepest = int(np.argmax(check_tree(tree.parents, tree.tokens, 7, 4)))
        path = path_to(tree.parents, deepest)
        committed = [int(tree.tokens[n]) for n in path] + [5]
        d.commit_tree(committed, path)
        fresh = Drafter(tree_lm, params)
        fresh.start(prompt + committed)
        assert d.tokens == fresh.tokens and d.kv.length <= len(d.tokens) - 1
        with torch.no_grad():
            assert np.allclose(d._next_logits([]), fresh._next_logits([]), atol=1e-4)
    with pytest.raises(ValueError, match="draft trees need a model that runs them"):
        Drafter(plain, SamplingParams(0.0)).draft_tree(3, 2, 2, np.random.default_rng(0))


def test_a_tree_below_a_chain_is_one_tree():
    from hat_split.math.tree import below_chain

    assert below_chain(1, [-1, 0, 0, 1]) == [-1, 0, 1, 1, 2]  # the root, then the tree below it
    assert below_chain(3, [-1, -1]) == [-1, 0, 1, 2, 2]  # two tokens the cache lacks, the root, two children
    check_tree(np.array(below_chain(3, [-1, -1, 0])), np.arange(6), 6, 6)


def test_top_tokens_is_the_stable_sorts_head_without_the_sort():
    """top_tokens(q, k) = np.argsort(-q, kind="stable")[:k] (most probable first, ties by the smaller id) on rows
    with ties across the k-th value, exact zeros, -inf logits and k beyond the vocabulary."""
    rng = np.random.default_rng(5)
    tied = np.array([0.1, 0.3, 0.3, 0.0, 0.3, 0.0])
    assert top_tokens(tied, 2).tolist() == [1, 2] and top_tokens(tied, 4).tolist() == [1, 2, 4, 0]
    rows = [tied, np.array([-np.inf, 2.0, -np.inf, 2.0]), rng.random(1000), rng.integers(0, 5, 1000).astype(float),
            np.zeros(7)]
    for q in rows:
        for k in (1, 2, 3, 5, 50, q.size, q.size + 3):
            assert top_tokens(q, k).tolist() == np.argsort(-q, kind="stable")[:k].tolist(), (q[:8], k)
    assert top_tokens(tied, 0).size == 0

