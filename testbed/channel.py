"""A block-fading wireless uplink (CU-HLM §II-B/C): Rayleigh or Rician gains, Shannon-rate uplink time, token
throughput.

Pure numpy. The channel gain |h|² (mean 1) stays constant within one round and is drawn afresh per round. An upload of
B bits in round t takes τ(t) = B / (W log2(1 + SNR·|h(t)|²)) seconds (eq. 5); a round costs τ_SLM on the device,
plus τ(t) + τ_LLM when it uploads (eq. 6). Throughput over a sequence is given two ways: tokens / total expected
latency (what a wall clock sees; under Rayleigh fading E[1/rate] grows without bound as the draws reach deeper fades,
so it is a Monte Carlo mean over a fixed number of draws) and the papers' mean of the per-round throughput (each
round's tokens / its latency), which assumes one token per round.

`mean_rate` gives the ergodic rate E[W log2(1 + SNR·|h|²)] that the link emulator can impose, so the simulated and the
really transported runs can be set side by side at the same average SNR.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

FADINGS = ("rayleigh", "rician", "none")


@dataclass(frozen=True)
class Channel:
    fading: str = "rayleigh"
    snr_db: float = 10.0  # average SNR
    bandwidth_hz: float = 10e6  # W (CU-HLM: 10 MHz)
    k_factor_db: float = 10.0  # Rician K (CU-HLM: 10 dB); unused otherwise

    def __post_init__(self) -> None:
        if self.fading not in FADINGS:
            raise ValueError(f"fading must be one of {', '.join(FADINGS)}, got {self.fading!r}")
        if not self.bandwidth_hz > 0 or not math.isfinite(self.snr_db) or not math.isfinite(self.k_factor_db):
            raise ValueError("bandwidth must be > 0 Hz; SNR and K must be finite dB values")

    @property
    def snr(self) -> float:
        return 10.0 ** (self.snr_db / 10.0)

    def gains(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """n block gains |h|² `# [n]`, E|h|² = 1."""
        if self.fading == "none":
            return np.ones(n)
        scatter = (rng.standard_normal(n) + 1j * rng.standard_normal(n)) / math.sqrt(2.0)  # CN(0, 1)
        if self.fading == "rayleigh":
            return np.abs(scatter) ** 2
        k = 10.0 ** (self.k_factor_db / 10.0)
        return np.abs(math.sqrt(k / (k + 1.0)) + math.sqrt(1.0 / (k + 1.0)) * scatter) ** 2

    def rates(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """Shannon rates of n blocks in bits/s `# [n]`."""
        return self.bandwidth_hz * np.log2(1.0 + self.snr * self.gains(n, rng))

    def mean_rate(self, n: int = 200_000, seed: int = 0) -> float:
        """Ergodic rate in bits/s (Monte Carlo over n blocks)."""
        return float(self.rates(n, np.random.default_rng(seed)).mean())


def uplink_times(bits: np.ndarray, channel: Channel, rng: np.random.Generator) -> np.ndarray:
    """τ(t) of eq. 5 for uploads of `bits # [n]`, one fresh block gain each."""
    bits = np.asarray(bits, dtype=np.float64).reshape(-1)
    if np.any(bits < 0):
        raise ValueError("payload bits must be >= 0")
    rates = channel.rates(bits.size, rng)
    return np.divide(bits, rates, out=np.full(bits.size, np.inf), where=rates > 0)


def token_throughput(n_tokens: int, upload_bits: Sequence[float], tau_slm: float, tau_llm: float, channel: Channel,
                     rng: np.random.Generator, draws: int = 64, per_round: bool = True) -> float:
    """Throughput (tokens/s) of an HLM sequence of n_tokens device tokens, len(upload_bits) of them uploaded.

    per_round=True: the mean of the per-round throughput of eq. 6 (the papers' figure; each skipped token counts as a
    round of 1/τ_SLM). per_round=False: tokens / total expected latency — what a wall clock measures, used to set the
    model beside runs over the link emulator. Each upload's fading is averaged over `draws` independent gains.
    """
    bits = np.asarray(upload_bits, dtype=np.float64).reshape(-1)
    if n_tokens < 1 or bits.size > n_tokens:
        raise ValueError(f"need n_tokens >= 1 and at most n_tokens uploads, got {n_tokens} and {bits.size}")
    if tau_slm < 0 or tau_llm < 0 or draws < 1:
        raise ValueError("compute times must be >= 0 and draws >= 1")
    tau = uplink_times(np.repeat(bits, draws), channel, rng).reshape(bits.size, draws)  # [uploads, draws]
    if not per_round:
        return float(n_tokens / (n_tokens * tau_slm + bits.size * tau_llm + tau.mean(axis=1).sum()))
    upload_tp = (1.0 / (tau_slm + tau + tau_llm)).mean(axis=1)  # [uploads]
    skipped = n_tokens - bits.size
    skip_tp = 1.0 / tau_slm if tau_slm > 0 else math.inf
    return float((upload_tp.sum() + skipped * skip_tp) / n_tokens)
