"""The llama.cpp engine (hat_split.models.llamacpp_lm) on the registry's own GGUF file of SmolLM2-135M: its logits are
llama.cpp's own, a crop then a continuation equals a fresh evaluation, its argmax agrees with the torch engine on the
same file, states are independent sequences of one context, and bad input is refused with the reason."""
from __future__ import annotations

import gc

import numpy as np
import pytest

from edge_runtime.config import EdgeConfig, EngineConfig, LinkConfig
from edge_runtime.runtime import EdgeRuntime
from hat_split.math.sampling import SamplingParams
from hat_split.models.lm import CausalLM
from hat_split.models.loading import vocab_fingerprint
from hat_split.models.registry import gguf_path
from hat_split.net.security import LinkSecurity
from tests.conftest import serving

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (scripts/install_llamacpp.sh)")

from hat_split.models.llamacpp_lm import LlamaCppLM, LlamaCppSettings, model_gguf  # noqa: E402

PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


@pytest.fixture(scope="module")
def gguf(smollm2):
    return gguf_path("smollm2-135m")


@pytest.fixture(scope="module")
def ids(smollm2):
    return list(smollm2.tokenizer(PROMPT)["input_ids"])


@pytest.fixture(scope="module")
def lm(gguf):
    with LlamaCppLM(gguf, LlamaCppSettings(n_ctx=512, n_batch=32, n_threads=2, n_seq_max=2)) as m:
        yield m


@pytest.mark.parametrize("flash_attn", [True, False])
def test_logits_are_llama_cpps_own_evaluation_of_the_same_tokens(gguf, ids, flash_attn):
    ref = llama_cpp.Llama(model_path=str(gguf), n_ctx=512, n_batch=32, n_threads=2, logits_all=True, verbose=False,
                          flash_attn=flash_attn)
    ref.eval(ids)
    expected = np.array(ref.scores[: len(ids)])  # [n, vocab]
    with LlamaCppLM(gguf, LlamaCppSettings(n_ctx=512, n_batch=32, n_threads=2, flash_attn=flash_attn)) as lm:
        got = lm.forward(lm.new_state(), ids, n_logits=len(ids))
    assert got.shape == (len(ids), lm.vocab_size) == expected.shape
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4)


def test_a_crop_then_a_continuation_equals_a_fresh_evaluation(lm, ids):
    drafts = lm.greedy(ids, 6)
    fresh = lm.forward(lm.new_state(), ids + drafts, n_logits=4)  # [4, vocab]
    state = lm.new_state()
    lm.forward(state, ids, n_logits=1)
    lm.forward(state, [9, 8, 7, 6, 5], n_logits=5)  # drafts that get rejected
    lm.crop(state, len(ids))
    assert state.length == len(ids)
    got = lm.forward(state, drafts, n_logits=4)
    np.testing.assert_allclose(got, fresh, rtol=0, atol=1e-3 * np.abs(fresh).max())
    assert (got.argmax(1) == fresh.argmax(1)).all()


def test_argmax_agrees_with_the_torch_engine_on_the_same_gguf(lm, smollm2, ids):
    torch_lm = CausalLM(smollm2.model)  # the same GGUF, dequantised to float32
    text = ids + torch_lm.greedy(ids, 24)
    ours = lm.forward(lm.new_state(), text, n_logits=len(text) - len(ids) + 1).argmax(1)
    theirs = torch_lm.forward(torch_lm.new_state(), text, n_logits=len(text) - len(ids) + 1).argmax(1)
    assert (ours == theirs).mean() >= 0.9, (ours, theirs)  # quantised matmuls: a near tie may flip


def test_states_are_independent_sequences_and_their_ids_are_reused(lm, ids):
    alone = lm.forward(lm.new_state(), ids, n_logits=1)
    gc.collect()
    a, b = lm.new_state(), lm.new_state()
    lm.forward(a, ids[:5], n_logits=1)
    lm.forward(b, [1, 2, 3], n_logits=1)  # interleaved with a
    got = lm.forward(a, ids[5:], n_logits=1)
    np.testing.assert_allclose(got, alone, rtol=0, atol=1e-3 * np.abs(alone).max())
    with pytest.raises(RuntimeError, match="all 2 llama.cpp sequences are in use"):
        lm.new_state()
    del a, b
    gc.collect()
    assert lm.new_state().length == 0  # a released id comes back empty


def test_bad_input_is_refused_with_the_reason(lm, tmp_path, gguf):
    text = tmp_path / "notes.gguf"
    text.write_text("not a model")
    with pytest.raises(ValueError, match="is not a GGUF file"):
        LlamaCppLM(text)
    header_only = tmp_path / "empty.gguf"
    header_only.write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(ValueError, match="could not load"):
        LlamaCppLM(header_only)
    with pytest.raises(ValueError, match="does not exist"):
        LlamaCppLM(tmp_path / "missing.gguf")
    with pytest.raises(ValueError, match="longer than the 512 configured"):
        lm.forward(lm.new_state(), list(range(513)))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        lm.forward(lm.new_state(), [lm.vocab_size])
    with pytest.raises(ValueError, match="n_ctx >= 8"):
        LlamaCppSettings(n_ctx=0)


def test_a_device_on_llama_cpp_with_a_torch_target_gives_the_torch_targets_tokens(smollm2, ids):
    """Mixed engines, temperature 0: whatever the draft runs on, `sd` and `hlm` return the target's own greedy
    tokens; `slm` returns llama.cpp's own greedy continuation."""
    target = CausalLM(smollm2.model)
    with serving(target, vocab=vocab_fingerprint(smollm2.tokenizer)) as server:
        config = EdgeConfig(model="smollm2-135m", engine=EngineConfig(backend="llamacpp", n_ctx=1024, threads=2),
                            link=LinkConfig(server.endpoint, security=LinkSecurity.plaintext()))
        with EdgeRuntime(config) as rt:
            assert isinstance(rt.lm, LlamaCppLM) and rt.eos_ids
            reference = target.greedy(ids, 24, eos=sorted(rt.eos_ids))
            for protocol in ("sd", "hlm"):
                result = rt.generate(ids, protocol, SamplingParams(0.0), 24, seed=0)
                assert result.tokens == reference, protocol
                assert result.accepted > 0
            assert rt.generate(ids, "slm", SamplingParams(0.0), 24, seed=0).tokens == rt.lm.greedy(ids, 24)
            with pytest.raises(ValueError, match="split protocols .* run on the torch engine"):
                rt.generate(ids, "ushape", SamplingParams(0.0), 4, seed=0)


def test_the_device_config_refuses_what_llama_cpp_cannot_run():
    with pytest.raises(ValueError, match="drafts with the whole model"):
        EngineConfig(backend="llamacpp", token_draft="adapter")
    with pytest.raises(ValueError, match="n_ctx must be >= 8"):
        EngineConfig(backend="llamacpp", n_ctx=4)
    with pytest.raises(ValueError, match="llama.cpp runs GGUF files"):
        model_gguf("some/hf-directory")
