"""Uncertainty-aware protocols: `uhlm` (U-HLM), `randhlm` (its random-skip baseline) and `cuhlm` (CU-HLM).

One round = one device token. The device drafts it exactly as `hlm` does (same draws from the device stream, so a
never-skipping `uhlm` reproduces `hlm` token for token), measures its uncertainty u by temperature perturbation on a
separate stream (hat_split.math.uncertainty), and either
- skips: commits the draft token locally; it joins `gen.pending`, which the next upload (or the session close)
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

import numpy as np

from edge_runtime.generation import Generation, send_verify
from hat_split.wire import dist_codec
from hat_split.math import topk_codec
from hat_split.math.sampling import sample
from hat_split.math.uncertainty import perturbation_uncertainty
from hat_split.math.vocab_size_policy import online_k


def _draft_one(gen: Generation, measure: bool = True) -> tuple[int, np.ndarray, float]:
    """The next draft token, its wire values `# [1, vocab]` and its uncertainty u (NaN when not measured)."""
    drafts, rows = gen.drafter.draft(1, gen.rng)
    values = rows[0]  # [1, vocab] float16 wire values
    if not measure:
        return drafts[0], values, float("nan")
    u = perturbation_uncertainty(gen.drafter.last_logits, np.asarray(drafts), gen.config.uncertainty.perturbation,
                                 gen.uncertainty_rng)
    return drafts[0], values, float(u[0])


def _skip(gen: Generation, token: int) -> None:
    """Commit the draft token locally; log its draft probability (for the true skip rate of benchmarks)."""
    gen.skipped += 1
    gen.skip_log.append([len(gen.generated), float(gen.drafter.last_q[0][token])])
    gen.pending.extend(gen.commit([token], 1))


def _upload(gen: Generation, token: int, payload) -> None:
    pending, gen.pending = gen.pending, []
    send_verify(gen, [token], payload, pending)


def round_uhlm(gen: Generation) -> None:
    token, values, u = _draft_one(gen)
    if u <= gen.config.uncertainty.u_threshold:
        _skip(gen, token)
    else:
        _upload(gen, token, dist_codec.pack(values, "dense"))


def round_randhlm(gen: Generation) -> None:
    token, values, _ = _draft_one(gen, measure=False)  # u has its own stream: not drawing it changes no token
    if gen.skip_rng.random() < gen.config.uncertainty.random_skip_prob:
        _skip(gen, token)
    else:
        _upload(gen, token, dist_codec.pack(values, "dense"))


def round_cuhlm(gen: Generation) -> None:
    cfg = gen.config.uncertainty
    token, values, u = _draft_one(gen)
    if u <= cfg.u_threshold:
        _skip(gen, token)
        return
    x = gen.drafter.last_q[0]  # [vocab] what the device sampled from
    vocab = x.size
    if cfg.k_mode == "offline":
        k = min(cfg.k_offline, vocab)
    else:
        beta_hat = float(np.clip(cfg.beta_a * u + cfg.beta_b, 0.0, 1.0))
        k = online_k(x, float(x[token]), beta_hat, cfg.k_theta, cfg.softplus_eta, min(cfg.k_max, vocab))
    row = topk_codec.select(x, k, token, cfg.prob_bits)
    if cfg.exact:  # sample the uploaded token from exactly what the cloud will reconstruct
        x_hat = topk_codec.reconstruct(row, vocab)
        token = int(sample(x_hat[None], gen.rng.random(1))[0])
    gen.upload_ks.append(int(row.indices.size))
    _upload(gen, token, dist_codec.pack_topk([row], vocab))
