"""The split draft w_S = output ∘ Λ ∘ input (HAT eq. 1) as a token model with CausalLM's interface.

A device that holds only its parts of a large model (input layers, the distilled adapter Λ, head) can still draft
for the token protocols (`sd`, `hlm`, `uhlm`, ...): the drafts are tokens, verified by the cloud's whole model. This is
the token-protocol counterpart of `hat` with the same draft, so a benchmark can set the two side by side; the
difference is what goes on the wire (tokens and draft distributions instead of hidden states).

One KVState holds the three part caches `(input, Λ, output tail)`; they always cover the same positions.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from hat_split.models.adapter import Adapter, adapter_stack
from hat_split.models.lm import KVState, board_time, check_crop, check_feed
from hat_split.models.loading import output_size
from hat_split.models.partition import PartCache, SplitModel
from hat_split.models.placement import to_host


@dataclass
class AdapterLM:
    split: SplitModel
    adapter: Adapter
    slowdown: float = 1.0  # > 1 emulates a slower board (hat_split.models.lm.board_time)
    vocab_size: int = field(init=False)

    def __post_init__(self) -> None:
        self.stack = adapter_stack(self.split, self.adapter)
        self.vocab_size = output_size(self.split.model)

    def warm_up(self) -> None:
        self.forward(self.new_state(), [0, 0], n_logits=1)

    def new_state(self) -> KVState:
        return KVState(cache=(PartCache(), PartCache(), PartCache()))

    def forward(self, state: KVState, tokens: Sequence[int], n_logits: int = 1) -> np.ndarray:
        """Append `tokens` to the three caches; float32 logits `# [n_logits, vocab]` of the last n_logits positions."""
        import torch

        check_feed(len(tokens), n_logits)
        inp, lam, dout = state.cache
        t0 = time.perf_counter()
        with torch.inference_mode():
            logits = self.split.run_output(dout, self.stack.forward(lam, self.split.run_input(inp, tokens)), n_logits)
        state.length += len(tokens)
        state.forward_s += board_time(time.perf_counter() - t0, self.slowdown)
        state.forward_tokens += len(tokens)
        return to_host(logits).reshape(n_logits, self.vocab_size)

    def crop(self, state: KVState, length: int) -> None:
        check_crop(state, length)
        for cache in state.cache:
            cache.crop(length)
        state.length = length

