"""Quantize-and-sample protocols: `qs` (QS-SD), `ksqs` and `csqs` (SQS-SD), and `sq`, the lossy sample-then-quantize
baseline.

A round over a TokenSession: the policy picks (L, ℓ) from the state (edge_runtime.policy.policies), the drafter
drafts up to L tokens — or, with a bit budget B, the longest draft whose rows fit in B bits (SQS §4) — each from its
lattice-quantized distribution (hat_split.wire.sqs.LatticeWire), the rows go to the cloud as one enumerative bit
stream ("lattice" payload), and the verdict commits the accepted drafts plus the cloud's token. `csqs` then rolls its
threshold back to the accepted prefix (SQS Algorithm 1). Each protocol's support rule and sampling order are its
record's in hat_split.protocols. The state of the request (wire, threshold, policy, confidences) lives in the session's
`round_state`; every round is logged in its `counters.round_log` (the policy's
state features, L, ℓ, bits, accepted, the rate the cloud measured).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from edge_runtime.policy.policies import (
    DEFAULT_RATE_BPS,
    RoundState,
    StaticPolicy,
    make_policy,
)
from edge_runtime.sessions.token import TokenSession
from hat_split import protocols
from hat_split.wire.sqs import ConformalThreshold, LatticeWire


@dataclass
class QSState:
    wire: LatticeWire
    policy: StaticPolicy
    state: RoundState = field(default_factory=RoundState)
    confidences: list = field(default_factory=list)  # draft probability of every accepted draft so far


def _state(session: TokenSession, name: str) -> QSState:
    """The request's QS state for protocol `name` (its record's support rule and sampling order), made at its first
    round."""
    if session.round_state is None:
        cfg = session.config.qs
        record = protocols.get(name)  # its support rule and sampling order
        conformal = ConformalThreshold(cfg.alpha, cfg.eta, cfg.beta) if record.support == "conformal" else None
        wire = LatticeWire(session.drafter.lm.vocab_size, cfg.ell, record.support, cfg.k, conformal,
                           sample_first=record.sample_first)
        policy = make_policy(cfg.policy, session.config.draft_len, cfg.ell, session.client.welcome.max_draft_len,
                             cfg.policy_file)
        session.round_state = QSState(wire, policy, RoundState(uplink_bps=DEFAULT_RATE_BPS))
    return session.round_state


def round_qs(session: TokenSession) -> None:
    """One round of the session's own protocol (qs, ksqs, csqs, sq), its (L, ℓ) the policy's."""
    qs_round(session, session.name)


def qs_round(session: TokenSession, name: str, draft_len: int = 0) -> None:
    """One round of protocol `name` over `session`: L drafts (`draft_len`, or the policy's when 0; protocol auto
    chooses its own) at the policy's ℓ, their lattice rows as one bit stream, the verdict committed."""
    st = _state(session, name)
    seen = st.state  # what the policy acts on this round, logged beside what it chose
    chosen, ell = st.policy.act(seen)
    draft_len = draft_len or chosen
    st.wire.ell = ell
    drafts, rows = session.drafter.draft(session.cap_draft_len(draft_len), session.rng, 0.0, st.wire,
                                         session.config.qs.budget_bits)
    bits = [st.wire.bits(r) for r in rows]
    payload = st.wire.pack(rows)
    confidence = [float(q[t]) for q, t in zip(session.drafter.last_q, drafts)]  # what the draft gave its own tokens
    verdict = session.verify(drafts, payload)
    n = verdict.n_accepted
    st.wire.settle(n, len(drafts))
    st.policy.observe(len(drafts), n)
    st.confidences.extend(confidence[:n])
    st.state = RoundState(float(np.mean(st.confidences)) if st.confidences else st.state.mean_confidence,
                          float(np.mean(confidence)), n / len(drafts),
                          session.uplink_bps or st.state.uplink_bps)
    session.counters.round_log.append({
        "L": len(drafts), "ell": ell, "k": [int(r.k) for r in rows], "bits": bits, "payload_bits": int(payload.bits),
        "accepted": n, "uplink_bps": verdict.uplink_bps, "beta": st.wire.conformal.beta if st.wire.conformal else None,
        "dropped": [float(r.dropped) for r in rows], "state": [float(x) for x in seen.features()]})
