"""U-HLM / CU-HLM calibration math (hat_split.math.calibration) and how the edge takes a calibration file."""
import json

import numpy as np
import pytest

from edge_runtime.cli import _uncertainty_config, build_parser
from edge_runtime.config import UncertaintyConfig
from hat_split.math import calibration as C
from hat_split.math.vocab_size_policy import offline_k, tail_l1


def test_rejection_probability():
    beta = C.rejection_probability(np.array([0.5, 0.5, 0.2, 0.0]), np.array([0.25, 0.9, 0.2, 0.3]))
    np.testing.assert_allclose(beta, [0.5, 0.0, 0.0, 0.0])
    with pytest.raises(ValueError):
        C.rejection_probability(np.array([0.5]), np.array([-0.1]))


def test_line_fit_recovers_a_known_line():
    rng = np.random.default_rng(0)
    u = rng.random(4000)
    beta = 0.8 * u - 0.05 + rng.normal(0, 0.02, u.size)
    fit = C.fit_line(u, beta)
    assert fit.a == pytest.approx(0.8, abs=0.01) and fit.b == pytest.approx(-0.05, abs=0.01)
    assert fit.mse == pytest.approx(0.02**2, rel=0.1)
    assert fit.r2 > 0.98 and fit.corr > 0.99 and fit.n == 4000
    with pytest.raises(ValueError, match="all uncertainties are equal"):
        C.fit_line(np.full(5, 0.3), np.arange(5.0))


def _records(n=3000, seed=1):
    """Synthetic tokens whose rejection grows with u: x_d fixed, y_d shrinks as u grows."""
    rng = np.random.default_rng(seed)
    u = rng.beta(0.6, 1.5, n)
    x_d = rng.uniform(0.2, 0.9, n)
    beta_true = np.clip(0.9 * u - 0.1 + rng.normal(0, 0.05, n), 0, 1)
    y_d = x_d * (1 - beta_true) + (beta_true == 0) * rng.uniform(0, 0.3, n)  # some tokens with y_d > x_d
    return u, x_d, y_d


def test_thresholds_risk_and_bound_follow_theorem_1():
    u, x_d, y_d = _records()
    cal = C.calibrate(u, x_d, y_d, None, 0.1, draft="d", target="t", temperature=1.0, perturb_samples=20,
                      theta_max=2.0)
    a, b = cal.fit.a, cal.fit.b
    assert cal.delta == pytest.approx(np.mean(y_d < x_d))
    assert cal.u_risk_averse == pytest.approx(-b / a) and cal.u_risk_prone == pytest.approx((cal.delta - b) / a)
    assert cal.u_risk_averse < cal.u_risk_prone
    inside = (u >= cal.u_risk_averse) & (u < cal.u_risk_prone)
    assert cal.risk_model == pytest.approx(np.sum((a * u + b)[inside]) / u.size)
    assert 0 < cal.risk_model <= cal.risk_bound  # eq. 13 (Hölder) bounds eq. 12
    assert cal.risk_measured > 0


def test_offline_k_accumulator_matches_the_batch_formula():
    rng = np.random.default_rng(2)
    xs = rng.dirichlet(np.full(50, 0.3), 20)
    ys = rng.dirichlet(np.full(50, 0.3), 20)
    acc = C.OfflineKAccumulator(50)
    for x, y in zip(xs, ys):
        acc.add(x, y)
    acc.add(xs[0], xs[0])  # D_TV = 0: left out
    tails = np.stack([tail_l1(x) for x in xs])
    tvd = 0.5 * np.abs(xs - ys).sum(axis=1)
    for theta in (0.05, 0.1, 0.5):
        assert acc.k_star(theta) == offline_k(tails, tvd, theta)
    assert acc.count == 20


def test_calibration_file_round_trip_and_edge_settings(tmp_path):
    u, x_d, y_d = _records()
    acc = C.OfflineKAccumulator(64)
    rng = np.random.default_rng(3)
    for _ in range(5):
        acc.add(rng.dirichlet(np.ones(64)), rng.dirichlet(np.ones(64)))
    cal = C.calibrate(u, x_d, y_d, acc, 0.1, draft="d", target="t", temperature=1.0, perturb_samples=12,
                      theta_max=1.5)
    path = tmp_path / "cal.json"
    C.save(str(path), cal)
    back = C.load(str(path))
    assert back == cal
    unc = UncertaintyConfig().calibrated(back, "risk-averse")
    assert unc.u_threshold == pytest.approx(cal.u_risk_averse) and unc.beta_a == cal.fit.a
    assert (unc.samples, unc.theta_max, unc.k_offline) == (12, 1.5, cal.k_star)
    args = build_parser().parse_args(["generate", "--model", "m", "--calibration", str(path), "--perturb-samples",
                                      "30", "x"])
    unc = _uncertainty_config(args)
    assert unc.u_threshold == pytest.approx(min(cal.u_risk_prone, 1.0)) and unc.samples == 30  # flag wins


def test_hat_calibrate_stamps_its_file_with_provenance_and_the_file_still_loads(tmp_path, monkeypatch):
    from edge_runtime.training import calibrate

    u, x_d, y_d = _records()
    acc = C.OfflineKAccumulator(64)
    rng = np.random.default_rng(3)
    for _ in range(5):
        acc.add(rng.dirichlet(np.ones(64)), rng.dirichlet(np.ones(64)))
    monkeypatch.setattr(calibrate, "record", lambda args: (u, x_d, y_d, acc, 1.5))  # no models: the records given
    monkeypatch.setattr(calibrate, "plot", lambda *a: "no plot here")
    out = tmp_path / "cal.json"
    assert calibrate.main(["--out", str(out)]) == 0
    stamp = json.loads(out.read_text())["extra"]["provenance"]
    assert len(stamp["git_commit"]) == 40 and stamp["command"] and stamp["machine"]["cpus"] >= 1
    assert "simd" in stamp["machine"] and stamp["finished_utc"].endswith("+00:00")
    assert C.load(str(out)).extra["provenance"] == stamp  # the calibration format keeps it in its free field


@pytest.mark.parametrize("content, match", [
    ("not json", "not JSON"),
    (json.dumps({"format": "other"}), "not a hatspec calibration"),
    (json.dumps({"format": C.FORMAT, "draft": "d"}), "incomplete"),
])
def test_bad_calibration_files_are_refused(tmp_path, content, match):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=match):
        C.load(str(path))
    with pytest.raises(ValueError, match="cannot read"):
        C.load(str(tmp_path / "missing.json"))


def test_recording_on_a_tiny_pair_matches_the_models(tiny_pair):
    """Records come from the exact HLM path: x_d and y_d are the two models' probabilities of the drafted token."""
    from edge_runtime.training.calibrate import record_pair
    from hat_split.math.sampling import SamplingParams, warp
    from hat_split.math.uncertainty import PerturbationConfig

    draft, target = tiny_pair
    prompts = [[5, 17, 99, 3], [250, 7, 8]]
    params = SamplingParams(1.0)
    u, x_d, y_d, acc = record_pair(draft, target, prompts, params, PerturbationConfig(8, 2.0), 12, 3, 64)
    assert u.size == x_d.size == y_d.size >= 8 and acc.count > 0
    assert ((u >= 0) & (u <= 1)).all() and (x_d > 0).all() and ((y_d >= 0) & (y_d <= 1)).all()
    # the first record of the first prompt: both models' distributions after the prompt
    q = warp(draft.forward(draft.new_state(), prompts[0], 1), params)[0]
    p = warp(target.forward(target.new_state(), prompts[0], 1), params)[0]
    token = int(np.flatnonzero(np.isclose(q, x_d[0], rtol=1e-3) & np.isclose(p, y_d[0], rtol=1e-3, atol=1e-9))[0])
    assert q[token] == pytest.approx(x_d[0], rel=1e-3) and p[token] == pytest.approx(y_d[0], rel=1e-3, abs=1e-9)


def test_risk_budget_threshold_bounds_the_measured_risk():
    u = np.array([0.1, 0.1, 0.2, 0.4, 0.6, 0.9])
    beta = np.array([0.0, 0.06, 0.0, 0.06, 0.3, 0.9])
    assert C.threshold_for_risk(u, beta, 0.0) == -1.0  # the two u = 0.1 tokens go together: 0.06 / 6 > 0
    assert C.threshold_for_risk(u, beta, 0.01) == pytest.approx(0.2)  # 0.06 / 6 = 0.01
    assert C.threshold_for_risk(u, beta, 0.02) == pytest.approx(0.4)
    assert C.threshold_for_risk(u, beta, 1.0) == pytest.approx(0.9)
    u, x_d, y_d = _records()
    cal = C.calibrate(u, x_d, y_d, None, 0.1, 0.01, draft="d", target="t", temperature=1.0, perturb_samples=20,
                      theta_max=2.0)
    beta = C.rejection_probability(x_d, y_d)
    assert np.sum(beta[u <= cal.threshold("risk-budget")]) / u.size <= 0.01
