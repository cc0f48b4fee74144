"""The continuous-batching scheduler without a model: budgets, chunked prefill beside decode, starvation, fairness,
admission."""
from __future__ import annotations

import random

import pytest

from cloud_runtime.scheduler import RECENT_STEPS, Scheduler, SchedulerConfig, SchedulerRefusal


def _run(sched: Scheduler, steps: int):
    """Plan and complete up to `steps` batches; returns (batches, finished works per step)."""
    out = []
    for _ in range(steps):
        batch = sched.plan()
        if batch is None:
            break
        out.append((batch, sched.complete(batch)))
    return out


def test_budget_is_respected_and_long_prompts_are_chunked_beside_decodes():
    sched = Scheduler(SchedulerConfig(token_budget=64, prefill_floor=8, usage_half_life=0))  # (usage: below)
    for s in ("a", "b", "c"):
        sched.open(s)
    sched.submit("a", "prefill", 200)
    sched.submit("b", "decode", 5)
    sched.submit("c", "decode", 1)
    steps = _run(sched, 10)
    assert all(b.tokens <= 64 for b, _ in steps)
    first = steps[0][0]
    assert [(s.session, s.kind, s.n) for s in first.segments] == [("b", "decode", 5), ("c", "decode", 1),
                                                                  ("a", "prefill", 58)]
    # the prompt continues in chunks where the previous one ended, and finishes exactly once
    chunks = [s for b, _ in steps for s in b.segments if s.session == "a"]
    assert [s.start for s in chunks] == [0, 58, 122, 186]
    assert sum(s.n for s in chunks) == 200 and [s.final for s in chunks] == [False, False, False, True]
    assert sched.sessions["a"].context == 200


def test_decodes_are_not_starved_by_a_long_prompt_and_prefill_keeps_its_floor():
    sched = Scheduler(SchedulerConfig(token_budget=32, prefill_floor=4))
    sched.open("long")
    sched.submit("long", "prefill", 4000)
    devices = [f"d{i}" for i in range(10)]
    for d in devices:
        sched.open(d)
    waited = {d: 0 for d in devices}
    prefill_per_step = []
    for step in range(50):
        for d in devices:
            if not sched.sessions[d].queue:
                sched.submit(d, "decode", 3)  # a verify of 2 drafts + 1
        batch = sched.plan()
        served = {s.session for s in batch.segments}
        for d in devices:
            waited[d] = 0 if d in served else waited[d] + 1
            assert waited[d] <= 1, f"{d} waited {waited[d]} steps"  # 10 × 3 > 28: some wait, none twice
        prefill_per_step.append(sum(s.n for s in batch.segments if s.kind == "prefill"))
        sched.complete(batch)
    assert min(prefill_per_step) >= 4


def test_fairness_across_sessions():
    rng = random.Random(0)
    sched = Scheduler(SchedulerConfig(token_budget=16, prefill_floor=0))
    sessions = [f"s{i}" for i in range(12)]
    for s in sessions:
        sched.open(s)
    turns = {s: 0 for s in sessions}
    waited = {s: 0 for s in sessions}
    for _ in range(400):
        order = sessions[:]
        rng.shuffle(order)  # requests arrive in any order
        for s in order:
            if not sched.sessions[s].queue:
                sched.submit(s, "decode", rng.randint(1, 5))
        batch = sched.plan()
        served = {seg.session for seg in batch.segments}
        for s in sessions:
            turns[s] += s in served
            waited[s] = 0 if s in served else waited[s] + 1
            assert waited[s] <= 5, f"{s} waited {waited[s]} steps"
        sched.complete(batch)
    counts = sorted(turns.values())
    assert counts[0] >= 0.9 * counts[-1], turns  # every session gets about the same number of turns


def test_admission_refuses_what_does_not_fit_and_changes_nothing():
    sched = Scheduler(SchedulerConfig(token_budget=16, prefill_floor=0, kv_capacity=100, max_context=60,
                                      max_sessions=2))
    sched.open("a")
    sched.open("b")
    with pytest.raises(SchedulerRefusal, match="limit of 2 sessions") as e:
        sched.open("c")
    assert e.value.code == "busy"
    sched.submit("a", "prefill", 50)
    with pytest.raises(SchedulerRefusal, match="would hold 61 positions; the limit is 60"):
        sched.submit("a", "decode", 11)
    with pytest.raises(SchedulerRefusal, match="exceeds the step budget"):
        sched.submit("b", "decode", 17)
    sched.submit("b", "prefill", 40)
    with pytest.raises(SchedulerRefusal, match="11 positions of KV cache needed, 10 of 100 free") as e:
        sched.submit("b", "decode", 11)
    assert e.value.code == "memory_full" and sched.kv_used == 90
    with pytest.raises(SchedulerRefusal, match="not open"):
        sched.submit("zz", "decode", 1)
    with pytest.raises(SchedulerRefusal, match="at least 1"):
        sched.submit("a", "decode", 0)
    # rejected drafts give memory back; closing frees a session's context and returns its unfinished work
    _run(sched, 100)
    assert sched.sessions["a"].context == 50
    sched.crop("a", 45)
    with pytest.raises(SchedulerRefusal, match="cannot crop"):
        sched.crop("a", 46)
    assert sched.kv_used == 85
    w = sched.submit("b", "decode", 5)
    assert sched.close("b") == [w] and sched.kv_used == 45


def test_plan_and_complete_pair_up_and_a_closed_session_is_dropped_from_its_batch():
    sched = Scheduler(SchedulerConfig(token_budget=8, prefill_floor=0))
    sched.open("a")
    sched.open("b")
    assert sched.plan() is None
    sched.submit("a", "decode", 2, tag="ra")
    sched.submit("b", "decode", 2, tag="rb")
    batch = sched.plan()
    assert sched.plan() is None  # one batch in flight at a time by default
    sched.close("b")
    assert [w.tag for w in sched.complete(batch)] == ["ra"]
    with pytest.raises(RuntimeError):
        sched.complete(batch)
    with pytest.raises(ValueError):
        SchedulerConfig(token_budget=8, prefill_floor=9)


def test_a_pipeline_plans_ahead_in_order_and_abandon_gives_positions_back():
    """max_in_flight = 3 (three pipeline stages): a long prompt's chunks go out in consecutive batches before any
    comes back, each starting where the previous ends; batches complete oldest first; nothing crops under flight."""
    sched = Scheduler(SchedulerConfig(token_budget=16, prefill_floor=0, max_in_flight=3))
    sched.open("a")
    sched.open("b")
    sched.submit("a", "prefill", 40, tag="pa")
    sched.submit("b", "decode", 3, tag="db")
    batches = [sched.plan() for _ in range(3)]
    assert sched.plan() is None and sched.in_flight == 3
    a = [seg for b in batches for seg in b.segments if seg.session == "a"]
    assert [(s.start, s.offset, s.n, s.final) for s in a] == [(0, 0, 13, False), (13, 13, 16, False),
                                                             (29, 29, 11, True)]
    assert [seg.session for seg in batches[0].segments] == ["b", "a"]  # the decode went first, and only once
    with pytest.raises(RuntimeError, match="oldest"):
        sched.complete(batches[1])
    with pytest.raises(SchedulerRefusal, match="in flight"):
        sched.crop("a", 0)
    assert [w.tag for w in sched.complete(batches[0])] == ["db"]
    assert sched.sessions["a"].context == 13 and sched.kv_used == 43
    assert sched.abandon() == batches[1:] and sched.in_flight == 0
    again = sched.plan()  # the abandoned positions are planned again, from where the cache really ends
    assert [(s.session, s.start, s.n) for s in again.segments] == [("a", 13, 16)]
    with pytest.raises(ValueError, match="max_in_flight"):
        SchedulerConfig(max_in_flight=0)


def test_step_budgets_are_shared_by_device_not_by_session():
    """Device A holds 10 sessions, device B one, every request queued before B's: each step still serves B (its
    decode, and half the prefill budget), so A's many sessions get no more of a step than B's one while B waits."""
    sched = Scheduler(SchedulerConfig(token_budget=8, prefill_floor=0))
    for i in range(10):
        sched.open(("A", i), owner="A")
    sched.open(("B", 0), owner="B")
    for i in range(10):
        sched.submit(("A", i), "decode", 2)
    sched.submit(("B", 0), "decode", 2)
    batch = sched.plan()
    owners = [seg.session[0] for seg in batch.segments]
    assert batch.tokens == 8 and owners.count("B") == 1 and owners.count("A") == 3
    sched.complete(batch)
    # prompts: A's ten, then B's one; the prefill budget splits evenly between the two devices
    sched = Scheduler(SchedulerConfig(token_budget=64, prefill_floor=0))
    for i in range(10):
        sched.open(("A", i), owner="A")
        sched.submit(("A", i), "prefill", 100)
    sched.open(("B", 0), owner="B")
    sched.submit(("B", 0), "prefill", 100)
    got = {}
    for seg in sched.plan().segments:
        got[seg.session[0]] = got.get(seg.session[0], 0) + seg.n
    assert got == {"A": 32, "B": 32}
    # a device with less than its share leaves the rest to the others
    sched = Scheduler(SchedulerConfig(token_budget=64, prefill_floor=0))
    for name, n in (("A", 100), ("B", 10), ("C", 100)):
        sched.open((name, 0), owner=name)
        sched.submit((name, 0), "prefill", n)
    got = {seg.session[0]: seg.n for seg in sched.plan().segments}
    assert got["B"] == 10 and got["A"] + got["C"] == 54 and abs(got["A"] - got["C"]) <= 1


def test_the_positions_of_the_other_devices_per_step():
    """others_positions(D): the positions planned for devices other than D per step, the mean over the last
    RECENT_STEPS steps: D's own prompt, the step before its session opened, does not count; older steps leave."""
    sched = Scheduler(SchedulerConfig(token_budget=128, prefill_floor=0))
    assert sched.others_positions("D") == 0.0
    for name in ("A", "B", "D"):
        sched.open((name, 0), owner=name)
    for _ in range(3):  # A and B decode 1 and 3 positions a step
        sched.submit(("A", 0), "decode", 1)
        sched.submit(("B", 0), "decode", 3)
        _run(sched, 1)
    sched.submit(("D", 0), "prefill", 60)  # D's prompt in a step of its own
    _run(sched, 1)
    assert sched.others_positions("D") == pytest.approx(12 / 4)  # 4 positions in 3 of the 4 steps
    assert sched.others_positions("A") == pytest.approx((9 + 60) / 4)
    assert sched.others_positions(None) == pytest.approx((12 + 60) / 4)
    for _ in range(RECENT_STEPS):  # D alone: the others' steps leave the window
        sched.submit(("D", 0), "decode", 2)
        _run(sched, 1)
    assert sched.others_positions("D") == 0.0 and sched.others_positions("A") == pytest.approx(2.0)

def _flood(sched: Scheduler, device: str, sessions: int = 8, prompt: int = 1500) -> None:
    """A device that keeps `sessions` long prompts queued (a hostile or greedy one)."""
    for i in range(sessions):
        sid = (device, i)
        if sid not in sched.sessions:
            sched.open(sid, owner=device)
        if not sched.sessions[sid].queue:
            sched.submit(sid, "prefill", prompt)


def _light_request(sched: Scheduler, flood: bool, prompt: int = 300, decodes: int = 16) -> tuple:
    """Simulated time (a step costs 16 + its positions) from a light device's request to its first token and between
    its tokens, with or without a flooding device beside it."""
    clock = 0
    sched.open("light", owner="L")
    sched.submit("light", "prefill", prompt)
    first, gaps, last = None, [], None
    while first is None or len(gaps) < decodes:
        if flood:
            _flood(sched, "H")
        batch = sched.plan()
        clock += 16 + batch.tokens
        if any(w.session == "light" for w in sched.complete(batch)):
            if first is None:
                first = clock
            else:
                gaps.append(clock - last)
            last = clock
            if len(gaps) < decodes:
                sched.submit("light", "decode", 1)
    sched.close("light")
    return first, max(gaps)


def test_a_flooding_device_gets_what_the_others_leave_in_small_chunks():
    """Device H keeps 8 prompts of 1,500 positions queued; device L then asks for a 300-position prompt and 16 tokens.
    L's time to first token stays within 1.5x of the cloud without H (equal shares alone give L half of each full
    step: ~3x), its steps grow by at most `prefill_floor` positions of H's (not by a full step), and H still
    progresses by those positions."""
    config = SchedulerConfig(token_budget=512, prefill_floor=64)
    alone = _light_request(Scheduler(config), flood=False)
    sched = Scheduler(config)
    for _ in range(20):  # H has the cloud to itself for a while
        _flood(sched, "H")
        sched.complete(sched.plan())
    assert sched.usage["H"] > 512 and "L" not in sched.usage
    beside = _light_request(sched, flood=True)
    assert beside[0] <= 1.5 * alone[0] and beside[1] <= alone[1] + 64, (alone, beside)
    batch = sched.plan()  # L has no work now: H gets whole steps again
    assert batch.tokens == 512 and {seg.session[0] for seg in batch.segments} == {"H"}
    # the same without usage priority: L shares every full step with H
    sched = Scheduler(SchedulerConfig(token_budget=512, prefill_floor=64, usage_half_life=0))
    for _ in range(20):
        _flood(sched, "H")
        sched.complete(sched.plan())
    equal = _light_request(sched, flood=True)
    assert sched.usage == {} and equal[0] > 2.5 * alone[0] and equal[1] > alone[1] + 400, (alone, equal)


def test_usage_decays_survives_closing_sessions_and_equal_devices_share_equally():
    sched = Scheduler(SchedulerConfig(token_budget=64, prefill_floor=8, usage_half_life=256))
    sched.open("h", owner="H")
    sched.submit("h", "prefill", 640)
    _run(sched, 10)
    assert sched.usage["H"] == pytest.approx(sum(64 * 0.5 ** (64 * k / 256) for k in range(10)))
    sched.close("h")  # closing and reopening does not reset its usage
    sched.open("h2", owner="H")
    sched.open("l", owner="L")
    sched.submit("h2", "prefill", 100)
    sched.submit("l", "prefill", 100)
    batch = sched.plan()
    got = {seg.session: seg.n for seg in batch.segments}
    assert got == {"l": 56, "h2": 8}  # within-share work first, H keeps the floor
    sched.complete(batch)
    # L catches up: once their usages are alike they share steps equally again
    for _ in range(20):
        for sid in ("h2", "l"):
            if not sched.sessions[sid].queue:
                sched.submit(sid, "prefill", 100)
        sched.complete(sched.plan())
    got = {seg.session: seg.n for seg in sched.plan().segments}
    assert got == {"h2": 32, "l": 32}, (got, sched.usage)
    # an over-share device's decodes wait for the others' turns
    sched = Scheduler(SchedulerConfig(token_budget=8, prefill_floor=0, usage_half_life=256))
    sched.open("h", owner="H")
    sched.submit("h", "prefill", 64)
    _run(sched, 8)
    for i in range(4):
        sched.open(("H", i), owner="H")
        sched.submit(("H", i), "decode", 2)
    sched.open("l", owner="L")
    sched.submit("l", "decode", 2)
    assert [seg.session for seg in sched.plan().segments][0] == "l"
    with pytest.raises(ValueError, match="usage_half_life"):
        SchedulerConfig(usage_half_life=-1)


@pytest.mark.parametrize("floor,half_life", [(0, 64), (8, 64), (8, 0), (0, 4096)])
def test_random_devices_always_progress_within_the_budget(floor, half_life):
    """Devices of random sizes come and go with prompts and decodes: while work waits a step is always planned (an
    over-share device alone still progresses), no step passes the budget, and every work finishes."""
    rng = random.Random(floor * 7 + half_life)
    sched = Scheduler(SchedulerConfig(token_budget=32, prefill_floor=floor, usage_half_life=half_life))
    submitted, finished, n = 0, 0, 0
    for step in range(600):
        if step < 500 and rng.random() < 0.4:
            sid = (rng.choice("ABCD"), n)
            n += 1
            sched.open(sid, owner=sid[0])
            for _ in range(rng.randint(1, 3)):
                big = sid[0] == "A"  # A sends long prompts
                sched.submit(sid, "prefill", rng.randint(100, 400) if big else rng.randint(1, 40))
                sched.submit(sid, "decode", rng.randint(1, 4))
                submitted += 2
        if any(s.queue for s in sched.sessions.values()):
            batch = sched.plan()
            assert batch is not None and 0 < batch.tokens <= 32
            finished += len(sched.complete(batch))
        for sid in [k for k, s in sched.sessions.items() if not s.queue]:
            sched.close(sid)
    while any(s.queue for s in sched.sessions.values()):
        finished += len(sched.complete(sched.plan()))
    assert finished == submitted
