"""The cloud's request handling without a socket or a model: the dispatcher (cloud_runtime.handlers), the device
registry (cloud_runtime.devices) and admission (cloud_runtime.quotas.Admission) over a fake work runner that holds
KV positions and hands back logits rows on demand. Every refusal is checked by its exact code, and that it changed
nothing."""
from __future__ import annotations

import dataclasses
import json
from typing import Dict, List, Tuple

import numpy as np
import pytest

from cloud_runtime.batching import StepStats
from cloud_runtime.config import CloudConfig
from cloud_runtime.devices import DeviceRegistry, check_stats
from cloud_runtime.handlers import Handlers
from cloud_runtime.quotas import Admission, Quota, QuotaBook
from cloud_runtime.sessions import ACTIVE_S, SessionTable
from cloud_runtime.state import CloudTables
from cloud_runtime.work import ModelFacts, Pending
from hat_split.math.chunking import DelayModel
from hat_split.math.sampling import SamplingParams, warp
from hat_split.net.security import LinkSecurity
from hat_split.wire import messages as P

VOCAB = 32
FACTS = ModelFacts("fake-target", "fake-vocab", VOCAB, layers=2, hidden_size=8,
                   split_refusal="the fake runs token protocols only")
COST = 4  # KV bytes per position of the fake model


class FakeWork:
    """A ModelWork holding `capacity` KV positions over every session: work queues positions (refused
    "memory_full" past the capacity, as the scheduler does) until `complete` computes it."""

    stages = 1
    wake_socket = None

    def __init__(self, capacity: int = 64):
        self.capacity = capacity
        self.scheduler = self  # what the cost report reads (cloud_runtime.work.cloud_cost): waiting, kv_free
        self.load = DelayModel()
        self.stats = StepStats()  # what the cost report's duty reads
        self.launches = 0
        self.positions: Dict[tuple, List[int]] = {}  # key → [computed, queued]
        self.queue: List[Tuple[tuple, int, int, Pending]] = []  # (key, positions, logits rows, tag)

    def open(self, key, start, stop, owner=None):
        self.close(key)
        self.positions[key] = [0, 0]

    def close(self, key):
        self.positions.pop(key, None)
        self.queue = [w for w in self.queue if w[0] != key]

    def held(self, key):
        return tuple(self.positions.get(key, (0, 0)))

    @property
    def waiting(self):
        return sum(1 for _, queued in self.positions.values() if queued)

    def others_positions(self, owner):
        self.asked_others_of = owner
        return 0.0

    @property
    def kv_free(self):
        return max(0, self.capacity - sum(map(sum, self.positions.values())))

    def held_bytes(self, key):
        return COST * sum(self.positions.get(key, (0, 0)))

    def kv_cost(self, start, stop):
        return COST

    def crop(self, key, length):
        self.positions[key][0] = length

    def submit_tokens(self, key, tokens, logits, tag):
        used = sum(sum(p) for p in self.positions.values())
        if used + len(tokens) > self.capacity:
            raise P.ProtocolError("memory_full", f"{len(tokens)} positions do not fit")
        self.positions[key][1] += len(tokens)
        self.queue.append((key, len(tokens), logits, tag))

    def submit_states(self, key, states, want, tag):
        raise P.ProtocolError("unsupported", "this cloud's model runs token protocols only")

    def complete(self, next_token: int = 3) -> List[Tuple[Pending, np.ndarray]]:
        """Compute every queued work: each gets logits rows whose argmax is `next_token`."""
        done, self.queue = self.queue, []
        for key, n, _, _ in done:
            self.positions[key] = [self.positions[key][0] + n, self.positions[key][1] - n]
        rows = np.full((1, VOCAB), -5.0, np.float32)
        rows[:, next_token] = 5.0
        return [(tag, np.repeat(rows, k, 0) if k else None) for _, _, k, tag in done]


def cloud(quota: Quota = Quota(), capacity: int = 64, kv_bytes: int = 0, **config):
    """(handlers, work, tables, admission) of a cloud over a FakeWork, plaintext."""
    cfg = CloudConfig(model="fake", security=LinkSecurity.plaintext(), **config)
    work = FakeWork(capacity)
    tables = CloudTables(SessionTable(work), DeviceRegistry(cfg, FACTS))
    admission = Admission(tables.sessions, QuotaBook(quota), tables.registry.device_of, cfg.max_sessions, kv_bytes)
    return Handlers(cfg, FACTS, work, tables, admission), work, tables, admission


def ask(handlers: Handlers, identity: bytes, msg):
    return handlers.handle(identity, msg, 0.0, 64)


def refused(handlers: Handlers, identity: bytes, msg) -> P.ProtocolError:
    with pytest.raises(P.ProtocolError) as info:
        ask(handlers, identity, msg)
    return info.value


def hello(handlers: Handlers, identity: bytes, device_id: str = "") -> P.Message:
    return ask(handlers, identity, P.Hello(device_id or identity.decode(), "draft", VOCAB, "fake-vocab"))


def open_token(sid: int, n: int = 1) -> P.OpenSession:
    return P.OpenSession(sid, "sd", np.arange(1, n + 1, dtype=np.int32), P.Sampling(temperature=0.0))


# -- the dispatcher -------------------------------------------------------------------------------------------------
def test_a_request_before_hello_is_refused_and_changes_nothing():
    handlers, work, tables, _ = cloud()
    err = refused(handlers, b"dev", open_token(1))
    assert (err.code, err.message) == ("no_handshake", "send Hello before any other request")
    assert not tables.sessions and not work.positions and not tables.registry.peers


def test_a_reply_is_no_request():
    handlers, _, _, _ = cloud()
    assert refused(handlers, b"dev", P.Reported(P.CloudState())).code == "unexpected"


def test_requests_reach_their_family_and_finishers_build_the_replies():
    """Hello → Welcome; a one-token prompt opens at once; Generate queues work whose logits come back through the
    token finisher as the argmax tokens (temperature 0, committed by the cloud); CloseSession reaches the token
    family's close; OpenSplit reaches the split family, which says why this model runs none."""
    handlers, work, tables, _ = cloud()
    welcome = hello(handlers, b"dev")
    assert isinstance(welcome, P.Welcome) and welcome.model == "fake-target" and "sd" in welcome.protocols
    # nothing computed yet: an empty cost curve, no session waiting, the whole capacity free (the cost report)
    assert ask(handlers, b"dev", open_token(1)) == P.SessionOpened(1, 1, 0.0, P.CloudCost([], 0.0, 0, 64))
    assert ask(handlers, b"dev", P.Generate(1, 1, 1, np.zeros(0, np.int32), 2)) is None  # queued
    ((pending, rows),) = work.complete(next_token=7)
    assert handlers.finish(pending, rows) is None  # the second token's work is queued
    ((pending, rows),) = work.complete(next_token=9)
    reply = handlers.finish(pending, rows)
    assert isinstance(reply, P.Generated) and reply.tokens.tolist() == [7, 9] and reply.position == 3
    closed = ask(handlers, b"dev", P.CloseSession(1))
    assert isinstance(closed, P.Closed) and closed.n_tokens == 3 and not tables.sessions and not work.positions
    split = P.OpenSplit(2, "hat", FACTS.fingerprint, 1, 2, "float32")
    err = refused(handlers, b"dev", split)
    assert (err.code, err.message) == ("invalid", FACTS.split_refusal)


def test_a_generate_that_asks_gets_each_tokens_probability_as_drawn():
    """Generate.probs: the reply carries p(x) of each token under the distribution it was drawn from (temperature
    applied), what a device needs to measure its draft's acceptance on llm's tokens; a Generate that does not ask
    gets none."""
    handlers, work, _, _ = cloud()
    hello(handlers, b"dev")
    ask(handlers, b"dev", P.OpenSession(1, "sd", np.ones(1, np.int32), P.Sampling(temperature=2.0), 5))
    for step, probs in ((1, True), (2, False)):
        assert ask(handlers, b"dev", P.Generate(1, step, 1 + 3 * (step - 1), np.zeros(0, np.int32), 3, probs)) is None
        reply = None
        while reply is None:
            ((pending, rows),) = work.complete(next_token=7)
            reply = handlers.finish(pending, rows)
        if not probs:
            assert reply.probs is None
            continue
        p = warp(np.where(np.arange(VOCAB) == 7, 5.0, -5.0)[None], SamplingParams(2.0))[0]
        assert reply.probs.dtype == np.float32 and reply.probs.tolist() == pytest.approx(p[reply.tokens].tolist())


def test_the_cost_report_counts_the_other_devices_using_the_cloud():
    """CloudCost.others: the devices besides the asker heard from within ACTIVE_S seconds or with work queued, so a
    device drafting between two verifies (nothing queued) still counts as load; one silent longer does not; the
    asker's own sessions never count."""
    handlers, work, tables, _ = cloud()
    for dev in (b"a", b"b", b"c"):
        hello(handlers, dev)
    assert ask(handlers, b"a", open_token(1)).cost.others == 0  # nobody else has a session
    assert ask(handlers, b"a", open_token(2)).cost.others == 0  # a second session of the asker's own
    assert ask(handlers, b"b", open_token(1)).cost.others == 1  # a, heard from just now, nothing queued
    assert work.asked_others_of == tables.registry.device_of(b"b")  # the positions of the others than the asker
    assert ask(handlers, b"c", P.Report(P.DeviceState())).cost.others == 2
    for key, s in tables.sessions.items():
        s.last_active -= ACTIVE_S + 1  # everyone silent for longer than ACTIVE_S
    assert ask(handlers, b"c", P.Report(P.DeviceState())).cost.others == 0
    assert ask(handlers, b"a", P.Generate(1, 1, 1, np.zeros(0, np.int32), 2)) is None  # a's work is queued
    tables.sessions.get((b"a", 1)).last_active -= ACTIVE_S + 1  # long queued: still using the cloud
    assert ask(handlers, b"c", P.Report(P.DeviceState())).cost.others == 1
    assert ask(handlers, b"a", P.Report(P.DeviceState())).cost.others == 0  # b silent; a's own work not counted

def test_the_cost_report_carries_the_operators_fleet_pace():
    """CloudConfig.fleet_pace_tokens_per_s in every cost report (SessionOpened's and Reported's); 0 when unset."""
    handlers, _, _, _ = cloud(fleet_pace_tokens_per_s=6.0)
    hello(handlers, b"a")
    assert ask(handlers, b"a", open_token(1)).cost.pace == 6.0
    assert ask(handlers, b"a", P.Report(P.DeviceState())).cost.pace == 6.0
    plain, _, _, _ = cloud()
    hello(plain, b"a")
    assert ask(plain, b"a", open_token(1)).cost.pace == 0.0


def test_the_cost_report_states_the_share_of_recent_time_in_steps():
    """CloudCost.duty: the share of the last DUTY_WINDOW_S seconds the cloud spent computing steps — 1 when steps ran
    back to back (a request then waits for the one in progress: hat_split.math.costmodel.phase_wait), the part of a
    step inside the window counted, 0 once the window holds none."""
    from cloud_runtime.batching import DUTY_WINDOW_S

    stats = StepStats()
    assert stats.duty(now=100.0) == 0.0
    for k in range(1, 21):  # steps of 0.5 s back to back, ending at 90.5 ... 100.0
        stats.observe(8, 2, 0.5, (0.5,), now=90.0 + 0.5 * k)
    assert stats.duty(now=100.0) == pytest.approx(1.0)
    assert stats.duty(now=101.0) == pytest.approx((DUTY_WINDOW_S - 1.0) / DUTY_WINDOW_S)  # a second idle since
    assert stats.duty(now=100.0 + DUTY_WINDOW_S) == 0.0
    assert len(stats.recent) <= DUTY_WINDOW_S / 0.5 + 1  # only the window's steps are kept
    json.dumps(dataclasses.asdict(stats))  # the cloud's status file holds these stats as JSON
    handlers, work, _, _ = cloud()
    hello(handlers, b"a")
    work.stats.observe(8, 2, 1.0, (1.0,))  # a step of a second that just ended
    assert ask(handlers, b"a", open_token(1)).cost.duty == pytest.approx(1.0 / DUTY_WINDOW_S, rel=0.05)


# -- the device registry ----------------------------------------------------------------------------------------------
def test_a_hello_with_another_vocabulary_is_refused_and_is_no_handshake():
    handlers, _, tables, _ = cloud()
    err = refused(handlers, b"dev", P.Hello("dev", "draft", VOCAB, "another-vocab"))
    assert err.code == "vocab_mismatch" and "cannot generate together" in err.message
    assert not tables.registry.knows(b"dev") and not tables.registry.devices
    assert refused(handlers, b"dev", open_token(1)).code == "no_handshake"


def test_a_report_with_a_negative_rate_is_refused_and_keeps_the_last_state():
    handlers, _, tables, _ = cloud()
    hello(handlers, b"dev", "orin-7")
    assert isinstance(ask(handlers, b"dev", P.Report(P.DeviceState(up_bps=8e6))), P.Reported)
    err = refused(handlers, b"dev", P.Report(P.DeviceState(up_bps=-1.0)))
    assert (err.code, err.message) == ("invalid", "the device's up_bps must be finite and >= 0")
    assert tables.registry.devices[b"dev"]["up_bps"] == 8e6


def test_device_stats_must_add_up():
    stats = P.DeviceStats(requests=3, protocols={"sd": 2})
    with pytest.raises(P.ProtocolError, match="count 3 requests but 2 by protocol") as info:
        check_stats(stats)
    assert info.value.code == "invalid"


def test_a_device_is_its_allow_list_name_else_its_hello_and_is_forgotten_when_silent():
    handlers, _, tables, _ = cloud()
    registry = tables.registry
    handlers.handle(b"conn-1", P.Hello("claims", "draft", VOCAB, "fake-vocab"), 0.0, 64, user="edge-7")
    hello(handlers, b"conn-2", "orin-2")
    assert registry.device_of(b"conn-1") == "edge-7" and registry.device_of(b"conn-2") == "orin-2"
    assert registry.device_of(b"never-seen") == b"never-seen"
    ask(handlers, b"conn-2", open_token(1))
    tables.expire(float("inf"), 1.0)  # both silent: conn-2's session goes first, then both peers
    assert not tables.sessions and not registry.peers and not registry.users and not registry.devices
    assert tables.stats.sessions_expired == 1


# -- admission --------------------------------------------------------------------------------------------------------
def test_a_session_over_the_device_quota_is_refused():
    handlers, _, tables, admission = cloud(quota=Quota(sessions=1))
    hello(handlers, b"dev")
    ask(handlers, b"dev", open_token(1))
    err = refused(handlers, b"dev", open_token(2))
    assert err.code == "quota" and err.message.startswith("device dev is over its sessions quota: it holds 1")
    assert list(k for k, _ in tables.sessions.items()) == [(b"dev", 1)]
    assert admission.usage("dev").sessions == 1 and admission.quotas.refusals == {"sessions": 1}


def test_an_idle_session_is_evicted_when_the_cloud_is_full():
    """The cloud's KV memory holds 8 positions. A's session holds 5 and is idle; B's prompt needs 5: A's session
    (over its fair share) is evicted and B's work queued. A's next request finds its session gone."""
    handlers, work, tables, admission = cloud(capacity=8, kv_bytes=8 * COST)
    hello(handlers, b"A")
    hello(handlers, b"B")
    assert ask(handlers, b"A", open_token(1, n=6)) is None
    ((pending, rows),) = work.complete()
    assert isinstance(handlers.finish(pending, rows), P.SessionOpened) and work.held((b"A", 1)) == (5, 0)
    assert ask(handlers, b"B", open_token(1, n=6)) is None  # queued once A's session made room
    assert admission.evicted == 1 and (b"A", 1) not in tables.sessions and (b"B", 1) in tables.sessions
    assert (b"A", 1) not in work.positions
    err = refused(handlers, b"A", P.Generate(1, 1, 6, np.zeros(0, np.int32), 1))
    assert err.code == "no_session"


def test_a_full_cloud_with_nothing_idle_refuses_and_evicts_nothing():
    """One session at most: A's is computing, so B's new session is refused "busy" and nothing is evicted."""
    handlers, _, tables, admission = cloud(max_sessions=1)
    hello(handlers, b"A")
    hello(handlers, b"B")
    assert ask(handlers, b"A", open_token(1, n=6)) is None  # its prompt is being computed
    err = refused(handlers, b"B", open_token(1))
    assert (err.code, err.message) == ("busy", "the cloud holds its limit of 1 sessions")
    assert admission.evicted == 0 and list(k for k, _ in tables.sessions.items()) == [(b"A", 1)]
