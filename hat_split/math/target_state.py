"""The target's side of one generation, without the model: the committed sequence, the sampling rule and the cloud's
random stream, and what the target does with its logits (verify drafts, or sample its own next token).

Whoever runs the target model feeds this state: the cloud's handlers with logits rows that came back from the batched
steps (cloud_runtime.token_handlers), the in-process driver with logits from its own HF cache (hat_split.models.target).
Terms (q, p, accepted, resampled, bonus) are hat_split.math.sampling's.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import numpy as np

from hat_split.math.rng import session_rng
from hat_split.math.sampling import SamplingParams, sample_rng, warp
from hat_split.math.tree import TreeVerdict, verify_tree, verify_tree_greedy
from hat_split.math.verify import verify_rng


@dataclass
class TargetState:
    params: SamplingParams  # temperature / top-k / top-p, applied to the target's logits as to the draft's
    seed: Optional[int]  # the request's seed; the cloud's stream is derived from it (hat_split.math.rng)
    tokens: List[int]  # committed sequence: prompt + generated
    rng: np.random.Generator = field(init=False)  # draws acceptance/resampling uniforms and `llm` samples
    last_p: Optional[np.ndarray] = None  # target distributions `# [L + 1, vocab]` of the last accept (hat-calibrate)
    drawn_p: float = 1.0  # the last sample_next's token's probability under the distribution it was drawn from

    def __post_init__(self) -> None:
        self.rng = session_rng(self.seed, "cloud")

    def accept(self, draft: List[int], q: np.ndarray, logits: np.ndarray) -> Tuple[int, int, int]:
        """Verify `draft` (sampled from q `# [L, vocab]`) against the target's logits `# [L + 1, vocab]` at the draft
        positions and the bonus one; commit the accepted drafts and the next token. Returns (n_accepted, next token,
        cache positions to keep: the committed sequence before this round plus the accepted drafts)."""
        p = self.last_p = warp(logits, self.params)  # [L + 1, vocab]
        result = verify_rng(np.asarray([draft]), q[None], p[None], self.rng)
        n = int(result.n_accepted[0])
        token = int(result.tokens[0, n])
        base = len(self.tokens)
        self.tokens.extend(draft[:n] + [token])
        return n, token, base + n

    def accept_tree(self, parents: np.ndarray, draft: List[int], q: np.ndarray, logits: np.ndarray) -> TreeVerdict:
        """Verify a draft tree (hat_split.math.tree: `parents`, its tokens `draft`, q `# [L + 1, vocab]` the draft's
        distribution after the root and after each node) against the target's logits `# [L + 1, vocab]` after the
        same; commit the accepted path's tokens and the next token. At temperature 0 the path follows the target's
        argmax and q is not read."""
        p = self.last_p = warp(logits, self.params)  # [L + 1, vocab]
        if self.params.temperature == 0:
            verdict = verify_tree_greedy(parents, draft, np.argmax(p, axis=-1))
        else:
            verdict = verify_tree(parents, draft, p, q, lambda: float(self.rng.random()))
        self.tokens.extend([int(draft[i]) for i in verdict.path] + [verdict.token])
        return verdict

    def sample_next(self, logits: np.ndarray) -> int:
        """Sample and commit the target's next token from its logits `# [1, vocab]` (protocol `llm`); `drawn_p` is
        then its probability there (what a device needs to measure a draft's acceptance on it: verify's
        acceptance_of_samples)."""
        p = warp(logits, self.params)
        token = int(sample_rng(p, self.rng)[0])
        self.drawn_p = float(p.reshape(-1)[token])
        self.tokens.append(token)
        return token
