"""The offline environment `hat-train-policy` trains the (L, ℓ) policy in (QS-SD §IV-V). Pure numpy.

Traces come from the real draft/target pair (edge_runtime/policy/train.py record): for every verification round along
real generations, the probability a_j(ℓ) = Σ_x min(p_j(x), q̂_j,ℓ(x)) that draft j is accepted when its distribution
is sent on the lattice of resolution ℓ (given the drafts before it were), the draft's confidence in each drafted
token, and the measured draft and verification times. The environment replays a trace round by round under a
two-state Markov uplink (QS-SD §V-A): an action (L, ℓ) earns the reward of eq. 13, expected new tokens
1 + Σ_{l≤L} Π_{j≤l} a_j(ℓ) over the round time of eq. 9 — L draft steps, the Verify frame's bits at the current
rate, the verification and the reply. The policy sees the rate of the round before (what the cloud last measured).
The next context is the trace's next round whatever the action: the acceptance statistics come from the real models,
the continuation is approximated by the recorded one.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Sequence, Tuple

import numpy as np

from edge_runtime.policy.policies import RoundState, expected_new_tokens


@dataclass
class Trace:
    accept: np.ndarray  # [R, n_ell, L_max] a_j(ℓ) of each round
    confidence: np.ndarray  # [R, L_max] the draft's probability of each drafted token
    draft_s: float  # device seconds per draft token
    verify_s: float  # cloud seconds per verification round

    def __post_init__(self) -> None:
        if self.accept.ndim != 3 or self.confidence.shape != (self.accept.shape[0], self.accept.shape[2]):
            raise ValueError("a trace needs accept [R, n_ell, L_max] and confidence [R, L_max]")
        if not ((0 <= self.accept) & (self.accept <= 1 + 1e-9)).all():
            raise ValueError("acceptance probabilities must lie in [0, 1]")


@dataclass
class TwoStateChannel:
    """Discrete-time two-state Markov uplink rate, one step per round (QS-SD §V-A), scattered within each state."""

    low_bps: float = 350e3
    high_bps: float = 4e6
    p_low_high: float = 0.2
    p_high_low: float = 0.2
    jitter_decades: float = 0.3  # each round's rate is the state's times 10^U(−j, j): measured rates scatter
    high: bool = False
    rate: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.low_bps <= self.high_bps:
            raise ValueError("need 0 < low rate <= high rate")
        if not (0 <= self.p_low_high <= 1 and 0 <= self.p_high_low <= 1):
            raise ValueError("transition probabilities must be in [0, 1]")

    def reset(self, rng: np.random.Generator) -> float:
        self.high = bool(rng.random() < 0.5)
        return self._draw(rng)

    def step(self, rng: np.random.Generator) -> float:
        if rng.random() < (self.p_high_low if self.high else self.p_low_high):
            self.high = not self.high
        return self._draw(rng)

    def _draw(self, rng: np.random.Generator) -> float:
        base = self.high_bps if self.high else self.low_bps
        self.rate = base * 10 ** rng.uniform(-self.jitter_decades, self.jitter_decades)
        return self.rate


@dataclass(frozen=True)
class RoundCost:
    """Bits and seconds of one round besides the models: the Verify frame and the reply."""

    ell_bits: Tuple[int, ...]  # bits of one draft distribution at each resolution of the action set
    frame_bits: int  # a Verify's fixed bits (header, framing) and...
    token_bits: int  # ...its bits per draft besides the distribution (the token id)
    downlink_s: float = 0.0  # the reply's time on the link plus propagation both ways

    def round_time(self, L: int, e: int, rate_bps: float, draft_s: float, verify_s: float) -> float:
        """QS-SD eq. 9: L T_SLM + uplink + T_LLM + downlink."""
        return L * draft_s + (self.frame_bits + L * (self.token_bits + self.ell_bits[e])) / rate_bps \
            + verify_s + self.downlink_s


@dataclass
class PolicyEnv:
    traces: List[Trace]
    actions: np.ndarray  # [A, 2]: (L, index into the resolutions)
    cost: RoundCost
    channel: TwoStateChannel = field(default_factory=TwoStateChannel)
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.traces:
            raise ValueError("no traces")
        l_max = min(t.accept.shape[2] for t in self.traces)
        if int(self.actions[:, 0].max()) > l_max or int(self.actions[:, 1].max()) >= len(self.cost.ell_bits):
            raise ValueError(f"actions reach past the traces (L <= {l_max}) or the resolutions")
        self.rng = np.random.default_rng(self.seed)

    def reset(self, trace: int | None = None) -> RoundState:
        self.trace = self.traces[int(self.rng.integers(len(self.traces))) if trace is None else trace]
        self.r = 0
        self.channel.reset(self.rng)
        self.kept_conf: List[float] = []
        self.state = RoundState(uplink_bps=self.channel.rate)
        return self.state

    def step(self, action: int) -> Tuple[RoundState, float, bool, dict]:
        L, e = (int(x) for x in self.actions[action])
        a = self.trace.accept[self.r, e, :L]
        conf = self.trace.confidence[self.r, :L]
        rate = self.channel.rate
        seconds = self.cost.round_time(L, e, rate, self.trace.draft_s, self.trace.verify_s)
        new = expected_new_tokens(a)
        accepted = int(np.argmin(np.append(self.rng.random(L) < a, False)))  # one realisation: first rejection
        self.kept_conf.extend(conf[:accepted].tolist())
        self.state = RoundState(float(np.mean(self.kept_conf)) if self.kept_conf else self.state.mean_confidence,
                                float(conf.mean()), accepted / L, rate)
        self.channel.step(self.rng)
        self.r += 1
        done = self.r >= self.trace.accept.shape[0]
        return self.state, new / seconds, done, {"new": new, "seconds": seconds, "accepted": accepted, "L": L,
                                                 "ell_index": e}


def action_grid(lengths: Sequence[int], n_ells: int) -> np.ndarray:
    """Every (L, ℓ index) pair `# [A, 2]`."""
    return np.array([(L, e) for L in lengths for e in range(n_ells)], dtype=np.int64)


def throughput(env: PolicyEnv, choose, episodes: Sequence[int], observe=None) -> float:
    """Tokens per second of a policy over whole traces: Σ expected new tokens / Σ round time (eq. 12)."""
    tokens = seconds = 0.0
    for i in episodes:
        state, done = env.reset(i), False
        while not done:
            state, _, done, info = env.step(choose(state))
            tokens += info["new"]
            seconds += info["seconds"]
            if observe is not None:
                observe(info["L"], info["accepted"])
    return tokens / seconds
