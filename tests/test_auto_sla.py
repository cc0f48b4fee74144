"""A request's SLA (`sla_tokens_per_s`): auto keeps that pace at the least cloud compute a token, the others' work in
the same steps aside (costmodel.marginal_cloud_s); the field is checked wherever a request is built."""
from __future__ import annotations

import math

import pytest

from edge_runtime.api import openai_api as O
from edge_runtime.auto import SLA_MARGIN, Choice
from edge_runtime.request import GenerationRequest, RequestDefaults
from hat_split.math.chunking import DelayModel
from hat_split.math.costmodel import CloudCosts, CostCurve, DeviceCosts, Link, WireSizes, marginal_cloud_s, predict
from hat_split.math.sampling import SamplingParams
from hat_split.wire import messages as P
from tests.test_auto import PROMPT, _controller, _estimates, _runtime, smollm2_server  # noqa: F401  (a fixture)

CPU_CURVE = [[1.0, 0.04], [8.0, 0.20], [16.0, 0.36], [32.0, 0.68]]  # 20 ms a position past the first (8 → 16)


def test_the_marginal_cloud_seconds_of_a_token_by_hand():
    """llm's chunk of 8 runs 8 steps of one position, a verify one step of γ + 1; on a cloud whose steps hold others'
    work (g(μ) = 0.2 s alone), a token adds its steps' seconds less g(μ) a step."""
    curve = CostCurve(((1.0, 0.22), (5.0, 0.30)))  # g(x + μ) as this device sees it
    cloud, wire = CloudCosts(curve), WireSizes(80.0, 60.0, 100.0, 4.0)
    device = DeviceCosts(draft_step_s=0.01)
    llm = predict("llm", 8, 20, Link(0.01), device, cloud, wire)
    assert llm.cloud_steps_per_token == 1.0 and llm.cloud_s_per_token == pytest.approx(0.22)
    assert marginal_cloud_s(llm, 0.0) == pytest.approx(0.22)  # alone on the cloud: the whole step
    assert marginal_cloud_s(llm, 0.2) == pytest.approx(0.02)
    sd = predict("sd", 4, 20, Link(0.01), device, cloud, wire, alpha=0.5)
    e = (1 - 0.5 ** 5) / (1 - 0.5)  # 1.9375 tokens a round
    assert sd.cloud_steps_per_token == pytest.approx(1 / e)
    assert marginal_cloud_s(sd, 0.2) == pytest.approx((0.30 - 0.2) / e)
    assert marginal_cloud_s(sd, 1.0) == 0.0  # never below nothing
    hat = predict("hat", 4, 20, Link(0.01), DeviceCosts(hat_draft_s=0.01, hat_verify_s=0.01),
                  CloudCosts(curve, middle_share=0.5), WireSizes(80.0, 0.0, 100.0, 4.0, hidden=3072.0), alpha=0.5)
    assert marginal_cloud_s(hat, 0.2) == pytest.approx(0.5 * (0.30 - 0.2) / e)  # the middle layers' share of each
    for bad in (-0.1, math.nan, math.inf):
        with pytest.raises(ValueError, match="others_step_s"):
            marginal_cloud_s(llm, bad)


def test_an_sla_keeps_the_pace_at_the_least_cloud_compute():
    """A slow draft that the target agrees with: llm is the fastest (9.9 tok/s, 100 ms of cloud a token), sd the
    cheaper for the cloud (a verify of γ + 1 costs little more than a step here) at every γ, and the cheaper the
    longer it drafts: with an SLA of 4.4 tok/s auto drafts the longest γ still predicted at SLA_MARGIN × 4.4 (γ 6:
    chains priced over the prompts' spread of α, `AutoEstimates.chain_tokens`, keep 4 tok/s up to γ 8); with 8 only
    llm keeps it; with 20 none does, and the fastest runs; without one, the fastest."""
    est = _estimates(0.9, 0.15, step_1=0.1, step_9=0.15)
    fastest = _controller(est).decide(Link(0.01))
    assert fastest.protocol == "llm"
    c = _controller(est, sla_tps=4.4)
    choice = c.decide(Link(0.01))
    assert choice.protocol == "sd", choice
    rate = {k: c.at("sd", k, Link(0.01)).tokens_per_s for k in range(1, 9)}
    cost = {k: c.cloud_cost(c.at("sd", k, Link(0.01))) for k in range(1, 9)}
    assert all(cost[k + 1] < cost[k] for k in range(1, 8))  # longer drafts: less cloud a token ...
    assert rate[choice.knob] >= SLA_MARGIN * 4.4 > rate[choice.knob + 1]  # ... as long as the pace is kept
    assert cost[choice.knob] < 0.5 * c.cloud_cost(c.at("llm", 8, Link(0.01)))
    assert f"sd γ={choice.knob} keeps 4.4 tok/s" in choice.reason and "(llm 100 ms)" in choice.reason
    assert choice.reason.startswith("predicted llm")  # a segment's kind, and the predictions by speed
    strict = _controller(est, sla_tps=8.0).decide(Link(0.01))
    assert strict.protocol == "llm" and "llm keeps 8 tok/s" in strict.reason and "sd misses it" in strict.reason
    unreachable = _controller(est, sla_tps=20.0).decide(Link(0.01))
    assert unreachable.protocol == "llm" and unreachable.reason.endswith("none predicted to keep 20 tok/s: the fastest")


def test_under_load_the_sla_leaves_the_fastest_for_what_costs_the_cloud_least():
    """A CPU cloud's steps (20 ms a position past the first) carrying 8 positions of other devices' work: sd γ = 6
    is this device's fastest (7.8 against llm's 4.3 tok/s), but llm's token adds g(9) − g(8) = 20 ms to the steps
    it joins, sd's at best (g(10) − g(8)) / E(0.8, 1) = 22 ms: a request that needs 2 tok/s runs llm. Idle, the
    other way round: llm's token is a whole step (40 ms), sd γ = 1's g(2) / 1.8 = 35 ms (γ = 2's a hair less: g(3) /
    2.46, its chain priced over the prompts' spread of α)."""
    est = _estimates(0.8, 0.01, step_1=0.04, step_9=0.2)
    est.observed = DelayModel()  # the report alone prices the cloud
    assert est.take_report(P.CloudCost(CPU_CURVE, batch_tokens=8.0, queued=3))
    assert _controller(est).decide(Link(0.01)).protocol == "sd"
    c = _controller(est, sla_tps=2.0)
    busy = c.decide(Link(0.01))
    assert busy.protocol == "llm", busy
    assert c.cloud_cost(c.at("llm", 8, Link(0.01))) == pytest.approx(0.02)
    assert c.cloud_cost(c.at("sd", 1, Link(0.01))) == pytest.approx(0.04 / 1.8)
    assert "llm keeps 2 tok/s" in busy.reason and "(sd 22 ms)" in busy.reason
    assert est.take_report(P.CloudCost(CPU_CURVE))  # the load ends
    idle = c.decide(Link(0.01))
    assert idle.protocol == "sd" and idle.knob in (1, 2), idle
    assert c.cloud_cost(c.at("sd", 1, Link(0.01))) == pytest.approx((0.04 + 0.16 / 7) / 1.8)
    assert c.cloud_cost(c.at("sd", idle.knob, Link(0.01))) <= c.cloud_cost(c.at("sd", 1, Link(0.01))) < 0.04


def test_the_clouds_fleet_pace_holds_a_request_without_an_sla_while_others_use_it():
    """The cloud's operator asks 2 tok/s of each device (CloudCost.pace): under the load of the test above, a request
    without an SLA runs llm, which keeps that pace at the least cloud compute, not its fastest (sd), and says whose
    pace it kept; alone on the cloud (no other device: its compute saved serves no one) it runs its fastest; a
    request's own SLA comes first; a malformed pace is refused and the last good one kept."""
    est = _estimates(0.8, 0.01, step_1=0.04, step_9=0.2)
    est.observed = DelayModel()
    load = dict(batch_tokens=8.0, queued=3, others_positions=8.0)
    assert est.take_report(P.CloudCost(CPU_CURVE, others=2, pace=2.0, **load)) and est.fleet_pace == 2.0
    held = _controller(est).decide(Link(0.01))
    assert held.protocol == "llm" and "llm keeps 2 tok/s (the cloud's fleet pace)" in held.reason, held
    own = _controller(est, sla_tps=50.0).decide(Link(0.01))  # the request's pace, which nothing keeps: the fastest
    assert own.protocol == "sd" and own.reason.endswith("none predicted to keep 50 tok/s: the fastest")
    assert not est.take_report(P.CloudCost(CPU_CURVE, others=2, pace=float("nan"), **load))
    assert "CloudCost.pace" in est.last_bad_report and est.fleet_pace == 2.0
    assert est.take_report(P.CloudCost(CPU_CURVE, others=0, pace=2.0, **load)) and est.fleet_pace == 0.0
    alone = _controller(est).decide(Link(0.01))
    assert alone.protocol == "sd" and "fleet pace" not in alone.reason, alone


def test_the_clouds_config_checks_the_fleet_pace():
    """CloudConfig.fleet_pace_tokens_per_s: refused with its name when negative, not finite or absurd (the cloud
    reports it: tests/test_handlers.py)."""
    from cloud_runtime.config import CloudConfig
    from hat_split.net.security import LinkSecurity

    lab = dict(model="m", security=LinkSecurity.plaintext())
    assert CloudConfig(**lab, fleet_pace_tokens_per_s=6.0).fleet_pace_tokens_per_s == 6.0
    for bad in (-1.0, math.nan, math.inf, 1e5):
        with pytest.raises(ValueError, match="fleet_pace_tokens_per_s"):
            CloudConfig(**lab, fleet_pace_tokens_per_s=bad)


def test_under_an_sla_a_switch_must_save_a_tenth_of_the_cloud_compute():
    """Running llm, which keeps the pace: sd, a little cheaper for the cloud (within SWITCH_GAIN), does not take over;
    a good deal cheaper, it does."""
    est = _estimates(0.7, 0.01, step_1=0.04, step_9=0.2)
    est.observed = DelayModel()
    assert est.take_report(P.CloudCost(CPU_CURVE))  # idle: sd γ=1 (0.04 + 0.16 / 7) / 1.7 = 37 ms, llm 40 ms a token
    c = _controller(est, sla_tps=2.0)
    c.record(Choice("llm", 8, "predicted", {}), 8)
    kept = c.decide(Link(0.01))
    assert kept.protocol == "llm" and kept.reason.endswith("llm kept: sd saves less than 1.10× its cloud compute")
    cheap_verify = [[1.0, 0.04], [2.0, 0.045], [8.0, 0.20], [16.0, 0.36]]
    assert est.take_report(P.CloudCost(cheap_verify))
    moved = c.decide(Link(0.01))
    assert moved.protocol == "sd", moved


def test_under_an_sla_the_draft_reads_while_sd_keeps_the_pace():
    """The reads while waiting (`sd_within_reach`) follow the SLA: sd, far slower than llm but keeping the pace,
    is within reach; without the SLA it is not."""
    est = _estimates(0.9, 0.3, step_1=0.05, step_9=0.1)
    preds = _controller(est).predictions(Link(0.01))
    assert preds["sd"].tokens_per_s < 0.5 * preds["llm"].tokens_per_s
    assert not _controller(est).sd_within_reach(preds)
    assert _controller(est, sla_tps=2.0).sd_within_reach(preds)


def test_the_sla_field_is_checked_where_requests_are_built():
    """A request names a pace for auto only; a bad one is refused with the field named; the defaults' pace goes to
    auto's requests only (generate --protocol llm,sd,auto, an agent whose default is sd)."""
    assert GenerationRequest("x", "auto", sla_tokens_per_s=4).sla_tokens_per_s == 4
    for bad in (-1.0, math.nan, math.inf, True, "4", 1e5):
        with pytest.raises(ValueError, match="sla_tokens_per_s"):
            GenerationRequest("x", "auto", sla_tokens_per_s=bad)
    with pytest.raises(ValueError, match="sla_tokens_per_s asks protocol auto"):
        GenerationRequest("x", "sd", sla_tokens_per_s=4.0)
    defaults = RequestDefaults("sd", sla_tokens_per_s=4.0)
    assert defaults.request("x").sla_tokens_per_s == 0.0
    assert defaults.request("x", protocol="auto").sla_tokens_per_s == 4.0
    with pytest.raises(ValueError, match="sla_tokens_per_s asks protocol auto"):
        defaults.request("x", protocol="llm", sla_tokens_per_s=4.0)
    with pytest.raises(ValueError, match="sla_tokens_per_s"):
        RequestDefaults("auto", sla_tokens_per_s=-2.0)
    with pytest.raises(ValueError, match="SLA's pace"):
        _controller(_estimates(0.9, 0.1, 0.1, 0.2), sla_tps=math.nan)
    ok = O.parse_request({"prompt": "x", "hatspec": {"protocol": "auto", "sla_tokens_per_s": 3}}, False, ("auto",),
                         RequestDefaults())
    assert ok.sla_tokens_per_s == 3
    for bad in ("fast", -1, True):
        with pytest.raises(O.ApiError, match="sla_tokens_per_s") as err:
            O.parse_request({"prompt": "x", "hatspec": {"protocol": "auto", "sla_tokens_per_s": bad}}, False,
                            ("auto",), RequestDefaults())
        assert err.value.param == "hatspec"


def test_the_cli_and_the_agent_take_the_sla(capsys):
    from edge_runtime.api.agent import GENERATE_KEYS
    from edge_runtime.cli import _request_defaults, build_parser

    args = build_parser().parse_args(["generate", "x", "--protocol", "llm,auto", "--sla-tokens-per-s", "3"])
    defaults = _request_defaults(args, "llm")
    assert defaults.sla_tokens_per_s == 3.0 and defaults.request("x", protocol="auto").sla_tokens_per_s == 3.0
    assert "sla_tokens_per_s" in GENERATE_KEYS
    from edge_runtime.cli import main

    assert main(["generate", "x", "--protocol", "sd", "--sla-tokens-per-s", "3"]) == 2  # before any model loads
    assert "protocol auto's: add auto to --protocol" in capsys.readouterr().err


@pytest.mark.real_models
def test_auto_with_an_sla_keeps_the_targets_greedy_tokens_and_says_why(smollm2, smollm2_server):  # noqa: F811
    """Real sockets, SmolLM2: after a request that measures both protocols, one with an SLA every protocol keeps
    (0.5 tok/s) runs what costs the cloud least, says so, and its greedy tokens are the target's (llm's)."""
    with _runtime(smollm2, smollm2_server.endpoint) as rt:
        rt.generate(PROMPT, "auto", SamplingParams(0.0), 16, seed=0)  # measure both
        target = rt.generate(PROMPT, "llm", SamplingParams(0.0), 16, seed=0)
        res = rt.generate(PROMPT, "auto", SamplingParams(0.0), 16, seed=0, sla_tokens_per_s=0.5)
    assert res.tokens == target.tokens
    decided = [s for s in res.auto if s["reason"].startswith("predicted")]
    assert decided and all("keeps 0.5 tok/s" in s["reason"] for s in decided), res.auto
