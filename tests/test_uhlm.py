"""uhlm / randhlm / cuhlm on tiny random models (plumbing), and CU-HLM's exact variant on pure math (statistics)."""
from __future__ import annotations

import numpy as np
import pytest

from edge_runtime.client import CloudClient
from edge_runtime.config import EdgeConfig, LinkConfig, UncertaintyConfig
from edge_runtime.drafter import Drafter
from edge_runtime.protocols import new_session
from edge_runtime.request import GenerationRequest
from hat_split.net.security import LinkSecurity
from hat_split.wire import messages as P
from hat_split.math import topk_codec
from hat_split.math.sampling import SamplingParams, sample_rng
from hat_split.math.verify import verify_rng

PROMPT = [5, 17, 99, 3, 250, 7]


def _run(server, draft_lm, protocol, params, n=32, seed=0, **unc):
    link = LinkConfig(server.endpoint, security=LinkSecurity.plaintext())
    with CloudClient(link, P.Hello("t", "tiny", 512, "tiny-vocab")) as client:
        config = EdgeConfig(model="tiny", uncertainty=UncertaintyConfig(**unc))
        gen = new_session(config, GenerationRequest(PROMPT, protocol, params, n, seed=seed),
                          Drafter(draft_lm, params), client, frozenset(), 1)
        before = server.stats.bytes_in
        result = gen.run(PROMPT, lambda toks: "")  # raises if device and cloud sequences differ at close
        return result, server.stats.bytes_in - before


def test_uhlm_that_never_skips_is_hlm(tiny_server, tiny_pair):
    params = SamplingParams(1.0, top_k=40)
    hlm, _ = _run(tiny_server, tiny_pair[0], "hlm", params, seed=5)
    uhlm, _ = _run(tiny_server, tiny_pair[0], "uhlm", params, seed=5, u_threshold=-1.0)
    assert uhlm.tokens == hlm.tokens and uhlm.skipped == 0


def test_always_skipping_is_the_draft_alone_and_the_cloud_catches_up(tiny_server, tiny_pair):
    draft = tiny_pair[0]
    slm = new_session(EdgeConfig(model="tiny"), GenerationRequest(PROMPT, "slm", SamplingParams(0.0), 20, seed=0),
                      Drafter(draft, SamplingParams(0.0)), None, frozenset(), 1).run(PROMPT, lambda t: "")
    res, _ = _run(tiny_server, draft, "uhlm", SamplingParams(0.0), n=20, u_threshold=1.0)
    assert res.tokens == slm.tokens and res.skipped == 20 and res.rounds == 0
    assert res.round_trips == 2  # open, and close carrying the 20 skipped tokens


@pytest.fixture(scope="module")
def peaky_draft(tiny_pair):
    """The tiny draft with a sharpened head: a random model is uncertain everywhere, this one only sometimes."""
    import copy

    import torch

    from hat_split.models.lm import CausalLM

    model = copy.deepcopy(tiny_pair[0].model)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(40.0)
    return CausalLM(model)


@pytest.mark.parametrize("protocol,unc", [("randhlm", {}), ("uhlm", {"u_threshold": 0.5}),
                                          ("cuhlm", {"u_threshold": 0.5, "k_mode": "online"}),
                                          ("cuhlm", {"u_threshold": 0.5, "k_mode": "offline", "k_offline": 7})])
def test_skipping_keeps_device_and_cloud_identical_and_bytes_are_real(tiny_server, peaky_draft, protocol, unc):
    res, server_in = _run(tiny_server, peaky_draft, protocol, SamplingParams(1.0), n=96, seed=2, **unc)
    assert len(res.tokens) == 96
    assert 0 < res.skipped < 96 and res.rounds > 0  # both paths were taken
    assert res.up_bytes == server_in  # what the device counted is what reached the server
    if protocol == "cuhlm":
        assert res.upload_ks and len(res.upload_ks) == res.rounds
        assert res.up_bytes < res.rounds * 512 * 2  # top-k bits, not a dense float16 row per upload
        if unc["k_mode"] == "offline":
            assert set(res.upload_ks) == {7}


def test_cuhlm_exact_greedy_is_the_targets_greedy(tiny_server, tiny_pair):
    import torch

    target = tiny_pair[1]
    ref = target.model.generate(torch.tensor([PROMPT]), max_new_tokens=24, do_sample=False, min_new_tokens=24,
                                pad_token_id=0, eos_token_id=None)[0, len(PROMPT):].tolist()
    res, _ = _run(tiny_server, tiny_pair[0], "cuhlm", SamplingParams(0.0), n=24, u_threshold=-1.0, exact=True,
                  k_mode="offline", k_offline=3)
    assert res.tokens == ref


def test_cuhlm_exact_output_follows_the_target_distribution():
    """The exact variant's math: d ~ x̂ (top-k reconstruction), verified against x̂ → the output follows p."""
    rng = np.random.default_rng(0)
    V, N = 12, 60_000
    x = rng.dirichlet(np.full(V, 0.5))
    p = rng.dirichlet(np.full(V, 0.5))
    x_hat = topk_codec.reconstruct(topk_codec.select(x, 3, int(np.argmax(x)), 8), V)
    drafts = sample_rng(np.repeat(x_hat[None], N, 0), rng)  # [N]
    res = verify_rng(drafts[:, None], np.repeat(x_hat[None, None], N, 0), np.repeat(p[None, None], N, 0)
                     .repeat(2, axis=1), rng)
    first = res.tokens[:, 0]
    freq = np.bincount(first, minlength=V) / N
    tv_target = 0.5 * np.abs(freq - p).sum()
    tv_draft = 0.5 * np.abs(freq - x_hat).sum()
    assert tv_target < 0.012 and tv_draft > 5 * tv_target


@pytest.mark.parametrize("protocol", ["uhlm", "cuhlm"])
def test_the_answer_budget_with_a_refitted_line_through_a_cloud(tiny_server, peaky_draft, protocol):
    """skip_rule answer with refit (hat_split.math.skip_budget) through a real cloud: device and cloud stay identical,
    every upload's verdict is a point of the line, a share of the would-be skips is explored, and the answer's
    predicted rejections stay within ε."""
    unc = dict(skip_rule="answer", answer_risk=3.0, refit=True, explore=0.3, k_mode="offline", k_offline=7)
    res, server_in = _run(tiny_server, peaky_draft, protocol, SamplingParams(1.0), n=96, seed=2, **unc)
    state = res.skip_policy
    assert len(res.tokens) == 96 and res.up_bytes == server_in
    assert 0 < res.skipped < 96 and res.explored > 0
    assert state["rule"] == "answer" and state["points"] == res.rounds  # each upload judged, explored ones included
    assert 0 < state["answer_risk_spent"] <= 3.0 and -1.0 <= state["threshold"] <= 1.0
    plain, _ = _run(tiny_server, peaky_draft, protocol, SamplingParams(1.0), n=96, seed=2, u_threshold=0.5,
                    k_mode="offline", k_offline=7)
    assert plain.explored == 0 and plain.skip_policy["rule"] == "threshold" and plain.skip_policy["points"] == 0


def test_bad_skip_settings_are_refused_in_one_line():
    with pytest.raises(ValueError, match="skip_rule must be threshold or answer"):
        UncertaintyConfig(skip_rule="answers")
    with pytest.raises(ValueError, match="explore must be in"):
        UncertaintyConfig(explore=1.5)
    with pytest.raises(ValueError, match="answer_risk must be"):
        UncertaintyConfig(answer_risk=-1)
