"""Uncertainty-aware protocols: `uhlm` (U-HLM), `randhlm` (its random-skip baseline) and `cuhlm` (CU-HLM).

One round = one device token. The device drafts it exactly as `hlm` does (same draws from the device stream, so a
never-skipping `uhlm` reproduces `hlm` token for token), measures its uncertainty u by temperature perturbation on a
separate stream (hat_split.math.uncertainty), and either
- skips: commits the draft token locally; it joins the session's `pending`, which the next upload (or the session close)
  carries as `new_tokens`, so the cloud's sequence and KV cache catch up and never diverge; or
- uploads: sends the token with its distribution — dense float16 (`uhlm`, `randhlm`: U-HLM transmits the full
  vocabulary distribution) or the top-k(t) of CU-HLM as packed bits (`cuhlm`) — and commits the cloud's verdict.

`cuhlm` picks k per upload: fixed (offline k*, eq. 21) or online (eq. 23-24) from the draft probability and the
rejection probability estimated by the calibrated line β = a·u + b. The paper's variant keeps the draft token it
sampled from the full distribution and forces it into the top-k; the cloud verifies against the reconstruction x̂
(eq. 15), which biases resampling slightly. `exact` samples the uploaded token from x̂ itself (the token used for u
and k is drawn first, from the full distribution), so every verification is unbiased.
"""
from __future__ import annotations

import math

import numpy as np

from edge_runtime.sessions.token import TokenSession
from hat_split.wire import dist_codec
from hat_split.math import topk_codec
from hat_split.math.sampling import sample
from hat_split.math.uncertainty import perturbation_uncertainty
from hat_split.math.vocab_size_policy import online_k


def _draft_one(session: TokenSession, measure: bool = True) -> tuple[int, np.ndarray, float]:
    """The next draft token, its wire values `# [1, vocab]` and its uncertainty u (NaN when not measured)."""
    drafts, rows = session.drafter.draft(1, session.rng)
    values = rows[0]  # [1, vocab] float16 wire values
    if not measure:
        return drafts[0], values, float("nan")
    u = perturbation_uncertainty(session.drafter.last_logits, np.asarray(drafts),
                                 session.config.uncertainty.perturbation, session.uncertainty_rng)
    return drafts[0], values, float(u[0])


def _skip(session: TokenSession, token: int) -> None:
    """Commit the draft token locally; log its draft probability (for the true skip rate of benchmarks)."""
    session.counters.skipped += 1
    session.counters.skip_log.append([len(session.generated), float(session.drafter.last_q[0][token])])
    session.pending.extend(session.commit([token], 1, session.token_logprobs(session.drafter.last_logits[:1], [token],
                                                                             "draft")))


def _upload(session: TokenSession, token: int, payload, u: float = float("nan")) -> None:
    """Send the token (after the pending skips); with the uncertainty u it was measured at, its verdict teaches the
    session's skip policy (a refitting one)."""
    pending, session.pending = session.pending, []
    verdict = session.verify([token], payload, pending)
    if not math.isnan(u):  # measured
        session.skip_policy.observe(u, verdict.n_accepted == 0)
        session.counters.skip_policy = session.skip_policy.state()


def _skips(session: TokenSession, u: float) -> bool:
    """The skip policy's decision (hat_split.math.skip_budget); a would-be skip it uploads to refit its line is
    counted as explored."""
    policy = session.skip_policy
    decision = policy.decide(u, session.skip_rng.random())
    session.counters.explored += decision == "explore"
    session.counters.skip_policy = policy.state()
    return decision == "skip"


def round_uhlm(session: TokenSession) -> None:
    token, values, u = _draft_one(session)
    if _skips(session, u):
        _skip(session, token)
    else:
        _upload(session, token, dist_codec.pack(values, "dense"), u)


def round_randhlm(session: TokenSession) -> None:
    token, values, _ = _draft_one(session, measure=False)  # u has its own stream: not drawing it changes no token
    if session.skip_rng.random() < session.config.uncertainty.random_skip_prob:
        _skip(session, token)
    else:
        _upload(session, token, dist_codec.pack(values, "dense"))


def round_cuhlm(session: TokenSession) -> None:
    cfg = session.config.uncertainty
    token, values, u = _draft_one(session)
    if _skips(session, u):
        _skip(session, token)
        return
    x = session.drafter.last_q[0]  # [vocab] what the device sampled from
    vocab = x.size
    if cfg.k_mode == "offline":
        k = min(cfg.k_offline, vocab)
    else:
        beta_hat = float(np.clip(cfg.beta_a * u + cfg.beta_b, 0.0, 1.0))
        k = online_k(x, float(x[token]), beta_hat, cfg.k_theta, cfg.softplus_eta, min(cfg.k_max, vocab))
    row = topk_codec.select(x, k, token, cfg.prob_bits)
    if cfg.exact:  # sample the uploaded token from exactly what the cloud will reconstruct
        x_hat = topk_codec.reconstruct(row, vocab)
        token = int(sample(x_hat[None], session.rng.random(1))[0])
    session.counters.upload_ks.append(int(row.indices.size))
    _upload(session, token, dist_codec.pack_topk([row], vocab), u)
