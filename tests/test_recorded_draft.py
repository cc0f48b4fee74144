"""The played-back draft of `hat-bench capacity` (profiles.bench.recorded_draft): recorded from a real model, it drafts
what the model drafts, so requests of every protocol through a real cloud commit the target's greedy tokens, it takes
the model's time, and it refuses a prefix it never saw."""
from __future__ import annotations

import pytest

from tests.conftest import serving

PROMPT = [5, 17, 99, 3, 250, 7]


@pytest.mark.real_models
def test_a_recorded_draft_drafts_what_the_model_drafts(smollm2):
    from edge_runtime.config import EdgeConfig, LinkConfig
    from edge_runtime.engine import Engine
    from edge_runtime.runtime import EdgeRuntime
    from hat_split.math.sampling import SamplingParams
    from hat_split.models.lm import CausalLM
    from hat_split.models.loading import vocab_fingerprint
    from hat_split.net.security import LinkSecurity
    from profiles.bench.recorded_draft import RecordedLM, record

    lm = CausalLM(smollm2.model)
    target = lm.greedy(PROMPT, 12)
    rec = record(lm, PROMPT, target, gamma=4)
    # the draft is the target here: every draft runs along the target's path, so the prefixes coincide
    assert len(rec.next_token) == len(target) + 4 and rec.step_s > 0 and rec.prefill_s_per_token > 0
    assert rec.next_token[tuple(PROMPT)] == target[0]

    played = RecordedLM(rec, strict=True)
    state = played.new_state()
    played.forward(state, PROMPT[:-1], n_logits=0)
    logits = played.forward(state, [PROMPT[-1]], n_logits=1)
    assert int(logits[0].argmax()) == int(lm.forward(lm.new_state(), PROMPT, n_logits=1)[0].argmax())
    assert state.forward_s >= rec.step_s and state.length == len(PROMPT)
    played.crop(state, 2)
    with pytest.raises(KeyError, match="no draft after this prefix of 3 tokens"):
        played.forward(state, [12345], n_logits=1)
    lenient = RecordedLM(rec)  # off the recording: a draft of token 0 (a wrong guess), counted
    off = lenient.new_state()
    assert int(lenient.forward(off, [5, 12345], n_logits=1)[0].argmax()) == 0 and lenient.misses == 1
    played.strict = False

    engine = Engine(played, smollm2.tokenizer, played.vocab_size, "played", vocab_fingerprint(smollm2.tokenizer),
                    frozenset())
    with serving(lm, vocab=vocab_fingerprint(smollm2.tokenizer)) as server:
        config = EdgeConfig(model="smollm2-135m", link=LinkConfig(server.endpoint,
                                                                   security=LinkSecurity.plaintext()))
        with EdgeRuntime(config, engine) as rt:
            for protocol in ("sd", "llm", "auto"):
                res = rt.generate(PROMPT, protocol, SamplingParams(0.0), 12, seed=0)
                assert res.tokens == target, protocol
            assert rt.generate(PROMPT, "sd", SamplingParams(0.0), 12, seed=0).accepted > 0


def test_near_ties_are_the_positions_whose_top_two_are_close():
    import numpy as np

    from profiles.bench.recorded_draft import near_ties

    logits = np.array([[3.0, 2.5, 0.0], [0.0, 5.0, 1.0], [1.0, 0.9, 1.2], [0.0, 0.0, 9.0]])
    # position 0: 3.0 vs 2.5 (the other is 1); 1: 4 apart; 2: the path took 1.0, below the top 1.2 (the other is the
    # top, 2); 3: far apart
    assert near_ties(logits, [0, 1, 0, 2], 1.0) == [(0, 1), (2, 2)]
    assert near_ties(logits, [0, 1, 0, 2], 0.0) == []
    with pytest.raises(ValueError, match="one row of logits per token"):
        near_ties(logits, [0, 1], 1.0)


@pytest.mark.real_models
def test_a_branch_takes_the_runner_up_then_follows_the_target(smollm2):
    from hat_split.models.lm import CausalLM
    from profiles.bench.recorded_draft import branches, record

    lm = CausalLM(smollm2.model)
    path = lm.greedy(PROMPT, 6)
    assert branches(lm, PROMPT, path, 0.0) == []
    forks = branches(lm, PROMPT, path, 1e9)  # every position a near tie
    assert [i for i, _ in forks] == list(range(len(path))) and all(len(f) == len(path) for _, f in forks)
    rows = lm.forward(lm.new_state(), PROMPT + path[:-1], n_logits=len(path))
    for i in (0, 3, 5):
        fork = forks[i][1]
        assert fork[:i] == path[:i] and fork[i] == int(rows[i].argsort()[-2]) != path[i]
        assert fork[i + 1:] == lm.greedy(PROMPT + fork[:i + 1], len(path) - i - 1)
    # a branch's recording from its near tie on: the whole answer's entries from there, none before
    fork = forks[3][1]
    whole, tail = record(lm, PROMPT, fork, gamma=2), record(lm, PROMPT, fork, gamma=2, start=3)
    assert tail.next_token.items() <= whole.next_token.items() and len(tail.next_token) >= len(fork) - 3 + 1
    assert all(k[:len(PROMPT) + 3] == tuple(PROMPT + fork[:3]) for k in tail.next_token)
    with pytest.raises(ValueError, match="start <= len"):
        record(lm, PROMPT, path, 2, start=len(path) + 1)
