"""The llama.cpp engine (hat_split.models.llamacpp_lm) on the registry's own GGUF file of SmolLM2-135M: its logits are
llama.cpp's own, a crop then a continuation equals a fresh evaluation, its argmax agrees with the torch engine on the
same file, states are independent sequences of one context, and bad input is refused with the reason."""
from __future__ import annotations

import gc
import threading

import numpy as np
import pytest

from cloud_runtime.process import CloudProcess
from edge_runtime.config import EdgeConfig, EngineConfig, LinkConfig
from edge_runtime.runtime import EdgeRuntime
from hat_split.math.sampling import SamplingParams
from hat_split.models.lm import CausalLM
from hat_split.models.loading import vocab_fingerprint
from hat_split.net.security import LinkSecurity
from tests.conftest import serving
from tests.exactness import assert_greedy

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (scripts/install_llamacpp.sh)")

from hat_split.models.llamacpp_lm import LlamaCppLM, LlamaCppSettings, model_gguf  # noqa: E402


@pytest.fixture(scope="module")
def lm(smollm2_gguf):
    with LlamaCppLM(smollm2_gguf, LlamaCppSettings(n_ctx=512, n_batch=32, n_threads=2, n_seq_max=2)) as m:
        yield m


@pytest.mark.parametrize("flash_attn", [True, False])
def test_logits_are_llama_cpps_own_evaluation_of_the_same_tokens(smollm2_gguf, smollm2_ids, flash_attn):
    ref = llama_cpp.Llama(model_path=str(smollm2_gguf), n_ctx=512, n_batch=32, n_threads=2, logits_all=True,
                          verbose=False, flash_attn=flash_attn)
    ref.eval(smollm2_ids)
    expected = np.array(ref.scores[: len(smollm2_ids)])  # [n, vocab]
    with LlamaCppLM(smollm2_gguf, LlamaCppSettings(n_ctx=512, n_batch=32, n_threads=2, flash_attn=flash_attn)) as lm:
        got = lm.forward(lm.new_state(), smollm2_ids, n_logits=len(smollm2_ids))
    assert got.shape == (len(smollm2_ids), lm.vocab_size) == expected.shape
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4)


def test_a_crop_then_a_continuation_equals_a_fresh_evaluation(lm, smollm2_ids):
    drafts = lm.greedy(smollm2_ids, 6)
    fresh = lm.forward(lm.new_state(), smollm2_ids + drafts, n_logits=4)  # [4, vocab]
    state = lm.new_state()
    lm.forward(state, smollm2_ids, n_logits=1)
    lm.forward(state, [9, 8, 7, 6, 5], n_logits=5)  # drafts that get rejected
    lm.crop(state, len(smollm2_ids))
    assert state.length == len(smollm2_ids)
    got = lm.forward(state, drafts, n_logits=4)
    np.testing.assert_allclose(got, fresh, rtol=0, atol=1e-3 * np.abs(fresh).max())
    assert (got.argmax(1) == fresh.argmax(1)).all()


def test_argmax_agrees_with_the_torch_engine_on_the_same_gguf(lm, smollm2, smollm2_ids):
    torch_lm = CausalLM(smollm2.model)  # the same GGUF, dequantised to float32
    text = smollm2_ids + torch_lm.greedy(smollm2_ids, 24)
    ours = lm.forward(lm.new_state(), text, n_logits=len(text) - len(smollm2_ids) + 1).argmax(1)
    theirs = torch_lm.forward(torch_lm.new_state(), text, n_logits=len(text) - len(smollm2_ids) + 1).argmax(1)
    assert (ours == theirs).mean() >= 0.9, (ours, theirs)  # quantised matmuls: a near tie may flip


def test_states_are_independent_sequences_and_their_ids_are_reused(lm, smollm2_ids):
    alone = lm.forward(lm.new_state(), smollm2_ids, n_logits=1)
    gc.collect()
    a, b = lm.new_state(), lm.new_state()
    lm.forward(a, smollm2_ids[:5], n_logits=1)
    lm.forward(b, [1, 2, 3], n_logits=1)  # interleaved with a
    got = lm.forward(a, smollm2_ids[5:], n_logits=1)
    np.testing.assert_allclose(got, alone, rtol=0, atol=1e-3 * np.abs(alone).max())
    with pytest.raises(RuntimeError, match="all 2 llama.cpp sequences are in use"):
        lm.new_state()
    del a, b
    gc.collect()
    assert lm.new_state().length == 0  # a released id comes back empty
    gc.collect()
    gc.disable()  # no automatic collection may free the cycle below
    try:
        held = [lm.new_state(), lm.new_state()]
        cycle = {"state": held.pop()}
        cycle["self"] = cycle  # dropped, but in a reference cycle: only a collection frees its sequence ...
        del cycle
        assert lm.new_state().length == 0  # ... which new_state runs when no id is free
    finally:
        gc.enable()


def test_bad_input_is_refused_with_the_reason(lm, tmp_path, smollm2_gguf):
    text = tmp_path / "notes.smollm2_gguf"
    text.write_text("not a model")
    with pytest.raises(ValueError, match="is not a GGUF file"):
        LlamaCppLM(text)
    header_only = tmp_path / "empty.smollm2_gguf"
    header_only.write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(ValueError, match="could not load"):
        LlamaCppLM(header_only)
    with pytest.raises(ValueError, match="does not exist"):
        LlamaCppLM(tmp_path / "missing.smollm2_gguf")
    with pytest.raises(ValueError, match="longer than the 512 configured"):
        lm.forward(lm.new_state(), list(range(513)))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        lm.forward(lm.new_state(), [lm.vocab_size])
    with pytest.raises(ValueError, match="n_ctx >= 8"):
        LlamaCppSettings(n_ctx=0)


def test_a_device_on_llama_cpp_with_a_torch_target_gives_the_torch_targets_tokens(smollm2, smollm2_ids):
    """Mixed engines, temperature 0: whatever the draft runs on, `sd`, `hlm` and the lattice protocols return the
    target's own greedy tokens; `slm` returns llama.cpp's own greedy continuation; U-HLM and CU-HLM measure the
    draft's uncertainty on llama.cpp's logits and skip the confident uploads."""
    target = CausalLM(smollm2.model)
    with serving(target, vocab=vocab_fingerprint(smollm2.tokenizer)) as server:
        config = EdgeConfig(model="smollm2-135m", engine=EngineConfig(backend="llamacpp", n_ctx=1024, threads=2),
                            link=LinkConfig(server.endpoint, security=LinkSecurity.plaintext()))
        with EdgeRuntime(config) as rt:
            assert isinstance(rt.engine.lm, LlamaCppLM) and rt.engine.eos_ids
            reference = target.greedy(smollm2_ids, 24, eos=sorted(rt.engine.eos_ids))
            for protocol in ("sd", "hlm"):
                result = rt.generate(smollm2_ids, protocol, SamplingParams(0.0), 24, seed=0)
                assert result.tokens == reference, protocol
                assert result.accepted > 0
            alone = rt.engine.lm.greedy(smollm2_ids, 24)
            assert rt.generate(smollm2_ids, "slm", SamplingParams(0.0), 24, seed=0).tokens == alone
            for protocol in ("qs", "ksqs", "csqs"):  # lattice-quantized drafts: exact too
                assert rt.generate(smollm2_ids, protocol, SamplingParams(0.0), 24, seed=0).tokens == reference
            for protocol in ("uhlm", "cuhlm"):  # temperature-perturbation uncertainty on llama.cpp's logits
                result = rt.generate(smollm2_ids, protocol, SamplingParams(0.0), 24, seed=0)
                assert result.n == 24 and 0 < result.skipped < 24 and len(result.skip_log) == result.skipped
            with pytest.raises(ValueError, match="split protocols .* run on the torch engine"):
                rt.generate(smollm2_ids, "ushape", SamplingParams(0.0), 4, seed=0)


def test_the_device_config_refuses_what_llama_cpp_cannot_run():
    with pytest.raises(ValueError, match="drafts with the whole model"):
        EngineConfig(backend="llamacpp", token_draft="adapter")
    with pytest.raises(ValueError, match="n_ctx must be >= 8"):
        EngineConfig(backend="llamacpp", n_ctx=4)
    with pytest.raises(ValueError, match="llama.cpp runs GGUF files"):
        model_gguf("some/hf-directory")


def test_several_states_in_one_forward_equal_each_alone(lm, smollm2_ids):
    alone = [lm.forward(lm.new_state(), smollm2_ids, n_logits=3),
             lm.forward(lm.new_state(), smollm2_ids[:7], n_logits=1)]
    a, b = lm.new_state(), lm.new_state()
    together = lm.forward_many([a, b], [smollm2_ids, smollm2_ids[:7]], [3, 1])
    for got, want in zip(together, alone):
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-3 * np.abs(want).max())
        assert (got.argmax(1) == want.argmax(1)).all()
    assert (a.length, b.length) == (len(smollm2_ids), 7)
    with pytest.raises(ValueError, match="once per forward_many"):
        lm.forward_many([a, a], [[1], [2]], [1, 1])


def test_a_llama_cpp_cloud_batches_devices_and_each_gets_its_greedy_answer(smollm2_gguf, smollm2, smollm2_ids):
    """Two devices at once on a llama.cpp target served from a thread: `sd` gives each the target's own greedy
    tokens, whatever else shares its steps, up to llama.cpp's numerics (`assert_greedy`: the two sessions' cells
    interleave in the one KV cache, so a near-tie may go to the runner-up); a split protocol is refused with the
    reason."""
    target = LlamaCppLM(smollm2_gguf, LlamaCppSettings(n_ctx=2048, n_batch=64, n_threads=2, n_seq_max=8))
    prompts = [smollm2_ids, list(smollm2.tokenizer("def quicksort(xs):\n")["input_ids"])]
    with serving(target, vocab=vocab_fingerprint(smollm2.tokenizer)) as server:
        config = EdgeConfig(model="smollm2-135m", engine=EngineConfig(backend="llamacpp", n_ctx=1024, threads=1),
                            link=LinkConfig(server.endpoint, security=LinkSecurity.plaintext()), draft_len=3)
        results = [None, None]

        def device(i):
            with EdgeRuntime(config) as rt:
                results[i] = rt.generate(prompts[i], "sd", SamplingParams(0.0), 20, seed=i).tokens

        threads = [threading.Thread(target=device, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        with EdgeRuntime(EdgeConfig(model="smollm2-135m", link=config.link), smollm2) as rt:
            with pytest.raises(Exception, match="run on the torch engine; this cloud runs llama.cpp"):
                rt.generate(smollm2_ids, "ushape", SamplingParams(0.0), 4, seed=0)
        trees = EdgeConfig(model="smollm2-135m", link=config.link, tree_nodes=8)  # draft trees: told before sending
        with EdgeRuntime(trees, smollm2) as rt:
            with pytest.raises(Exception, match="verifies no draft trees"):
                rt.generate(smollm2_ids, "sd", SamplingParams(0.0), 4, seed=0)
            assert rt.client.welcome.max_tree_nodes == 0
    assert all(r is not None and len(r) == 20 for r in results), results  # once the cloud has stopped: one thread
    for prompt, tokens in zip(prompts, results):
        assert_greedy(target, prompt, tokens)


def test_llama_cpp_on_both_sides_across_processes_gives_the_targets_own_tokens(smollm2_gguf, smollm2, smollm2_ids):
    """`hat-cloud serve --engine llamacpp` in its own process, the device on llama.cpp: `sd` and `hlm` at
    temperature 0 return exactly the llama.cpp target's greedy continuation."""
    with LlamaCppLM(smollm2_gguf, LlamaCppSettings(n_ctx=1024, n_batch=512, n_threads=2)) as alone:
        reference = alone.greedy(smollm2_ids, 24)
    with CloudProcess("smollm2-135m", extra_args=["--engine", "llamacpp", "--n-ctx", "2048"], threads=1,
                      ready_timeout_s=300) as cloud:
        assert "engine=llamacpp" in cloud.ready_info
        config = EdgeConfig(model="smollm2-135m", engine=EngineConfig(backend="llamacpp", n_ctx=1024, threads=1),
                            link=LinkConfig(cloud.endpoint, security=LinkSecurity.plaintext()))
        with EdgeRuntime(config) as rt:
            for protocol in ("sd", "hlm", "llm"):
                assert rt.generate(smollm2_ids, protocol, SamplingParams(0.0), 24, seed=0).tokens == reference, protocol


def test_sampled_sd_over_a_llama_cpp_cloud_follows_its_softmax_with_a_far_draft(smollm2_gguf, smollm2):
    """T = 1, `hat-cloud serve --engine llamacpp` in its own process verifying a torch draft far from it (SmolLM2 with
    Gaussian noise (sd 0.06) on its head, which is also its embedding table: mean TV(p, q) 0.66 at the drafted
    positions, where a draft of the target's own dequantised weights sat near p and a verifier accepting every draft
    passed; 160 tokens, power 1.00 against accept-all, 0.63 against mix15): every drafted position of a generation
    follows the llama.cpp target's softmax given its prefix (tests/exactness.py; p from llama.cpp on the same tokens, q
    from the draft), and the run has the power to catch a verifier that accepts every draft. The tiny-model tests
    (tests/test_exactness.py) carry the sample size for the subtler faults; this is the real pair's smaller check."""
    from tests.exactness import Z_CRIT, drafted_positions, drift, llama_cpp_far_draft_run, power, tv_rows

    n = 160
    res, p, q = llama_cpp_far_draft_run(smollm2, smollm2_gguf, n, draft_len=3)
    tokens = res.tokens
    at = drafted_positions({"tokens": tokens, "verify_log": res.verify_log})
    d = drift(np.asarray(tokens)[at], p[at], q[at])
    pw = {f: power(p[at], q[at], f, n, 3) for f in ("accept-all", "mix15")}
    print(f"llama.cpp target, far draft: {d}; mean TV(p, q) {tv_rows(p[at], q[at]).mean():.2f}; power {pw}")
    assert tv_rows(p[at], q[at]).mean() >= 0.3
    assert abs(d.z) < Z_CRIT and pw["accept-all"] >= 0.99, (str(d), pw)
