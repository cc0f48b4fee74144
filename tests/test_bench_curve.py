"""hat-bench curve: the socket part on real ZeroMQ pairs (CurveZMQ and plaintext), and the request summary's
per-prompt ratios."""
from __future__ import annotations

import pytest

from profiles.bench.bench_curve import format_table, socket_part, summarise


def test_both_socket_pairs_echo_every_size_and_the_ratio_is_paired_per_repeat():
    out = socket_part([64, 65536], seconds=0.05, repeats=2)
    assert set(out) == {"64", "65536"}
    for size, e in out.items():
        assert e["curve_round_trips_per_s"] > 0 and e["plaintext_round_trips_per_s"] > 0
        assert e["curve_mb_per_s"] == pytest.approx(2 * int(size) * e["curve_round_trips_per_s"] / 1e6)
        assert e["ratio"]["n"] == 2 and e["ratio"]["lo"] <= e["ratio"]["mean"] <= e["ratio"]["hi"]
        assert e["ratio"]["method"] == "t" and len(e["curve_round_trips_per_s_repeats"]) == 2  # kept: recomputable


def _row(tps, ttft, text="a"):
    return {"tokens": 10, "total_s": 10 / tps, "ttft_s": ttft, "tokens_per_s": tps, "up_bytes": 100,
            "down_bytes": 50, "text": text}


def test_request_ratios_are_encrypted_over_plaintext_on_the_same_prompt():
    rows = {"sd": {"curve": [_row(9.0, 0.2), _row(4.0, 0.5, "b")],
                   "plaintext": [_row(10.0, 0.1), _row(5.0, 0.4, "c")]}}
    e = summarise(rows)["sd"]
    assert e["tokens_per_s_ratio"]["mean"] == pytest.approx((0.9 + 0.8) / 2) and e["tokens_per_s_ratio"]["n"] == 2
    assert e["ttft_ratio"]["mean"] == pytest.approx((2.0 + 1.25) / 2)
    assert e["curve"]["tokens_per_s"]["mean"] == pytest.approx(6.5) and e["curve"]["up_bytes_per_token"] == 10
    assert e["same_text"] == "1/2" and "sd" in format_table(summarise(rows))
    assert "95 % intervals: n=2 (t)" in format_table(summarise(rows))
