"""edge_runtime.read_ahead: the draft model's reads on a thread of their own, on a real Drafter over a toy model whose
forwards can be held."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from edge_runtime.drafter import Drafter
from edge_runtime.read_ahead import ReadAhead
from hat_split.math.sampling import SamplingParams
from tests.markov_lm import MarkovLM


class HeldLM(MarkovLM):
    """A MarkovLM whose forwards wait for `go` (set: they run at once), counting the forwards begun."""

    def __init__(self, vocab: int = 300):
        rng = np.random.default_rng(0)
        table = rng.random((vocab, vocab)) + 0.01
        super().__init__(table / table.sum(axis=1, keepdims=True))
        self.go = threading.Event()
        self.go.set()
        self.begun = threading.Semaphore(0)
        self.fail = False
        self.in_forward = False

    def forward(self, state, tokens, n_logits=1):
        self.in_forward = True
        try:
            self.begun.release()
            assert self.go.wait(10.0), "a test left a forward held"
            if self.fail:
                raise RuntimeError("the board's model went away")
            return super().forward(state, tokens, n_logits)
        finally:
            self.in_forward = False

    def crop(self, state, length):
        if self.in_forward:  # two writers of one cache (a llama.cpp context is not thread-safe)
            raise AssertionError("the cache was cropped while a forward was in progress")
        super().crop(state, length)


def _drafter(prompt_len: int = 150) -> Drafter:
    d = Drafter(HeldLM(), SamplingParams(0.0))
    d.start(list(range(1, prompt_len + 1)), prefill=False)
    return d


def _until_idle(r: ReadAhead) -> None:
    """Wait for the reader to run out of tokens by itself (settle would stop it after its forward in progress)."""
    deadline = time.monotonic() + 10.0
    while r.running and time.monotonic() < deadline:
        time.sleep(0.005)
    assert not r.running


def test_it_reads_everything_committed_in_forwards_of_at_most_its_size():
    d = _drafter(150)
    r = ReadAhead(d, most=64)
    r.start()
    _until_idle(r)
    reads = r.drain()
    assert [read.tokens for read in reads] == [64, 64, 21] and all(read.seconds >= 0 for read in reads)
    assert all(read.compared == 0 for read in reads)  # not asked
    assert d.kv.length == 149 and not r.drain() and not r.running


def test_a_whole_start_reads_all_that_is_lacking_in_its_first_forward_then_forwards_of_its_size():
    """The opening's prompt in one forward (start(whole=True)); what is committed later, in forwards of `most`."""
    d = _drafter(150)
    r = ReadAhead(d, most=64)
    r.start(whole=True)
    _until_idle(r)
    assert [read.tokens for read in r.drain()] == [149] and d.behind == 0
    d.commit(list(range(200, 300)))
    r.start()
    _until_idle(r)
    assert [read.tokens for read in r.drain()] == [64, 36] and d.behind == 0


def test_a_step_reads_one_token_on_the_callers_thread_and_never_beside_a_running_reader():
    """step(): a draft step's forward (one token) on the caller's thread, kept for drain; nothing while a reader
    runs (one writer of the cache at a time) or when nothing is lacking."""
    d = _drafter(150)
    r = ReadAhead(d, most=64)
    assert r.step() and [read.tokens for read in r.drain()] == [1] and d.behind == 148
    assert {t.name for t in threading.enumerate()}.isdisjoint({"hatspec-read-ahead"})
    d.lm.go.clear()  # the reader's forward is held
    r.start()
    assert d.lm.begun.acquire(timeout=10.0) and d.lm.begun.acquire(timeout=10.0)  # the step's, the reader's
    assert not r.step()  # a reader is running: no second writer
    d.lm.go.set()
    _until_idle(r)
    assert [read.tokens for read in r.drain()] == [64, 64, 20] and d.behind == 0
    assert not r.step() and not r.drain()  # nothing lacking


def test_the_callers_thread_never_waits_for_a_forward_and_settle_does():
    """start returns while a forward is held; tokens committed meanwhile are read by the same thread; stop leaves the
    forward in progress to finish on its own; settle waits for it."""
    d = _drafter(10)
    lm = d.lm
    lm.go.clear()
    r = ReadAhead(d, most=64)
    t0 = time.perf_counter()
    r.start()
    assert lm.begun.acquire(timeout=5.0) and time.perf_counter() - t0 < 1.0 and r.running
    threads = [t for t in threading.enumerate() if t.name == "hatspec-read-ahead"]
    d.commit([11, 12, 13])  # an llm round's tokens, committed while the prompt's read is in progress
    r.start()  # a reader already running goes on: no second thread
    assert [t for t in threading.enumerate() if t.name == "hatspec-read-ahead"] == threads
    lm.go.set()
    _until_idle(r)
    assert [read.tokens for read in r.drain()] == [9, 3] and d.behind == 0
    assert lm.begun.acquire(timeout=5.0)  # the second forward's
    d.commit([14, 15])
    lm.go.clear()
    r.start()
    assert lm.begun.acquire(timeout=5.0)
    r.stop()
    r.start()  # asked to go on before its forward ended: the stop is withdrawn
    d.commit([16])
    lm.go.set()
    _until_idle(r)
    assert [read.tokens for read in r.drain()] == [2, 1] and lm.begun.acquire(timeout=5.0)
    d.commit([17, 18])
    lm.go.clear()
    r.start()
    assert lm.begun.acquire(timeout=5.0)
    r.stop()
    assert r.running  # the forward in progress finishes on its own
    waiter = threading.Thread(target=r.settle)
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # settle waits for it
    lm.go.set()
    waiter.join(5.0)
    assert not waiter.is_alive() and not r.running and d.behind == 0 and [read.tokens for read in r.drain()] == [2]


def test_a_commit_while_reading_leaves_the_cache_to_the_reader():
    """Drafter.commit crops only a cache that holds drafts: the reader's forward in progress is left alone (no second
    writer of the cache), and after it the cache holds the prompt, the committed tokens still to read."""
    d = _drafter(20)
    d.lm.go.clear()
    r = ReadAhead(d)
    r.start()
    assert d.lm.begun.acquire(timeout=5.0)
    d.commit([30, 31])
    d.lm.go.set()
    r.settle()
    assert d.kv.length == 19 and d.behind == 2 and d.tokens[-2:] == [30, 31]


def test_a_failed_read_is_raised_where_the_session_settles():
    d = _drafter(10)
    d.lm.fail = True
    r = ReadAhead(d)
    r.start()
    assert d.lm.begun.acquire(timeout=5.0)
    with pytest.raises(RuntimeError, match="read while waiting failed: the board's model went away"):
        r.settle()
    assert not r.running
    r.settle()  # raised once


def test_nothing_to_read_starts_no_thread_and_a_size_below_one_is_refused():
    d = _drafter(1)
    r = ReadAhead(d)
    r.start()
    assert not r.running and r._thread is None
    r.settle()
    with pytest.raises(ValueError, match="at least one token"):
        ReadAhead(d, most=0)


def test_at_temperature_0_it_counts_the_targets_tokens_the_draft_named():
    """compare: every target token read past the prompt is checked against the draft's argmax from the prefix
    before it (a bigram model: the argmax after t is table[t]'s); the prompt's own tokens are not counted."""
    d = _drafter(10)
    best = d.lm.table.argmax(axis=1)
    first = int(best[d.tokens[-1]])
    other = int((best[first] + 1) % d.lm.vocab_size)  # not what the draft names after `first`
    d.commit([first, other, int(best[other])])
    r = ReadAhead(d, most=4, compare=True)
    r.start()
    _until_idle(r)
    reads = r.drain()
    assert [read.tokens for read in reads] == [4, 4, 4]  # all but the last committed token (the next draft's)
    assert [read.compared for read in reads] == [0, 0, 3] and [read.agreed for read in reads] == [0, 0, 2]
    assert (d.agreed, d.compared) == (2, 3)
    # and each token's mark: its index, whether the draft named it, the draft's probability of what it named (a
    # row of the bigram table: HAT eq. 5's confidence), what an η-ended chain would have done there
    sure = [float(d.lm.table[t].max()) for t in (10, first, other)]
    assert reads[-1].marks == tuple(d.marks) and [m[:2] for m in d.marks] == [(10, True), (11, False), (12, True)]
    assert [m[2] for m in d.marks] == pytest.approx(sure, rel=1e-5)
    d.start(list(range(1, 11)), prefill=False)
    assert d.marks == []  # a new request's own


def test_above_temperature_0_it_estimates_acceptance_from_the_targets_drawn_probabilities():
    """T = 1: each target token read whose probability as drawn the cloud sent (note_drawn) adds min(1, q(x) / p(x)),
    q the draft's distribution after the token before it (a bigram model: table[prev]); a token committed without
    one (an sd round's) is not counted, the prompt's own never."""
    d = Drafter(HeldLM(), SamplingParams(1.0))
    d.start(list(range(1, 11)), prefill=False)
    rng = np.random.default_rng(3)
    vocab = d.lm.vocab_size
    target = rng.dirichlet(np.ones(vocab), size=vocab)
    seq, probs, prev = [], [], d.tokens[-1]
    for _ in range(6):
        prev = int(rng.choice(vocab, p=target[prev]))
        probs.append(float(target[d.tokens[-1] if not seq else seq[-1], prev]))
        seq.append(prev)
    d.note_drawn(probs[:4])
    d.commit(seq[:4])
    d.commit(seq[4:5])
    d.note_drawn(probs[5:])
    d.commit(seq[5:])
    r = ReadAhead(d, most=4, compare=True)
    r.start()
    _until_idle(r)
    reads = r.drain()
    before = [10] + seq[:-1]
    due = [min(1.0, d.lm.table[a, x] / p) for i, (a, x, p) in enumerate(zip(before, seq, probs)) if i != 4]
    assert sum(read.compared for read in reads) == d.compared == 5
    assert d.agreed == pytest.approx(sum(due), rel=1e-5) and 0 < d.agreed < 5
    assert not d.marks and all(read.marks == () for read in reads)  # a draft's confidence in its own token is not
    # read above temperature 0
