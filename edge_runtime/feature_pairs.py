"""The feature drafter's side of the device's split drafting (edge_runtime.split_drafter, docs/HAT.md): which pairs
(f_{p-1}, s_p) its cache lacks at a draft step and where each comes from, and what is kept for the next round after a
verdict. `DraftState` is one draft in progress, of Λ or of the feature drafter."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import numpy as np

from edge_runtime.backends.split_parts import PartCacheLike


@dataclass
class DraftState:
    """A draft in progress: its tokens, the distributions they were sampled from, and the caches after them."""

    base: int  # position of the first shallow state (the last committed token's)
    inp: PartCacheLike  # input part, covering base + len(shallow)
    lam: PartCacheLike  # Λ (or the feature drafter), covering base + len(drafts) once the next step has run it
    dout: PartCacheLike  # the draft's output tail layers (same coverage as lam)
    drafts: List[int] = field(default_factory=list)
    q: List[np.ndarray] = field(default_factory=list)  # per draft `# [vocab]`
    conf: List[float] = field(default_factory=list)  # per draft: its draft probability (raw softmax)
    shallow: List[Any] = field(default_factory=list)  # per position `# [1, 1, hidden]`: T[-1], d1, ..., dL (backend's)
    stopped: bool = False  # η fired, or the cost rule refused the next draft: the draft is complete
    first: int = -1  # a parallel-drafting candidate: the token it replaces the last draft with
    last_logits: Optional[np.ndarray] = None  # `# [vocab]` raw draft logits of the last draft's position
    fhat: Dict[int, Any] = field(default_factory=dict)  # feature drafter: predicted f̂_p `# [1, 1, hidden]` by position
    true_len: int = 0  # feature drafter: lam's first positions that hold true features (kept after the verdict)


class FeaturePairs:
    """SplitDrafter's methods for the feature drafter. They use its `parts`, `tokens`, `feats` (the target's f_p by
    position), `shallows` (committed positions' shallow states not yet in the drafter's cache), `deferred` and
    `_over_vocab`."""

    def _feature_step(self, state: DraftState) -> np.ndarray:
        """The feature drafter on the pairs its cache lacks, up to the draft's last shallow state: at a round start
        the committed positions since the last round (true features), then one pair per draft step (its own predicted
        feature before it). The next token's logits `# [1, vocab]`, -inf outside a draft vocabulary."""
        end = state.base + len(state.drafts)  # the position of shallow[-1]
        positions = range(state.lam.length, end + 1)
        feats = self.parts.cat([self._feature(state, p - 1) for p in positions])
        states = None if self.deferred else self.parts.cat([state.shallow[p - state.base] if p >= state.base
                                                            else self.shallows[p] for p in positions])
        tokens = [self._token_at(state, p) for p in positions]
        logits, fhat = self.parts.run_feature(state.lam, feats, states, tokens)
        state.fhat[end] = fhat[:, -1:]
        return self._over_vocab(logits)

    def _feature_level(self, fhat: Dict[int, Any], states: Any, tokens: List[int], parents: List[int],
                       nodes: List[int], start: int) -> np.ndarray:
        """Draft logits `# [len(nodes), vocab]` after a draft tree's new level (hat_split.math.tree.grow_tree's
        nodes): each node's pair is its parent's predicted feature and its own state (`states # [1, n, hidden]`, None
        for embeddings), run under the tree's mask; the level's predictions join `fhat` by node (ROOT: the root's)."""
        feats = self.parts.cat([fhat[parents[n]] for n in nodes])
        logits, out = self.parts.run_feature_tree(self.lam, feats, states, [tokens[n] for n in nodes], parents, start)
        fhat.update({n: out[:, i:i + 1] for i, n in enumerate(nodes)})
        return self._over_vocab(logits)

    def _keep_tree_pairs(self, base: int, shallow: Any, path: List[int], states: Any) -> None:
        """After a tree's verdict: the drafter's cache back to its true pairs (up to the root at `base`), the
        accepted nodes' shallow states (`shallow # [1, 1 + N, hidden]`, the upload) waiting for the next round's
        chunk, and the target's features of the root and the path from the output part's `states` of the tree."""
        self.lam.crop(base + 1)
        if not self.deferred:
            self.shallows.update({base + 1 + i: shallow[:, n + 1:n + 2] for i, n in enumerate(path)})
        feats = self.parts.features_at(states, [0] + [n + 1 for n in path])
        self.feats.update({base + i: feats[:, i:i + 1] for i in range(len(path) + 1)})

    def _feature(self, state: DraftState, p: int) -> Any:
        """f_p for a pair: the draft's own prediction where it made one, else the target's; zeros before position 0
        (and for a position generated alone with no prediction kept)."""
        if p in state.fhat:
            return state.fhat[p]
        f = self.feats.get(p)
        return f if f is not None else self.parts.zeros(1)

    def _token_at(self, state: DraftState, p: int) -> int:
        if p < state.base:
            return self.tokens[p]
        if p == state.base:
            return state.first if state.first >= 0 else self.tokens[p]
        return state.drafts[p - state.base - 1]

    def _keep_pairs(self, state: Optional[DraftState], keep: int, floor: int) -> None:
        """After the verdict: the accepted positions' shallow states wait for the next round's chunk, with the
        target's features of the verified positions (a position committed without one keeps the draft's prediction:
        tokens generated alone); what lies past the committed sequence, or before `floor` (the first pair any live
        cache may still need), is dropped."""
        if state is not None:
            for p in range(state.base, keep):
                if not self.deferred:
                    self.shallows[p] = state.shallow[p - state.base]
                if p not in self.feats and p in state.fhat:
                    self.feats[p] = state.fhat[p]
        self.feats = {p: f for p, f in self.feats.items() if floor - 1 <= p < keep}
        self.shallows = {p: s for p, s in self.shallows.items() if floor <= p < keep}
