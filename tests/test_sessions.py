"""What every request's session shares (edge_runtime/sessions/base.py): `Session.commit` (end tokens, the length limit,
the request's callbacks, nothing after the finish), `TextStream`, `GenerationResult.summary()` and `recoverable`, on a
`LocalSession` (edge_runtime/sessions/local.py) built by edge_runtime.protocols.new_session, with a recording
stand-in drafter or the tiny draft model.

The token and split families' sessions run against a cloud in tests/test_generation.py, tests/test_hat.py and
tests/test_faults.py (reopening after a drop); tests/README.md maps them."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from edge_runtime.client import CloudError, CloudUnavailable, LinkDown
from edge_runtime.config import EdgeConfig
from edge_runtime.drafter import Drafter
from edge_runtime.protocols import new_session
from edge_runtime.request import GenerationRequest
from edge_runtime.sessions.base import GenerationResult, TextStream, recoverable
from edge_runtime.sessions.local import LocalSession
from hat_split.math.logprobs import Logprobs
from hat_split.math.sampling import SamplingParams
from hat_split.wire import messages as P

PROMPT = [5, 17, 99, 3, 250, 7]
EOS = 2
GREEDY = SamplingParams(0.0)


class RecordingDrafter:
    """Stands in for edge_runtime.drafter.Drafter where only commits matter: records (tokens, accepted drafts)."""

    compute_s = 0.0
    can_generate_alone = True

    def __init__(self):
        self.commits = []

    def commit(self, tokens, n_accepted):
        self.commits.append((list(tokens), n_accepted))


def session(max_new_tokens=8, drafter=None, eos=(EOS,), **request):
    return new_session(EdgeConfig(model="tiny"),
                       GenerationRequest(PROMPT, "slm", GREEDY, max_new_tokens, seed=0, **request),
                       drafter or RecordingDrafter(), None, frozenset(eos))


def logprobs(n):
    return Logprobs(np.zeros(n, np.float32), np.zeros((n, 1), np.int32), np.zeros((n, 1), np.float32))


# -- Session.commit ---------------------------------------------------------------------------------------------------
def test_an_end_token_finishes_with_eos_and_cuts_what_follows_it():
    s = session()
    assert isinstance(s, LocalSession)
    assert s.commit([10, 11]) == [10, 11] and not s.done
    assert s.commit([12, EOS, 13, 14], n_accepted_drafts=4) == [12, EOS]
    assert s.generated == [10, 11, 12, EOS] and s.finish_reason == "eos"
    assert s.drafter.commits == [([10, 11], 0), ([12, EOS], 2)]  # the drafter accepts no more than was committed


def test_the_length_limit_finishes_with_length():
    s = session(max_new_tokens=4)
    s.commit([10, 11])
    assert s.remaining == 2 and not s.done
    assert s.commit([12, 13, 14, 15]) == [12, 13]
    assert s.finish_reason == "length" and s.remaining == 0
    last = session(max_new_tokens=3)
    last.commit([10, 11, EOS])
    assert last.finish_reason == "eos"  # an end token at the limit is an end token


@pytest.mark.parametrize("finish", ["eos", "length", "stop"])
def test_nothing_is_committed_after_the_finish(finish):
    stop = {"stop": lambda: "stop"}.get(finish, lambda: "")
    calls = []
    s = session(max_new_tokens=3, on_tokens=lambda toks, lp: calls.append(list(toks)), should_stop=stop)
    s.commit([10, EOS] if finish == "eos" else [10, 11, 12] if finish == "length" else [10])
    assert s.finish_reason == finish
    generated, commits = list(s.generated), list(s.drafter.commits)
    assert s.commit([20, 21]) == [] and s.commit([]) == []
    assert (s.generated, s.drafter.commits, len(calls), s.finish_reason) == (generated, commits, 1, finish)


def test_on_tokens_gets_each_commit_and_should_stop_is_asked_after_it():
    events = []
    reasons = iter(["", "", "cancelled"])

    def should_stop():
        events.append(("asked", len(s.generated)))
        return next(reasons)

    s = session(max_new_tokens=20, on_tokens=lambda toks, lp: events.append(("tokens", list(toks), lp)),
                should_stop=should_stop)
    s.commit([10, 11])
    s.commit([12])
    s.commit([13, 14, 15])
    assert events == [("tokens", [10, 11], None), ("asked", 2), ("tokens", [12], None), ("asked", 3),
                      ("tokens", [13, 14, 15], None), ("asked", 6)]
    assert s.finish_reason == "cancelled" and s.commit([16]) == []
    eos = session(should_stop=lambda: pytest.fail("asked after the request had finished"))
    eos.commit([10, EOS])  # finished by its end token: should_stop is not asked, the reason stays "eos"
    assert eos.finish_reason == "eos"


def test_a_request_asking_logprobs_gets_them_with_each_commit_or_the_commit_is_refused():
    got = []
    s = session(logprobs=1, on_tokens=lambda toks, lp: got.append((list(toks), len(lp))))
    with pytest.raises(RuntimeError, match="protocol slm: 2 tokens committed with no log-probabilities"):
        s.commit([10, 11])
    with pytest.raises(RuntimeError, match="2 tokens committed with 1 log-probabilities"):
        s.commit([10, 11], logprobs=logprobs(1))
    s.commit([10, EOS, 12], logprobs=logprobs(3))
    assert got == [([10, EOS], 2)] and [len(lp) for lp in s.logprobs] == [2]  # cut with the tokens


# -- Session.run on the tiny draft ------------------------------------------------------------------------------------
def _run(tiny_pair, n=12, eos=(), **request):
    draft = tiny_pair[0]
    s = session(n, Drafter(draft, GREEDY), eos, **request)
    return s.run(PROMPT, lambda toks: " ".join(map(str, toks))), s


def test_a_local_session_runs_the_draft_alone_and_reports_it(tiny_pair):
    ref = tiny_pair[0].greedy(PROMPT, 12)
    texts = []
    result, s = _run(tiny_pair, on_text=texts.append)
    assert result.tokens == ref and result.finish_reason == "length" and result.protocol == "slm"
    assert result.text == " ".join(map(str, ref)) == "".join(texts)
    assert (result.rounds, result.prompt_tokens, result.up_bytes, result.round_trips) == (12, len(PROMPT), 0, 0)
    assert 0 < result.ttft_s <= result.total_s and result.device_compute_s > 0
    ended, _ = _run(tiny_pair, eos=(ref[4],))
    assert ended.tokens == ref[:5] and ended.finish_reason == "eos"
    with pytest.raises(ValueError, match="the prompt is empty"):
        s.run([], str)
    with pytest.raises(RuntimeError, match="no cloud session to reopen"):
        s.reopen(PROMPT)


# -- TextStream -------------------------------------------------------------------------------------------------------
def test_text_stream_holds_back_incomplete_utf8_and_emits_deltas():
    deltas = []
    stream = TextStream(lambda ids: bytes(ids).decode("utf-8", errors="replace"), deltas.append)
    for piece in ([0x61], [0xC3], [0xA9, 0x62], [0xE2, 0x82], [0xAC], [0xF0, 0x9F, 0x99], [0x82]):
        stream(piece)  # a, é split over two tokens, b, € over two, 🙂 over two
    assert deltas == ["a", "é" + "b", "€", "🙂"]
    assert "".join(deltas) == "aéb€🙂" == stream.emitted


def test_text_stream_emits_no_empty_delta_and_copes_with_a_decoding_that_is_not_prefix_stable():
    deltas = []
    texts = {1: "ab", 2: "ab", 3: "a bc"}  # the third token's text rewrites the end of what came before
    stream = TextStream(lambda ids: texts[len(ids)], deltas.append)
    stream([1])
    stream([2])
    stream([3])
    assert deltas == ["ab", " bc"] and stream.emitted == "a bc"


# -- GenerationResult.summary and recoverable ------------------------------------------------------------------------
def test_summary_is_none_not_nan_where_nothing_was_drafted(tiny_pair):
    result, _ = _run(tiny_pair, n=4)  # slm drafts nothing
    summary = result.summary()
    assert summary["acceptance_rate"] is None and summary["alpha"] is None and summary["accepted_per_round"] is None
    assert summary["tokens_per_round"] == 1.0 and summary["n_tokens"] == 4
    json.dumps(result.to_json(), allow_nan=False)  # strict JSON: a NaN would raise here
    nothing = GenerationResult().summary()  # no rounds, no tokens: still numbers or None
    assert nothing["tokens_per_round"] is None and nothing["tokens_per_s"] == 0.0
    assert not any(isinstance(v, float) and math.isnan(v) for v in nothing.values())
    drafted = GenerationResult(tokens=list(range(8)), rounds=2, drafted=8, accepted=6, rejected=1).summary()
    assert (drafted["acceptance_rate"], drafted["alpha"], drafted["accepted_per_round"],
            drafted["tokens_per_round"]) == (0.75, 6 / 7, 3.0, 4.0)


@pytest.mark.parametrize("exc,resumable", [
    (LinkDown("reset"), True),
    (CloudError(P.Error("no_session", "no open session 1")), True),
    (CloudError(P.Error("desync", "position 4, expected 5")), False),
    (CloudError(P.Error("invalid", "token out of range")), False),
    (CloudUnavailable("no answer"), False),
    (ValueError("bad request"), False),
])
def test_recoverable_is_a_dropped_link_or_a_forgotten_session(exc, resumable):
    assert recoverable(exc) is resumable
