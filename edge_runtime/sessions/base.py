"""One request on the device, as one object (Petals' `InferenceSession`): its state, its counters, its link.

A session is opened on a prompt, stepped by its protocol's round function (edge_runtime.rounds; one round drafts,
asks the cloud once, and commits what it produced through `commit`), reopened from its own history when the link
drops or the cloud forgets it, and closed. Its family (hat_split.protocols) picks the class: `TokenSession` (token
ids cross the link), `SplitSession` (hidden states cross; HAT) or `LocalSession` (nothing crosses);
edge_runtime.protocols.new_session builds the right one. `run()` does all of it and returns a `GenerationResult`: the
session's `Counters` plus what the request measured at its end (wall time, time to first token, link bytes counted from
the real frames).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import numpy as np

from edge_runtime.client import (
    CloudClient,
    CloudError,
    CloudUnavailable,
    LinkCounters,
    LinkDown,
    reconnect_delays,
)
from edge_runtime.config import EdgeConfig
from hat_split.math.logprobs import Logprobs, token_logprobs
from hat_split.math.rng import session_rng
from edge_runtime.request import GenerationRequest
from hat_split import protocols
from hat_split.protocols import Protocol

log = logging.getLogger("hatspec.edge")


@dataclass
class Counters:
    """What a request counts while it runs, defined once: the session counts into it, the result is one."""

    rounds: int = 0  # draft/verify or generate rounds
    drafted: int = 0  # draft tokens sent for verification
    accepted: int = 0  # of those, accepted by the cloud
    rejected: int = 0  # rounds that ended in a rejected draft (the others accepted all their drafts)
    cloud_compute_s: float = 0.0  # model time the cloud reported
    skipped: int = 0  # tokens committed on the device without an upload (uhlm, randhlm, cuhlm)
    explored: int = 0  # uhlm, cuhlm with refit: would-be skips uploaded to measure the rejection line's low end
    skip_policy: Dict[str, Any] = field(default_factory=dict)  # uhlm, cuhlm: the skip rule's state at the last token
    upload_ks: List[int] = field(default_factory=list)  # cuhlm: tokens kept per upload
    round_up_bytes: List[int] = field(default_factory=list)  # bytes of each round's request frame (channel models)
    skip_log: List[List[float]] = field(default_factory=list)  # [index in tokens, draft probability] per skipped token
    round_log: List[dict] = field(default_factory=list)  # qs, ksqs, csqs, sq: one entry per round (rounds.qs)
    verify_log: List[List[float]] = field(default_factory=list)  # sd, hlm, hat: [committed, drafted, wall s] per round
    # (drafting, link and verification: hat_split.math.speedup's n_i, γ_i, w_i)
    prefill_chunks: int = 0  # hat / ushape: prompt chunks uploaded
    pd_steps: int = 0  # hat: draft steps spent on parallel-drafting candidates
    pd_hits: int = 0  # hat: rounds that started from a parallel-drafted continuation
    interruptions: int = 0  # link drops the request survived (reconnected and resumed from its history)
    degraded: List[int] = field(default_factory=list)  # indices of tokens made by the device alone (link down)


@dataclass
class GenerationResult(Counters):
    """A finished request: its Counters, and what was measured once it ended. (Every field has a default only because
    a dataclass's fields after defaulted ones must have one; `Session.run` sets them all.)"""

    protocol: str = ""
    prompt_tokens: int = 0
    tokens: List[int] = field(default_factory=list)  # generated token ids (EOS included when produced)
    text: str = ""
    total_s: float = 0.0  # request start (session open included) to last token
    ttft_s: float = 0.0  # request start to first generated token
    up_bytes: int = 0  # request frames sent for this request (session open and close included)
    down_bytes: int = 0
    round_trips: int = 0
    device_compute_s: float = 0.0  # the draft model's forward time on the device (prompt included)
    device_prefill_s: float = 0.0  # of device_compute_s: the prompt
    cloud_prefill_s: float = 0.0  # of cloud_compute_s: the prompt
    open_s: float = 0.0  # of total_s: opening the request (the prompt on the link and on both sides)
    finish_reason: str = ""  # "eos" | "length" | a should_stop reason ("stop", "cancelled")
    logprobs: Optional[List[Logprobs]] = None  # when asked: the tokens' log-probabilities, in commit order (not JSON)
    auto: List[dict] = field(default_factory=list)  # protocol auto: what ran, in order (protocol, knob, tokens,
    # rounds, reason: edge_runtime.auto.Segment); empty for a request that named its protocol

    @property
    def n(self) -> int:
        return len(self.tokens)

    def summary(self) -> Dict[str, Optional[float]]:
        n = max(self.n, 1)
        decode_s = self.total_s - self.ttft_s
        return {
            "n_tokens": self.n,
            "tokens_per_s": self.n / self.total_s if self.total_s > 0 else 0.0,
            "decode_tokens_per_s": (self.n - 1) / decode_s if self.n > 1 and decode_s > 0 else 0.0,
            "after_open_tokens_per_s": self.n / (self.total_s - self.open_s) if self.total_s > self.open_s else 0.0,
            "ttft_s": self.ttft_s,
            # None (JSON null) where there is nothing to divide by: a protocol that drafts nothing (slm, llm)
            "acceptance_rate": self.accepted / self.drafted if self.drafted else None,
            "alpha": self.accepted / (self.accepted + self.rejected) if self.drafted else None,
            "accepted_per_round": self.accepted / self.rounds if self.rounds and self.drafted else None,
            "tokens_per_round": self.n / self.rounds if self.rounds else None,
            "up_bytes_per_token": self.up_bytes / n,
            "down_bytes_per_token": self.down_bytes / n,
            "round_trips_per_token": self.round_trips / n,
        }

    def to_json(self) -> dict:
        out = {**dataclasses.asdict(self), **self.summary()}
        out.pop("logprobs")
        return out


class TextStream:
    """Turns a growing token list into text deltas, holding back incomplete UTF-8 sequences."""

    def __init__(self, decode: Callable[[List[int]], str], on_text: Callable[[str], None]):
        self.decode = decode
        self.on_text = on_text
        self.tokens: List[int] = []
        self.emitted = ""

    def __call__(self, new_tokens: List[int]) -> None:
        self.tokens.extend(new_tokens)
        text = self.decode(self.tokens)
        if text.endswith("\ufffd"):  # a multi-byte character is not complete yet
            return
        if text.startswith(self.emitted):
            delta = text[len(self.emitted):]
        else:  # decoding is not always prefix-stable (merged spaces): emit the rest honestly
            delta = text[len(os.path.commonprefix([text, self.emitted])):]
        self.emitted = text
        if delta:
            self.on_text(delta)


def recoverable(exc: Exception) -> bool:
    """A dropped link, or a cloud that no longer holds the session (it expired there, or the cloud restarted)."""
    return isinstance(exc, LinkDown) or isinstance(exc, CloudError) and exc.error.code == "no_session"


class Session(ABC):
    """One request's state on the device; a family subclass says how it opens, reopens and closes with the cloud."""

    def __init__(self, config: EdgeConfig, request: GenerationRequest, drafter, client: Optional[CloudClient],
                 round_fn: Callable[["Session"], None], eos_ids: frozenset = frozenset(), session_id: int = 1):
        """request: the generation, whole (edge_runtime.request; a seed is drawn when it names none); drafter:
        edge_runtime.drafter.Drafter (token and local families) or edge_runtime.split_drafter.SplitDrafter (split);
        client: None for the local family. The request's should_stop is asked after each commit: a finish reason it
        returns ("stop", "cancelled") ends the request there (the session is still closed properly: every committed
        token is one the cloud verified)."""
        request = request.seeded()
        self.config = config
        self.generation = request  # what was asked, whole (its callbacks among it)
        self.drafter = drafter
        self.client = client
        self.protocol: Protocol = protocols.get(request.protocol)
        self.round_fn = round_fn
        self.params = request.sampling
        self.max_new_tokens = request.max_new_tokens
        self.eos_ids = eos_ids
        self.seed: int = request.seed  # one seed per request: the device and the cloud derive independent streams
        self.session_id = session_id
        self.logprobs_k = request.logprobs  # k: record each committed token's log-probability and k alternatives
        self.counters = Counters()
        self.generated: List[int] = []
        self.finish_reason = ""
        self.first_token_at: Optional[float] = None
        self.round_state = None  # a round function's own state across rounds (qs: wire, threshold, policy)
        self.rng = session_rng(self.seed, "device")  # the device's stream: draft sampling, local sampling
        self.uncertainty_rng = session_rng(self.seed, "uncertainty")  # temperature perturbation (its own stream)
        self.skip_rng = session_rng(self.seed, "skip")  # randhlm's coin
        self.logprobs: List[Logprobs] = []  # theirs, in commit order (hat_split.math.logprobs), when logprobs_k is set
        self._text: Optional[TextStream] = None  # the request's on_text, fed while `run` runs

    # -- what a family defines -----------------------------------------------------------------------------------
    @abstractmethod
    def open(self, prompt: List[int]) -> None:
        """Start the request on the prompt (the cloud's session and the device's prefill)."""

    @abstractmethod
    def reopen(self, prompt: List[int]) -> None:
        """After a link drop or a forgotten session: a new cloud session holding the whole committed sequence."""

    @abstractmethod
    def close(self, prompt: List[int]) -> None:
        """End the cloud's session and check that both sides hold the same sequence."""

    # -- the request ---------------------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.protocol.name

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.generated)

    @property
    def done(self) -> bool:
        return bool(self.finish_reason)

    def token_logprobs(self, logits: Any, tokens: List[int], source: str = "target") -> Optional[Logprobs]:
        """The log-probabilities of `tokens` under raw `# logits [n, vocab]` when the request asked (else None)."""
        if self.logprobs_k is None:
            return None
        return token_logprobs(np.asarray(logits, np.float32)[-len(tokens):], tokens, self.logprobs_k, source)

    def commit(self, tokens: List[int], n_accepted_drafts: int = 0, logprobs: Optional[Logprobs] = None) -> List[int]:
        """Commit tokens (truncated at EOS or the length limit); returns what was committed. Nothing is committed once
        the request has finished (EOS, length, or should_stop mid-round). `logprobs`: the tokens' (token_logprobs),
        required when the request asked for them."""
        if self.finish_reason:
            return []
        if self.logprobs_k is not None and (logprobs is None or len(logprobs) != len(tokens)):
            raise RuntimeError(f"protocol {self.name}: {len(tokens)} tokens committed with "
                               f"{'no' if logprobs is None else len(logprobs)} log-probabilities")
        out: List[int] = []
        for t in tokens[: self.remaining]:
            out.append(t)
            if t in self.eos_ids:
                self.finish_reason = "eos"
                break
        self.drafter.commit(out, min(n_accepted_drafts, len(out)))
        self.generated.extend(out)
        if logprobs is not None and out:
            self.logprobs.append(logprobs.head(len(out)))
        if not self.finish_reason and self.remaining <= 0:
            self.finish_reason = "length"
        if out:
            if self.first_token_at is None:
                self.first_token_at = time.perf_counter()
            if self.generation.on_tokens is not None:
                self.generation.on_tokens(out, self.logprobs[-1] if logprobs is not None else None)
            if self._text is not None:
                self._text(out)
        if not self.finish_reason and self.generation.should_stop is not None:
            self.finish_reason = self.generation.should_stop()
        return out

    def commit_local(self) -> None:
        """One token from the device's draft model alone (no target): the device-only protocol, a degraded stretch."""
        token = self.drafter.sample_local(self.rng)
        self.commit([token], logprobs=self.token_logprobs(self.drafter.local_logits, [token], "draft"))

    def run(self, prompt: List[int], decode_text: Callable[[List[int]], str]) -> GenerationResult:
        """Open, step the protocol's round until the request is done, close; what was measured. `prompt`: the
        request's prompt as token ids; `decode_text`: token ids to text (the request's on_text gets it as it grows)."""
        if not prompt:
            raise ValueError("the prompt is empty")
        if self.generation.on_text is not None:
            self._text = TextStream(decode_text, self.generation.on_text)
        before = self.client.counters.snapshot() if self.client is not None else LinkCounters()
        t0 = time.perf_counter()
        # a drop while the prompt is on the link is resumed like one mid-answer; False: the request ended while the
        # link was down (degrade), nothing to close in the cloud
        linked = self._resuming(prompt, lambda: self.open(prompt))
        device_prefill_s = self.drafter.compute_s
        cloud_prefill_s = self.counters.cloud_compute_s
        open_s = time.perf_counter() - t0
        while not self.done:
            linked = self._resuming(prompt, lambda: self.round_fn(self))
        t1 = time.perf_counter()
        if linked:
            try:
                self.close(prompt)
            except (LinkDown, CloudError) as exc:  # the answer is complete: a cloud that cannot close frees it later
                if not recoverable(exc):
                    raise
                log.warning("session %d was not closed (%s): the cloud frees it after its timeout", self.session_id,
                            exc)
                # its reply may still come on this connection, where the next request would read it for its own:
                # the next request connects afresh
                self.client.close()
        link = self.client.counters.since(before) if self.client is not None else LinkCounters()
        return GenerationResult(
            **dataclasses.asdict(self.counters),
            protocol=self.name,
            prompt_tokens=len(prompt),
            tokens=list(self.generated),
            text=decode_text(self.generated),
            total_s=t1 - t0,
            ttft_s=(self.first_token_at or t1) - t0,
            up_bytes=link.up_bytes,
            down_bytes=link.down_bytes,
            round_trips=link.round_trips,
            device_compute_s=self.drafter.compute_s,
            device_prefill_s=device_prefill_s,
            cloud_prefill_s=cloud_prefill_s,
            open_s=open_s,
            finish_reason=self.finish_reason,
            logprobs=list(self.logprobs) if self.logprobs_k is not None else None,
        )

    # -- link drops ----------------------------------------------------------------------------------------------
    def _resuming(self, prompt: List[int], step: Callable[[], None]) -> bool:
        """Run one step of the request; if it fails recoverably, resume. Whether the cloud holds the session after.
        The step's retry draws what the lost step drew (the device's streams go back to where it began): the draft
        samples, U-HLM's perturbations and randhlm's coins after a cut are those of an uninterrupted answer."""
        drawn = self._draws()
        try:
            step()
            return True
        except (LinkDown, CloudError) as exc:
            if not recoverable(exc):
                raise
            self._redraw(drawn)
            return self.resume(prompt, exc)

    def _draws(self) -> List[dict]:
        """Where the device's random streams stand (their bit generators' states)."""
        return [g.bit_generator.state for g in self._streams]

    def _redraw(self, states: List[dict]) -> None:
        for g, state in zip(self._streams, states):
            g.bit_generator.state = state

    @property
    def _streams(self) -> tuple:
        return self.rng, self.uncertainty_rng, self.skip_rng

    def resume(self, prompt: List[int], exc: Exception) -> bool:
        """The link dropped mid-answer, or the cloud forgot the session: reconnect with backoff and `reopen` from the
        device's own history, so nothing is lost or repeated. `wait` pauses meanwhile; `degrade` keeps generating
        with the device's model (those tokens are marked in `degraded`). Returns False when the answer finished
        before the cloud came back (degrade). A device that cannot generate alone (U-shape: no draft) waits under
        either policy. The `fail` policy re-raises."""
        link = self.config.link
        if link.link_policy == "fail":
            raise exc
        self.counters.interruptions += 1
        self.drafter.rollback()  # drafts of the lost round; caches back to the committed sequence
        alone = link.link_policy == "degrade" and self.drafter.can_generate_alone
        deadline = time.monotonic() + link.reconnect_timeout_s
        for delay in reconnect_delays(link.backoff_s):
            try:
                self.client.connect()
                self.reopen(prompt)
                return True
            except CloudUnavailable as err:
                if time.monotonic() > deadline:
                    raise CloudUnavailable(f"the link stayed down for {link.reconnect_timeout_s:.0f} s: {err}") \
                        from None
            if alone:
                t_end = time.monotonic() + delay
                while not self.done and time.monotonic() < t_end:
                    self.counters.degraded.append(len(self.generated))
                    self.commit_local()
                if self.done:
                    return False
            else:
                time.sleep(delay)
