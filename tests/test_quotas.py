"""A cloud one device cannot monopolise: per-device quotas, KV memory in bytes, eviction of idle sessions under
pressure (the evicted device resumes with identical tokens), quota files of allow-list entries."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cloud_runtime.quotas import (Holding, Quota, QuotaBook, QuotaExceeded, Usage, eviction_order, format_bytes,
                                  parse_bytes, quota_from_file)
from edge_runtime.client import CloudClient, CloudError
from edge_runtime.config import EdgeConfig, LinkConfig
from edge_runtime.drafter import Drafter
from edge_runtime.protocols import new_session
from edge_runtime.request import GenerationRequest
from hat_split.math.sampling import SamplingParams
from hat_split.net.security import LinkSecurity
from hat_split.wire import messages as P
from tests.conftest import serving, tiny_model

PROMPT = [5, 17, 99, 3, 250, 7]


def test_sizes_and_quota_files(tmp_path):
    assert parse_bytes("8GiB") == 8 << 30 and parse_bytes("1.5 MB") == 1_500_000 and parse_bytes(4096) == 4096
    with pytest.raises(ValueError, match="kv_memory must be a size"):
        parse_bytes("8 parsecs", "kv_memory")
    assert format_bytes(3 << 29) == "1.50 GiB"
    (tmp_path / "edge-7.quota.toml").write_text('sessions = 2\nkv_memory = "1MiB"\n')
    q = quota_from_file(tmp_path / "edge-7.quota.toml", Quota(16, 0, 8, 0))
    assert q == Quota(sessions=2, kv_bytes=1 << 20, in_flight=8)
    (tmp_path / "bad.quota.toml").write_text("sesions = 2\n")
    with pytest.raises(ValueError, match="bad.quota.toml: unknown quota 'sesions'"):
        quota_from_file(tmp_path / "bad.quota.toml", Quota())


def test_quota_book_names_the_quota_and_the_usage():
    book = QuotaBook(Quota(sessions=2, kv_bytes=1000, in_flight=1, prompt_tokens_per_min=100),
                     {"big": Quota(sessions=10)})
    book.check("a", Usage(sessions=1), sessions=1)
    with pytest.raises(QuotaExceeded, match="device a is over its sessions quota: it holds 2 .* its quota is 2"):
        book.check("a", Usage(sessions=2), sessions=1)
    with pytest.raises(QuotaExceeded, match="kv_memory quota: it holds 900 B and asks 200 B"):
        book.check("a", Usage(kv_bytes=900), kv_bytes=200)
    book.check("big", Usage(sessions=5), sessions=1)  # its own quota
    book.spend_prompt("a", 80, now=0.0)
    with pytest.raises(QuotaExceeded, match="prompt_tokens_per_min"):
        book.check("a", Usage(prompt_tokens=book.prompt_tokens("a", 30.0)), prompt_tokens=30)
    assert book.prompt_tokens("a", 61.0) == 0  # the minute has passed
    assert book.refusals == {"sessions": 1, "kv_memory": 1, "prompt_tokens_per_min": 1}


def test_eviction_takes_the_over_share_device_first_and_never_for_it():
    s = [Holding(("a", 1), "a", 600, True, 5.0), Holding(("a", 2), "a", 300, True, 1.0),
         Holding(("b", 1), "b", 100, True, 0.0), Holding(("c", 1), "c", 100, False, 0.0)]
    order = eviction_order(s, 900, asking="b")  # shares: 300 each; a holds 900
    assert [h.key for h in order] == [("a", 2), ("a", 1), ("b", 1)]  # a's LRU first; c's is busy
    assert [h.key for h in eviction_order(s, 900, asking="a")] == [("a", 2), ("a", 1)]  # a cannot push out b
    assert [h.key for h in eviction_order(s, 900, asking="b", spare=("a", 2))] == [("a", 1), ("b", 1)]


def _client(server, device_id):
    return CloudClient(LinkConfig(server.endpoint, security=LinkSecurity.plaintext()),
                       P.Hello(device_id, "tiny", 512, "tiny-vocab"))


def _open(client, sid, n=6):
    return client.request(P.OpenSession(sid, "sd", np.arange(1, n + 1, dtype=np.int32)))


def _hf_greedy(model, n):
    out = model.generate(torch.tensor([PROMPT]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                         pad_token_id=0, eos_token_id=None)
    return out[0, len(PROMPT):].tolist()


def test_a_device_over_its_quota_is_refused_while_another_is_served(tiny_pair):
    """Device A may hold 2 sessions and 40 KV positions: its third session and an oversized prompt are refused with
    the quota named, nothing changes for it; device B opens and generates meanwhile."""
    draft, target = tiny_pair
    cost = 2 * 2 * 2 * 16 * 4  # layers x (K, V) x kv heads x head dim x float32
    with serving(target, device_sessions=2, device_kv_memory=str(40 * cost)) as server, \
            _client(server, "A") as a, _client(server, "B") as b:
        assert isinstance(_open(a, 1), P.SessionOpened) and isinstance(_open(a, 2), P.SessionOpened)
        with pytest.raises(CloudError, match=r"\(quota\): device A is over its sessions quota: it holds 2"):
            _open(a, 3)
        a.request(P.CloseSession(2))
        with pytest.raises(CloudError, match="over its kv_memory quota: it holds 2.50 KiB and asks 19.50 KiB"):
            _open(a, 4, n=40)
        assert isinstance(_open(b, 1), P.SessionOpened)
        gen = new_session(EdgeConfig(model="tiny"), GenerationRequest(PROMPT, "sd", SamplingParams(0.0), 12, seed=0),
                          Drafter(draft, SamplingParams(0.0)), b, frozenset(), 9)
        assert gen.run(PROMPT, lambda t: "").tokens == _hf_greedy(target.model, 12)
        report = server.report()
        assert report["quotas"]["refusals"] == {"sessions": 1, "kv_memory": 1}
        assert report["server"]["errors_by_code"]["quota"] == 2
        usage = report["quotas"]["usage"]  # recent positions per device: A 5 of each 6-token prompt, B a generation
        assert set(usage) == {"A", "B"} and usage["B"] > usage["A"] >= 10, usage


def test_the_prompt_rate_quota_counts_what_was_queued(tiny_pair):
    """10 prompt tokens a minute: a 6-token prompt is taken, the next is refused naming the quota; a refused prompt
    is not counted."""
    with serving(tiny_pair[1], device_prompt_tokens_per_min=10, device_sessions=1) as server, \
            _client(server, "A") as a:
        assert isinstance(_open(a, 1), P.SessionOpened)
        with pytest.raises(CloudError, match="sessions quota"):  # refused before its prompt counts
            _open(a, 2)
        a.request(P.CloseSession(1))
        with pytest.raises(CloudError, match="over its prompt_tokens_per_min quota: it holds 6 and asks 6 more"):
            _open(a, 3)
        assert server.admission.usage("A").prompt_tokens == 6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_byte_accounting_matches_the_kv_tensors(dtype):
    """The scheduler's bytes of a token session (every layer) and of a split session (its middle layers) equal the
    bytes of the KV tensors the runner really holds, after prefill, a verify and a crop."""
    from cloud_runtime.runner import CROP, Engine, LocalExecutor, ModelEnds
    from cloud_runtime.scheduler import Scheduler, SchedulerConfig

    model = tiny_model(2, layers=3).to(dtype)
    engine = Engine(Scheduler(SchedulerConfig(kv_bytes=1 << 30)), LocalExecutor(model), ModelEnds(model))
    engine.open("token", 0, 3, owner="d")
    engine.open("split", 1, 2, owner="d")
    engine.submit("token", "prefill", np.arange(9, dtype=np.int64))
    engine.submit("split", "prefill", np.zeros((7, model.config.hidden_size), np.float32))
    while engine.busy:
        engine.step()
    engine.submit("token", "decode", np.arange(4, dtype=np.int64))
    while engine.busy:
        engine.step()
    engine.crop("token", 11)
    caches = engine.executor.runner.caches
    sid = {key: engine._sessions[key][0] for key in ("token", "split")}
    for key, positions in (("token", 11), ("split", 7)):
        held = engine.scheduler.sessions[key].held_bytes
        engine.executor.apply([(CROP, sid[key], positions)])
        assert held == caches[sid[key]].nbytes() > 0, key
    assert engine.scheduler.kv_bytes_used == sum(c.nbytes() for c in caches.values())


def test_an_evicted_session_resumes_with_identical_tokens(tiny_pair):
    """The cloud's KV memory holds 36 positions. Device A is mid-answer (idle between rounds, holding 15 positions)
    when device B's request needs room (up to 34 positions): the cloud evicts A's idle session (A is over its fair
    share), B is served; A's next round finds its session gone, reopens it from its own history and ends with the
    target's greedy tokens, like B."""
    draft, target = tiny_pair
    cost = 2 * 2 * 2 * 16 * 4
    ref = _hf_greedy(target.model, 24)
    seen = []
    with serving(target, kv_memory=str(36 * cost), device_kv_memory="100%") as server, \
            _client(server, "A") as a, _client(server, "B") as b:
        def mid_answer(tokens, _logprobs):
            seen.append(len(tokens))
            if len(seen) == 9:  # A holds 15 positions and is between rounds
                gen_b = new_session(EdgeConfig(model="tiny"),
                                    GenerationRequest(PROMPT, "sd", SamplingParams(0.0), 24, seed=0),
                                    Drafter(draft, SamplingParams(0.0)), b, frozenset(), 1)
                assert gen_b.run(PROMPT, lambda t: "").tokens == ref

        gen_a = new_session(EdgeConfig(model="tiny"),
                            GenerationRequest(PROMPT, "sd", SamplingParams(0.0), 24, seed=0, on_tokens=mid_answer),
                            Drafter(draft, SamplingParams(0.0)), a, frozenset(), 1)
        result = gen_a.run(PROMPT, lambda t: "")
        assert server.admission.evicted >= 1
        assert result.tokens == ref and result.interruptions >= 1


def test_over_curvezmq_a_device_is_its_certificate_and_its_entry_carries_its_quota(tmp_path, tiny_pair):
    """The allow-list entry edge-7 carries `sessions = 1` (edge-7.quota.toml): the device that authenticated with
    that key is held to it, whatever device id its Hello claims; another key gets the defaults."""
    from hat_split.net.security import ephemeral

    cloud, keys = ephemeral(tmp_path, ["edge-7", "edge-8"])
    (tmp_path / "allow" / "edge-7.quota.toml").write_text("sessions = 1\n")
    with serving(tiny_pair[1], security=cloud) as server:
        for name in ("edge-7", "edge-8"):
            with CloudClient(LinkConfig(server.endpoint, security=keys[name]),
                             P.Hello("claims-to-be-someone-else", "tiny", 512, "tiny-vocab")) as c:
                assert isinstance(_open(c, 1), P.SessionOpened)
                if name == "edge-7":
                    with pytest.raises(CloudError, match="device edge-7 is over its sessions quota"):
                        _open(c, 2)
                else:
                    assert isinstance(_open(c, 2), P.SessionOpened)
        assert sorted({s.device for s in server.tables.sessions.values()}) == ["edge-7", "edge-8"]
