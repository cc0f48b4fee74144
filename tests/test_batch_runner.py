"""One batched forward over several sessions' caches equals forwarding each session alone (issue 6's runner core):
ragged segments (decode, verify, prefill chunks) on caches of different lengths, every model family, and a real
model's middle part."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hat_split.models.partition import PartCache, Stack  # noqa: E402
from tests.test_hat import _family  # noqa: E402


def _sessions(stack: Stack, hidden_size: int, pasts, seed: int):
    """Two identical sets of caches (one per way of running), prefilled to `pasts` positions."""
    g = torch.Generator().manual_seed(seed)
    alone, batched = [], []
    for p in pasts:
        x = torch.randn(1, p, hidden_size, generator=g)
        a, b = PartCache(), PartCache()
        stack.forward(a, x)
        stack.forward(b, x)
        alone.append(a)
        batched.append(b)
    return alone, batched


def _step(stack, alone, batched, lengths, hidden_size, seed):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(1, n, hidden_size, generator=g) for n in lengths]
    ref = [stack.forward(c, x) for c, x in zip(alone, xs)]
    got = stack.forward_batch(batched, xs)
    assert [o.shape for o in got] == [r.shape for r in ref]
    return max(float((o - r).abs().max()) for o, r in zip(got, ref))


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_batched_forward_equals_each_session_alone(family):
    model = _family(family)
    stack = Stack(model, 0, model.config.num_hidden_layers)
    h = model.config.hidden_size
    alone, batched = _sessions(stack, h, [3, 9, 1, 6], seed=0)
    # decode, a verify of 4 drafts + 1, a 2-position draft and a prefill chunk — past Gemma's window of 4
    assert _step(stack, alone, batched, [1, 5, 2, 4], h, seed=1) < 1e-5
    # the caches advanced by exactly their own segments: a second step still agrees
    assert [c.length for c in batched] == [4, 14, 3, 10]
    assert _step(stack, alone, batched, [3, 1, 1, 2], h, seed=2) < 1e-5
    # rejected positions cropped in one session only, then batched again
    alone[1].crop(11)
    batched[1].crop(11)
    assert _step(stack, alone, batched, [1, 2, 1, 1], h, seed=3) < 1e-5


def test_batched_forward_refuses_bad_batches():
    model = _family("llama")
    stack = Stack(model, 0, 2)
    c = PartCache()
    x = torch.zeros(1, 2, model.config.hidden_size)
    with pytest.raises(ValueError, match="once per batch"):
        stack.forward_batch([c, c], [x, x])
    with pytest.raises(ValueError, match="at least one position"):
        stack.forward_batch([c, PartCache()], [x, x[:, :0]])
    with pytest.raises(ValueError, match="one cache per segment"):
        stack.forward_batch([c], [x, x])


@pytest.mark.real_models
def test_batched_middle_part_of_a_real_model(smollm2):
    """smollm2's middle part (layers 2-29) on real tokens' shallow states: batched = alone up to float noise relative
    to the deep states' scale, and the same next-token argmax everywhere."""
    from hat_split.models.partition import SplitModel

    split = SplitModel(smollm2.model, 2)
    ids = smollm2.tokenizer("The quick brown fox jumps over the lazy dog. " * 12)["input_ids"]
    starts, pasts, lengths = [0, 20, 50], [40, 7, 23], [1, 6, 3]
    inp = [PartCache() for _ in starts]
    alone, batched = [PartCache() for _ in starts], [PartCache() for _ in starts]
    for c_in, a, b, s0, p in zip(inp, alone, batched, starts, pasts):
        shallow = split.run_input(c_in, ids[s0:s0 + p])
        split.middle.forward(a, shallow)
        split.middle.forward(b, shallow)
    xs = [split.run_input(c_in, ids[s0 + p:s0 + p + n]) for c_in, s0, p, n in zip(inp, starts, pasts, lengths)]
    ref = [split.middle.forward(c, x) for c, x in zip(alone, xs)]
    got = split.middle.forward_batch(batched, xs)
    for o, r in zip(got, ref):
        assert float((o - r).abs().max()) < 1e-4 * float(r.abs().max())
        assert torch.equal(split.run_output(PartCache(), o).argmax(-1), split.run_output(PartCache(), r).argmax(-1))


def _serve_plans(engine, stack, plans, h, budget):
    """Drive `engine` through every session's plan, one request in flight per session; returns (expected, got,
    steps), each work's output keyed by (session, request index)."""
    g = torch.Generator().manual_seed(5)
    alone, expected, got = {}, {}, {}
    for s in plans:
        engine.open(s, stack.start, stack.stop)
        alone[s] = PartCache()
    pending = {s: list(p) for s, p in plans.items()}
    steps = 0
    while any(pending.values()) or engine.busy:
        for s, todo in pending.items():
            if todo and not engine.scheduler.sessions[s].queue:  # one request in flight per device
                kind, n = todo.pop(0)
                x = torch.randn(1, n, h, generator=g)
                engine.submit(s, kind, x[0].numpy(), tag=(s, len(plans[s]) - len(todo) - 1))
                expected[(s, len(plans[s]) - len(todo) - 1)] = stack.forward(alone[s], x)
        finished, reports = engine.step()
        for batch, report in reports:
            assert report.tokens == batch.tokens <= budget and report.compute_s > 0
        for work, out in finished:
            got[work.tag] = out
        steps += 1
        assert steps < 200
    return expected, got, steps


PLANS = {"a": [("prefill", 50), ("decode", 1), ("decode", 5)], "b": [("prefill", 3), ("decode", 2)],
         "c": [("prefill", 9), ("decode", 1), ("decode", 1)], "d": [("prefill", 1)], "e": [("prefill", 20)]}


def test_scheduler_and_runner_serve_many_sessions_like_each_alone():
    """Five sessions: a long prompt the scheduler chunks over steps, short prompts, then decode and verify segments;
    every work's output equals running that session alone on its own cache."""
    from cloud_runtime.runner import Engine, LocalExecutor, ModelEnds
    from cloud_runtime.scheduler import Scheduler, SchedulerConfig

    model = _family("gemma3")
    stack = Stack(model, 1, 4)
    engine = Engine(Scheduler(SchedulerConfig(token_budget=16, prefill_floor=4)), LocalExecutor(model),
                    ModelEnds(model))
    expected, got, steps = _serve_plans(engine, stack, PLANS, model.config.hidden_size, 16)
    assert set(got) == set(expected)
    for tag, ref in expected.items():
        assert got[tag].shape == ref.shape and float((got[tag] - ref).abs().max()) < 1e-5, tag
    assert steps >= 50 // 16  # the long prompt took several steps
    assert not engine.busy and all(not s.queue for s in engine.scheduler.sessions.values())
