"""Per-round choice of draft length L and lattice resolution ℓ (QS-SD §IV-V). Pure numpy: runs on any device.

Every policy maps the state at the start of a round — the draft's confidence on the text so far, how the last round
went, and the uplink rate the cloud last measured — to an action (L, ℓ):
- `static`: always the configured (L, ℓ);
- `heuristic` (QS-SD §V): L grows by one when every draft was accepted, else becomes the accepted count (at least
  one); ℓ stays fixed;
- `dqn`: a Q-network trained offline by `hat-train-policy` (double DQN, reward = expected new tokens / round time,
  QS-SD eq. 13); the action with the largest Q wins. Its file holds the weights, the action set and the feature scaling.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import List, Sequence, Tuple

import numpy as np

from hat_split.wire.dist_codec import MAX_ELL

POLICIES = ("static", "heuristic", "dqn")
N_FEATURES = 4
DEFAULT_RATE_BPS = 1e6  # what a policy assumes before the cloud has measured the uplink


@dataclass
class RoundState:
    """What a policy sees at the start of a round (QS-SD §IV-B: semantic and connectivity information)."""

    mean_confidence: float = 1.0  # f̄: mean draft probability of the drafted tokens kept so far
    last_confidence: float = 1.0  # mean draft probability of the last round's drafts
    last_accept_frac: float = 1.0  # accepted / drafted in the last round
    uplink_bps: float = DEFAULT_RATE_BPS  # the cloud's last measurement of the uplink rate

    def features(self) -> np.ndarray:
        """`# [N_FEATURES]` float64: the three confidences and log10 of the rate."""
        return np.array([self.mean_confidence, self.last_confidence, self.last_accept_frac,
                         math.log10(max(self.uplink_bps, 1.0))])


class StaticPolicy:
    def __init__(self, draft_len: int, ell: int):
        self.draft_len, self.ell = draft_len, ell

    def act(self, state: RoundState) -> Tuple[int, int]:
        return self.draft_len, self.ell

    def observe(self, drafted: int, accepted: int) -> None:
        """A static policy learns nothing from a verdict."""


class HeuristicPolicy(StaticPolicy):
    """QS-SD §V: grow L by one after a fully accepted round, else set it to the accepted count."""

    def __init__(self, draft_len: int, ell: int, max_len: int = 16):
        super().__init__(draft_len, ell)
        self.max_len = max_len

    def observe(self, drafted: int, accepted: int) -> None:
        self.draft_len = min(self.max_len, drafted + 1) if accepted == drafted else max(1, accepted)


@dataclass
class QNetwork:
    """A small MLP (ReLU) from scaled features to one Q value per action."""

    weights: List[np.ndarray]  # [in, out] per layer
    biases: List[np.ndarray]
    actions: np.ndarray  # [A, 2] int64: (L, ℓ)
    feat_mean: np.ndarray  # [N_FEATURES]
    feat_std: np.ndarray
    meta: dict

    def q_values(self, features: np.ndarray) -> np.ndarray:
        h = (np.asarray(features, dtype=np.float64) - self.feat_mean) / self.feat_std
        for i, (w, b) in enumerate(zip(self.weights, self.biases)):
            h = h @ w + b
            if i < len(self.weights) - 1:
                h = np.maximum(h, 0.0)
        return h

    def save(self, path: str | Path) -> None:
        arrays = {f"w{i}": w for i, w in enumerate(self.weights)}
        arrays.update({f"b{i}": b for i, b in enumerate(self.biases)})
        np.savez(path, actions=self.actions, feat_mean=self.feat_mean, feat_std=self.feat_std,
                 meta=np.frombuffer(json.dumps(self.meta).encode(), np.uint8), **arrays)

    @classmethod
    def load(cls, path: str | Path) -> "QNetwork":
        try:
            with np.load(path, allow_pickle=False) as f:
                n = sum(1 for k in f.files if k.startswith("w"))
                net = cls([f[f"w{i}"] for i in range(n)], [f[f"b{i}"] for i in range(n)], f["actions"],
                          f["feat_mean"], f["feat_std"], json.loads(f["meta"].tobytes().decode()))
        except (OSError, KeyError, ValueError) as exc:
            raise ValueError(f"{path}: not a hat-train-policy file ({exc})") from None
        net.check()
        return net

    def check(self) -> None:
        dims = [N_FEATURES] + [w.shape[1] for w in self.weights]
        if (not self.weights or any(w.ndim != 2 or w.shape[0] != d for w, d in zip(self.weights, dims))
                or any(b.shape != (w.shape[1],) for w, b in zip(self.weights, self.biases))):
            raise ValueError("policy network layers do not chain from the state features to the actions")
        if (self.actions.ndim != 2 or self.actions.shape != (dims[-1], 2) or (self.actions < 1).any()
                or (self.actions[:, 1] > MAX_ELL).any()):
            raise ValueError(f"policy actions must be one (L >= 1, 1 <= ℓ <= {MAX_ELL}) pair per network output")
        if self.feat_mean.shape != (N_FEATURES,) or self.feat_std.shape != (N_FEATURES,) or (self.feat_std <= 0).any():
            raise ValueError("policy feature scaling must be N_FEATURES means and positive deviations")


class DQNPolicy(StaticPolicy):
    def __init__(self, net: QNetwork):
        self.net = net

    def act(self, state: RoundState) -> Tuple[int, int]:
        a = int(np.argmax(self.net.q_values(state.features())))
        return int(self.net.actions[a, 0]), int(self.net.actions[a, 1])


def make_policy(name: str, draft_len: int, ell: int, max_len: int, path: str = "") -> StaticPolicy:
    if name == "static":
        return StaticPolicy(draft_len, ell)
    if name == "heuristic":
        return HeuristicPolicy(draft_len, ell, max_len)
    if name == "dqn":
        if not path:
            raise ValueError("the dqn policy needs a file from hat-train-policy (--policy-file)")
        return DQNPolicy(QNetwork.load(path))
    raise ValueError(f"policy must be one of {POLICIES}, got {name!r}")


def expected_new_tokens(accept_probs: Sequence[float]) -> float:
    """1 + Σ_l Π_{j<=l} a_j: the tokens a round adds when draft j is accepted with probability a_j given the earlier
    ones (QS-SD eq. 14 with g as Bernoulli trials; the 1 is the resampled or bonus token)."""
    return 1.0 + float(np.sum(np.cumprod(np.asarray(accept_probs, dtype=np.float64))))
