"""A token model that drafts trees: the model's own layers run as one Stack (explicit positions and masks,
hat_split.models.partition) with CausalLM's interface, plus a tree's nodes in one forward and the accepted path kept.

CausalLM runs the transformers model whole, whose masks are causal chains; a tree needs each node to see only its
ancestors, which the Stack's explicit masks give (hat_split.math.masks.tree_allowed). The same weights, the same
logits on a chain (tests/test_tree.py), one more forward kind.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from hat_split.models.lm import KVState, check_crop, check_feed
from hat_split.models.loading import output_size
from hat_split.models.partition import PartCache, Stack, embed, head_logits
from hat_split.models.placement import to_host


@dataclass
class TreeLM:
    model: Any  # a loaded *ForCausalLM of a family hat_split.models.partition supports
    vocab_size: int = field(init=False)

    def __post_init__(self) -> None:
        self.stack = Stack(self.model, 0, self.model.config.num_hidden_layers)
        self.vocab_size = output_size(self.model)

    def warm_up(self) -> None:
        self.forward(self.new_state(), [0, 0], n_logits=1)

    def new_state(self) -> KVState:
        return KVState(cache=PartCache())

    def _logits(self, hidden: Any, n_logits: int) -> np.ndarray:
        if n_logits == 0:
            return np.zeros((0, self.vocab_size), dtype=np.float32)
        return to_host(head_logits(self.model, hidden[:, hidden.shape[1] - n_logits:])[0]).reshape(n_logits,
                                                                                                  self.vocab_size)

    def forward(self, state: KVState, tokens: Sequence[int], n_logits: int = 1) -> np.ndarray:
        """Append `tokens` (a chain) to the cache; float32 logits `# [n_logits, vocab]` of the last n_logits."""
        check_feed(len(tokens), n_logits)
        t0 = time.perf_counter()
        hidden = self.stack.forward(state.cache, embed(self.model, tokens))
        out = self._logits(hidden, n_logits)
        state.length += len(tokens)
        state.forward_s += time.perf_counter() - t0
        state.forward_tokens += len(tokens)
        return out

    def forward_tree(self, state: KVState, parents: Sequence[int], tokens: Sequence[int], start: int) -> np.ndarray:
        """A draft tree's new nodes (the last len(tokens) entries of `parents`, the tree so far) on a tree begun at
        cache position `start`; float32 logits `# [len(tokens), vocab]` after each new node."""
        if not tokens:
            raise ValueError("a tree step needs at least one node")
        t0 = time.perf_counter()
        hidden = self.stack.forward_tree(state.cache, embed(self.model, tokens), parents, start)
        out = self._logits(hidden, len(tokens))
        state.length += len(tokens)
        state.forward_s += time.perf_counter() - t0
        state.forward_tokens += len(tokens)
        return out

    def keep(self, state: KVState, start: int, rows: Sequence[int]) -> None:
        """Of the tree begun at `start`, keep the nodes `rows` (the accepted path, offsets from start)."""
        state.cache.keep(start, rows)
        state.length = start + len(rows)

    def crop(self, state: KVState, length: int) -> None:
        check_crop(state, length)
        state.cache.crop(length)
        state.length = length
