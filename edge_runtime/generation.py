"""One request on the device, for every protocol: the shared round loop and its measured result.

A protocol is a function `round(gen) -> committed tokens` that performs one round (draft + verify, a cloud-only chunk,
a local step...) and commits what it produced through `gen.commit`. `run()` opens the cloud session, calls the
protocol's round until the request is done, and fills a `GenerationResult` with what was measured: wall time, time to
first token, accepted drafts per round, and link bytes counted from the real frames. Later protocols (uhlm, cuhlm, qs,
hat...) register a round function here; nothing else changes.
"""
from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional

import numpy as np

from edge_runtime.client import (CloudClient, CloudError, CloudUnavailable, LinkCounters, LinkDown,
                                 reconnect_delays)
from edge_runtime.config import EdgeConfig
from edge_runtime.drafter import Drafter
from hat_split.wire import dist_codec
from hat_split.wire import messages as P
from hat_split.math.rng import session_rng
from hat_split.math.sampling import SamplingParams

log = logging.getLogger("hatspec.edge")


@dataclass
class GenerationResult:
    protocol: str
    prompt_tokens: int
    tokens: List[int]  # generated token ids (EOS included when produced)
    text: str
    total_s: float  # request start (session open included) to last token
    ttft_s: float  # request start to first generated token
    rounds: int  # draft/verify or generate rounds
    drafted: int  # draft tokens sent for verification
    accepted: int  # of those, accepted by the cloud
    rejected: int  # rounds that ended in a rejected draft (the others accepted all their drafts)
    up_bytes: int  # request frames sent for this request (session open and close included)
    down_bytes: int
    round_trips: int
    cloud_compute_s: float  # model time the cloud reported
    device_compute_s: float  # the draft model's forward time on the device (prompt included)
    finish_reason: str  # "eos" | "length"
    skipped: int = 0  # tokens committed on the device without an upload (uhlm, randhlm, cuhlm)
    upload_ks: List[int] = field(default_factory=list)  # cuhlm: tokens kept per upload
    round_up_bytes: List[int] = field(default_factory=list)  # bytes of each round's request frame (channel models)
    device_prefill_s: float = 0.0  # of device_compute_s: the prompt
    cloud_prefill_s: float = 0.0  # of cloud_compute_s: the prompt
    skip_log: List[List[float]] = field(default_factory=list)  # [index in tokens, draft probability] per skipped token
    round_log: List[dict] = field(default_factory=list)  # qs, ksqs, csqs, sq: one entry per round (edge_runtime.qs)
    prefill_chunks: int = 0  # hat / ushape: prompt chunks uploaded
    pd_steps: int = 0  # hat: draft steps spent on parallel-drafting candidates
    pd_hits: int = 0  # hat: rounds that started from a parallel-drafted continuation
    interruptions: int = 0  # link drops the request survived (reconnected and resumed from its history)
    degraded: List[int] = field(default_factory=list)  # indices of tokens made by the device alone (link down)

    @property
    def n(self) -> int:
        return len(self.tokens)

    def summary(self) -> Dict[str, float]:
        n = max(self.n, 1)
        decode_s = self.total_s - self.ttft_s
        return {
            "n_tokens": self.n,
            "tokens_per_s": self.n / self.total_s if self.total_s > 0 else 0.0,
            "decode_tokens_per_s": (self.n - 1) / decode_s if self.n > 1 and decode_s > 0 else 0.0,
            "ttft_s": self.ttft_s,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else float("nan"),
            "alpha": self.accepted / (self.accepted + self.rejected) if self.drafted else float("nan"),
            "accepted_per_round": self.accepted / self.rounds if self.rounds and self.drafted else float("nan"),
            "tokens_per_round": self.n / self.rounds if self.rounds else float("nan"),
            "up_bytes_per_token": self.up_bytes / n,
            "down_bytes_per_token": self.down_bytes / n,
            "round_trips_per_token": self.round_trips / n,
        }

    def to_json(self) -> dict:
        return {**asdict(self), **self.summary()}


@dataclass
class Generation:
    """State of one request while it runs; protocol round functions read and commit through it."""

    config: EdgeConfig
    drafter: Drafter
    client: Optional[CloudClient]
    protocol: str
    params: SamplingParams
    max_new_tokens: int
    eos_ids: frozenset
    seed: int  # one seed per request: the device and the cloud derive independent streams from it
    session_id: int
    on_tokens: Callable[[List[int]], None] = lambda tokens: None
    should_stop: Callable[[], str] = lambda: ""  # checked after each commit: a finish reason ("stop", "cancelled") ends
    # the request there (the session is still closed properly: every committed token is one the cloud verified)
    generated: List[int] = field(default_factory=list)
    step: int = 0
    cloud_position: int = 0  # committed tokens the cloud holds
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    rejected: int = 0
    cloud_compute_s: float = 0.0
    first_token_at: Optional[float] = None
    finish_reason: str = ""
    pending: List[int] = field(default_factory=list)  # committed here, not yet sent to the cloud (skipped uploads)
    skipped: int = 0  # tokens committed without an upload (uhlm, randhlm, cuhlm)
    upload_ks: List[int] = field(default_factory=list)  # cuhlm: tokens kept per upload
    round_up_bytes: List[int] = field(default_factory=list)
    skip_log: List[List[float]] = field(default_factory=list)
    round_log: List[dict] = field(default_factory=list)  # qs family: per round L, ℓ, bits, accepted, uplink rate
    uplink_bps: float = 0.0  # the cloud's latest measurement (0: none yet)
    protocol_state: Any = None  # a protocol's own state across rounds (qs: wire, threshold, policy)
    prefill_chunks: int = 0
    pd_steps: int = 0
    pd_hits: int = 0
    interruptions: int = 0  # link drops survived (edge_runtime.generation.resume)
    degraded: List[int] = field(default_factory=list)  # indices of tokens the device made alone while the link was down
    rng: np.random.Generator = field(init=False)  # the device's stream: draft sampling, local sampling
    uncertainty_rng: np.random.Generator = field(init=False)  # temperature perturbation (its own stream)
    skip_rng: np.random.Generator = field(init=False)  # randhlm's coin

    def __post_init__(self) -> None:
        self.rng = session_rng(self.seed, "device")
        self.uncertainty_rng = session_rng(self.seed, "uncertainty")
        self.skip_rng = session_rng(self.seed, "skip")

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.generated)

    @property
    def done(self) -> bool:
        return bool(self.finish_reason)

    def commit(self, tokens: List[int], n_accepted_drafts: int = 0) -> List[int]:
        """Commit tokens (truncated at EOS or the length limit); returns what was committed. Nothing is committed once
        the request has finished (EOS, length, or should_stop mid-round)."""
        if self.finish_reason:
            return []
        out: List[int] = []
        for t in tokens[: self.remaining]:
            out.append(t)
            if t in self.eos_ids:
                self.finish_reason = "eos"
                break
        self.drafter.commit(out, min(n_accepted_drafts, len(out)))
        self.generated.extend(out)
        if not self.finish_reason and self.remaining <= 0:
            self.finish_reason = "length"
        if out:
            if self.first_token_at is None:
                self.first_token_at = time.perf_counter()
            self.on_tokens(out)
        if not self.finish_reason:
            self.finish_reason = self.should_stop()
        return out

    def request(self, msg: P.Message) -> P.Message:
        self.step += 1
        before = self.client.counters.up_bytes
        reply = self.client.request(msg)
        self.round_up_bytes.append(self.client.counters.up_bytes - before)
        return reply


# -- protocols -------------------------------------------------------------------------------------------------------
def send_verify(gen: Generation, drafts: List[int], payload: P.DistPayload, new_tokens: List[int] = ()) -> P.Verdict:
    """Send drafts with their distributions (after `new_tokens` the cloud has not seen); commit the verdict."""
    n = len(drafts)
    msg = P.Verify(
        session_id=gen.session_id,
        step=gen.step + 1,
        position=gen.cloud_position,
        new_tokens=np.asarray(new_tokens, np.int32),
        draft=np.asarray(drafts, np.int32),
        dist=payload,
        idle_s=max(0.0, time.perf_counter() - gen.client.last_reply_at),
    )
    verdict = gen.request(msg)
    if not isinstance(verdict, P.Verdict) or verdict.n_accepted > n:
        raise RuntimeError(f"unexpected answer to Verify: {verdict!r}")
    gen.rounds += 1
    gen.drafted += n
    gen.accepted += verdict.n_accepted
    gen.rejected += verdict.n_accepted < n
    gen.cloud_compute_s += verdict.compute_s
    gen.cloud_position = verdict.position
    if verdict.uplink_bps > 0:
        gen.uplink_bps = verdict.uplink_bps
    gen.commit(drafts[: verdict.n_accepted] + [verdict.token], verdict.n_accepted)
    return verdict


def _verify_round(gen: Generation, draft_len: int, dist_format: str, stop_below: float = 0.0) -> None:
    """Draft up to `draft_len` tokens, send them with their distributions, commit the cloud's verdict."""
    wire = dist_codec.FloatWire(gen.drafter.wire_dtype, dist_format)
    drafts, rows = gen.drafter.draft(cap_draft_len(gen, draft_len), gen.rng, stop_below, wire)
    send_verify(gen, drafts, wire.pack(rows))


def cap_draft_len(gen: Generation, draft_len: int) -> int:
    """At most the cloud's limit (stated in its Welcome), and no draft past the last token the request needs."""
    return max(1, min(draft_len, gen.client.welcome.max_draft_len, gen.remaining - 1))


def round_sd(gen: Generation) -> None:
    _verify_round(gen, gen.config.draft_len, gen.config.dist_format, gen.config.draft_stop_prob)


def round_hlm(gen: Generation) -> None:
    """U-HLM §II baseline: one draft token and its full (dense) distribution every round."""
    _verify_round(gen, 1, "dense")


def round_llm(gen: Generation) -> None:
    """Cloud only: the target decodes a chunk of tokens on its own."""
    reply = gen.request(
        P.Generate(gen.session_id, gen.step + 1, gen.cloud_position, np.zeros(0, np.int32),
                   min(gen.config.llm_chunk, gen.remaining))
    )
    if not isinstance(reply, P.Generated):
        raise RuntimeError(f"unexpected answer to Generate: {reply!r}")
    gen.rounds += 1
    gen.cloud_compute_s += reply.compute_s
    gen.cloud_position = reply.position
    gen.commit([int(t) for t in reply.tokens])


def round_slm(gen: Generation) -> None:
    """Device only: the draft model generates on its own, nothing crosses the link."""
    gen.rounds += 1
    gen.commit([gen.drafter.sample_local(gen.rng)])


def _close(gen: Generation, prompt: List[int]) -> None:
    """Close the session, handing over tokens the cloud has not seen (skipped ones); check both sequences agree."""
    pending = list(gen.pending)
    mine = list(prompt) + gen.generated
    msg = P.CloseSession(gen.session_id, gen.cloud_position if pending else None,
                         np.asarray(pending, np.int32) if pending else None, len(mine))
    closed = gen.client.request(msg)
    if not isinstance(closed, P.Closed):
        raise RuntimeError(f"unexpected answer to CloseSession: {closed!r}")
    if closed.n_tokens < len(mine) or closed.digest != P.sequence_digest(mine):
        raise RuntimeError(f"device and cloud sequences diverged: device {len(mine)} tokens, cloud {closed.n_tokens}")


def run(gen: Generation, prompt: List[int], decode_text: Callable[[List[int]], str]) -> GenerationResult:
    """Run one request to completion with gen.protocol's round function."""
    from edge_runtime.protocols import CLOSERS, LOCAL_PROTOCOLS, OPENERS, ROUNDS

    if gen.protocol not in ROUNDS:
        raise ValueError(f"unknown protocol {gen.protocol!r}; known: {sorted(ROUNDS)}")
    if gen.max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    if not prompt:
        raise ValueError("the prompt is empty")
    round_fn = ROUNDS[gen.protocol]
    remote = gen.protocol not in LOCAL_PROTOCOLS
    cloud_prefill_s = 0.0
    before = gen.client.counters.snapshot() if remote else LinkCounters()
    t0 = time.perf_counter()

    def open_session() -> None:
        nonlocal cloud_prefill_s
        if gen.protocol in OPENERS:  # split protocols: their own session and chunked prefill (edge_runtime.hat)
            OPENERS[gen.protocol](gen, prompt)
            cloud_prefill_s = gen.cloud_compute_s
        else:
            cloud_prefill_s = _open_tokens(gen, prompt, remote)

    # a drop while the prompt is on the link is resumed like one mid-answer; False: the request ended while the link
    # was down (degrade), nothing to close in the cloud
    linked = _resuming(gen, prompt, open_session)
    device_prefill_s = gen.drafter.compute_s
    while not gen.done:
        linked = _resuming(gen, prompt, lambda: round_fn(gen))
    t1 = time.perf_counter()
    if remote and linked:
        try:
            CLOSERS.get(gen.protocol, _close)(gen, prompt)
        except (LinkDown, CloudError) as exc:  # the answer is complete: a cloud that cannot close frees it later
            if not recoverable(exc):
                raise
            log.warning("session %d was not closed (%s): the cloud frees it after its timeout", gen.session_id, exc)
    link = gen.client.counters.since(before) if remote else LinkCounters()
    return GenerationResult(
        protocol=gen.protocol,
        prompt_tokens=len(prompt),
        tokens=list(gen.generated),
        text=decode_text(gen.generated),
        total_s=t1 - t0,
        ttft_s=(gen.first_token_at or t1) - t0,
        rounds=gen.rounds,
        drafted=gen.drafted,
        accepted=gen.accepted,
        rejected=gen.rejected,
        up_bytes=link.up_bytes,
        down_bytes=link.down_bytes,
        round_trips=link.round_trips,
        cloud_compute_s=gen.cloud_compute_s,
        device_compute_s=gen.drafter.compute_s,
        finish_reason=gen.finish_reason,
        skipped=gen.skipped,
        upload_ks=list(gen.upload_ks),
        round_up_bytes=list(gen.round_up_bytes),
        device_prefill_s=device_prefill_s,
        cloud_prefill_s=cloud_prefill_s,
        skip_log=[list(x) for x in gen.skip_log],
        round_log=list(gen.round_log),
        prefill_chunks=gen.prefill_chunks,
        pd_steps=gen.pd_steps,
        pd_hits=gen.pd_hits,
        interruptions=gen.interruptions,
        degraded=list(gen.degraded),
    )


def recoverable(exc: Exception) -> bool:
    """A dropped link, or a cloud that no longer holds the session (it expired there, or the cloud restarted)."""
    return isinstance(exc, LinkDown) or isinstance(exc, CloudError) and exc.error.code == "no_session"


def _resuming(gen: Generation, prompt: List[int], step: Callable[[], None]) -> bool:
    """Run one step of the request; if it fails recoverably, resume. Whether the cloud holds the session after."""
    try:
        step()
        return True
    except (LinkDown, CloudError) as exc:
        if not recoverable(exc):
            raise
        return resume(gen, prompt, exc)


def resume(gen: Generation, prompt: List[int], exc: Exception) -> bool:
    """The link dropped mid-answer, or the cloud forgot the session: reconnect with backoff and reopen the session
    from the device's own history, so nothing is lost or repeated. `wait` pauses meanwhile; `degrade` keeps
    generating with the device's model (those tokens are marked in `degraded`). Returns False when the answer
    finished before the cloud came back (degrade).

    Token protocols reopen with the committed tokens (OpenSession); the split protocols replay the history's shallow
    states, recomputed on the device (edge_runtime.hat.reopen_split). A device that cannot generate alone (U-shape:
    no draft) waits under either policy. The `fail` policy re-raises."""
    from edge_runtime.protocols import REOPENERS

    policy = gen.config.link_policy
    if policy == "fail":
        raise exc
    gen.interruptions += 1
    gen.drafter.rollback()  # drafts of the lost round; caches back to the committed sequence
    alone = policy == "degrade" and gen.drafter.can_generate_alone
    reopen = REOPENERS.get(gen.protocol, _reopen)
    deadline = time.monotonic() + gen.config.reconnect_timeout_s
    for delay in reconnect_delays(gen.config.backoff_s):
        try:
            gen.client.connect()
            reopen(gen, prompt)
            return True
        except CloudUnavailable as err:
            if time.monotonic() > deadline:
                raise CloudUnavailable(f"the link stayed down for {gen.config.reconnect_timeout_s:.0f} s: {err}") \
                    from None
        if alone:
            t_end = time.monotonic() + delay
            while not gen.done and time.monotonic() < t_end:
                gen.degraded.append(len(gen.generated))
                gen.commit([gen.drafter.sample_local(gen.rng)])
            if gen.done:
                return False
        else:
            time.sleep(delay)


def _reopen(gen: Generation, prompt: List[int]) -> None:
    """A new session holding the whole committed sequence (prompt + generated, degraded tokens included)."""
    history = list(prompt) + gen.generated
    sampling = P.Sampling(gen.params.temperature, gen.params.top_k, gen.params.top_p)
    monitor = gen.client.monitor
    opened = gen.client.request(P.OpenSession(gen.session_id, gen.protocol, np.asarray(history, np.int32), sampling,
                                              gen.seed, gen.client.base_rtt_s,
                                              monitor.state() if monitor else P.DeviceState()))
    if not isinstance(opened, P.SessionOpened):
        raise RuntimeError(f"unexpected answer to OpenSession: {opened!r}")
    gen.cloud_position = opened.position
    gen.pending = []
    gen.step = 0  # the new session counts its requests from 1


def _open_tokens(gen: Generation, prompt: List[int], remote: bool) -> float:
    """Token protocols: the prompt goes to the cloud in OpenSession; the device prefills its draft meanwhile (or
    after, on a shared host). Returns the cloud's prefill compute seconds. If the link drops on the way (a re-Hello
    in send, or the reply), the draft is still started on this prompt: resuming may generate with it."""
    overlap = not remote or gen.config.overlaps_prefill
    started = False
    try:
        if remote:
            sampling = P.Sampling(gen.params.temperature, gen.params.top_k, gen.params.top_p)
            monitor = gen.client.monitor
            gen.client.send(P.OpenSession(gen.session_id, gen.protocol, np.asarray(prompt, np.int32), sampling,
                                          gen.seed, gen.client.base_rtt_s,
                                          monitor.state() if monitor else P.DeviceState()))
        if overlap:
            gen.drafter.start(prompt)  # the device's prefill runs while the cloud's does
            started = True
        if not remote:
            return 0.0
        opened = gen.client.receive()
    except (LinkDown, CloudError):
        if not started:
            gen.drafter.start(prompt)
        raise
    if not isinstance(opened, P.SessionOpened):
        raise RuntimeError(f"unexpected answer to OpenSession: {opened!r}")
    gen.cloud_position = opened.position
    gen.cloud_compute_s += opened.compute_s
    if not overlap:
        gen.drafter.start(prompt)  # same host: two concurrent prefills would oversubscribe the cores
    return opened.compute_s
