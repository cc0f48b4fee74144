"""Draft trees on llama.cpp (hat_split.models.llamacpp_lm, sequence-id sets) on the registry's GGUF file of
SmolLM2-135M: a tree's logits from one forward (or a level per forward) equal each path's computed alone, the cache
after `keep` equals a fresh evaluation of the accepted path and frees every other branch's sequences, bad trees and
misuse are refused with nothing changed; a llama.cpp cloud verifies trees from a llama.cpp device and a torch one,
greedy = the target's own tokens, and defers a tree to the next step when its sequences are short."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from edge_runtime.config import EdgeConfig, EngineConfig, LinkConfig
from edge_runtime.runtime import EdgeRuntime
from hat_split.math.sampling import SamplingParams
from hat_split.math.tree import below_chain
from hat_split.models.loading import vocab_fingerprint
from hat_split.net.security import LinkSecurity
from tests.conftest import serving
from tests.exactness import assert_greedy

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (scripts/install_llamacpp.sh)")

from cloud_runtime.cache_runner import CacheRunner, tree_capacity, tree_sequences  # noqa: E402
from hat_split.models.llamacpp_lm import LlamaCppLM, LlamaCppSettings  # noqa: E402

#            0   1   2  3  4  5  6  7
PARENTS = [-1, -1, 0, 0, 1, 2, 2, 4]  # two root children, a node with two children, depth 4 at most
TOKENS = [28, 314, 2051, 17, 905, 11, 260, 4463]


@pytest.fixture(scope="module")
def lm(smollm2_gguf):
    with LlamaCppLM(smollm2_gguf, LlamaCppSettings(n_ctx=1024, n_batch=64, n_threads=2, n_seq_max=24)) as m:
        yield m


def path_of(node: int, parents=PARENTS):
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


def close(got, want):
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-3 * np.abs(want).max())
    assert (got.argmax(-1) == want.argmax(-1)).all()


def near(got, want, bound=0.05):
    """After a keep the kept cells sit among freed ones, and the next tokens fill those holes: llama.cpp's CPU flash
    attention accumulates values in float16 in cell order, so logits move by up to ~1 (KL up to 0.02 measured
    here), as they do between batch shapes without flash attention (KL 0.025 between one-by-one and batched
    decodes of the same tokens): the same argmax, KL(want ‖ got) below `bound`."""
    from hat_split.math.sampling import SamplingParams, warp

    p, q = warp(want, SamplingParams(1.0)), warp(got, SamplingParams(1.0))
    kl = (p * (np.log(p + 1e-30) - np.log(q + 1e-30))).sum(-1)
    assert (got.argmax(-1) == want.argmax(-1)).all() and kl.max() < bound, kl


def alone(lm, ids, path_tokens):
    """The logits after a path's last token, computed on a fresh chain."""
    return lm.forward(lm.new_state(), list(ids) + list(path_tokens), n_logits=1)[0]


def test_a_tree_in_one_forward_equals_each_path_computed_alone(lm, smollm2_ids):
    free = lm.free_sequences
    state = lm.new_state()
    lm.forward(state, smollm2_ids, n_logits=1)
    got = lm.forward_tree(state, PARENTS, TOKENS, len(smollm2_ids))
    assert got.shape == (len(TOKENS), lm.vocab_size) and state.length == len(smollm2_ids) + len(TOKENS)
    assert lm.free_sequences == free - 1 - 4  # the state, and one sequence per leaf (3, 5, 6, 7)
    for node in range(len(TOKENS)):
        close(got[node], alone(lm, smollm2_ids, [TOKENS[n] for n in path_of(node)]))
    lm.crop(state, len(smollm2_ids))  # the tree goes whole
    assert lm.free_sequences == free - 1 and state.length == len(smollm2_ids)


def test_a_tree_grown_a_level_per_forward_equals_the_one_forward(lm, smollm2_ids):
    """The device's way (edge_runtime.drafter.Drafter.draft_tree): each level's nodes join the cached tree."""
    one = lm.new_state()
    lm.forward(one, smollm2_ids, n_logits=1)
    whole = lm.forward_tree(one, PARENTS, TOKENS, len(smollm2_ids))
    state = lm.new_state()
    lm.forward(state, smollm2_ids, n_logits=1)
    start, rows = len(smollm2_ids), []
    for level in ([0, 1], [2, 3, 4], [5, 6, 7]):
        rows.append(lm.forward_tree(state, PARENTS[:level[-1] + 1], [TOKENS[n] for n in level], start))
    close(np.concatenate(rows), whole)


@pytest.mark.parametrize("node", [7, 6, 1])
def test_keep_leaves_the_accepted_path_equal_to_a_fresh_evaluation(lm, smollm2_ids, node):
    free = lm.free_sequences
    state = lm.new_state()
    lm.forward(state, smollm2_ids, n_logits=1)
    start = len(smollm2_ids)
    lm.forward_tree(state, PARENTS, TOKENS, start)
    path = path_of(node)
    lm.keep(state, start, path)
    assert state.length == start + len(path) and lm.free_sequences == free - 1  # every path's sequence back
    after = [lm.vocab_size - 5, 42]  # the cache goes on from the kept path
    got = lm.forward(state, after, n_logits=2)
    want = lm.forward(lm.new_state(), smollm2_ids + [TOKENS[n] for n in path] + after, n_logits=2)
    near(got, want)


def test_the_clouds_feed_a_chain_then_a_tree_keeps_the_chain_and_the_path(lm, smollm2_ids):
    """cloud_runtime.token_handlers: the tokens the cache lacks and the root, then the nodes, in one forward
    (hat_split.math.tree.below_chain); keep from the first node on."""
    prefix, lacking = smollm2_ids[:-3], smollm2_ids[-3:]
    state = lm.new_state()
    lm.forward(state, prefix, n_logits=1)
    feed = lacking + TOKENS
    got = lm.forward_many([state], [feed], [len(TOKENS) + 1], [(below_chain(len(lacking), PARENTS), len(prefix))])[0]
    close(got[0], alone(lm, smollm2_ids, []))  # after the root
    for node in range(len(TOKENS)):
        close(got[node + 1], alone(lm, smollm2_ids, [TOKENS[n] for n in path_of(node)]))
    lm.keep(state, len(smollm2_ids), path_of(5))
    near(lm.forward(state, [99], n_logits=1)[0], alone(lm, smollm2_ids, [TOKENS[n] for n in path_of(5)] + [99]))


def test_trees_of_two_states_and_a_chain_in_one_forward_equal_each_alone(lm, smollm2_ids):
    other = smollm2_ids[:9]
    a, b, c = lm.new_state(), lm.new_state(), lm.new_state()
    for s, ids in ((a, smollm2_ids), (b, other), (c, other)):
        lm.forward(s, ids, n_logits=1)
    out = lm.forward_many([a, b, c], [TOKENS, TOKENS[:4], [5, 6]], [len(TOKENS), 4, 2],
                          [(PARENTS, len(smollm2_ids)), ([-1, 0, 0, -1], len(other)), None])
    for node in range(len(TOKENS)):
        close(out[0][node], alone(lm, smollm2_ids, [TOKENS[n] for n in path_of(node)]))
    for node, path in enumerate(([0], [0, 1], [0, 2], [3])):
        close(out[1][node], alone(lm, other, [TOKENS[n] for n in path]))
    close(out[2], lm.forward(lm.new_state(), other + [5, 6], n_logits=2))


def test_bad_trees_and_misuse_are_refused_with_nothing_changed(smollm2_gguf, smollm2_ids):
    with LlamaCppLM(smollm2_gguf, LlamaCppSettings(n_ctx=512, n_batch=16, n_threads=2, n_seq_max=4)) as lm:
        state = lm.new_state()
        lm.forward(state, smollm2_ids, n_logits=1)
        start, free = len(smollm2_ids), lm.free_sequences
        for parents, why in (([-1, 1], "not an earlier node"), ([-1, -2], "not an earlier node"),
                             ([-1, 0, 5], "not an earlier node")):
            with pytest.raises(ValueError, match=why):
                lm.forward_tree(state, parents, [1] * len(parents), start)
        with pytest.raises(ValueError, match="begins at the state's length"):
            lm.forward_tree(state, [-1], [1], start - 1)
        with pytest.raises(RuntimeError, match="need 4 llama.cpp sequences, 3 are free"):
            lm.forward_tree(state, [-1, -1, -1, -1], [1, 2, 3, 4], start)
        with pytest.raises(ValueError, match="longer than one batch"):
            lm.forward_tree(state, list(range(-1, 16)), [1] * 17, start)
        assert (state.length, lm.free_sequences) == (start, free)
        lm.forward_tree(state, [-1, -1, 0], [1, 2, 3], start)
        with pytest.raises(ValueError, match="holds a draft tree"):
            lm.forward(state, [4])
        with pytest.raises(ValueError, match="extend the draft tree"):
            lm.forward_tree(state, [-1, 0, 0, 1], [1, 2, 3, 4], start)
        with pytest.raises(ValueError, match="cannot crop a draft tree"):
            lm.crop(state, start + 1)
        with pytest.raises(ValueError, match="not a path of the draft tree"):
            lm.keep(state, start, [0, 1])
        with pytest.raises(ValueError, match="not a path of the draft tree"):
            lm.keep(state, start, [2])
        assert state.length == start + 3
        lm.keep(state, start, [0, 2])
        assert (state.length, lm.free_sequences) == (start + 2, free)
        with pytest.raises(ValueError, match="holds no draft tree"):
            lm.keep(state, start, [1])
        lm.keep(state, start, [0])  # a chain's rows in place: a crop
        assert state.length == start + 1


def test_sequence_arithmetic_of_a_llama_cpp_cloud():
    assert tree_sequences(8, 0, 256) == 9  # no trees: a sequence per session and one more
    assert tree_sequences(8, 16, 256) == 9 + 128
    assert tree_sequences(64, 64, 256) == 256  # capped by llama.cpp's build
    assert tree_capacity(256, 64) == 191 and tree_capacity(9, 8) == 0 and tree_capacity(8, 64) == 0


class _Tag:
    def __init__(self):
        self.compute_s = 0.0
        self.session = self


def test_a_step_leaves_a_tree_whose_paths_do_not_fit_to_the_next(smollm2_gguf, smollm2_ids):
    """Two sessions' 4-leaf trees and 6 sequences for trees: the first step verifies one (and the other session's
    chain work would go with it), the second the other once the first is kept; each tree's rows equal its paths
    alone."""
    from hat_split.math.chunking import DelayModel
    from cloud_runtime.scheduler import SchedulerConfig

    lm = LlamaCppLM(smollm2_gguf, LlamaCppSettings(n_ctx=512, n_batch=64, n_threads=2, n_seq_max=2 + 6))
    runner = CacheRunner(lm, SchedulerConfig(token_budget=64, prefill_floor=0, max_sessions=2), decode_limit=17,
                         load=DelayModel())
    assert runner.takes_trees
    prefix = smollm2_ids[:-1]
    for key in "ab":
        runner.open(key, 0, 0, owner=key)
        runner.submit_tokens(key, prefix, 0, _Tag())
    while runner.busy:
        runner.step()
    nodes, star = [28, 314, 2051, 17], [-1, -1, -1, -1]  # four leaves below the root
    feed = smollm2_ids[-1:] + nodes
    tags = {key: _Tag() for key in "ab"}
    for key in "ab":
        runner.submit_tokens(key, feed, 5, tags[key], below_chain(1, star))
    first = runner.step().done
    assert len(first) == 1 and runner.busy
    assert lm.free_sequences == 2  # the first tree's 4 paths held until its keep
    key = "a" if first[0][0] is tags["a"] else "b"
    runner.keep(key, len(smollm2_ids), [2])
    assert runner.held(key) == (len(smollm2_ids) + 1, 0)
    second = runner.step().done
    assert len(second) == 1 and second[0][0] is tags["b" if key == "a" else "a"]
    for _, rows in first + second:
        close(rows[0], alone(lm, smollm2_ids, []))
        for n, token in enumerate(nodes):
            close(rows[n + 1], alone(lm, smollm2_ids, [token]))


def _client(endpoint, fingerprint, vocab):
    from edge_runtime.client import CloudClient
    from hat_split.wire import messages as P

    return CloudClient(LinkConfig(endpoint, security=LinkSecurity.plaintext()),
                       P.Hello("t", "smollm2-135m", vocab, fingerprint))


def test_a_llama_cpp_cloud_verifies_trees_from_both_engines(smollm2_gguf, smollm2, smollm2_ids):
    """Greedy tree `sd` over a llama.cpp target gives its own tokens (up to llama.cpp's numerics: `assert_greedy`),
    the device drafting on llama.cpp or on torch, two devices at once; a malformed tree is refused with the reason
    and the session goes on; a cloud whose sessions take every sequence states 0 nodes and the device is told before
    sending."""
    from edge_runtime.client import CloudError
    from hat_split.wire import dist_codec
    from hat_split.wire import messages as P

    target = LlamaCppLM(smollm2_gguf, LlamaCppSettings(n_ctx=2048, n_batch=64, n_threads=2,
                                                       n_seq_max=tree_sequences(2, 12, 256)))
    fingerprint = vocab_fingerprint(smollm2.tokenizer)
    prompts = [smollm2_ids, list(smollm2.tokenizer("def quicksort(xs):\n")["input_ids"])]
    reference = [target.greedy(p, 20) for p in prompts]
    with serving(target, vocab=fingerprint, max_sessions=2) as server:
        link = LinkConfig(server.endpoint, security=LinkSecurity.plaintext())
        configs = [EdgeConfig(model="smollm2-135m", engine=EngineConfig(backend="llamacpp", n_ctx=1024, threads=1),
                              link=link, tree_nodes=8, tree_depth=4, tree_width=3),
                   EdgeConfig(model="smollm2-135m", link=link, tree_nodes=8, tree_depth=4, tree_width=3)]
        results, welcomes = [None, None], [None, None]

        def device(i):
            with EdgeRuntime(configs[i], None if i == 0 else smollm2) as rt:
                results[i] = rt.generate(prompts[i], "sd", SamplingParams(0.0), 20, seed=i)
                welcomes[i] = rt.client.welcome.max_tree_nodes

        threads = [threading.Thread(target=device, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
        assert welcomes == [24, 24]
        for prompt, r in zip(prompts, results):
            assert_greedy(target, prompt, r.tokens)
        assert all(r.drafted > r.rounds for r in results)  # trees of several nodes were sent
        with _client(server.endpoint, fingerprint, target.vocab_size) as client:
            empty = dist_codec.pack(np.zeros((0, target.vocab_size), np.float16), "sparse")
            client.request(P.OpenSession(1, "sd", np.asarray(smollm2_ids, np.int32), P.Sampling(0.0), 0))
            with pytest.raises(CloudError, match="not an earlier node"):
                client.request(P.Verify(1, 1, len(smollm2_ids), np.zeros(0, np.int32), np.asarray([4, 5], np.int32),
                                        empty, parents=np.asarray([-1, 1], np.int16)))
            verdict = client.request(P.Verify(1, 1, len(smollm2_ids), np.zeros(0, np.int32),
                                              np.asarray([reference[0][0], 9, reference[0][1]], np.int32), empty,
                                              parents=np.asarray([-1, -1, 0], np.int16)))
            assert list(verdict.path) == [0, 2] and verdict.token == reference[0][2]
    with serving(target, vocab=fingerprint, max_sessions=64) as server:
        trees = EdgeConfig(model="smollm2-135m", link=LinkConfig(server.endpoint,
                                                                 security=LinkSecurity.plaintext()), tree_nodes=8)
        with EdgeRuntime(trees, smollm2) as rt:
            with pytest.raises(Exception, match="verifies no draft trees"):
                rt.generate(smollm2_ids, "sd", SamplingParams(0.0), 4, seed=0)
            assert rt.client.welcome.max_tree_nodes == 0


def test_sampled_tree_sd_over_a_llama_cpp_cloud_follows_its_softmax_with_a_far_draft(smollm2_gguf, smollm2):
    """T = 1, `hat-cloud serve --engine llamacpp` in its own process verifying 8-node draft trees (3 levels, 3 a
    level; children drawn without replacement, recursive rejection sampling in the cloud) from a torch draft far from
    it (SmolLM2 with Gaussian noise on its head, as tests/test_llamacpp.py's chain test): every generated token
    follows the llama.cpp target's softmax given its prefix (tests/exactness.py; p from a fresh llama.cpp evaluation
    of the same tokens: the cell-order shift after a keep, KL ≤ 0.02, is far below what 240 tokens can see), and the
    run has the power to catch a verifier that accepts every draft (the last token of each round left out, as a
    possible bonus)."""
    from tests.exactness import Z_CRIT, drift, fault_law, llama_cpp_far_draft_run, power_of_law, tv_rows

    n = 240
    res, p, q = llama_cpp_far_draft_run(smollm2, smollm2_gguf, n, ["--max-sessions", "4"], tree_nodes=8, tree_depth=3,
                                        tree_width=3)
    tokens = res.tokens
    d = drift(tokens, p, q)
    keep = 1.0 - res.rounds / n
    pw = power_of_law(p, q, fault_law(p, q, "accept-all"), keep)
    print(f"llama.cpp target, trees, far draft: {d}; mean TV(p, q) {tv_rows(p, q).mean():.2f}; "
          f"{n / res.rounds:.2f} tokens a round; power {pw:.3f}")
    assert res.drafted > 2 * res.rounds and tv_rows(p, q).mean() >= 0.3
    assert abs(d.z) < Z_CRIT and pw >= 0.99, (str(d), pw)
