"""`hat-bench soak` (issue 9): the answer checker on its own, and a short soak on the real model (CI's version of the
10-minute command: three devices, link cuts, every answer checked against the model's greedy one)."""
from __future__ import annotations

import json

import pytest

from profiles.bench.soak_check import check, compare, failures, slope_mb_per_min, summarise

REF = [1, 2, 3, 4, 5, 6, 7, 8]


def test_compare_tells_exact_duplicated_lost_and_other():
    assert compare(REF, REF) == {"match": "exact"}
    assert compare([1, 2, 3, 4, 3, 4, 5, 6], REF) == {"match": "duplicated", "at": 4, "run": 2}
    assert compare([1, 2, 5, 6, 7, 8], REF)["match"] == "lost"  # 3, 4 skipped
    assert compare([1, 2, 3], REF) == {"match": "lost", "at": 3, "run": 5}  # ended early
    assert compare(REF + [9], REF) == {"match": "duplicated", "at": 8, "run": 1}  # went on past the end
    assert compare([1, 2, 9, 4, 5, 6, 7, 8], REF) == {"match": "other", "at": 2}
    assert compare([1, 2, 3, 9, 9], REF, upto=3) == {"match": "exact"}  # the rest was the device's own (degrade)
    assert compare([1, 7, 3, 9], REF, upto=3)["match"] == "other"


def test_an_answer_without_a_reference_is_counted_unchecked_not_exact():
    rec = {"response": {"error": None, "done": True, "finals": 1, "deltas": ["ab"], "times": [0.1], "usage":
                        {"completion_tokens": 2}, "hatspec": {"tokens": [5, 6]}}}
    v = check(rec, None, 2, [0], lambda ids: "ab")
    assert v["completed"] and v["delivered"] and v["reference"] == {"match": "unchecked"}
    assert check(rec, [5, 6], 2, [0], lambda ids: "ab")["reference"] == {"match": "exact"}


def _record(protocol, tokens, ref, near_tie=None):
    """A completed answer's record with its verdict against `ref` (a near tie marked as the soak marks it)."""
    rec = {"protocol": protocol, "policy": "wait", "reference_kind": "greedy",
           "response": {"error": None, "done": True, "finals": 1, "deltas": ["x"], "times": [0.1, 0.2],
                        "usage": {"completion_tokens": len(tokens)}, "hatspec": {"tokens": tokens}}}
    rec["verdict"] = check(rec, ref, len(tokens), [], lambda ids: "x")
    if near_tie is not None:
        rec["verdict"]["reference"]["near_tie"] = near_tie
    return rec


def test_a_wrong_answer_fails_the_soak_and_a_near_tie_does_not():
    """The soak's verdict (what `hat-bench soak` exits on and the short soak asserts): an answer that leaves its
    reference where the reference had a clear winner is wrong and fails the run; one that took the second of a near
    tie does not; an unchecked answer fails too (nothing was shown of it)."""
    exact = _record("sd", REF, REF)
    tie = _record("sd", [1, 2, 9, 4, 5, 6, 7, 8], REF, near_tie=True)
    wrong = _record("sd", [1, 2, 9, 4, 5, 6, 7, 8], REF, near_tie=False)
    unchecked = _record("uhlm", REF, None)
    assert failures(summarise([exact, tie], [], [], 0.0)) == []
    s = summarise([exact, tie, wrong], [], [], 0.0)
    assert (s["reference_other"], s["reference_other_near_tie"], s["reference_wrong"]) == (2, 1, 1)
    assert failures(s) == ["1 answers other than their reference without a near tie there"]
    assert failures(summarise([exact, unchecked], [], [], 0.0)) == ["1 answers left unchecked (their reference "
                                                                    "failed)"]


def test_slope_is_in_mb_per_minute():
    assert slope_mb_per_min([(0, 100.0), (60, 110.0), (120, 120.0)]) == pytest.approx(10.0)
    assert slope_mb_per_min([(0, 100.0)]) is None


def test_hostile_phases_alternate_and_sides_are_summarised_apart():
    from types import SimpleNamespace

    from profiles.bench.soak import hostile_on
    from profiles.bench.soak_check import hostile_sides

    args = SimpleNamespace(hostile_phases=4, duration=100.0)
    assert [hostile_on(args, t) for t in (0, 24.9, 25, 49.9, 50, 75, 99)] == [False, False, True, True, False,
                                                                               True, True]
    assert not hostile_on(SimpleNamespace(hostile_phases=0, duration=100.0), 30)

    def rec(on, ttft, done=True):
        return {"hostile_on": on, "verdict": {"completed": done, "tokens": 3},
                "response": {"times": [ttft, ttft + 0.1, ttft + 0.2]}}

    sides = hostile_sides([rec(False, 1.0), rec(False, 2.0), rec(True, 3.0), rec(True, 9.0, done=False)])
    assert (sides["without"]["completed"], sides["with"]["completed"], sides["with"]["lost"]) == (2, 1, 1)
    assert sides["p99_ttft_ratio"] == pytest.approx(3.0 / sides["without"]["ttft_s"]["p99"])
    assert sides["with"]["tbt_s"]["p50"] == pytest.approx(0.1)


def test_the_hostile_devices_junk_is_answered_and_the_cloud_carries_on(tiny_pair):
    """Each junk frame the hostile device sends gets an Error, and a proper request after them is served."""
    import numpy as np
    import zmq

    from hat_split.wire import messages as P
    from profiles.bench.hostile import junk
    from tests.conftest import serving

    with serving(tiny_pair[1]) as server:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(server.endpoint)
        sock.send_multipart(P.encode(P.Hello("hostile", "tiny", 512, "tiny-vocab")))
        assert isinstance(P.decode(sock.recv_multipart()), P.Welcome)
        rng = np.random.default_rng(0)
        for kind in range(3):
            sock.send_multipart(junk(rng, kind))
            assert sock.poll(5000) and isinstance(P.decode(sock.recv_multipart()), P.Error), kind
        sock.send_multipart(P.encode(P.OpenSession(1, "sd", np.arange(1, 5, dtype=np.int32))))
        assert sock.poll(5000) and isinstance(P.decode(sock.recv_multipart()), P.SessionOpened)
        sock.close()


@pytest.mark.real_models
def test_a_short_soak_loses_and_repeats_nothing(tmp_path):
    from hat_split.models.registry import is_installed
    from profiles.bench.bench import main

    if not is_installed("smollm2-135m"):
        pytest.skip("smollm2-135m is not installed")
    out = tmp_path / "soak.json"
    rc = main(["soak", "--devices", "3", "--hosts", "1", "--draft", "model", "--protocols", "sd,llm,uhlm",
               "--duration", "20", "--rate", "0.4", "--max-tokens", "12", "--prompts", "4", "--max-prompt-tokens",
               "96", "--cut-rate", "0.4", "--cut-seconds", "0.5,4", "--long-cuts", "0.25", "--long-cut-seconds", "8",
               "--session-timeout", "5", "--heartbeat", "1", "--sample-every", "1", "--out", str(out)])
    report = json.loads(out.read_text())
    s = report["summary"]
    assert rc == 0, s
    assert s["requests"] >= 3 and s["completed"] == s["requests"] and s["lost"] == s["duplicated"] == 0
    assert s["lost_tokens"] == 0 and s["delivery_inconsistent"] == 0 and s["cuts"] >= 1
    # every answer equals its reference (under degrade: up to the device's first token of its own), but for a
    # difference where the greedy reference's top two logits were a near tie; none wrong, none unchecked
    assert failures(s) == [], failures(s)
    assert s["reference_exact"] + s["reference_other_near_tie"] == s["completed"], s
    assert report["memory"][-1]["cloud"]["open"] == 0 and report["memory"][-1]["cloud"]["kv_positions"] == 0
    # exact protocols against the model's greedy answer, the lossy uhlm against its calm replay
    kinds = {p: b["reference"] for p, b in s["by_protocol"].items()}
    assert all(kinds[p] == ["greedy"] for p in ("sd", "llm") if p in kinds), kinds
    assert kinds.get("uhlm", ["replay"]) == ["replay"], kinds
    assert set(report["memory"][-1]["rss_mb"]) == {"cloud", "host-0", "driver"}
