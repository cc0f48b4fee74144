"""One device's generation session on the cloud: the target's KV cache and the committed sequence.

Token protocols (`sd`, `hlm`, `llm`, ...) verify against the full target model. In the server the model work runs in
batched steps with other sessions' (cloud_runtime.batching) and this object keeps the committed tokens, sampling and
verification (`accept`, `sample_next`); `prefill` / `verify` / `generate` run the model here on the session's own
HF cache (in-process calibration; a model the batched path does not know). The cache convention is hat_split.models.lm's:
the cache covers `tokens[:kv.length]`; the last committed token is fed together with the next drafts, so the prefix
is never recomputed and a rejected draft position is cropped away before the next step.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import List, Optional

import numpy as np

from hat_split.models.lm import CausalLM, KVState
from hat_split.math.rng import session_rng
from hat_split.math.sampling import SamplingParams, sample_rng, warp
from hat_split.math.verify import verify_rng


@dataclass
class TargetSession:
    lm: CausalLM
    session_id: int
    protocol: str
    params: SamplingParams
    seed: Optional[int]
    tokens: List[int]  # committed sequence: prompt + generated
    kv: KVState = field(init=False)
    rng: np.random.Generator = field(init=False)  # draws acceptance/resampling uniforms and `llm` samples
    step: int = 0  # last request step served
    last_active: float = field(default_factory=time.monotonic)
    compute_s: float = 0.0
    last_p: Optional[np.ndarray] = None  # target distributions `# [L + 1, vocab]` of the last verify (hat-calibrate)
    link_rtt_s: float = 0.0  # the device's tiny-message round trip (OpenSession): baseline of the uplink estimate
    replied_at: float = 0.0  # perf_counter() when the last reply to this session left

    def __post_init__(self) -> None:
        self.kv = self.lm.new_state()
        self.rng = session_rng(self.seed, "cloud")

    def prefill(self) -> float:
        """Cache the prompt except its last token (fed with the first drafts). Returns compute seconds."""
        if len(self.tokens) > 1:
            self._timed(lambda: self.lm.forward(self.kv, self.tokens[:-1], n_logits=0))
        return self.compute_s

    def _feed_pending(self, extra: List[int], n_logits: int) -> np.ndarray:
        """Feed the committed tokens the cache lacks, then `extra`; logits of the last n_logits positions."""
        return self.lm.forward(self.kv, self.tokens[self.kv.length:] + extra, n_logits=n_logits)

    def verify(self, new_tokens: List[int], draft: List[int], q: np.ndarray) -> tuple[int, int]:
        """Commit new_tokens, verify `draft` (sampled from q `# [L, vocab]`); returns (n_accepted, next token)."""
        self.tokens.extend(new_tokens)
        logits = self._timed(lambda: self._feed_pending(draft, len(draft) + 1))  # [L + 1, vocab]
        n, token, keep = self.accept(draft, q, logits)
        self.lm.crop(self.kv, keep)  # keep accepted drafts, drop the rejected tail
        return n, token

    def accept(self, draft: List[int], q: np.ndarray, logits: np.ndarray) -> tuple[int, int, int]:
        """Verify `draft` against the target's logits `# [L + 1, vocab]` at the draft positions (and the bonus one),
        commit the accepted drafts and the next token; returns (n_accepted, next token, cache positions to keep)."""
        p = self.last_p = warp(logits, self.params)  # [L + 1, vocab]
        result = verify_rng(np.asarray([draft]), q[None], p[None], self.rng)
        n = int(result.n_accepted[0])
        token = int(result.tokens[0, n])
        base = len(self.tokens)
        self.tokens.extend(draft[:n] + [token])
        return n, token, base + n

    def generate(self, new_tokens: List[int], n: int) -> List[int]:
        """Commit new_tokens, then decode n tokens with the target alone (protocol `llm`)."""
        self.tokens.extend(new_tokens)
        out: List[int] = []
        for _ in range(n):
            out.append(self.sample_next(self._timed(lambda: self._feed_pending([], 1))))  # logits [1, vocab]
        return out

    def sample_next(self, logits: np.ndarray) -> int:
        """Sample and commit the target's next token from its logits `# [1, vocab]` (protocol `llm`)."""
        token = int(sample_rng(warp(logits, self.params), self.rng)[0])
        self.tokens.append(token)
        return token

    def _timed(self, fn):
        t0 = time.perf_counter()
        try:
            return fn()
        finally:
            self.compute_s += time.perf_counter() - t0
