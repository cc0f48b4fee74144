"""The round loop on tiny random models (plumbing): greedy hybrid output equals plain target decoding."""
from __future__ import annotations

import pytest
import torch

from edge_runtime.client import CloudClient
from edge_runtime.config import EdgeConfig, LinkConfig
from edge_runtime.drafter import Drafter
from edge_runtime.protocols import new_session
from edge_runtime.request import GenerationRequest
from hat_split.net.security import LinkSecurity
from hat_split.wire import messages as P
from hat_split.math.sampling import SamplingParams

PROMPT = [5, 17, 99, 3, 250, 7]


def _run(server, draft_lm, protocol, params, n=24, seed=0, draft_len=4, stop=0.0):
    link = LinkConfig(server.endpoint, security=LinkSecurity.plaintext())
    with CloudClient(link, P.Hello("t", "tiny", 512, "tiny-vocab")) as client:
        config = EdgeConfig(model="tiny", draft_len=draft_len, llm_chunk=5, draft_stop_prob=stop)
        gen = new_session(config, GenerationRequest(PROMPT, protocol, params, n, seed=seed),
                          Drafter(draft_lm, params), client, frozenset(), 1)
        return gen.run(PROMPT, lambda toks: ""), gen


def _hf_greedy(lm, n):
    out = lm.model.generate(torch.tensor([PROMPT]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                            pad_token_id=0, eos_token_id=None)
    return out[0, len(PROMPT):].tolist()


@pytest.mark.parametrize("protocol,draft_len", [("sd", 1), ("sd", 4), ("sd", 7), ("hlm", 1), ("llm", 1)])
def test_greedy_hybrid_equals_target_greedy(tiny_server, tiny_pair, protocol, draft_len):
    draft, target = tiny_pair
    result, gen = _run(tiny_server, draft, protocol, SamplingParams(0.0), draft_len=draft_len)
    assert result.tokens == _hf_greedy(target, 24)
    assert result.finish_reason == "length"
    # the device's draft cache never holds a rejected position
    assert gen.drafter.kv.length <= len(gen.drafter.tokens)


def test_confidence_stop_shortens_drafts_and_stays_exact(tiny_server, tiny_pair):
    """η close to 1 ends every draft after its first token (a random model is never that sure); η = 0 never does."""
    draft, target = tiny_pair
    short, _ = _run(tiny_server, draft, "sd", SamplingParams(0.0), draft_len=6, stop=0.99)
    full, _ = _run(tiny_server, draft, "sd", SamplingParams(0.0), draft_len=6)
    assert short.tokens == full.tokens == _hf_greedy(target, 24)
    assert short.drafted == short.rounds  # one draft per round
    assert full.drafted > full.rounds


def test_drafts_longer_than_the_clouds_limit_are_cut_to_it(tiny_server, tiny_pair):
    """The cloud states max_draft_len in its Welcome; a device asking for more drafts no more than that."""
    draft, target = tiny_pair
    limit = tiny_server.config.max_draft_len
    result, _ = _run(tiny_server, draft, "sd", SamplingParams(0.0), n=3 * limit, draft_len=limit + 8)
    assert result.tokens == _hf_greedy(target, 3 * limit)
    assert result.drafted <= result.rounds * limit


def test_slm_is_the_draft_model_alone(tiny_pair):
    draft, _ = tiny_pair
    gen = new_session(EdgeConfig(model="tiny"), GenerationRequest(PROMPT, "slm", SamplingParams(0.0), 16, seed=0),
                      Drafter(draft, SamplingParams(0.0)), None, frozenset(), 1)
    result = gen.run(PROMPT, lambda toks: "")
    assert result.tokens == _hf_greedy(draft, 16) and result.up_bytes == 0 and result.round_trips == 0


def test_seeded_sampling_is_reproducible(tiny_server, tiny_pair):
    params = SamplingParams(1.0, top_k=50, top_p=0.95)
    a, _ = _run(tiny_server, tiny_pair[0], "sd", params, seed=11)
    b, _ = _run(tiny_server, tiny_pair[0], "sd", params, seed=11)
    c, _ = _run(tiny_server, tiny_pair[0], "sd", params, seed=12)
    assert a.tokens == b.tokens and a.tokens != c.tokens


def test_eos_stops_generation(tiny_server, tiny_pair):
    ref = _hf_greedy(tiny_pair[1], 24)
    eos = ref[5]
    with CloudClient(LinkConfig(tiny_server.endpoint, security=LinkSecurity.plaintext()),
                     P.Hello("t", "tiny", 512, "tiny-vocab")) as client:
        gen = new_session(EdgeConfig(model="tiny"), GenerationRequest(PROMPT, "sd", SamplingParams(0.0), 24, seed=0),
                          Drafter(tiny_pair[0], SamplingParams(0.0)), client, frozenset([eos]), 1)
        result = gen.run(PROMPT, lambda toks: "")
    assert result.tokens == ref[: ref.index(eos) + 1] and result.finish_reason == "eos"


def test_bytes_are_counted_from_frames(tiny_server, tiny_pair):
    result, _ = _run(tiny_server, tiny_pair[0], "hlm", SamplingParams(1.0), n=8, seed=3)
    # hlm sends one dense float16 row of the 512-token vocabulary per round
    assert result.up_bytes >= result.rounds * 512 * 2
    assert result.round_trips == result.rounds + 2  # + open and close


def test_token_protocols_of_many_devices_share_batched_steps(tiny_server, tiny_pair):
    """Six devices at once (sd with several draft lengths, hlm, llm): the cloud verifies and decodes them in shared
    batched steps over every layer, and each still gets the target's greedy tokens."""
    import threading

    draft, target = tiny_pair
    ref = _hf_greedy(target, 24)
    jobs = [("sd", 1), ("sd", 4), ("sd", 7), ("hlm", 1), ("llm", 1), ("sd", 3)]
    results, start = {}, threading.Barrier(len(jobs))
    stats = tiny_server.work.stats
    steps0, segments0 = stats.steps, stats.segments

    def device(i, protocol, draft_len):
        start.wait()
        results[i] = _run(tiny_server, draft, protocol, SamplingParams(0.0), draft_len=draft_len)[0].tokens

    threads = [threading.Thread(target=device, args=(i, *job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert [results.get(i) for i in range(len(jobs))] == [ref] * len(jobs)
    assert stats.segments - segments0 > stats.steps - steps0 > 0  # on average more than one session per step
    assert not tiny_server.work.scheduler.sessions  # every session closed: its KV positions are free
