"""The token family's session: the prompt goes up in OpenSession, rounds send token ids (and draft distributions) in
Verify or ask for tokens with Generate, and CloseSession compares both sides' sequences by digest.

The cloud's session holds `cloud_position` committed tokens; tokens committed on the device without an upload (the
skips of uhlm, randhlm, cuhlm) wait in `pending` until the next upload or the close carries them.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, List, Optional, Sequence

import numpy as np

from edge_runtime.client import CloudError, LinkDown, expect
from edge_runtime.monitor import DeviceMonitor
from edge_runtime.sessions.base import Session
from hat_split.math.logprobs import Logprobs
from hat_split.math.skip_budget import SkipPolicy
from hat_split.wire import messages as P

log = logging.getLogger("hatspec.edge")


class TokenSession(Session):
    def __init__(self, *args, monitor: Optional[DeviceMonitor] = None, skip_policy: Optional[SkipPolicy] = None,
                 **kwargs):
        """Session's arguments; monitor: the device's state sent with every session opening (None: an empty one);
        skip_policy: uhlm / cuhlm's skip decision kept across requests (None: a new one from the config)."""
        super().__init__(*args, **kwargs)
        self.monitor = monitor
        self.skip_policy = skip_policy if skip_policy is not None else self.config.uncertainty.skip_policy()
        self.skip_policy.begin(self.max_new_tokens)  # this answer's budget and threshold
        self.step = 0  # requests of this cloud session (Verify / Generate carry step + 1)
        self.cloud_position = 0  # committed tokens the cloud holds
        self.pending: List[int] = []  # committed here, not yet sent to the cloud (skipped uploads)
        self.uplink_bps = 0.0  # the cloud's latest measurement of this device's uploads (0: none yet)
        self.cloud_cost: Optional[P.CloudCost] = None  # the cloud's step costs as its last SessionOpened stated
        self.drawn_probs = False  # Generate asks for each token's probability as the target drew it (auto, T > 0)

    def _open_message(self, tokens: Sequence[int]) -> P.OpenSession:
        sampling = P.Sampling(self.params.temperature, self.params.top_k, self.params.top_p)
        return P.OpenSession(self.session_id, self.name, np.asarray(tokens, np.int32), sampling, self.seed,
                             self.client.base_rtt_s, self.monitor.state() if self.monitor else P.DeviceState(),
                             self.logprobs_k)

    def open(self, prompt: List[int]) -> None:
        """The prompt goes to the cloud in OpenSession; the device prefills its draft meanwhile (or after, on a shared
        host). If the link drops on the way (a re-Hello in send, or the reply), the draft is still started on this
        prompt: resuming may generate with it."""
        overlap = self.config.overlaps_prefill
        # `llm` drafts nothing: the draft reads the prompt only if the link drops and the device generates alone
        prefill = self.protocol.round != "llm"
        started = False
        try:
            self.client.send(self._open_message(prompt))
            if overlap:
                self.drafter.start(prompt, prefill)  # the device's prefill runs while the cloud's does
                started = True
                self.while_waiting()
            opened = expect(self.client.receive(), P.SessionOpened, P.OpenSession)
        except (LinkDown, CloudError):
            if not started:
                self.drafter.start(prompt, prefill)
            raise
        self.cloud_position = opened.position
        self.cloud_cost = opened.cost
        self.counters.cloud_compute_s += opened.compute_s
        if not overlap:
            self.drafter.start(prompt, prefill)  # same host: two concurrent prefills would oversubscribe the cores

    def reopen(self, prompt: List[int]) -> None:
        """A new session holding the whole committed sequence (prompt + generated, degraded tokens included)."""
        opened = expect(self.client.request(self._open_message(list(prompt) + self.generated)), P.SessionOpened,
                        P.OpenSession)
        self.cloud_position = opened.position
        self.cloud_cost = opened.cost
        self.pending = []
        self.step = 0  # the new session counts its requests from 1

    def close(self, prompt: List[int]) -> None:
        """Close the session, handing over tokens the cloud has not seen (skipped ones); check both sequences agree."""
        pending = list(self.pending)
        mine = list(prompt) + self.generated
        msg = P.CloseSession(self.session_id, self.cloud_position if pending else None,
                             np.asarray(pending, np.int32) if pending else None, len(mine))
        closed = expect(self.client.request(msg), P.Closed, P.CloseSession)
        if closed.n_tokens < len(mine) or closed.digest != P.sequence_digest(mine):
            raise RuntimeError(f"device and cloud sequences diverged: device {len(mine)} tokens, cloud "
                               f"{closed.n_tokens}")

    def while_waiting(self) -> None:
        """Work the device does while it waits for a reply it drafted nothing for (the opening, llm's rounds):
        none here (protocol auto's session has its draft model read the tokens it lacks)."""

    # -- what rounds use -----------------------------------------------------------------------------------------
    def request(self, msg: P.Message, meanwhile: Optional[Callable[[], None]] = None) -> P.Message:
        """One round's request and its reply (meanwhile: run between the two); the request frame's bytes are logged
        for the channel models."""
        self.step += 1
        before = self.client.counters.up_bytes
        self.client.send(msg)
        if meanwhile is not None:
            meanwhile()
        reply = self.client.receive()
        self.counters.round_up_bytes.append(self.client.counters.up_bytes - before)
        return reply

    def cap_draft_len(self, draft_len: int) -> int:
        """At most the cloud's limit (stated in its Welcome), and no draft past the last token the request needs."""
        return max(1, min(draft_len, self.client.welcome.max_draft_len, self.remaining - 1))

    def verify(self, drafts: List[int], payload: P.DistPayload, new_tokens: Sequence[int] = ()) -> P.Verdict:
        """Send drafts with their distributions (after `new_tokens` the cloud has not seen); commit the verdict."""
        n = len(drafts)
        msg = P.Verify(
            session_id=self.session_id,
            step=self.step + 1,
            position=self.cloud_position,
            new_tokens=np.asarray(new_tokens, np.int32),
            draft=np.asarray(drafts, np.int32),
            dist=payload,
            idle_s=max(0.0, time.perf_counter() - self.client.last_reply_at),
        )
        verdict = expect(self.request(msg), P.Verdict, P.Verify)
        if verdict.n_accepted > n:
            raise RuntimeError(f"the cloud accepted {verdict.n_accepted} of {n} drafts")
        c = self.counters
        c.rounds += 1
        c.drafted += n
        c.accepted += verdict.n_accepted
        c.rejected += verdict.n_accepted < n
        c.cloud_compute_s += verdict.compute_s
        self.cloud_position = verdict.position
        if verdict.uplink_bps > 0:
            self.uplink_bps = verdict.uplink_bps
        self.commit(drafts[: verdict.n_accepted] + [verdict.token], verdict.n_accepted,
                    self._cloud_logprobs(verdict.logprobs, verdict.n_accepted + 1))
        return verdict

    def verify_tree(self, parents: np.ndarray, tokens: np.ndarray, payload: P.DistPayload) -> P.Verdict:
        """Send a draft tree (hat_split.math.tree) with the distributions its children were drawn from; commit the
        accepted path the verdict names and the cloud's token after it (the drafter keeps the path's cache)."""
        n = len(tokens)
        msg = P.Verify(self.session_id, self.step + 1, self.cloud_position, np.zeros(0, np.int32),
                       np.asarray(tokens, np.int32), payload,
                       max(0.0, time.perf_counter() - self.client.last_reply_at), np.asarray(parents, np.int16))
        verdict = expect(self.request(msg), P.Verdict, P.Verify)
        path = [] if verdict.path is None else [int(i) for i in np.asarray(verdict.path).reshape(-1)]
        if len(path) != verdict.n_accepted or any(
                not 0 <= v < n or int(parents[v]) != (path[i - 1] if i else -1) for i, v in enumerate(path)):
            raise RuntimeError(f"the cloud's verdict names no path of the tree sent: {path} "
                               f"({verdict.n_accepted} accepted)")
        c = self.counters
        c.rounds += 1
        c.drafted += n
        c.accepted += len(path)
        c.rejected += not path or bool(np.any(parents == path[-1]))  # the path stopped above a leaf: a rejection
        c.cloud_compute_s += verdict.compute_s
        self.cloud_position = verdict.position
        if verdict.uplink_bps > 0:
            self.uplink_bps = verdict.uplink_bps
        self.drafter.keep_path(path)
        self.commit([int(tokens[v]) for v in path] + [verdict.token], len(path),
                    self._cloud_logprobs(verdict.logprobs, len(path) + 1))
        return verdict

    def generate(self, n: int) -> None:
        """Cloud only: the target decodes up to n tokens on its own; commit them."""
        msg = P.Generate(self.session_id, self.step + 1, self.cloud_position, np.zeros(0, np.int32),
                         min(n, self.remaining), probs=self.drawn_probs)
        reply = expect(self.request(msg, self.while_waiting), P.Generated, P.Generate)
        self.counters.rounds += 1
        self.counters.cloud_compute_s += reply.compute_s
        self.cloud_position = reply.position
        tokens = [int(t) for t in reply.tokens]
        if self.drawn_probs:
            if reply.probs is None:  # an older cloud: asked no more in this request
                log.warning("the cloud sends no probabilities with its tokens (an older cloud?): the draft's "
                            "acceptance is not measured on them")
                self.drawn_probs = False
            self.drafter.note_drawn(checked_probs(reply.probs, len(tokens)))
        self.commit(tokens, logprobs=self._cloud_logprobs(reply.logprobs, len(tokens)))

    def _cloud_logprobs(self, wire: Optional[P.TokenLogprobs], n: int) -> Optional[Logprobs]:
        """The log-probabilities the cloud sent with n committed tokens (checked), when the request asked."""
        if self.logprobs_k is None:
            return None
        if wire is None:
            raise RuntimeError("the cloud sent no log-probabilities although the session asked (an older cloud?)")
        try:
            lp = Logprobs(np.asarray(wire.values, np.float32), np.asarray(wire.top_ids, np.int32),
                          np.asarray(wire.top_values, np.float32))
        except ValueError as exc:
            raise RuntimeError(f"the cloud's log-probabilities are malformed: {exc}") from None
        if len(lp) != n or lp.k != self.logprobs_k:
            raise RuntimeError(f"the cloud sent log-probabilities of {len(lp)} tokens with {lp.k} alternatives; "
                               f"{n} tokens with {self.logprobs_k} were due")
        return lp


def checked_probs(wire, n: int) -> List[float]:
    """The probabilities a Generated reply of n tokens carries (Generate.probs), checked; none from an older cloud or
    a malformed reply (the field named in the log): they only feed an estimate, the tokens stand."""
    if wire is None:
        return []
    probs = np.asarray(wire)
    if probs.shape != (n,) or not np.issubdtype(probs.dtype, np.floating) or not ((probs > 0) & (probs <= 1)).all():
        log.warning("Generated.probs refused: %d values in (0, 1] were due, got shape %s dtype %s", n, probs.shape,
                    probs.dtype)
        return []
    return probs.tolist()
