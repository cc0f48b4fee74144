"""Quantize-and-sample protocols: `qs` (QS-SD), `ksqs` and `csqs` (SQS-SD), and `sq`, the lossy sample-then-quantize
baseline.

A round: the policy picks (L, ℓ) from the state (edge_runtime.policy.policies), the drafter drafts up to L tokens — or, with a
bit budget B, the longest draft whose rows fit in B bits (SQS §4) — each from its lattice-quantized distribution
(hat_split.wire.sqs.LatticeWire), the rows go to the cloud as one enumerative bit stream ("lattice" payload), and the
verdict commits the accepted drafts plus the cloud's token. `csqs` then rolls its threshold back to the accepted
prefix (SQS Algorithm 1). The state of the request (wire, threshold, policy, confidences) lives in
`gen.protocol_state`; every round is logged in `gen.round_log` (L, ℓ, bits, accepted, the rate the cloud measured).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from edge_runtime.generation import Generation, cap_draft_len, send_verify
from edge_runtime.policy.policies import DEFAULT_RATE_BPS, RoundState, StaticPolicy, make_policy
from hat_split.wire.sqs import ConformalThreshold, LatticeWire

SUPPORT_OF = {"qs": "full", "ksqs": "topk", "csqs": "conformal", "sq": "full"}


@dataclass
class QSState:
    wire: LatticeWire
    policy: StaticPolicy
    state: RoundState = field(default_factory=RoundState)
    confidences: list = field(default_factory=list)  # draft probability of every accepted draft so far


def _state(gen: Generation) -> QSState:
    if gen.protocol_state is None:
        cfg = gen.config.qs
        conformal = ConformalThreshold(cfg.alpha, cfg.eta, cfg.beta) if gen.protocol == "csqs" else None
        wire = LatticeWire(gen.drafter.lm.vocab_size, cfg.ell, SUPPORT_OF[gen.protocol], cfg.k, conformal,
                           sample_first=gen.protocol == "sq")
        policy = make_policy(cfg.policy, gen.config.draft_len, cfg.ell, gen.client.welcome.max_draft_len,
                             cfg.policy_file)
        gen.protocol_state = QSState(wire, policy, RoundState(uplink_bps=DEFAULT_RATE_BPS))
    return gen.protocol_state


def round_qs(gen: Generation) -> None:
    st = _state(gen)
    draft_len, ell = st.policy.act(st.state)
    st.wire.ell = ell
    drafts, rows = gen.drafter.draft(cap_draft_len(gen, draft_len), gen.rng, 0.0, st.wire, gen.config.qs.budget_bits)
    bits = [st.wire.bits(r) for r in rows]
    payload = st.wire.pack(rows)
    confidence = [float(q[t]) for q, t in zip(gen.drafter.last_q, drafts)]  # what the draft gave its own tokens
    verdict = send_verify(gen, drafts, payload)
    n = verdict.n_accepted
    st.wire.settle(n, len(drafts))
    st.policy.observe(len(drafts), n)
    st.confidences.extend(confidence[:n])
    st.state = RoundState(float(np.mean(st.confidences)) if st.confidences else st.state.mean_confidence,
                          float(np.mean(confidence)), n / len(drafts),
                          gen.uplink_bps or st.state.uplink_bps)
    gen.round_log.append({"L": len(drafts), "ell": ell, "k": [int(r.k) for r in rows], "bits": bits,
                          "payload_bits": int(payload.bits), "accepted": n, "uplink_bps": verdict.uplink_bps,
                          "beta": st.wire.conformal.beta if st.wire.conformal else None,
                          "dropped": [float(r.dropped) for r in rows]})
