"""Protocol auto's record (edge_runtime.auto_record): what a runtime measured, kept in a file for the next runtime."""
from __future__ import annotations

import json
import logging

import pytest

from edge_runtime.auto import AutoController
from edge_runtime.acceptance import Acceptance
from edge_runtime.auto_estimates import GREEDY, AutoEstimates
from edge_runtime.auto_record import ADDED, RECORDED, RecordError, RecordFile, pair_key, restore, to_record
from hat_split.files import strict_json
from hat_split.math.chunking import DelayModel
from hat_split.math.costmodel import Link
from tests import test_auto
from tests.test_auto import PROMPT, _measures_a_protocol, _runtime

smollm2_server = test_auto.smollm2_server  # the fixture: a cloud serving the real SmolLM2-135M

SHAPE = (8, 8, 1)


def _learned() -> AutoEstimates:
    """Estimates that measured every kind of figure a record keeps: both protocols' rounds, a tree's and the
    η-chain's, greedy and sampled acceptance, two power modes, a catch-up curve."""
    est = AutoEstimates(draft_step_s=0.021, local_step_s=0.019, up_round=81.0, down_round=97.5, down_per_token=4.0,
                        measured={"sd": 7, "llm": 5}, power_mode="MAXN",
                        overhead_s={"sd": 0.004, "llm": 0.002, "sd:busy": -0.01, "sd_tree 8x8x1": 0.006},
                        up_per_row={("sd", GREEDY): 60.0, ("sd", "T=0.7"): 30000.0})
    est.overhead_rounds = {"sd": 30, "sd:busy": 2}
    est.mode_rounds = {"15W": {"sd": 4}}
    est.acceptance[("sd", GREEDY)] = Acceptance(accepted=2.9, examined=3.6, rounds=41, opening_accepted=1.5,
                                                opening_examined=2.5, opening_rounds=6)
    est.acceptance[("sd", "T=0.7")] = Acceptance(accepted=1.0, examined=2.0, rounds=3)
    est.catch_up = DelayModel()
    est.catch_up.observe(1, 0.02)
    est.catch_up.observe(40, 0.09)
    est.by_mode["15W"] = {"draft_step_s": 0.05, "catch_up": DelayModel(buckets={0: (1.0, 0.05)}), "sd": 0.01}
    est.restart = {"local_step_s"}
    key = (SHAPE, GREEDY)
    est.tree_tokens[key], est.tree_draft_steps[SHAPE], est.tree_step_tokens[SHAPE] = 3.4, 5.2, 3.3
    est.tree_up_per_node[key], est.tree_rounds[key], est.tree_sent[key] = 6.0, 9, 5.1
    est.tree_opening[key], est.eta_chain[key], est.eta_opening[key] = (2.2, 4), (3.4, 3.1, 9), (2.0, 2.4, 3)
    est.census_marks = [((40, True, 0.9), (41, False, 0.35)), ((7, True, 1.0),)]  # the census requests' reads
    est.observed.observe(1, 0.1)  # the cloud's and the link's: not kept
    est.uplink_bps, est.idle = 1e6, {"llm": 30}
    return est


def _through_a_file(record: dict) -> dict:
    return strict_json.loads(strict_json.dumps(record))


def test_a_record_restores_every_figure_it_keeps_and_nothing_of_the_cloud_or_link():
    est = _learned()
    back = AutoEstimates()
    restore(back, _through_a_file(to_record(est)))
    for name in RECORDED:
        got, want = getattr(back, name), getattr(est, name)
        if isinstance(want, DelayModel):
            assert (got.alpha, got.mu, got.buckets) == (want.alpha, want.mu, want.buckets), name
        elif name == "by_mode":
            assert got["15W"]["draft_step_s"] == 0.05 and got["15W"]["catch_up"].buckets == {0: (1.0, 0.05)}
        else:
            assert got == want, name
    assert not back.observed.known and back.uplink_bps == 0.0 and back.idle == {}
    assert back.acceptance[("sd", GREEDY)].request_examined == 0  # a request's own drafts are its own
    # priced alike: the same curve and link give the same predictions, and nothing is measured again
    for e in (est, back):
        e.observed = DelayModel()
        e.observed.observe(1, 0.1)
        e.observed.observe(9, 0.2)
        e.begin_request()
        e.opening = False
    a, b = (AutoController(e, ("sd", "llm"), 8, 8, 20, trees=(SHAPE,)) for e in (est, back))
    assert a.predictions(Link(0.05)) == b.predictions(Link(0.05))
    choice = b.decide(Link(0.05))
    assert not choice.reason.startswith("measuring"), choice


@pytest.mark.parametrize("field, value, named", [
    ("draft_step_s", -0.1, "draft_step_s"),
    ("draft_step_s", "fast", "draft_step_s"),
    ("up_round", 1e12, "up_round"),
    ("measured", [["sd", 2.5]], "measured[0].value"),
    ("measured", [["sd", True]], "measured[0].value"),
    ("acceptance", [[["sd", "greedy"], {"accepted": 1.0}]], "acceptance[0].value.examined"),
    ("tree_rounds", [[[[8, 0, 1], "greedy"], 3]], "tree_rounds[0].key[0]"),
    ("by_mode", [["15W", [["evil", 1.0]]]], "by_mode[0].value[0].key"),
    ("by_mode", [["15W", [["catch_up", 0.1]]]], "by_mode[0].value[0].value"),
    ("by_mode", [["15W", [["draft_step_s", -0.1]]]], "by_mode[0].value[0].value"),
    ("catch_up", {"alpha": 2.0, "mu": None, "buckets": []}, "catch_up.alpha"),
    ("overhead_s", {"sd": 0.1}, "overhead_s"),
    ("overhead_rounds", [["sd:busy", -1]], "overhead_rounds[0].value"),
    ("mode_rounds", [["15W", [["sd", 0.5]]]], "mode_rounds[0].value[0].value"),
    ("census_marks", [[[40, "yes", 0.5]]], "census_marks[0][0]"),
    ("census_marks", [[[40, True, 1.5]]], "census_marks[0][0][2]"),
    ("census_marks", [[[-1, True, 0.5]]], "census_marks[0][0][0]"),
    ("census_marks", [[[40, True, 0.5]], 3], "census_marks[1]"),
    ("census_marks", [[]] * 33, "census_marks"),
    ("eta_chain", [[[[8, 8, 1], "greedy"], [3.4, 3.1, -1]]], "eta_chain[0].value[2]"),
])
def test_a_bad_field_is_refused_by_name_and_the_estimates_are_untouched(field, value, named):
    record = _through_a_file(to_record(_learned()))
    record[field] = value
    est = AutoEstimates()
    with pytest.raises(RecordError, match=r"^estimates\." + named.replace("[", r"\[").replace("]", r"\]")):
        restore(est, record)
    assert est == AutoEstimates()
    del record[field]
    if field in ADDED:
        return
    with pytest.raises(RecordError, match=f"estimates.{field}: missing"):
        restore(est, record)


def test_a_record_written_before_a_field_was_added_reads_with_it_empty():
    """A record from before the busy overheads' round counts (auto_record.ADDED) restores every other figure and
    prices its overheads as established: as measured."""
    record = _through_a_file(to_record(_learned()))
    del record["overhead_rounds"], record["mode_rounds"]
    est = AutoEstimates()
    restore(est, record)
    assert est.overhead_rounds == {} and est.mode_rounds == {}
    assert est.overhead_s == _learned().overhead_s and est.measured == {"sd": 7, "llm": 5}
    est.cloud_busy, est.reported_wait_s = True, 0.1
    assert est.overhead("sd") == pytest.approx(-0.01 + 0.1)  # as measured, not pulled toward the idle 0.004
    restore(est, _through_a_file(to_record(_learned())))
    assert est.overhead_rounds == {"sd": 30, "sd:busy": 2}
    assert est.overhead("sd") == pytest.approx((2 * -0.01 + 4 * 0.004) / 6 + 0.1)


def test_the_file_keeps_one_entry_a_pair_and_never_writes_over_what_it_cannot_parse(tmp_path, caplog):
    path = tmp_path / "deep" / "auto.json"
    f = RecordFile(str(path), "test/1")
    one, two = pair_key("draft", "target-a", "fp", ""), pair_key("draft", "target-b", "fp", "agx-orin-64gb")
    assert not f.load(one, AutoEstimates())  # no file yet: nothing read, nothing said
    assert f.save(one, _learned())
    assert f.save(two, AutoEstimates(draft_step_s=0.5))
    data = json.loads(path.read_text())
    assert data["format"] == "hatspec.auto-record" and data["version"] == 1 and set(data["pairs"]) == {one, two}
    assert data["pairs"][one]["software"] == "test/1" and data["pairs"][one]["written"]
    est = AutoEstimates()
    assert f.load(two, est) and est.draft_step_s == 0.5 and not est.measured
    assert not RecordFile(str(path)).load(pair_key("draft", "target-c", "fp", ""), AutoEstimates())
    # a bad entry: not read (logged with its field), the next save replaces it, the others stay
    data["pairs"][one]["estimates"]["draft_step_s"] = -1
    path.write_text(json.dumps(data))
    est = AutoEstimates()
    with caplog.at_level(logging.WARNING, "hatspec.edge"):
        assert not f.load(one, est)
    assert "draft_step_s" in caplog.text and est == AutoEstimates()
    # a file that cannot be parsed (cut short, NaN, another version): not read, and never written over
    for text in ('{"format": "hatspec.auto-record", "vers', '{"format": "hatspec.auto-record", "version": NaN}',
                 '{"format": "hatspec.auto-record", "version": 2, "pairs": {}}', '[1, 2]'):
        path.write_text(text)
        g = RecordFile(str(path))
        caplog.clear()
        with caplog.at_level(logging.WARNING, "hatspec.edge"):
            assert not g.load(one, AutoEstimates())
            assert not g.save(one, _learned())
        assert "not writing over it" in caplog.text and path.read_text() == text


def test_a_field_a_record_no_longer_keeps_is_passed_over_and_one_it_never_kept_is_refused():
    """A record written before stop 94 keeps the η-chain's own drafts past a rejection (`eta_tail`, DROPPED: priced
    from the reads since): it restores every other figure. A field no record kept is refused by name."""
    record = _through_a_file(to_record(_learned()))
    record["eta_tail"] = [[[[8, 8, 1], "greedy"], [6.0, 3]]]
    est = AutoEstimates()
    restore(est, record)
    assert est.eta_chain == _learned().eta_chain and not hasattr(est, "eta_tail")
    record["eta_tale"] = []
    est = AutoEstimates()
    with pytest.raises(RecordError, match=r"^estimates\.eta_tale: not a field a record keeps"):
        restore(est, record)
    assert est == AutoEstimates()


def test_a_record_that_is_not_an_object_is_refused():
    with pytest.raises(RecordError, match="estimates: expected an object"):
        restore(AutoEstimates(), [1, 2])


# -- through a runtime and a cloud (the real SmolLM2-135M) -----------------------------------------------------------

@pytest.mark.real_models
def test_a_new_runtime_starts_from_the_record_and_measures_nothing(smollm2, smollm2_server, tmp_path):
    """A runtime with a record measures sd and llm in its first auto request and writes what it learned; the next
    runtime (a new `hat-edge generate`) reads it and runs its first request on the predicted best, the target's
    tokens either way; a device of another profile has no entry yet and measures."""
    import dataclasses

    from hat_split.math.sampling import SamplingParams

    path = str(tmp_path / "auto.json")

    def runtime(profile: str = ""):
        rt = _runtime(smollm2, smollm2_server.endpoint)
        rt.config = dataclasses.replace(rt.config, auto_record=path, device_profile=profile)
        rt.auto_record = RecordFile(path)
        return rt

    with runtime() as rt:
        ref = rt.generate(PROMPT, "llm", SamplingParams(0.0), 24, seed=0)
        first = rt.generate(PROMPT, "auto", SamplingParams(0.0), 24, seed=0)
        learned = rt.auto_estimates.measured
    assert any(_measures_a_protocol(s) for s in first.auto), first.auto
    with runtime() as rt:
        again = rt.generate(PROMPT, "auto", SamplingParams(0.0), 24, seed=0)
        assert rt.auto_estimates.measured.keys() == learned.keys()
    assert again.tokens == first.tokens == ref.tokens
    assert not any(_measures_a_protocol(s) for s in again.auto), again.auto
    with runtime("agx-orin-64gb") as rt:
        other = rt.generate(PROMPT, "auto", SamplingParams(0.0), 24, seed=0)
    assert other.tokens == ref.tokens and any(_measures_a_protocol(s) for s in other.auto), other.auto
    assert len(json.loads(open(path).read())["pairs"]) == 2


def test_a_cloud_with_another_target_starts_auto_afresh_from_that_pairs_entry(tmp_path):
    """Acceptance is two models' agreement: a runtime whose cloud names another target drops its estimates and reads
    that pair's entry; the same pair again keeps what it has."""
    from types import SimpleNamespace

    from edge_runtime.runtime import EdgeRuntime
    from hat_split.wire import messages as P

    path = str(tmp_path / "auto.json")
    RecordFile(path).save(pair_key("draft", "target-b", "fp", ""), AutoEstimates(draft_step_s=0.5))
    rt = SimpleNamespace(engine=SimpleNamespace(model_name="draft", fingerprint="fp"),
                         config=SimpleNamespace(device_profile=""), auto_pair="", auto_estimates=AutoEstimates(),
                         auto_record=RecordFile(path))

    def welcome(target: str) -> P.Welcome:
        return P.Welcome(1, target, 10, "fp", 60.0, 8, 512, ["sd", "llm"])

    EdgeRuntime._auto_pair(rt, welcome("target-a"))  # no entry: measured afresh
    assert rt.auto_estimates.draft_step_s is None
    rt.auto_estimates.draft_step_s = 0.02
    EdgeRuntime._auto_pair(rt, welcome("target-a"))
    assert rt.auto_estimates.draft_step_s == 0.02
    EdgeRuntime._auto_pair(rt, welcome("target-b"))
    assert rt.auto_estimates.draft_step_s == 0.5 and rt.auto_pair == pair_key("draft", "target-b", "fp", "")
