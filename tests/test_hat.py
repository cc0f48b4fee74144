"""HAT (paper 004): the partition, Λ, the hidden-state codec, eq. 1-3 and 6, and the split protocols end to end.

Tiny random models of each family check the plumbing exactly; smollm2-135m (real) checks the partition and the
protocols on a real model across processes.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from edge_runtime.client import CloudClient, CloudError
from edge_runtime.config import EdgeConfig, EngineConfig, LinkConfig, SplitConfig
from edge_runtime.protocols import new_session
from edge_runtime.request import GenerationRequest
from edge_runtime.split_drafter import SplitDrafter
from edge_runtime.backends.split_parts import TorchSplitParts
from hat_split.wire import messages as P
from hat_split.models.adapter import Adapter, adapter_stack, load_adapter, save_adapter
from hat_split.math.chunking import DelayModel, chunk_size, parallel_steps, prefill_finish
from hat_split.net.security import LinkSecurity
from hat_split.wire.hidden_codec import decode_hidden, encode_hidden
from hat_split.models.loading import load_model
from hat_split.models.partition import PartCache, SplitModel, head_logits
from hat_split.math.sampling import SamplingParams
from tests.conftest import requires_real_pair, serving

PROMPT = [5, 17, 99, 3, 250, 7, 41, 8, 300, 12, 77]
V = 300


def _family(name: str):
    from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config,
                              Qwen2ForCausalLM)

    torch.manual_seed(0)
    common = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=5, num_attention_heads=4)
    if name == "llama":
        return LlamaForCausalLM(LlamaConfig(num_key_value_heads=2, **common)).eval()
    if name == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(num_key_value_heads=2, **common)).eval()
    layer_types = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    return Gemma3ForCausalLM(Gemma3TextConfig(num_key_value_heads=1, head_dim=16, sliding_window=4,
                                              layer_types=layer_types, final_logit_softcapping=30.0,
                                              **common)).eval()


def _split_logits(sp: SplitModel, tokens, bounds):
    ci, cm, co = PartCache(), PartCache(), PartCache()
    outs = []
    for a, b in bounds:
        outs.append(sp.run_output(co, sp.middle.forward(cm, sp.run_input(ci, tokens[a:b]))))
    return torch.cat(outs), (ci, cm, co)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("m,tail", [(1, 0), (2, 1), (1, 3)])
def test_partition_reproduces_the_full_model(family, m, tail):
    model = _family(family)
    tokens = list(np.random.default_rng(1).integers(0, V, 20))
    with torch.inference_mode():
        ref = model(torch.tensor([tokens])).logits[0].float()
    # prefill chunk, single token, multi-token chunk on a cache, a chunk past Gemma's sliding window
    got, caches = _split_logits(SplitModel(model, m, tail), tokens, [(0, 7), (7, 8), (8, 13), (13, 14), (14, 20)])
    assert float((got - ref).abs().max()) < 1e-5
    for c in caches:  # rejected positions cropped, then the same positions recomputed
        c.crop(9)
    sp = SplitModel(model, m, tail)
    again = sp.run_output(caches[2], sp.middle.forward(caches[1], sp.run_input(caches[0], tokens[9:20])))
    assert float((again - ref[9:20]).abs().max()) < 1e-5


def test_the_fingerprint_is_the_same_for_a_float32_and_a_bfloat16_copy_and_differs_between_checkpoints():
    import copy

    from hat_split.models.partition import model_fingerprint
    from tests.conftest import tiny_model

    def trained(seed):  # a fresh model's norms are all ones: give them a checkpoint's spread
        model = tiny_model(seed, layers=3)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 1:
                    p.copy_(1 + 0.3 * torch.randn(p.shape))
        return model
    model = trained(7)
    assert model_fingerprint(model) == model_fingerprint(copy.deepcopy(model).to(torch.bfloat16))
    assert model_fingerprint(model) != model_fingerprint(copy.deepcopy(model).to(torch.float16))  # rounds differently
    assert model_fingerprint(trained(8)) != model_fingerprint(model)


def test_partition_refuses_bad_cuts():
    model = _family("llama")
    with pytest.raises(ValueError, match="no middle layer"):
        SplitModel(model, 3, 2)
    with pytest.raises(ValueError, match="cannot split"):
        from transformers import GPT2Config, GPT2LMHeadModel

        SplitModel(GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50)), 1)


def _real_cut_matches_the_full_model(model, tokens, m: int, tail: int, tol: float) -> None:
    """Prefill in a chunk, one token, a multi-token draft on the cache; then the draft rejected (caches cropped) and
    other positions computed there: every logit row equals the full model's, and every argmax."""
    with torch.inference_mode():
        ref = model(torch.tensor([tokens])).logits[0].float()
    n = len(tokens)
    got, caches = _split_logits(SplitModel(model, m, tail), tokens, [(0, n - 6), (n - 6, n - 5), (n - 5, n)])
    scale = float(ref.abs().max())
    assert float((got - ref).abs().max()) < tol * scale
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    for c in caches:
        c.crop(n - 5)
    sp = SplitModel(model, m, tail)
    with torch.inference_mode():
        again = sp.run_output(caches[2], sp.middle.forward(caches[1], sp.run_input(caches[0], tokens[n - 5:])))
    assert float((again - ref[n - 5:]).abs().max()) < tol * scale


@pytest.mark.real_models
def test_partition_real_smollm2(smollm2):
    tokens = smollm2.tokenizer("def add(a, b):\n    return a + b\n\nprint(add(2, 3))")["input_ids"]
    _real_cut_matches_the_full_model(smollm2.model, tokens, 2, 0, 1e-4)


@pytest.mark.real_models
@requires_real_pair
@pytest.mark.parametrize("name,m,tail", [("qwen2.5-coder-1.5b", 2, 0), ("qwen2.5-coder-1.5b", 4, 2),
                                         ("qwen2.5-coder-0.5b", 2, 0)])
def test_partition_real_qwen_cut(name, m, tail):
    """The real Qwen2.5-Coder targets cut as HAT cuts them (m input layers and `tail` last layers on the device),
    float32: the cut reproduces the full model."""
    loaded = load_model(name, dtype="float32")
    tokens = loaded.tokenizer("def quicksort(xs):\n    if len(xs) < 2:\n        return xs\n")["input_ids"]
    _real_cut_matches_the_full_model(loaded.model, tokens, m, tail, 1e-4)


# -- codec, planning math --------------------------------------------------------------------------------------------
def test_hidden_codec_round_trip_and_refusals():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(6, 96)).astype(np.float32)
    x[:, 5] *= 400.0  # a "massive activation" dimension
    assert np.array_equal(decode_hidden(encode_hidden(x, "float32"), 6, 96), x)
    assert np.allclose(decode_hidden(encode_hidden(x, "float16"), 6, 96), x, rtol=1e-3, atol=1e-3)
    y = decode_hidden(encode_hidden(x, "int8"), 6, 96)
    assert np.allclose(y[:, 5], x[:, 5], rtol=1e-3)  # the outlier travels exactly (float16)
    rest = np.delete(np.abs(x - y), 5, axis=1)
    assert rest.max() <= np.delete(np.abs(x), 5, axis=1).max() / 127  # absmax int8 error bound, per row or better
    frames = P.encode(P.Hidden(1, 1, 0, encode_hidden(x, "int8"), 1))
    assert P.frame_bytes(frames) < P.frame_bytes(P.encode(P.Hidden(1, 1, 0, encode_hidden(x, "float16"), 1)))
    with pytest.raises(ValueError, match="float16"):
        decode_hidden(P.HiddenPayload("float16", x), 6, 96)
    with pytest.raises(ValueError, match=r"\[6, 95\]"):
        decode_hidden(encode_hidden(x, "float16"), 6, 95)
    bad = encode_hidden(x, "int8")
    with pytest.raises(ValueError, match="outlier indices"):
        decode_hidden(P.HiddenPayload("int8", bad.values, bad.scales, bad.outlier_idx + 500, bad.outliers), 6, 96)
    with pytest.raises(ValueError, match="NaN"):
        encode_hidden(np.full((1, 4), np.nan), "float16")


def test_delay_model_moving_averages_eq_1_2():
    d = DelayModel(alpha=0.8)
    d.observe(100, 0.10)
    d.observe(100, 0.20)
    assert d.mu == pytest.approx(100.0)
    assert d.g(100) == pytest.approx(0.8 * 0.10 + 0.2 * 0.20)
    d.observe(400, 0.50)
    assert d.mu == pytest.approx(0.8 * 100 + 0.2 * 400)
    assert d.g(250) == pytest.approx(0.12 + (0.50 - 0.12) * 150 / 300)  # between the two buckets
    assert d.g(10) == pytest.approx(0.12)  # flat below the smallest observation
    with pytest.raises(ValueError):
        d.observe(0, 0.1)


def test_chunk_size_solves_eq_3():
    a, b = 0.02, 0.0005  # g(x) = a + b x, seconds
    d = DelayModel()
    for x in (8, 64, 512, 4096):
        d.observe(x, a + b * x)
    d.mu = 100.0
    A, up, P_ = 1152, 20e6, 2  # bytes per position, bit/s, pipeline
    X = chunk_size(d, A, up, P_, 5000)
    exact = (2 * a + 2 * b * d.mu) / (P_ * 8 * A / up - b)  # X·8A/β = (2a + b(2μ + X)) / P, solved for X
    assert abs(X - exact) <= 1.0
    assert chunk_size(d, A, 1e12, 1, 5000) == 5000  # a free link, one stage: nothing to overlap, one chunk
    assert chunk_size(d, A, 1e12, P_, 5000) < 5000  # a free link, two stages: chunks overlap across the stages
    assert chunk_size(d, A, up, P_, 10) == 10  # a short prompt is one chunk
    assert parallel_steps(5, 1000, 8e6, 16e6, 0.05, 0.01) == math.floor((5e-3 + 0.05 + 2.5e-3) / 0.01)
    assert parallel_steps(5, 1000, 8e6, 16e6, 0.05, 0.0) == 0


def test_chunk_size_in_the_compute_bound_case_minimises_the_predicted_prefill():
    """No crossing of eq. 3 (the cloud is slower per position than the link): the chunking with the earliest predicted
    end, which beats one chunk by overlapping the upload with the cloud's compute."""
    d = DelayModel()
    for x in (1, 8, 64, 512, 2048):
        d.observe(x, 0.005 + 0.0006 * x)  # a CPU cloud: 5 ms per step + 0.6 ms per position
    d.mu = 2.0
    A, up, N = 1152, 80e6, 2000  # 0.115 ms per position on the link: compute-bound
    X = chunk_size(d, A, up, 1, N)
    finish = {x: prefill_finish(d, A, up, 1, N, x) for x in range(1, N + 1)}
    assert 1 < X < N
    assert finish[X] < finish[N] - 0.1  # the overlap saves more than 0.1 s
    assert finish[X] <= min(finish.values()) * 1.01  # the grid of chunk counts finds the optimum
    # the simulation on a hand-checked case: 2 chunks of 2, 1 s per token on the link, g = 1 + x, P = 2, wait g(0)/2
    e = DelayModel()
    e.observe(1, 2.0)
    e.observe(4, 5.0)
    e.mu = 0.0
    g = e.g  # g(0) = 2 (flat below), g(2) = 3
    assert g(2.0) == pytest.approx(3.0)
    # chunk 1: sent 2, +wait 1 -> stage 1 ends 4.5, stage 2 ends 6; chunk 2: sent 4, +1 -> 5 -> stage 1 6.5, stage 2 8
    assert prefill_finish(e, 1.0, 8.0, 2, 4, 2) == pytest.approx(8.0)
    with pytest.raises(ValueError):
        prefill_finish(e, 1.0, 8.0, 0, 4, 2)


def test_chunk_size_counts_a_slow_devices_prefill():
    """A board slower than the cloud is a third pipeline stage: its input layers must compute a chunk before it can
    leave, and Λ runs over it before the next one. Eq. 3 alone (device time 0) keeps its answer; with the device's
    time the size with the earliest predicted finish, which for a fast link and a slow board means several chunks."""
    d = DelayModel()
    for x in (1, 8, 64, 512, 2048):
        d.observe(x, 0.005 + 0.005 * x)  # the cloud: 5 ms per position
    d.mu = 1.0
    A, up, N = 3072, 40e6, 900  # 0.6 ms per position on the link
    assert chunk_size(d, A, up, 1, N) == chunk_size(d, A, up, 1, N, 0.0, 0.0)
    X = chunk_size(d, A, up, 1, N, input_s=0.0015, adapter_s=0.001)
    one = prefill_finish(d, A, up, 1, N, N, 0.0015, 0.001)
    best = prefill_finish(d, A, up, 1, N, X, 0.0015, 0.001)
    assert X < N and best < one - 0.8  # the board's 1.35 s of input layers mostly hidden behind the cloud
    assert one == pytest.approx(0.0015 * N + N * 8 * A / up + d.g(1.0) + d.g(1.0 + N))
    # hand-checked: 2 chunks of 2, input 1 s and Λ 0.5 s per position, 1 s per position on the link, g(x) = 1 + x
    e = DelayModel()
    e.observe(1, 2.0)
    e.observe(4, 5.0)
    e.mu = 0.0  # wait g(0) = 2 (flat below), g(2) = 3
    # chunk 1: computed 2, sent 4, +2 -> 6, ends 9; chunk 2: computed 1 * 4 + 0.5 * 2 = 5, sent max(4, 5) + 2 = 7,
    # +2 -> 9, ends 12
    assert prefill_finish(e, 1.0, 8.0, 1, 4, 2, input_s=1.0, adapter_s=0.5) == pytest.approx(12.0)
    with pytest.raises(ValueError):
        prefill_finish(e, 1.0, 8.0, 1, 4, 2, input_s=-1.0)


def test_link_rates_weigh_transfers_by_size_and_only_known_arrivals_measure():
    from hat_split.math.chunking import RateEstimate, arrival_known

    r = RateEstimate(10e6)  # configured: used until the first measurement
    assert r.bps == 10e6
    r.observe(8e6, 0.2)  # one prompt upload of 1 MB at 40 Mbit/s
    assert r.bps == pytest.approx(40e6)
    rates = []
    for noise in (0.0005, 0.0002, 0.0009, 0.0001, 0.0007):  # decoding rounds: 6 KB (1.2 ms) + clock noise
        rates.append(48e3 / (0.0012 + noise))
        r.observe(48e3, 0.0012 + noise)
    assert 38e6 < r.bps < 40e6  # the big transfer still holds most of the weight: the small ones' noise,
    assert sum(rates) / len(rates) < 30e6  # which an average of their rates would take for a 25 % slower link
    assert RateEstimate().bps == 0.0
    with pytest.raises(ValueError):
        r.observe(0.0, 1.0)
    # a reply seen somewhere in a 30 ms window (a draft step) cannot time a 1.2 ms upload; one seen on arrival can
    assert not arrival_known(0.03, 48e3, 40e6)
    assert arrival_known(0.0, 48e3, 40e6) and arrival_known(0.0009, 48e3, 40e6)  # within the clock's 1 ms
    assert arrival_known(0.03, 8e6, 40e6)  # a 200 ms transfer tolerates 50 ms
    assert not arrival_known(0.002, 48e3, 0.0) and arrival_known(0.0, 48e3, 0.0)  # no rate yet: only exact arrivals


def test_the_round_trip_is_the_least_recent_sample_and_follows_a_changing_link():
    from hat_split.math.chunking import RoundTripFilter

    f = RoundTripFilter(window=4, max_age_s=10.0)
    assert f.value == 0.0  # nothing seen yet
    for t, s in enumerate([0.0021, 0.0020, 0.0090, 0.0025]):  # loopback, one sample slowed by scheduling
        f.observe(s, float(t))
    assert f.value == 0.0020
    for t in range(4, 8):  # the link slows to 60 ms: the old samples leave the window one by one
        f.observe(0.060 + 0.001 * (t % 2), float(t))
        assert f.value == (0.0020 if t < 5 else 0.0025 if t < 7 else 0.060)
    assert f.observe(0.003, 8.0) == 0.003  # faster again: at the first faster sample
    f.observe(0.050, 30.0)  # after a silence longer than max_age_s only the newest sample counts
    assert f.value == 0.050 and len(f.samples) == 1
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="round-trip sample"):
            f.observe(bad, 31.0)
    assert f.value == 0.050  # a refused sample changes nothing
    with pytest.raises(ValueError, match="window >= 1"):
        RoundTripFilter(window=0)
    f.clear()
    assert f.value == 0.0


# -- Λ and the device's drafter ---------------------------------------------------------------------------------------
def _target():
    from tests.conftest import tiny_model

    return tiny_model(2, layers=2)


def test_draft_distributions_equal_the_uncached_draft_model(tmp_path):
    model = _target()
    split = SplitModel(model, 1)
    adapter = Adapter(model, 1).eval()
    dev = SplitDrafter(TorchSplitParts(split, adapter), SamplingParams(1.0), seed=3)
    dev.start(PROMPT)
    shallow = dev.prompt_states(len(PROMPT))
    dev.lam_prefill(shallow)
    dev.commit([42])
    state = dev.draft(6, 0.0)
    seq = PROMPT + [42] + state.drafts
    with torch.inference_mode():  # w_S = head ∘ Λ ∘ input over the whole sequence, no cache
        s = split.input.forward(PartCache(), split.embed(seq))
        logits = head_logits(model, adapter_stack(split, adapter).forward(PartCache(), s))[0]
    q_ref = torch.softmax(logits[len(PROMPT):len(PROMPT) + 6], -1).numpy()
    assert np.allclose(np.stack(state.q), q_ref, atol=1e-5)
    save_adapter(tmp_path / "a", adapter, split, "tiny", {"steps": 0})
    again = load_adapter(tmp_path / "a", split)
    assert all(torch.equal(p, q) for p, q in zip(again.parameters(), adapter.parameters()))
    with pytest.raises(ValueError, match="distilled for 'tiny'"):
        load_adapter(tmp_path / "a", SplitModel(_target_three(), 1))
    with pytest.raises(ValueError, match="cut m=1"):
        load_adapter(tmp_path / "a", SplitModel(model, 0))


def test_the_split_draft_as_a_token_model_equals_the_uncached_draft():
    """AdapterLM (hat_split.models.draft_lm): w_S with CausalLM's interface; chunked feeding, crops and re-feeds give
    the uncached logits, and a device config asking for it without an adapter is refused."""
    from hat_split.models.draft_lm import AdapterLM

    model = _target()
    split = SplitModel(model, 1)
    adapter = Adapter(model, 1).eval()
    lm = AdapterLM(split, adapter)
    seq = PROMPT + [42, 7, 19]
    with torch.inference_mode():
        s = split.input.forward(PartCache(), split.embed(seq))
        ref = head_logits(model, adapter_stack(split, adapter).forward(PartCache(), s))[0].numpy()
    state = lm.new_state()
    assert lm.forward(state, seq[:5], n_logits=0).shape == (0, lm.vocab_size)
    got = [lm.forward(state, seq[5:9], n_logits=4), lm.forward(state, [123, 4], n_logits=2)]
    assert np.allclose(got[0], ref[5:9], atol=1e-5)
    lm.crop(state, 9)  # the two drafts are rejected
    assert state.length == 9 and all(c.length == 9 for c in state.cache)
    assert np.allclose(lm.forward(state, seq[9:], n_logits=len(seq) - 9), ref[9:], atol=1e-5)
    assert state.forward_tokens == len(seq) + 2
    with pytest.raises(ValueError, match="cannot crop"):
        lm.crop(state, len(seq) + 1)
    with pytest.raises(ValueError, match="at least one token"):
        lm.forward(state, [])
    with pytest.raises(ValueError, match="needs split.adapter"):
        EdgeConfig(model="tiny", engine=EngineConfig(token_draft="adapter"))
    with pytest.raises(ValueError, match="token_draft must be one of"):
        EdgeConfig(model="tiny", engine=EngineConfig(token_draft="layers"))


def test_sd_drafting_with_the_split_draft_gives_the_targets_tokens(tiny_server, tiny_pair, tiny_adapter):
    """Token protocol `sd` with w_S as its draft (a device holding only its parts): the cloud's whole model verifies,
    so temperature 0 gives the target's greedy tokens, and drafts are accepted at all."""
    from edge_runtime.drafter import Drafter
    from hat_split.models.draft_lm import AdapterLM

    model = tiny_pair[1].model
    params = SamplingParams(0.0)
    lm = AdapterLM(SplitModel(model, 1), tiny_adapter)
    link = LinkConfig(tiny_server.endpoint, security=LinkSecurity.plaintext())
    with CloudClient(link, P.Hello("t", "tiny", 512, "tiny-vocab")) as client:
        gen = new_session(EdgeConfig(model="tiny", draft_len=3), GenerationRequest(PROMPT, "sd", params, 20, seed=0),
                          Drafter(lm, params), client, frozenset(), 1)
        res = gen.run(PROMPT, lambda toks: "")
    assert res.tokens == _greedy(model, 20)
    assert res.drafted >= 3 and res.rounds < 20


def _target_three():
    from tests.conftest import tiny_model

    return tiny_model(2, layers=3)


# -- end to end over the tiny server ----------------------------------------------------------------------------------
def _run_split(server, model, protocol, params, n=20, seed=0, adapter=None, tap=None, endpoint=None, parts=None,
               link_state=None, **split_kw):
    """parts: the device's parts (default: torch's, of `model` cut at 1 with `adapter`); link_state: the connection's
    estimates (default: a fresh one from the config)."""
    parts = parts or TorchSplitParts(SplitModel(model, 1), adapter)
    split_cfg = SplitConfig(m=1, hidden_format=split_kw.pop("hidden_format", "float32"), **split_kw)
    link = LinkConfig(endpoint or server.endpoint, security=LinkSecurity.plaintext())
    with CloudClient(link, P.Hello("t", "tiny", 512, "tiny-vocab")) as client:
        client.tap = tap
        drafter = SplitDrafter(parts, params, seed, slowdown=split_cfg.slowdown)
        gen = new_session(EdgeConfig(model="tiny", split=split_cfg), GenerationRequest(PROMPT, protocol, params, n,
                                                                                        seed=seed),
                          drafter, client, frozenset(), 1, link_state=link_state)
        return gen.run(PROMPT, lambda toks: "")


def _greedy(model, n):
    out = model.generate(torch.tensor([PROMPT]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                         pad_token_id=0, eos_token_id=None)
    return out[0, len(PROMPT):].tolist()


@pytest.fixture(scope="module")
def tiny_adapter(tiny_pair):
    model = tiny_pair[1].model
    return Adapter(model, 1).eval().requires_grad_(False)


@pytest.mark.parametrize("protocol", ["ushape", "hat"])
@pytest.mark.parametrize("chunk", [0, 3])
def test_split_protocols_greedy_equal_the_full_model(tiny_server, tiny_pair, tiny_adapter, protocol, chunk):
    model = tiny_pair[1].model
    adapter = tiny_adapter if protocol == "hat" else None
    res = _run_split(tiny_server, model, protocol, SamplingParams(0.0), adapter=adapter, draft_stop_prob=0.0,
                     draft_len=4, chunk_tokens=chunk)
    assert res.tokens == _greedy(model, 20)
    assert res.prefill_chunks == (4 if chunk else 1)
    if protocol == "hat":
        assert res.drafted > 0


@pytest.mark.parametrize("nodes,depth,width,layers,tail", [(1, 1, 1, 2, 0), (8, 4, 2, 2, 0), (14, 5, 3, 2, 0),
                                                            (10, 4, 3, 4, 2)])
def test_hat_draft_trees_greedy_equal_the_full_model(tiny_pair, nodes, depth, width, layers, tail):
    """protocol hat with split.tree_nodes > 0 (issue 47): Λ drafts a tree, the middle layers verify its shallow
    states in one masked forward, the device's output part (with tail layers, too) turns the deep states into the
    target's logits and keeps the accepted path; the cloud keeps it on the next upload."""
    from hat_split.models.lm import CausalLM
    from tests.conftest import tiny_model

    target = tiny_pair[1] if layers == 2 else CausalLM(tiny_model(3, layers=layers))
    model = target.model
    adapter = Adapter(model, 1).eval().requires_grad_(False)
    with serving(target, max_message_bytes=1 << 20) as server:
        res = _run_split(server, model, "hat", SamplingParams(0.0), n=24, adapter=adapter,
                         parts=TorchSplitParts(SplitModel(model, 1, tail), adapter), tail=tail, tree_nodes=nodes,
                         tree_depth=depth, tree_width=width, parallel_draft=False)
    assert res.tokens == _greedy(model, 24)
    assert res.drafted > res.rounds * (nodes > 1) and res.finish_reason == "length"


def test_a_hat_tree_verify_computes_only_the_head_rows_its_walk_reads(tiny_pair, tiny_adapter):
    """The device's head over a tree's 1 + N deep states is most of its verify: rows are computed as the walk reads
    them (the accepted path's and the one after it), and equal the head over all rows at once."""
    from hat_split.math.tree import below_chain

    model = tiny_pair[1].model
    parts = TorchSplitParts(SplitModel(model, 1), tiny_adapter)
    dev = SplitDrafter(parts, SamplingParams(0.0), 0)
    dev.start(PROMPT)
    dev.lam_prefill(dev.prompt_states(len(PROMPT) - 1))
    draft = dev.draft_tree(12, 4, 3)
    n = len(draft.tree.tokens)
    deep = torch.randn(1, n + 1, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    logits = dev.target_logits(deep, draft.base, n + 1, tree=below_chain(1, draft.tree.parents))
    verdict = dev.verify_tree(draft, logits)
    assert logits.computed == len(verdict.path) + 1 < n + 1
    every = parts.head_at(logits.states, range(n + 1))
    np.testing.assert_allclose(logits.take(range(n + 1)), every, rtol=1e-5, atol=1e-5)


def test_hat_draft_trees_sampled_are_seeded(tiny_pair):
    """Above temperature 0 a tree round is reproducible from the seed (its draws are keyed by position), another
    seed gives another answer, and every run ends in step with the cloud (the close checks the positions held)."""
    model = tiny_pair[1].model
    adapter = Adapter(model, 1).eval().requires_grad_(False)
    with serving(tiny_pair[1], max_message_bytes=1 << 20) as server:
        runs = [_run_split(server, model, "hat", SamplingParams(1.0, top_k=40), n=24, seed=s, adapter=adapter,
                           tree_nodes=9, tree_depth=3, tree_width=3, parallel_draft=False) for s in (5, 5, 6)]
    assert runs[0].tokens == runs[1].tokens != runs[2].tokens
    assert all(len(r.tokens) == 24 for r in runs)


def test_malformed_hat_trees_are_refused_and_the_session_goes_on(tiny_server, tiny_pair):
    """A split session's draft tree is checked before anything changes (a bad parent, a count that does not match,
    a tree whose deep states are not all asked for, a `keep` without a tree or naming rows the tree does not
    have); then a good tree and the next upload keeping its path (the root and node 1) go through."""
    fp = SplitModel(tiny_pair[1].model, 1).fingerprint()
    states = lambda n: encode_hidden(np.zeros((n, 64), np.float32), "float32")  # noqa: E731
    tree = lambda *p: np.asarray(p, np.int16)  # noqa: E731
    with CloudClient(LinkConfig(tiny_server.endpoint, security=LinkSecurity.plaintext()),
                     P.Hello("t", "tiny", 512, "tiny-vocab")) as client:
        assert isinstance(client.request(P.OpenSplit(1, "hat", fp, 1, 2, "float32")), P.SplitOpened)
        assert isinstance(client.request(P.Hidden(1, 1, 0, states(6), 1)), P.Deep)  # a prompt of 6 positions
        for msg, match in [
                (P.Hidden(1, 2, 6, states(3), 3, parents=tree(-1, 0, 5)), "not an earlier node"),
                (P.Hidden(1, 2, 6, states(3), 3, parents=tree(-1, 0)), "parents has 2 entries"),
                (P.Hidden(1, 2, 6, states(3), 1, parents=tree(-1, 0, 0)), "want=1"),
                (P.Hidden(1, 2, 6, states(1), 1, keep=tree(0)), "holds none")]:  # a refusal keeps the step
            with pytest.raises(CloudError, match=match):
                client.request(msg)
        deep = client.request(P.Hidden(1, 2, 6, states(3), 3, parents=tree(-1, 0, 0)))
        assert isinstance(deep, P.Deep) and deep.position == 9
        with pytest.raises(CloudError, match="not a list of rows"):
            client.request(P.Hidden(1, 3, 8, states(1), 1, keep=tree(0, 5)))
        after = client.request(P.Hidden(1, 3, 8, states(1), 1, keep=tree(0, 2)))
        assert isinstance(after, P.Deep) and after.position == 9


def test_parallel_drafting_changes_timing_not_output(tiny_server, tiny_pair, tiny_adapter, pd_driven):
    """Over a link with 15 ms of delay each way, so the device has time to draft candidates while it waits."""
    from testbed.link_emulator import LinkEmulator
    from testbed.links import LinkProfile

    model = tiny_pair[1].model
    hits = []
    host, port = tiny_server.endpoint.split("//")[1].rsplit(":", 1)
    with LinkEmulator(LinkProfile("pd-test", delay_s=0.015), (host, int(port))) as link:
        for params in (SamplingParams(0.0), SamplingParams(1.0)):
            on = _run_split(tiny_server, model, "hat", params, n=30, seed=7, adapter=tiny_adapter, draft_stop_prob=0.3,
                            parallel_draft=True, pd_topk=4, endpoint=link.address)
            off = _run_split(tiny_server, model, "hat", params, n=30, seed=7, adapter=tiny_adapter, draft_stop_prob=0.3,
                             parallel_draft=False)
            assert on.tokens == off.tokens
            assert on.pd_steps > 0
            hits.append(on.pd_hits)
    assert sum(hits) > 0  # some rounds did start from a parallel-drafted continuation


@pytest.mark.parametrize("drafter", ["adapter", "feature"])
def test_no_token_text_or_distribution_crosses_the_link(tiny_server, tiny_pair, tiny_adapter, drafter):
    """Λ or the feature drafter: only OpenSplit / Hidden / Close up and their replies down, states as float16 rows,
    no run of token ids anywhere in the frames."""
    from hat_split.models.feature_drafter import FeatureDrafter

    frames = []
    model = tiny_pair[1].model
    module = tiny_adapter if drafter == "adapter" else FeatureDrafter(model).eval().requires_grad_(False)
    res = _run_split(tiny_server, model, "hat", SamplingParams(1.0), seed=1, adapter=module,
                     hidden_format="float16", chunk_tokens=4, tap=lambda d, f: frames.append((d, f)))
    assert res.drafted > 0
    allowed = {"up": (P.OpenSplit, P.Hidden, P.CloseSession), "down": (P.SplitOpened, P.Deep, P.Closed)}
    sequence = np.asarray(PROMPT + res.tokens, "<i4")
    for direction, f in frames:
        msg = P.decode(f)
        assert isinstance(msg, allowed[direction]), type(msg).__name__
        payload = getattr(msg, "states", None)
        if payload is not None:
            assert payload.values.dtype == np.float16  # hidden states only: no integer or probability arrays
        blob = b"".join(f)
        for i in range(len(sequence) - 2):  # no three consecutive token ids as int32 anywhere in the frames
            assert sequence[i:i + 3].tobytes() not in blob


def test_a_reply_read_late_counts_from_when_it_was_first_seen(tiny_server):
    """A device drafting in parallel reads the cloud's reply after its current step; the link estimates (the idle time
    it reports, the downlink rate) must count from the reply's arrival, which `ready` saw, not from the read."""
    import time

    hello = P.Hello("t", "tiny", 512, "tiny-vocab")
    with CloudClient(LinkConfig(tiny_server.endpoint, security=LinkSecurity.plaintext()), hello) as client:
        sent = time.perf_counter()
        client.send(hello)
        while not client.ready():
            time.sleep(0.001)
        seen = time.perf_counter()
        assert client.ready()  # asking again keeps the first stamp
        time.sleep(0.3)  # the device finishes a draft step
        assert isinstance(client.receive(), P.Welcome)
        assert sent <= client.last_reply_at <= seen
        client.send(hello)  # a reply read without `ready`: stamped when read
        client.receive()
        assert client.last_reply_at > seen + 0.3


def test_the_draft_vocabulary_ranks_the_data_and_refuses_what_it_cannot_give(tmp_path):
    from hat_split.models.adapter import load_draft_vocab, rank_vocab, save_draft_vocab

    ranked = rank_vocab([[5, 7, 7, 3], [7, 5, 9]], 12, first=[11])
    assert ranked.tolist() == [11, 7, 5, 3, 9]  # the end token first, then by count, ties by id; unseen ids left out
    assert rank_vocab([[4, 4]], 12, first=[4]).tolist() == [4]  # no duplicate
    with pytest.raises(ValueError, match="outside"):
        rank_vocab([[12]], 12)
    with pytest.raises(FileNotFoundError, match="--draft-vocab 3"):
        load_draft_vocab(tmp_path, 3)  # says how to add one
    save_draft_vocab(tmp_path, ranked)
    assert load_draft_vocab(tmp_path, 3).tolist() == [5, 7, 11]  # the 3 most frequent, ascending
    with pytest.raises(ValueError, match="ranked 5 distinct tokens"):
        load_draft_vocab(tmp_path, 6)
    with pytest.raises(ValueError):
        load_draft_vocab(tmp_path, 0)


def test_drafting_over_a_token_subset_is_exact_and_drafts_only_those_tokens(tiny_server, tiny_pair, tiny_adapter):
    """split.draft_vocab: Λ's head over N tokens only (their weight rows). Its logits are the full head's at those
    tokens; the drafts stay inside the subset (q is 0 elsewhere), and the output is the target's: greedy, the full
    model's tokens; sampled, verification takes a q of smaller support as any other (exact for every q)."""
    model = tiny_pair[1].model
    split = SplitModel(model, 1)
    vocab = int(model.lm_head.weight.shape[0])
    ids = np.arange(0, vocab, 3)  # every third token
    full_parts = TorchSplitParts(split, tiny_adapter)
    sub_parts = TorchSplitParts(split, tiny_adapter, ids)
    a, b = full_parts.new_cache(), sub_parts.new_cache()
    states = split.run_input(PartCache(), PROMPT)
    full = full_parts.run_output(a, full_parts.run_adapter(full_parts.new_cache(), states), 2, draft=True)
    sub = sub_parts.run_output(b, sub_parts.run_adapter(sub_parts.new_cache(), states), 2, draft=True)
    np.testing.assert_allclose(sub, full[:, ids], rtol=1e-5, atol=1e-5)
    assert sub_parts.run_output(sub_parts.new_cache(), states, 1).shape == (1, vocab)  # the target keeps its whole head
    res = _run_split(tiny_server, model, "hat", SamplingParams(0.0), n=20, parts=sub_parts, draft_stop_prob=0.0,
                     draft_len=4)
    assert res.tokens == _greedy(model, 20)
    drafted = []
    for seed in range(3):
        dev = SplitDrafter(sub_parts, SamplingParams(1.0), seed=seed)
        dev.start(PROMPT)
        dev.lam_prefill(dev.prompt_states(len(PROMPT)))
        dev.commit([1])  # a first token outside the subset: the drafts after it are still inside
        state = dev.draft(8, 0.0)
        drafted += state.drafts
        assert all(float(q[np.setdiff1d(np.arange(vocab), ids)].sum()) == 0.0 for q in state.q)
    assert drafted and set(drafted) <= set(ids.tolist())
    sampled = _run_split(tiny_server, model, "hat", SamplingParams(1.0), n=20, seed=5, parts=sub_parts,
                         draft_stop_prob=0.0, draft_len=4)
    assert len(sampled.tokens) == 20 and sampled.drafted > 0


def test_a_reply_arriving_while_an_emulated_board_sleeps_is_stamped_on_arrival(tiny_server):
    """An emulated slower board sleeps out its extra compute time through `CloudClient.wait`, which watches the socket:
    a reply arriving in the sleep is stamped when it arrives (uncertainty ~0), and the sleep still lasts its time. A
    reply that waited through real work is stamped with the window since the last look (its uncertainty)."""
    import time

    hello = P.Hello("t", "tiny", 512, "tiny-vocab")
    with CloudClient(LinkConfig(tiny_server.endpoint, security=LinkSecurity.plaintext()), hello) as client:
        t0 = time.perf_counter()
        client.send(hello)
        client.wait(0.25)
        slept = time.perf_counter() - t0
        assert isinstance(client.receive(), P.Welcome)
        assert slept >= 0.25 and client.last_reply_at - t0 < 0.1  # seen as it came, long before the sleep ended
        assert client.arrival_uncertainty_s < 0.01
        client.send(hello)
        time.sleep(0.2)  # real work: nobody looks
        assert isinstance(client.receive(), P.Welcome)
        assert client.arrival_uncertainty_s > 0.15  # seen only after the work: the window is known, not the moment
        assert client.last_reply_bytes > 0


def test_parallel_drafting_on_a_slowed_board_keeps_the_uplink_estimate(tiny_server, tiny_pair, tiny_adapter,
                                                                       pd_driven, monkeypatch):
    """HAT's decoding rounds with parallel drafting on a board emulated 40x slower, over a link of 100 kB/s up (5 ms
    each way): the device drafts while its upload and the cloud's reply are under way, and the reply lands during a
    draft step. The uplink estimate must stay near the link's rate: a reply stamped at the end of that step made each
    round's upload (about 8 ms on this link) look several times slower (an estimate near a fifth of the link's rate
    when the stamps are taken as exact and the board's sleeps do not watch the socket), and the next prompt was cut
    into dozens of chunks. An upload takes 8 ms here, not 4, so that a loaded CI machine's few milliseconds of
    scheduling stay well inside the bounds while that error does not."""
    import edge_runtime.sessions.split as split_session
    from edge_runtime.sessions.split import LinkState
    from testbed.link_emulator import LinkEmulator
    from testbed.links import LinkProfile

    known = []

    def spied(*args, **kw):
        known.append(arrival_known(*args, **kw))
        return known[-1]

    arrival_known = split_session.arrival_known
    monkeypatch.setattr(split_session, "arrival_known", spied)
    model = tiny_pair[1].model
    state = LinkState.configured(0.0, 0.0)
    host, port = tiny_server.endpoint.split("//")[1].rsplit(":", 1)
    with LinkEmulator(LinkProfile("pd-rate", 100e3, 200e3, 0.005), (host, int(port))) as link:
        res = _run_split(tiny_server, model, "hat", SamplingParams(0.0), n=24, adapter=tiny_adapter,
                         draft_stop_prob=0.3, parallel_draft=True, pd_topk=4, slowdown=40.0, endpoint=link.address,
                         link_state=state)
    assert res.tokens == _greedy(model, 24)
    assert res.pd_steps > 0
    assert True in known  # the estimate comes from timed uploads, not from the configured guess
    print(f"uplink estimate {state.up_bps:.0f} bit/s of {8 * 100e3:.0f}; uploads timed {known.count(True)} "
          f"of {len(known)}")
    assert 0.4 * 8 * 100e3 < state.up_bps < 2.5 * 8 * 100e3, state
    assert state.input_s > 0  # the prefill's device time, for the next request's chunk size


def test_split_session_refusals(tiny_server, tiny_pair):
    model = tiny_pair[1].model
    fp = SplitModel(model, 1).fingerprint()
    with CloudClient(LinkConfig(tiny_server.endpoint, security=LinkSecurity.plaintext()),
                     P.Hello("t", "tiny", 512, "tiny-vocab")) as client:
        for msg, code in [(P.OpenSplit(1, "hat", "f" * 32, 1, 2), "model_mismatch"),
                          (P.OpenSplit(1, "hat", fp, 0, 2), "invalid"),
                          (P.OpenSplit(1, "sd", fp, 1, 2), "invalid"),
                          (P.OpenSplit(1, "hat", fp, 1, 2, hidden_format="bf8"), "invalid")]:
            reply = client._roundtrip(msg, 5)
            assert isinstance(reply, P.Error) and reply.code == code, reply
        assert isinstance(client._roundtrip(P.OpenSplit(1, "hat", fp, 1, 2), 5), P.SplitOpened)
        x = np.zeros((2, 64), np.float32)
        for msg, code in [(P.Hidden(1, 1, 5, encode_hidden(x, "float32"), 1), "desync"),
                          (P.Hidden(1, 1, 0, encode_hidden(x, "float32"), 3), "invalid"),
                          (P.Hidden(1, 1, 0, encode_hidden(np.zeros((2, 63)), "float32"), 1), "invalid"),
                          (P.Hidden(1, 2, 0, encode_hidden(x, "float32"), 1), "desync")]:
            reply = client._roundtrip(msg, 5)
            assert isinstance(reply, P.Error) and reply.code == code, reply
        ok = client._roundtrip(P.Hidden(1, 1, 0, encode_hidden(x, "float32"), 1), 5)  # the session survived
        assert isinstance(ok, P.Deep) and ok.position == 2


# -- end to end across processes on the real smollm2-135m --------------------------------------------------------------
FIB = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


def greedy_reference(model, ids, n):
    """The whole model's n greedy tokens after `ids`, through hat_split.models.lm's cached forward."""
    from hat_split.models.lm import CausalLM

    return CausalLM(model).greedy(ids, n)


def _split_across_processes(loaded, tmp_path, cloud_args, protocols=("ushape", "hat", "sd", "llm"), prompt=FIB,
                            drafter="adapter", edge_args=()):
    """A `hat-cloud serve` process (with `cloud_args`) holds the model's middle layers, a `hat-edge generate` process
    its input and output parts (and a draft module, untrained: exactness does not depend on it; `drafter`: Λ or the
    feature drafter); temperature 0 must give the full model's tokens for both split protocols, and for token
    protocols through the same batched steps (`sd` drafting with the model itself, `llm`)."""
    from hat_split.models.feature_drafter import FeatureDrafter, save_feature_drafter

    import json
    import os
    import subprocess
    import sys

    from cloud_runtime.process import CloudProcess

    model = loaded.model
    split = SplitModel(model, 2)
    if drafter == "feature":
        save_feature_drafter(tmp_path / "adapter", FeatureDrafter(model).eval(), split, loaded.name, {"steps": 0})
    else:
        save_adapter(tmp_path / "adapter", Adapter(model, 2).eval(), split, loaded.name, {"steps": 0})
    ids = loaded.tokenizer(prompt)["input_ids"]
    ref = greedy_reference(model, ids, 16)
    (tmp_path / "p.json").write_text(json.dumps([prompt]))
    with CloudProcess(loaded.name, extra_args=["--dtype", "float32", *cloud_args], threads=1) as cloud:
        cmd = [sys.executable, "-m", "edge_runtime.cli", "generate", "--model", loaded.name, "--server",
               cloud.endpoint, "--prompts-file", str(tmp_path / "p.json"), "--protocol", ",".join(protocols),
               "--adapter", str(tmp_path / "adapter"), "--hidden-format", "float32", "--chunk-tokens", "7",
               "--max-new-tokens", "16", "--temperature", "0", "--threads", "1", "--quiet", "--json",
               str(tmp_path / "out.json"),
               "--plaintext", *edge_args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ))
        info = cloud.ready_info
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "out.json").read_text())["results"]
    assert [r["protocol"] for r in results] == list(protocols)
    for r in results:
        assert r["tokens"] == ref, r["protocol"]
    assert [r["prefill_chunks"] for r in results[:2]] == [-(-len(ids) // 7)] * 2
    return info


@pytest.mark.real_models
def test_the_runtime_drafts_over_the_vocabulary_each_request_asks_for(smollm2, tmp_path):
    """split.draft_vocab on the runtime (the path hat-edge and hat-bench take): requests with and without a draft
    vocabulary each get their own parts (a runtime kept them per protocol only, so a later request drafted over the
    first one's head), both give the full model's greedy tokens; a vocabulary larger than the adapter's ranking is
    refused with the reason."""
    import dataclasses

    from edge_runtime.runtime import EdgeRuntime
    from hat_split.models.adapter import rank_vocab, save_draft_vocab
    from hat_split.models.lm import CausalLM
    from hat_split.models.loading import vocab_fingerprint
    from tests.conftest import serving

    model = smollm2.model
    save_adapter(tmp_path / "a", Adapter(model, 2).eval(), SplitModel(model, 2), smollm2.name, {"steps": 0})
    ids = smollm2.tokenizer(FIB)["input_ids"]
    vocab = int(model.lm_head.weight.shape[0])
    save_draft_vocab(tmp_path / "a", rank_vocab([list(range(0, vocab, 7))], vocab))
    ref = greedy_reference(model, ids, 12)
    with serving(CausalLM(model), vocab=vocab_fingerprint(smollm2.tokenizer)) as server:
        split = SplitConfig(m=2, adapter=str(tmp_path / "a"), hidden_format="float32", draft_stop_prob=0.0, draft_len=3)
        config = EdgeConfig(model="smollm2-135m", link=LinkConfig(server.endpoint, security=LinkSecurity.plaintext()),
                            split=split)
        with EdgeRuntime(config, smollm2) as rt:
            assert rt.generate(ids, "hat", SamplingParams(0.0), 12, seed=0).tokens == ref
            rt.config = dataclasses.replace(config, split=dataclasses.replace(split, draft_vocab=2000))
            sub = rt.generate(ids, "hat", SamplingParams(0.0), 12, seed=0)
            assert sub.tokens == ref and sub.drafted > 0
            parts = rt.engine._parts[(True, split.adapter, 2000)]
            assert len(parts.draft_ids) == 2000 and rt.engine._parts[(True, split.adapter, 0)].draft_ids is None
            rt.config = dataclasses.replace(config, split=dataclasses.replace(split, draft_vocab=vocab))
            with pytest.raises(ValueError, match="ranked .* distinct tokens"):
                rt.generate(ids, "hat", SamplingParams(0.0), 4, seed=0)


SLOTS = ["--kv-layout", "slots", "--kv-positions", "32768"]  # 4 slots of 8192 positions (the CUDA layout, on the CPU)


@pytest.mark.real_models
def test_split_protocols_across_processes_equal_full_model_greedy(smollm2, tmp_path):
    """With the device stated (cpu) and the slot layout CUDA uses by default."""
    info = _split_across_processes(smollm2, tmp_path, ["--device", "cpu", *SLOTS])
    assert "pipeline=1" in info and "device=cpu" in info and "kv=slots:4x8192 graphs=off" in info, info


@pytest.mark.real_models
@requires_real_pair
def test_split_protocols_on_the_real_qwen_cut_across_processes_equal_full_model_greedy(tmp_path):
    """The real Qwen2.5-Coder 0.5B cut at m = 2 (the 1.5B's fast second: the same family, tokenizer and code paths),
    float32: ushape and hat across a cloud process and a device process give the full model's greedy tokens."""
    loaded = load_model("qwen2.5-coder-0.5b", dtype="float32")
    _split_across_processes(loaded, tmp_path, [], ("ushape", "hat"))


@pytest.mark.real_models
@pytest.mark.parametrize("stages", [2, 3])
def test_torchrun_pipeline_stages_equal_the_single_process_result(smollm2, tmp_path, stages):
    """`hat-cloud serve --pipeline P` starts itself under torchrun: P gloo processes, each with a slice of the middle
    layers and several batches in flight; a device process gets exactly the single-process (= full model) tokens.
    Three stages keep their sessions in slots (the CUDA layout); on two (growing caches) `sd` and `hat` draft trees,
    each verified in one masked forward per stage and its accepted path kept on every stage."""
    trees = ["--tree-nodes", "6", "--tree-depth", "3", "--tree-width", "2", "--hat-tree-nodes", "6", "--hat-tree-depth",
             "3", "--hat-tree-width", "2"] if stages == 2 else []
    info = _split_across_processes(smollm2, tmp_path, ["--pipeline", str(stages), *(SLOTS if stages == 3 else [])],
                                   edge_args=trees)
    assert f"pipeline={stages}" in info and ("kv=slots" in info) == (stages == 3), info


def test_pipeline_stage_bounds():
    from cloud_runtime.pipeline import stage_bounds

    assert stage_bounds(30, 1) == [0, 30]
    assert stage_bounds(30, 2) == [0, 15, 30]
    assert stage_bounds(30, 4) == [0, 8, 15, 22, 30]  # 29 layers: 7, 7, 7, 8 after layer 0
    assert stage_bounds(3, 2) == [0, 2, 3]
    with pytest.raises(ValueError, match="cannot share"):
        stage_bounds(3, 3)


def test_many_devices_at_once_are_batched_and_each_gets_the_full_models_tokens(tiny_server, tiny_pair, tiny_adapter):
    """Eight devices (threads, each its own socket) generate at the same time, ushape and hat, chunked and not: the
    server batches their middle-part work (steps with several sessions' segments) and every device still gets exactly
    the full model's greedy tokens."""
    from concurrent.futures import ThreadPoolExecutor

    model = tiny_pair[1].model
    ref = _greedy(model, 20)
    jobs = [("ushape" if i % 2 else "hat", (0, 3, 5, 0)[i % 4]) for i in range(8)]

    def one(job):
        protocol, chunk = job
        return _run_split(tiny_server, model, protocol, SamplingParams(0.0), draft_stop_prob=0.0, draft_len=4,
                          chunk_tokens=chunk, adapter=tiny_adapter if protocol == "hat" else None)

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, jobs))
    assert all(r.tokens == ref for r in results), [r.tokens for r in results]
    stats = tiny_server.work.stats
    assert stats.max_segments > 1 and stats.segments > stats.steps, stats  # several devices shared steps
    assert not tiny_server.work.scheduler.sessions  # every session closed: its KV positions are free


def _device_process(endpoint: str, protocol: str, chunk: int, out, start) -> None:
    """One device in its own process: the same tiny model (seeded), its own socket, one greedy request, started
    together with the others."""
    from tests.conftest import tiny_model

    torch.set_num_threads(1)
    model = tiny_model(2, layers=2)
    adapter = Adapter(model, 1).eval().requires_grad_(False) if protocol == "hat" else None
    start.wait(timeout=240)
    res = _run_split(None, model, protocol, SamplingParams(0.0), draft_stop_prob=0.0, draft_len=4, chunk_tokens=chunk,
                     adapter=adapter, endpoint=endpoint)
    out.put((protocol, chunk, res.tokens))


def test_eight_device_processes_generate_concurrently(tiny_server, tiny_pair):
    """Eight device processes at once against one cloud: all complete, all exact, their work batched together."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out, start = ctx.Queue(), ctx.Barrier(8)
    jobs = [("hat" if i % 2 else "ushape", (0, 4)[i % 2]) for i in range(8)]
    procs = [ctx.Process(target=_device_process, args=(tiny_server.endpoint, p, c, out, start)) for p, c in jobs]
    for p in procs:
        p.start()
    results = [out.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    ref = _greedy(tiny_pair[1].model, 20)
    assert sorted((p, c) for p, c, _ in results) == sorted(jobs)
    assert all(tokens == ref for _, _, tokens in results)
    assert tiny_server.work.stats.max_segments > 1
