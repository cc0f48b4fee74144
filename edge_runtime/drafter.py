"""The device's draft model with its own KV cache, kept in step with the committed sequence.

Drafting feeds whatever committed tokens the cache lacks, then one token per draft step; after the cloud's verdict the
cache is cropped to the accepted prefix (rejected drafts are forgotten, accepted ones are kept and never recomputed).
Each draft token is sampled from the quantized distribution that is sent with it (a wire: float16 values,
hat_split.wire.dist_codec, or a lattice point, hat_split.wire.sqs), so the cloud verifies against exactly the
distribution the device sampled from.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Tuple

import numpy as np

from hat_split.wire import dist_codec
from hat_split.models.lm import CausalLM, KVState
from hat_split.math.sampling import SamplingParams, sample, softmax_prob, warp


@dataclass
class Drafter:
    lm: CausalLM
    params: SamplingParams
    wire_dtype: str = "float16"
    tokens: List[int] = field(default_factory=list)  # committed sequence (prompt + generated)
    kv: KVState = field(init=False)
    last_logits: np.ndarray = field(init=False, default=None)  # raw logits of the last draft() call
    last_q: List[np.ndarray] = field(init=False, default_factory=list)  # per draft: `# [vocab]` it was sampled from
    local_logits: np.ndarray = field(init=False, default=None)  # raw logits of the last sample_local() call
    can_generate_alone = True  # sessions.base.Session.resume under link_policy "degrade"

    def __post_init__(self) -> None:
        self.kv = self.lm.new_state()

    @property
    def compute_s(self) -> float:
        """Draft-model time of this request so far (prompt included)."""
        return self.kv.forward_s

    def start(self, prompt: List[int], prefill: bool = True) -> None:
        """New request: forget the old cache and cache the prompt except its last token (prefill=False: later, in
        the first forward that needs the cache)."""
        self.kv = self.lm.new_state()
        self.tokens = list(prompt)
        if prefill and len(prompt) > 1:
            self.lm.forward(self.kv, self.tokens[:-1], n_logits=0)

    @property
    def behind(self) -> int:
        """Committed tokens (all but the last, which the next draft feeds) the cache has not read yet."""
        return max(0, len(self.tokens) - 1 - self.kv.length)

    def catch_up(self, max_tokens: int) -> int:
        """Read up to max_tokens of what the cache lacks (no logits): lets the device use time it would wait anyway
        (a round in which it drafts nothing) so that a later draft starts at once. Returns how many it read."""
        feed = self.tokens[self.kv.length:max(0, len(self.tokens) - 1)][:max(0, max_tokens)]
        if feed:
            self.lm.forward(self.kv, feed, n_logits=0)
        return len(feed)

    def rollback(self) -> None:
        """Forget cached positions past the committed sequence (drafts of a round that never got its verdict)."""
        keep = max(0, len(self.tokens) - 1)
        if self.kv.length > keep:
            self.lm.crop(self.kv, keep)

    def _next_logits(self, extra: List[int]) -> np.ndarray:
        """Logits `# [1, vocab]` of the position after tokens + extra (feeds what the cache lacks)."""
        feed = (self.tokens + extra)[self.kv.length:]
        return self.lm.forward(self.kv, feed, n_logits=1)

    def draft(self, n: int, rng: np.random.Generator, stop_below: float = 0.0, wire=None,
              budget_bits: int = 0) -> Tuple[List[int], list]:
        """Sample up to n draft tokens; returns them and their wire rows (one per draft, for `wire.pack`).

        wire: how a distribution is quantized, sampled and sent — dist_codec.FloatWire (default, this drafter's
        wire_dtype) or sqs.LatticeWire (qs / ksqs / csqs / sq). The token is drawn from what the row says (except
        for the lossy `sq`), so the cloud verifies against the distribution the device sampled from.
        stop_below = η > 0 ends the draft after the first token whose confidence (plain softmax probability under the
        draft, `softmax_prob`) is below η — HAT eq. 5; that token is still sent.
        budget_bits = B > 0 keeps the longest draft whose rows fit in B bits (SQS §4; at least one draft).
        Both stopping rules read only the device's own distributions, so verification stays exact.
        """
        wire = wire or dist_codec.FloatWire(self.wire_dtype)
        drafts: List[int] = []
        rows, raw, self.last_q = [], [], []
        used_bits = 0
        for _ in range(n):
            logits = self._next_logits(drafts)  # [1, vocab]
            q = warp(logits, self.params)[0]  # [vocab]
            row = wire.quantize(q)
            if budget_bits:
                used_bits += wire.bits(row)
                if drafts and used_bits > budget_bits:
                    break
            token, row, drawn_from = wire.sample(row, q, float(rng.random()))
            raw.append(logits)
            self.last_q.append(drawn_from)
            drafts.append(token)
            rows.append(row)
            if stop_below > 0 and softmax_prob(logits, np.array([token]))[0] < stop_below:
                break
        self.last_logits = np.concatenate(raw, axis=0)  # [len, vocab]: for uncertainty measures (rounds.uhlm)
        return drafts, rows

    def sample_local(self, rng: np.random.Generator) -> int:
        """One token from the draft model alone (protocol `slm`); the caller commits it. Its raw logits stay in
        `local_logits` `# [1, vocab]`."""
        self.local_logits = self._next_logits([])
        return int(sample(warp(self.local_logits, self.params), rng.random(1))[0])

    def commit(self, tokens: List[int], n_accepted_drafts: int = 0) -> None:
        """Append committed tokens, of which the first n_accepted_drafts are this round's accepted drafts.

        Cached positions past the old sequence are valid only for accepted drafts; the rest (rejected drafts) go.
        """
        if not 0 <= n_accepted_drafts <= len(tokens):
            raise ValueError(f"n_accepted_drafts={n_accepted_drafts} outside 0..{len(tokens)}")
        keep = len(self.tokens) + n_accepted_drafts
        self.tokens.extend(tokens)
        self.lm.crop(self.kv, min(self.kv.length, keep))
