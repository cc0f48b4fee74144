"""Log-probabilities of the emitted tokens: the pure math, the wire, and every protocol family end to end against the
target's own log-softmax (token protocols: the cloud computes them; split protocols: the device's head; skipped and
local tokens: the draft's, marked)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from edge_runtime.client import CloudClient, CloudError
from edge_runtime.backends.split_parts import TorchSplitParts
from edge_runtime.config import EdgeConfig, LinkConfig, SplitConfig, UncertaintyConfig
from edge_runtime.drafter import Drafter
from edge_runtime.protocols import new_session
from edge_runtime.request import GenerationRequest
from edge_runtime.split_drafter import SplitDrafter
from hat_split.math.logprobs import MAX_TOP_LOGPROBS, concat, sources, token_logprobs
from hat_split.math.sampling import SamplingParams
from hat_split.models.adapter import Adapter
from hat_split.models.partition import SplitModel
from hat_split.net.security import LinkSecurity
from hat_split.wire import messages as P

PROMPT = [5, 17, 99, 3, 250, 7]
K = 5


def _reference(model, tokens):
    """The model's own log-softmax at each generated position `# [n, vocab]` (one forward over the whole text)."""
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + list(tokens)])).logits[0].double()
    return torch.log_softmax(logits, -1)[len(PROMPT) - 1:len(PROMPT) - 1 + len(tokens)].numpy()


def _check(result, model, k=K, tol=1e-4):
    lp = concat(result.logprobs)
    ref = _reference(model, result.tokens)
    assert len(lp) == len(result.tokens) and lp.k == k
    np.testing.assert_allclose(lp.values, ref[np.arange(len(ref)), result.tokens], atol=tol)
    best = np.argsort(-ref, axis=1, kind="stable")[:, :k]
    assert (lp.top_ids == best).all()
    np.testing.assert_allclose(lp.top_values, np.take_along_axis(ref, best, 1), atol=tol)
    assert (np.diff(lp.top_values, axis=1) <= 0).all()
    return lp


def test_token_logprobs_are_the_log_softmax_ordered_with_ties_by_id():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 64)).astype(np.float32)
    x[2, 9] = x[2, 40] = 12.0  # a tie at the top: the smaller id first
    lp = token_logprobs(x, [3, 0, 40, 63], 6)
    ref = torch.log_softmax(torch.tensor(x, dtype=torch.float64), -1).numpy()
    np.testing.assert_allclose(lp.values, ref[np.arange(4), [3, 0, 40, 63]], atol=1e-6)
    assert lp.top_ids[2, :2].tolist() == [9, 40] and (np.diff(lp.top_values, axis=1) <= 0).all()
    assert token_logprobs(x, [1, 1, 1, 1], 0).top_ids.shape == (4, 0)
    assert token_logprobs(x, [1, 1, 1, 1], 64).top_ids.shape == (4, 64)
    assert lp.head(2).values.tolist() == lp.values[:2].tolist()
    for bad, match in (((x, [1, 2], 3), "one logits row per token"), ((x, [1, 2, 3, 64], 3), "token ids"),
                       ((x, [1, 2, 3, 4], 65), "k must be")):
        with pytest.raises(ValueError, match=match):
            token_logprobs(*bad)
    assert sources([lp.head(1), token_logprobs(x[:2], [1, 1], 0, "draft")]) == ["target", "draft", "draft"]


def test_a_verdict_carries_them_and_the_cloud_refuses_more_than_the_limit(tiny_server):
    lp = token_logprobs(np.zeros((2, 8), np.float32), [1, 2], 3)
    msg = P.Verdict(1, 1, 1, 2, 9, 0.0, 0.0, P.TokenLogprobs(lp.values, lp.top_ids, lp.top_values))
    back = P.decode(P.encode(msg))
    assert np.array_equal(back.logprobs.top_ids, lp.top_ids) and back.logprobs.values.dtype == np.float32
    assert P.decode(P.encode(P.Verdict(1, 1, 1, 2, 9, 0.0))).logprobs is None
    link = LinkConfig(tiny_server.endpoint, security=LinkSecurity.plaintext())
    with CloudClient(link, P.Hello("t", "tiny", 512, "tiny-vocab")) as client:
        with pytest.raises(CloudError, match=f"at most {MAX_TOP_LOGPROBS}"):
            client.request(P.OpenSession(1, "sd", np.asarray(PROMPT, np.int32), logprobs=MAX_TOP_LOGPROBS + 1))


@pytest.mark.parametrize("protocol", ["sd", "hlm", "llm", "qs"])
def test_token_protocols_return_the_targets_logprobs(tiny_server, tiny_pair, protocol):
    draft, target = tiny_pair
    link = LinkConfig(tiny_server.endpoint, security=LinkSecurity.plaintext())
    params = SamplingParams(0.0)
    with CloudClient(link, P.Hello("t", "tiny", 512, "tiny-vocab")) as client:
        gen = new_session(EdgeConfig(model="tiny", draft_len=3), GenerationRequest(PROMPT, protocol, params, 12, seed=0,
                                                                                    logprobs=K),
                          Drafter(draft, params), client, frozenset(), 1)
        result = gen.run(PROMPT, lambda t: "")
    lp = _check(result, target.model)
    assert lp.source == "target" and set(sources(result.logprobs)) == {"target"}


def test_uhlm_marks_the_tokens_it_committed_without_the_target_as_the_drafts(tiny_server, tiny_pair):
    draft, target = tiny_pair
    link = LinkConfig(tiny_server.endpoint, security=LinkSecurity.plaintext())
    params = SamplingParams(0.0)
    config = EdgeConfig(model="tiny", uncertainty=UncertaintyConfig(u_threshold=1.0))  # every token may skip
    with CloudClient(link, P.Hello("t", "tiny", 512, "tiny-vocab")) as client:
        gen = new_session(config, GenerationRequest(PROMPT, "uhlm", params, 8, seed=0, logprobs=2),
                          Drafter(draft, params), client, frozenset(), 1)
        result = gen.run(PROMPT, lambda t: "")
    assert result.skipped > 0 and sources(result.logprobs).count("draft") == result.skipped
    first_skip = sources(result.logprobs).index("draft")
    ref = _reference(draft.model, result.tokens)  # the draft's own distribution
    got = concat(result.logprobs).values[first_skip]
    assert got == pytest.approx(ref[first_skip, result.tokens[first_skip]], abs=1e-4)


@pytest.mark.parametrize("protocol", ["hat", "ushape"])
def test_split_protocols_return_the_targets_logprobs_from_the_devices_head(tiny_server, tiny_pair, protocol):
    model = tiny_pair[1].model
    adapter = Adapter(model, 1).eval().requires_grad_(False) if protocol == "hat" else None
    params = SamplingParams(0.0)
    link = LinkConfig(tiny_server.endpoint, security=LinkSecurity.plaintext())
    with CloudClient(link, P.Hello("t", "tiny", 512, "tiny-vocab")) as client:
        drafter = SplitDrafter(TorchSplitParts(SplitModel(model, 1), adapter), params, 0)
        config = EdgeConfig(model="tiny", split=SplitConfig(m=1, hidden_format="float32", draft_stop_prob=0.0,
                                                            draft_len=4))
        gen = new_session(config, GenerationRequest(PROMPT, protocol, params, 12, seed=0, logprobs=K), drafter, client,
                          frozenset(), 1)
        result = gen.run(PROMPT, lambda t: "")
    _check(result, model)
    if protocol == "hat":
        assert result.drafted > 0


def test_without_asking_nothing_is_computed_or_sent(tiny_server, tiny_pair):
    draft, _ = tiny_pair
    link = LinkConfig(tiny_server.endpoint, security=LinkSecurity.plaintext())
    sizes = {}
    for k in (None, MAX_TOP_LOGPROBS):
        with CloudClient(link, P.Hello("t", "tiny", 512, "tiny-vocab")) as client:
            gen = new_session(EdgeConfig(model="tiny", draft_len=3),
                              GenerationRequest(PROMPT, "sd", SamplingParams(0.0), 12, seed=0, logprobs=k),
                              Drafter(draft, SamplingParams(0.0)), client, frozenset(), 1)
            result = gen.run(PROMPT, lambda t: "")
        sizes[k] = result.down_bytes
        assert (result.logprobs is None) == (k is None)
    # each committed token brings 4 + 20 x 8 bytes down, and the frames' references: counted on the wire
    assert sizes[MAX_TOP_LOGPROBS] - sizes[None] >= 12 * (4 + MAX_TOP_LOGPROBS * 8)


@pytest.mark.real_models
def test_hat_on_the_real_smollm2_returns_its_own_logprobs(smollm2):
    """SmolLM2-135M cut at m = 2 with an undistilled Λ (exactness does not depend on it), float32, temperature 0:
    each token's logprob and its top 5 are the whole model's own log-softmax."""
    from hat_split.models.lm import CausalLM
    from tests.conftest import serving

    model, tok = smollm2.model, smollm2.tokenizer
    prompt = tok("def add(a, b):\n    return")["input_ids"]
    params = SamplingParams(0.0)
    with serving(CausalLM(model), vocab="smollm2") as server, \
            CloudClient(LinkConfig(server.endpoint, security=LinkSecurity.plaintext()),
                        P.Hello("t", "smollm2", len(tok), "smollm2")) as client:
        parts = TorchSplitParts(SplitModel(model, 2), Adapter(model, 2).eval().requires_grad_(False))
        config = EdgeConfig(model="smollm2", split=SplitConfig(m=2, hidden_format="float32", draft_stop_prob=0.0,
                                                               draft_len=4))
        gen = new_session(config, GenerationRequest(prompt, "hat", params, 12, seed=0, logprobs=K),
                          SplitDrafter(parts, params, 0), client, frozenset(), 1)
        result = gen.run(prompt, lambda t: "")
    with torch.no_grad():
        logits = model(torch.tensor([prompt + result.tokens])).logits[0].double()
    ref = torch.log_softmax(logits, -1)[len(prompt) - 1:len(prompt) - 1 + len(result.tokens)].numpy()
    lp = concat(result.logprobs)
    assert result.drafted > 0 and len(lp) == 12
    np.testing.assert_allclose(lp.values, ref[np.arange(12), result.tokens], atol=1e-3)
    np.testing.assert_allclose(lp.top_values, -np.sort(-ref, axis=1)[:, :K], atol=1e-3)
