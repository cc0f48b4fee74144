"""Fuzzing (issue 9), the short version CI runs: the decoder and a live server under malformed, truncated,
oversized, reordered and replayed frames, with a well-behaved device beside them; `hat-bench fuzz` runs 10^5.
The stateful mode (profiles.bench.fuzz_state) mutates requests against the tracked state of sessions it opened."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hat_split.wire import messages as P
from profiles.bench.fuzz import MUTATIONS, fuzz, fuzz_decoder


@settings(max_examples=400, deadline=None)
@given(st.lists(st.binary(max_size=300), min_size=0, max_size=4))
def test_decoder_answers_any_bytes_with_a_message_or_a_protocol_error(frames):
    assert fuzz_decoder(frames).split(":")[0] in ("ok", "error")  # anything else raised fails the test


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32), st.integers(0, 2**32), st.lists(st.integers(-2**40, 2**40), max_size=8),
       st.sampled_from(["dense", "sparse", "topk", "lattice", "???"]))
def test_out_of_range_fields_are_protocol_errors(sid, step, tokens, fmt):
    import msgspec

    head = {"type": "Verify", "session_id": sid, "step": step, "position": sid % 7,
            "new_tokens": {"dtype": "int32", "shape": [len(tokens)], "frame": 1},
            "draft": {"dtype": "int64", "shape": [1], "frame": 2},
            "dist": {"format": fmt, "values": {"dtype": "float16", "shape": [1, 4], "frame": 3}}}
    frames = [P.MAGIC + bytes([P.PROTOCOL_VERSION]) + msgspec.msgpack.encode(head),
              np.asarray(tokens, np.int64).tobytes(), b"\0" * 8, b"\0" * 8]
    assert fuzz_decoder(frames).split(":")[0] in ("ok", "error")


def test_short_fuzz_run_finds_no_crash_and_corrupts_no_session():
    report = fuzz(3000, seed=1, check_every=1000, progress=False)
    assert report["bugs"] == [] and report["unanswered"] == 0 and report["server_alive"]
    assert report["legit_checks"] == 4 and report["legit_mismatches"] == 0
    kinds = {key.split(" ")[0] for key in report["server"]}
    assert kinds == set(MUTATIONS)  # every mutation was exercised against the server
    assert sum(v for k, v in report["server"].items() if "error:" in k) > 1000  # bad frames answered with errors


def test_stateful_fuzz_reaches_every_handler_past_its_checks():
    """Sessions opened properly, requests mutated against their tracked state: every handler answers end to end
    (the reply types prove it) and refuses in its own validation (desync, busy_session, invalid), nothing is left
    unanswered or fails internally, and the device beside the fuzzer keeps generating the greedy tokens."""
    report = fuzz(2000, seed=3, check_every=1000, progress=False, stateful=True)
    assert report["bugs"] == [] and report["unanswered"] == 0 and report["server_alive"]
    assert report["legit_checks"] == 2 and report["legit_mismatches"] == 0
    cov = report["coverage"]
    for kind, reply in [("OpenSession", "SessionOpened"), ("Verify", "Verdict"), ("Generate", "Generated"),
                        ("OpenSplit", "SplitOpened"), ("Hidden", "Deep"), ("Report", "Reported"),
                        ("CloseSession", "Closed"), ("Hello", "Welcome")]:
        assert cov[kind].get(f"ok:{reply}", 0) >= 1, (kind, cov[kind])
    for kind in ("Verify", "Generate", "Hidden"):  # refused by the checks against the session's state
        assert cov[kind].get("error:desync", 0) >= 10 and cov[kind].get("error:invalid", 0) >= 10, cov[kind]
    for kind in ("Verify", "Generate", "CloseSession"):  # a second request while the first is being computed
        assert cov[kind].get("error:busy_session", 0) >= 1, cov[kind]
    assert cov["Report"].get("error:no_handshake", 0) >= 1  # a refused Hello lets nothing through
    assert sum(n for k, n in report["mutations"].items() if " valid ok:" in k) > 200  # valid requests succeeded
    assert report["deepest"]["step"] >= 20, report["deepest"]  # and sessions advanced far
