"""The target model driven in process: one generation's target on its own HF cache (offline calibration and policy
traces: edge_runtime.training.calibrate, edge_runtime.policy.train).

The committed sequence, sampling and verification are hat_split.math.target_state's `TargetState`, the same code the
cloud's handlers run on logits from its batched steps; this driver only feeds the model. The cache convention is
hat_split.models.lm's: the cache covers `tokens[:kv.length]`; the last committed token is fed together with the next
drafts, so the prefix is never recomputed and a rejected draft position is cropped away before the next step.
"""
from __future__ import annotations

import time
from typing import Callable, List, Optional, Tuple, TypeVar

import numpy as np

from hat_split.math.sampling import SamplingParams
from hat_split.math.target_state import TargetState
from hat_split.models.lm import CausalLM

T = TypeVar("T")


class TargetDriver:
    """`lm`'s side of one generation: `prefill`, then `verify` rounds (or `generate`), each timed into compute_s."""

    def __init__(self, lm: CausalLM, session_id: int, protocol: str, params: SamplingParams, seed: Optional[int],
                 tokens: List[int]):
        self.lm = lm
        self.session_id = session_id
        self.protocol = protocol
        self.state = TargetState(params, seed, tokens)
        self.kv = lm.new_state()  # covers tokens[:kv.length]
        self.compute_s = 0.0  # model time so far

    @property
    def tokens(self) -> List[int]:
        """The committed sequence: prompt + generated."""
        return self.state.tokens

    @property
    def last_p(self) -> Optional[np.ndarray]:
        """The target's distributions `# [L + 1, vocab]` of the last verify."""
        return self.state.last_p

    def prefill(self) -> float:
        """Cache the prompt except its last token (fed with the first drafts). Returns compute seconds."""
        if len(self.tokens) > 1:
            self._timed(lambda: self.lm.forward(self.kv, self.tokens[:-1], n_logits=0))
        return self.compute_s

    def verify(self, new_tokens: List[int], draft: List[int], q: np.ndarray) -> Tuple[int, int]:
        """Commit new_tokens, verify `draft` (sampled from q `# [L, vocab]`); returns (n_accepted, next token)."""
        self.tokens.extend(new_tokens)
        logits = self._timed(lambda: self._feed_pending(draft, len(draft) + 1))  # [L + 1, vocab]
        n, token, keep = self.state.accept(draft, q, logits)
        self.lm.crop(self.kv, keep)  # keep accepted drafts, drop the rejected tail
        return n, token

    def generate(self, new_tokens: List[int], n: int) -> List[int]:
        """Commit new_tokens, then decode n tokens with the target alone (protocol `llm`)."""
        self.tokens.extend(new_tokens)
        return [self.state.sample_next(self._timed(lambda: self._feed_pending([], 1))) for _ in range(n)]

    def _feed_pending(self, extra: List[int], n_logits: int) -> np.ndarray:
        """Feed the committed tokens the cache lacks, then `extra`; logits `# [n_logits, vocab]` of the last
        positions."""
        return self.lm.forward(self.kv, self.tokens[self.kv.length:] + extra, n_logits=n_logits)

    def _timed(self, fn: Callable[[], T]) -> T:
        t0 = time.perf_counter()
        try:
            return fn()
        finally:
            self.compute_s += time.perf_counter() - t0
