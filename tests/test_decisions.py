"""`hat-bench auto --decisions`: auto's choices recorded with every candidate's price and its round's tokens, and
nothing recorded (nor computed) when off."""
import logging

from edge_runtime.auto import DECISIONS, Choice
from hat_split.math.costmodel import Link
from profiles.bench.decisions import recorded
from tests.test_auto import _controller, _estimates


def test_each_choice_is_recorded_with_its_candidates_and_its_rounds_tokens():
    est = _estimates(0.8, 0.02, step_1=0.2, step_9=0.22)
    c = _controller(est)
    level, propagate = DECISIONS.level, DECISIONS.propagate
    with recorded(True) as log:
        first = c.decide(Link(0.01), now=5.0, remaining=32)
        c.record(first, 5)
        second = c.decide(Link(0.01), remaining=27)  # not run yet: no tokens
        other = _controller(est)  # another request's round does not fill this one's
        other.record(Choice("llm", 8, "predicted", {}), 8)
        got = log.take()
    assert [r["choice"]["reason"] for r in got] == [first.reason, second.reason]
    assert got[0]["tokens"] == 5 and "tokens" not in got[1] and "request" not in got[0]
    assert got[0]["remaining"] == 32 and got[0]["alpha"] == est.alpha and got[0]["opening"] is False
    assert (got[0]["at"], got[1]["at"]) == (5.0, None)  # the caller's clock
    priced = {(name, knob) for name, shape, knob, *_ in got[0]["candidates"]}
    assert {("sd", g) for g in range(1, 9)} | {("llm", 8)} <= priced  # every chain and llm, as priced
    best = max(got[0]["candidates"], key=lambda cand: cand[3])
    assert (best[0], best[2]) == (first.protocol, first.knob)
    assert log.take() == []
    assert (DECISIONS.level, DECISIONS.propagate) == (level, propagate) and not DECISIONS.handlers
    with recorded(False) as off:
        assert off is None and not DECISIONS.isEnabledFor(logging.DEBUG)
        c.decide(Link(0.01))
