"""A bigram model behind the CausalLM interface, so statistical tests run the real device and cloud code on a model
whose every distribution is known in closed form (next token ~ table[last token])."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from hat_split.models.lm import KVState


class MarkovLM:
    def __init__(self, table: np.ndarray):
        self.table = np.asarray(table, dtype=np.float64)  # [V, V] rows sum to 1, all positive
        self.vocab_size = self.table.shape[0]
        self.logits = np.log(self.table).astype(np.float32)

    def warm_up(self) -> None:
        """Nothing to page in."""

    def new_state(self) -> KVState:
        return KVState(cache=[])

    def forward(self, state: KVState, tokens: Sequence[int], n_logits: int = 1) -> np.ndarray:
        if not tokens or not 0 <= n_logits <= len(tokens):
            raise ValueError("bad forward")
        state.cache.extend(int(t) for t in tokens)
        state.length += len(tokens)
        state.forward_tokens += len(tokens)
        return self.logits[list(tokens)[len(tokens) - n_logits:]] if n_logits else self.logits[:0]

    def crop(self, state: KVState, length: int) -> None:
        if not 0 <= length <= state.length:
            raise ValueError("bad crop")
        del state.cache[length:]
        state.length = length


def chain_probability(table: np.ndarray, start: int, seqs: np.ndarray) -> np.ndarray:
    """Probability of each row of `seqs # [n, T]` under the chain started after `start`."""
    prob = table[start, seqs[:, 0]]
    for t in range(1, seqs.shape[1]):
        prob = prob * table[seqs[:, t - 1], seqs[:, t]]
    return prob
