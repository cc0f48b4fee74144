"""Faults (issue 9): a link cut mid-answer and a cloud restarted mid-session. The device notices the drop (ZMTP
heartbeats / the connection's end), reconnects with backoff and reopens its session from its own history: nothing is
lost or repeated. `wait` pauses (greedy output identical to an uninterrupted run); `degrade` keeps generating with
the device's own model meanwhile and marks those tokens."""
from __future__ import annotations

import threading
import time

import pytest

from edge_runtime.client import CloudClient
from edge_runtime.config import EdgeConfig
from edge_runtime.drafter import Drafter
from edge_runtime.generation import Generation, run
from hat_split import protocol as P
from hat_split.sampling import SamplingParams
from hat_split.security import LinkSecurity
from profiles.link_emulator import LinkEmulator
from tests.conftest import serving

PROMPT = [5, 17, 99, 3, 250, 7]
N = 40


def _generate(endpoint, draft, policy="wait", on_tokens=None, protocol="sd"):
    params = SamplingParams(0.0)
    with CloudClient(endpoint, P.Hello("faulty", "tiny", 512, "tiny-vocab"), connect_timeout_s=0.5, retries=1,
                     backoff_s=0.1, request_timeout_s=30, heartbeat_s=1.0) as client:
        config = EdgeConfig(model="tiny", security=LinkSecurity.plaintext(), link_policy=policy, backoff_s=0.2,
                            reconnect_timeout_s=60)
        gen = Generation(config, Drafter(draft, params), client, protocol, params, N, frozenset(), 0, 1)
        if on_tokens is not None:
            gen.on_tokens = on_tokens
        return run(gen, PROMPT, lambda toks: "")


def _cut_after(link, k, seconds, mode="reset"):
    """An on_tokens hook cutting the link once `k` tokens are out, restoring it `seconds` later."""
    state = {"n": 0, "cut": False}

    def hook(tokens):
        state["n"] += len(tokens)
        if state["n"] >= k and not state["cut"]:
            state["cut"] = True
            link.cut(mode)
            state["timer"] = threading.Timer(seconds, link.restore)
            state["timer"].start()

    hook.state = state
    return hook


@pytest.mark.parametrize("mode", ["reset", "stall"])
def test_link_cut_under_wait_gives_the_uninterrupted_answer(tiny_server, tiny_pair, mode):
    draft = tiny_pair[0]
    host, port = tiny_server.endpoint.split("//")[1].rsplit(":", 1)
    reference = _generate(tiny_server.endpoint, draft)
    with LinkEmulator("loopback", (host, int(port))) as link:
        hook = _cut_after(link, 8, 3.0, mode)  # longer than the heartbeat
        got = _generate(link.address, draft, "wait", hook)
        hook.state["timer"].join()
    assert got.tokens == reference.tokens and got.n == N  # nothing lost, nothing duplicated
    assert got.interruptions >= 1 and got.degraded == []


def test_link_cut_under_degrade_keeps_generating_and_marks_the_tokens(tiny_server, tiny_pair):
    draft = tiny_pair[0]
    host, port = tiny_server.endpoint.split("//")[1].rsplit(":", 1)
    reference = _generate(tiny_server.endpoint, draft)
    with LinkEmulator("loopback", (host, int(port))) as link:
        hook = _cut_after(link, 8, 1.0)
        got = _generate(link.address, draft, "degrade", hook)
        hook.state["timer"].join()  # the answer may be complete before the link is back
    assert got.n == N and got.interruptions >= 1 and got.degraded
    first = got.degraded[0]
    assert 8 <= first and got.tokens[:first] == reference.tokens[:first]  # before the cut: the target's tokens
    assert got.degraded == list(range(first, first + len(got.degraded)))  # one run of local tokens, marked


def test_a_cloud_restarted_mid_session_lets_the_device_finish(tiny_pair):
    """The cloud goes away mid-answer (its socket closed, its sessions gone) and a new cloud binds the same port a
    second later: the device replays its history into a new session; its answer equals the uninterrupted one."""
    draft, target = tiny_pair
    first_ctx = serving(target)
    first = first_ctx.__enter__()
    endpoint = first.endpoint
    reference = _generate(endpoint, draft)
    second = {}

    def start_second():
        time.sleep(1.0)
        second["ctx"] = serving(target, bind=endpoint)
        second["server"] = second["ctx"].__enter__()

    state = {"n": 0}

    def hook(tokens):
        state["n"] += len(tokens)
        if state["n"] >= 10 and "thread" not in state:
            first_ctx.__exit__(None, None, None)  # the cloud dies
            state["thread"] = threading.Thread(target=start_second)
            state["thread"].start()

    try:
        got = _generate(endpoint, draft, "wait", hook)
        assert got.tokens == reference.tokens and got.interruptions >= 1
        assert second["server"].stats.sessions_opened >= 1  # the answer was finished by the new cloud
    finally:
        state["thread"].join()
        second["ctx"].__exit__(None, None, None)
