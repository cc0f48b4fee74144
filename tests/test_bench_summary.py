"""hat-bench's arithmetic on hand-made runs: variant parsing, α per examined position, ideal and overhead-free speedup."""
from __future__ import annotations

import pytest

from hat_split.verify import ideal_speedup
from scripts.bench import parse_variants, summarise, variant_name


def _row(tokens, total_s, drafted=0, accepted=0, rejected=0, rounds=0):
    return {"tokens": tokens, "total_s": total_s, "drafted": drafted, "accepted": accepted, "rejected": rejected,
            "rounds": rounds}


def test_parse_variants():
    assert parse_variants("3, 4,8@0.5") == [(3, 0.0), (4, 0.0), (8, 0.5)]
    assert variant_name(8, 0.5) == "g8_eta0.5" and variant_name(4, 0.0) == "g4"
    for bad in ("", "x", "0", "4@1.5", "4@-0.1"):
        with pytest.raises(ValueError):
            parse_variants(bad)


def test_summary_uses_alpha_per_examined_position():
    toks = list(range(20))
    runs = {
        "hf_target": [_row(toks, 10.0)],  # 2 tok/s
        "hf_draft": [_row(toks, 2.0)],  # 10 tok/s -> c = 0.2
        # 5 rounds of γ = 4: 3 rounds accept all 4 (no rejection), 2 rounds accept 1 then reject -> 14 accepted
        "hatspec_sd_g4": [_row(toks[:19], 5.0, drafted=20, accepted=14, rejected=2, rounds=5)],
    }
    s = summarise(runs, [(4, 0.0)])
    e = s["hatspec_sd_g4"]
    assert s["c"] == pytest.approx(0.2)
    assert e["alpha"] == pytest.approx(14 / 16)  # accepted / (accepted + rejections), not 14 / 20
    assert e["acceptance_rate"] == pytest.approx(14 / 20)
    assert e["ideal_speedup"] == pytest.approx(ideal_speedup(14 / 16, 4, 0.2))
    assert e["speedup"] == pytest.approx((19 / 5.0) / 2.0)
    assert e["efficiency"] == pytest.approx(e["speedup"] / e["ideal_speedup"])
    assert e["overhead_free_speedup"] == pytest.approx((14 + 5) / 5 / (4 * 0.2 + 1))
    assert e["identical_to_target_greedy"] == "0/1"  # 19 tokens are not the target's 20


def test_confidence_stopped_variant_has_no_closed_form():
    toks = list(range(10))
    runs = {"hf_target": [_row(toks, 5.0)], "hf_draft": [_row(toks, 1.0)],
            "hatspec_sd_g8_eta0.5": [_row(toks, 2.0, drafted=9, accepted=6, rejected=2, rounds=4)]}
    e = summarise(runs, [(8, 0.5)])["hatspec_sd_g8_eta0.5"]
    assert e["ideal_speedup"] is None and e["efficiency"] is None
    assert e["mean_drafts_per_round"] == pytest.approx(9 / 4) and e["overhead_free_speedup"] > 0
