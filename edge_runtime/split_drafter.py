"""The device's half of a split model (HAT and U-shape): input part, Λ draft, output part, and exact verification.

Cache convention (one request; T = the committed sequence, prompt + generated):
- at every round start the input part and Λ cover T[:-1] and so does the cloud's middle part; the last committed token
  is fed first in the next round (as in hat_split.models.lm);
- a HAT round drafts d1..dL with w_S = output ∘ Λ ∘ input: input part on [T[-1], d1, ..., dL] (L + 1 shallow states,
  the upload), Λ and the draft's output part on the first L of them; drafting stops after the first token whose
  draft probability is below η (eq. 5) or at the length limit;
- the device turns the cloud's L + 1 deep states into target distributions with its output part, verifies the drafts
  itself (exact speculative sampling; greedy at temperature 0) and crops every cache to the accepted prefix; the next
  upload's `position` tells the cloud where to crop its own.

The feature drafter (hat_split.models.feature_drafter, parts of kind "feature") drafts instead of Λ: its cache holds
the pairs (f_{p-1}, s_p) of the target's feature before position p and p's shallow state. The features come from the
deep states the cloud returns anyway (`target_logits` keeps them: every prompt position's at the prefill, the verified
positions' each round); a draft step on its own predicted feature needs nothing from the link. At a round start the
pairs since the last round run as one chunk on true features, and after the verdict the drafter's cache is cropped back
to its true pairs (`DraftState.true_len`): the accepted positions run again next round with the features the cloud
computed for them. A drafter whose tokens enter as embeddings (`token_input` "embedding") needs no shallow state to
draft, so the input part runs once per round over all the drafts as they upload (`upload_states`): its weights are read
once a round instead of once a draft.

Parallel drafting (§3.5) forks the caches (cache tensors are never written in place, so a fork is a shallow copy) and
drafts continuations of the top-k alternatives to the last draft token while the cloud works; a continuation whose
first token is the one the verification emits becomes the next round's draft. Randomness is position-keyed
(hat_split.math.rng.keyed_uniform), so a reused continuation is token for token what a fresh draft would have been.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from edge_runtime.backends.split_parts import PartCacheLike, SplitParts
from edge_runtime.feature_pairs import DraftState, FeaturePairs
from hat_split.math.rng import keyed_rng, keyed_uniform
from hat_split.math.sampling import SamplingParams, sample, softmax_prob, warp
from hat_split.math.tree import (ROOT, GrownTree, TreeVerdict, grow_tree, top_tokens, verify_tree,
                                 verify_tree_greedy)
from hat_split.math.verify import speculative_verify
from hat_split.models.lm import board_time


@dataclass
class TreeDraft:
    """A draft tree of a HAT round: below the root at position `base`, its nodes from base + 1 in node order."""

    base: int
    tree: GrownTree
    shallow: Any  # `# [1, 1 + N, hidden]`: the root's and every node's shallow state (the upload)
    fed: int  # nodes the input part held before the last level's upload (Λ and its output part hold these)


class TreeLogits:
    """The target's logits after a draft tree's positions, computed a row at a time as verification reads them (the
    head over 1 + N positions is most of the device's work; a walk reads the accepted path's rows and one more)."""

    def __init__(self, states: Any, drafter: "SplitDrafter"):
        self.states, self.drafter = states, drafter
        self._rows: Dict[int, np.ndarray] = {}

    def __getitem__(self, i: int) -> np.ndarray:
        """Row i `# [vocab]` float32 (0: after the root; n + 1: after node n)."""
        if i not in self._rows:
            t0 = time.perf_counter()
            self._rows[i] = self.drafter.parts.head_at(self.states, [i])[0]
            self.drafter._timed(t0)
        return self._rows[i]

    def take(self, rows: Sequence[int]) -> np.ndarray:
        return np.stack([self[i] for i in rows])

    @property
    def computed(self) -> int:
        return len(self._rows)


class _Rows:
    """Rows on demand, cached: what verification indexes (`rows[i]`)."""

    def __init__(self, fn: Callable[[int], Any]):
        self.fn, self._cache = fn, {}

    def __getitem__(self, i: int) -> Any:
        if i not in self._cache:
            self._cache[i] = self.fn(int(i))
        return self._cache[i]


@dataclass
class SplitDrafter(FeaturePairs):
    parts: SplitParts  # edge_runtime.backends.split_parts: torch, or a bundle's graphs; no adapter: U-shape only
    params: SamplingParams
    seed: Optional[int]
    tokens: List[int] = field(default_factory=list)
    compute_s: float = 0.0  # device model time of this request (a drafter serves one request; restarts after a
    prefill_s: float = 0.0  # dropped link add to it)
    input_s: float = 0.0  # of prefill_s: the input layers over prompt chunks (`prompt_states`)
    slowdown: float = 1.0  # > 1: sleep so that each computation takes this many times as long (a slower board)
    pause: Callable[[float], None] = time.sleep  # how that sleep is spent (a session watches its socket meanwhile)
    local_logits: Optional[np.ndarray] = None  # `# [1, vocab]` raw logits of the last sample_local() call

    def __post_init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.inp, self.lam, self.dout, self.tout = (self.parts.new_cache() for _ in range(4))
        self.pending: Optional[DraftState] = None  # the draft in flight
        self.adopted: Optional[DraftState] = None  # a parallel-drafted continuation the next round starts from
        self.feats: Dict[int, Any] = {}  # feature drafter: the target's f_p `# [1, 1, hidden]` by position
        self.shallows: Dict[int, Any] = {}  # feature drafter: committed positions' shallow states not yet in lam

    @property
    def features(self) -> bool:
        """The feature drafter drafts: it needs the deep state of every prompt position at the prefill."""
        return self.parts.kind == "feature"

    @property
    def deferred(self) -> bool:
        """The drafts' shallow states wait for the upload (a feature drafter that reads embeddings)."""
        return self.features and self.parts.token_input == "embedding"

    # -- prefill ---------------------------------------------------------------------------------------------------
    def start(self, prompt: Sequence[int]) -> None:
        if not prompt:
            raise ValueError("the prompt is empty")
        self.tokens = list(prompt)
        self._reset()

    def prompt_states(self, end: int) -> Any:
        """Shallow states `# [1, n, hidden]` of prompt positions inp.length .. end - 1 (one chunk); Λ follows them."""
        t0 = time.perf_counter()
        start = self.inp.length
        shallow = self.parts.run_input(self.inp, self.tokens[start:end])
        if self.features and not self.deferred:  # the pairs' token states (embeddings need none kept)
            self.shallows.update({start + i: shallow[:, i:i + 1] for i in range(end - start)})
        self.input_s += self._timed(t0, prefill=True)
        return shallow

    def lam_prefill(self, shallow: Any) -> None:
        """Λ (and the draft's tail layers) over a prompt chunk: device-only work done while the chunk uploads. (The
        feature drafter waits for the chunk's features: it runs over the prompt at the first draft.)"""
        if self.parts.kind != "adapter":
            return
        t0 = time.perf_counter()
        self._lam_step(self.lam, self.dout, shallow, logits=False)
        self._timed(t0, prefill=True)

    def target_logits(self, deep: Any, position: int, n_logits: int, tree: Optional[Sequence[int]] = None
                      ) -> np.ndarray:
        """Target logits `# [n_logits, vocab]` from deep states `# [1, n, hidden]` of positions position.. (tree: the
        parents of those n positions, a draft tree's; then n_logits = n)."""
        t0 = time.perf_counter()
        if tree is not None:
            if not self.parts.tail:  # norm + head only: no cache, only the bookkeeping
                self.tout.length = position
            if self.tout.length > position:
                self.tout.crop(position)
            states = self.parts.run_tail_tree(self.tout, deep, list(tree), position)
            self._timed(t0)
            return TreeLogits(states, self)
        if not self.parts.tail:  # norm + head only: no cache, only the bookkeeping
            self.tout.length = position
        if self.tout.length > position:
            self.tout.crop(position)
        if self.tout.length != position:
            raise RuntimeError(f"output part holds {self.tout.length} positions, deep states start at {position}")
        if self.features:  # the features of every position: the drafter's pairs
            logits, feats = self.parts.run_output_features(self.tout, deep, n_logits)
            self.feats.update({position + i: feats[:, i:i + 1] for i in range(feats.shape[1])})
        else:
            logits = self.parts.run_output(self.tout, deep, n_logits)
        self._timed(t0)
        return logits

    # -- after a link drop (sessions.base.Session.resume) ---------------------------------------------------------
    @property
    def can_generate_alone(self) -> bool:
        """HAT's device has a whole draft model (output ∘ Λ ∘ input); U-shape's has no way to predict a token."""
        return self.parts.has_adapter

    def rollback(self) -> None:
        """Back to the committed sequence: drafts in flight, forks and half-sent prompt chunks are forgotten, and the
        caches are rebuilt over T[:-1] on the device (the cost of a prompt prefill). The feature drafter keeps the
        features it had: they belong to the committed positions."""
        feats = {p: f for p, f in self.feats.items() if p < len(self.tokens) - 1}
        self.start(self.tokens)
        self.feats = feats
        if len(self.tokens) > 1:
            self.lam_prefill(self.prompt_states(len(self.tokens) - 1))

    def sample_local(self, rng: Any = None) -> int:
        """One token from the draft w_S alone (the link is down, policy degrade); the caller commits it. Its
        randomness is position-keyed like every draft's (`rng` is the token drafter's interface, unused). Its raw
        logits stay in `local_logits` `# [1, vocab]`."""
        state = self.draft(1, 0.0)
        self.local_logits = state.last_logits[None]
        return state.drafts[0]

    # -- decode ----------------------------------------------------------------------------------------------------
    def last_state(self) -> Any:
        """U-shape: the shallow state `# [1, 1, hidden]` of the last committed token."""
        t0 = time.perf_counter()
        s = self.parts.run_input(self.inp, self.tokens[-1:])
        self._timed(t0)
        return s

    def draft(self, max_len: int, eta: float, admit: Optional[Callable[[float], bool]] = None) -> DraftState:
        """HAT drafting (eq. 5): up to max_len drafts, stopping after the first with draft probability < η; or, with
        `admit` (hat_split.math.draft_stop.DraftStop.admit: the measured cost rule), before the first draft it
        refuses given its draft probability (a round may then send none)."""
        if not self.parts.has_adapter:
            raise RuntimeError("drafting needs an adapter (protocol hat)")
        state = self.adopted
        self.adopted = None
        if state is None:
            base = len(self.tokens) - 1
            state = DraftState(base, self.inp, self.lam, self.dout, true_len=base + 1)
            state.shallow.append(self._input(state.inp, self.tokens[-1]))
        if len(state.drafts) > max_len:  # a reused continuation longer than this round allows
            self._truncate(state, max_len)
        if admit is not None:  # a reused continuation's drafts pass the rule like fresh ones
            kept = next((i for i, c in enumerate(state.conf) if not admit(c)), None)
            if kept is not None:
                self._truncate(state, kept)
                state.stopped = True
        self.extend(state, max_len, eta, admit=admit)
        self.pending = state
        return state

    def extend(self, state: DraftState, max_len: int, eta: float, steps: Optional[int] = None,
               stop: Callable[[], bool] = lambda: False, admit: Optional[Callable[[float], bool]] = None) -> None:
        """Continue a draft by up to `steps` tokens (default: until η, `admit`'s refusal or max_len), checking `stop`
        between tokens. A refused token is not kept: its step's draft-module work is the rule's price."""
        t0 = time.perf_counter()
        done = 0
        while not state.stopped and len(state.drafts) < max_len and (steps is None or done < steps) and not stop():
            logits = (self._feature_step(state) if self.features else
                      self._lam_step(state.lam, state.dout, state.shallow[-1], logits=True))  # [1, vocab]
            q = warp(logits, self.params)  # [1, vocab]
            position = state.base + len(state.drafts) + 1
            token = int(sample(q, np.array([keyed_uniform(self.seed, "draft", position)]))[0])
            conf = float(softmax_prob(logits, np.array([token]))[0])
            done += 1
            if admit is not None and not admit(conf):  # the refused step's pair leaves the draft module's caches
                self._truncate(state, len(state.drafts))  # (a parallel-drafting fork starts before the last draft)
                state.stopped = True
                break
            state.drafts.append(token)
            state.q.append(q[0])
            state.conf.append(conf)
            state.last_logits = logits[0]
            if not self.deferred:
                state.shallow.append(self._input(state.inp, token))
            state.stopped = admit is None and eta > 0 and conf < eta
        self._timed(t0)

    def upload_states(self, state: DraftState) -> Any:
        """The L + 1 shallow states `# [1, L + 1, hidden]` the cloud needs to verify this draft (the drafts' own, when
        deferred, computed now in one pass)."""
        missing = len(state.drafts) + 1 - len(state.shallow)
        if missing > 0:
            t0 = time.perf_counter()
            states = self.parts.run_input(state.inp, state.drafts[-missing:])
            state.shallow.extend(states[:, i:i + 1] for i in range(missing))
            self._timed(t0)
        return self.parts.cat(state.shallow)

    def verify(self, state: DraftState, logits: np.ndarray) -> Tuple[int, int]:
        """Exact speculative verification of the draft against target logits `# [L + 1, vocab]` → (accepted, token)."""
        L = len(state.drafts)
        p = warp(logits, self.params)  # [L + 1, vocab]
        accept_u = np.array([[keyed_uniform(self.seed, "accept", state.base + 1 + i) for i in range(L)]])
        resample_u = np.array([keyed_uniform(self.seed, "resample", state.base)])
        q = np.stack(state.q)[None] if L else np.zeros((1, 0, p.shape[-1]), np.float32)
        result = speculative_verify(np.array([state.drafts], dtype=np.int64).reshape(1, L), q, p[None], accept_u,
                                    resample_u)
        n = int(result.n_accepted[0])
        return n, int(result.tokens[0, n])

    def sample_target(self, logits: np.ndarray) -> int:
        """U-shape (and the first token): sample the target's next token `# logits [1, vocab]` at its position."""
        p = warp(logits[-1:], self.params)
        return int(sample(p, np.array([keyed_uniform(self.seed, "resample", len(self.tokens) - 1)]))[0])

    def commit(self, new_tokens: List[int], n_accepted: int = 0) -> None:
        """Append committed tokens (the first n_accepted are the pending draft's) and bring every cache to T[:-1].

        If a parallel-drafted continuation was adopted and starts right here, its forked caches (which already hold
        its drafts) become the live ones; otherwise the pending draft's caches are cropped to the accepted prefix, and
        Λ catches up on the last draft when all were accepted.
        """
        state, adopted = self.pending, self.adopted
        self.pending = None
        self.tokens.extend(new_tokens)
        keep = len(self.tokens) - 1
        if self.features:
            floor = min([keep, self.lam.length] + [s.true_len for s in (state, adopted) if s is not None])
            self._keep_pairs(state, keep, floor)
        if adopted is not None and adopted.base == keep:
            self.inp, self.lam, self.dout = adopted.inp, adopted.lam, adopted.dout
            return
        self.adopted = None
        if state is not None:
            self.inp, self.lam, self.dout = state.inp, state.lam, state.dout
            if self.features:
                self.lam.crop(min(self.lam.length, state.true_len))
            elif self.parts.has_adapter:
                t0 = time.perf_counter()
                for s in state.shallow[self.lam.length - state.base: keep - state.base]:
                    self._lam_step(self.lam, self.dout, s, logits=False)
                self._timed(t0)
        for cache in (self.inp, self.lam, self.dout):
            if cache.length > keep:
                cache.crop(keep)

    # -- draft trees (hat_split.math.tree) ---------------------------------------------------------------------------
    def draft_tree(self, budget: int, max_depth: int, width: int, eta: float = 0.0) -> "TreeDraft":
        """The draft module (Λ or the feature drafter) drafts a tree (grow_tree: at most `budget` nodes, `max_depth`
        levels, `width` new nodes per level) below the last committed token, one masked forward per level, ending
        after the level whose main-line token has draft probability below `eta` (HAT eq. 5). Λ: the input part, Λ
        and the draft head over the level's nodes; the last level's nodes go through the input part only (their
        shallow states upload; nothing is drawn after them). The feature drafter: the pairs since the last round and
        the root's on true features (as a chain's first step), then per level each node's pair (its parent's
        predicted feature, its own shallow state or embedding) under the tree's mask; with embeddings the input part
        runs once over all the nodes at the end.
        At temperature 0 the shape follows the draft's plain softmax; above, the children are draws without
        replacement from the draft's distribution, keyed by position (hat_split.math.rng.keyed_rng). Returns the tree
        and the shallow states `# [1, 1 + N, hidden]` of the root and the nodes, in node order."""
        if not self.parts.has_adapter:
            raise ValueError("hat's draft trees are drafted by a draft module (Λ or the feature drafter); these parts "
                             "have none")
        greedy = self.params.temperature == 0
        shape = SamplingParams(1.0) if greedy else self.params
        t0 = time.perf_counter()
        base = len(self.tokens) - 1
        start = base + 1
        shallow = [self._input(self.inp, self.tokens[-1])]
        fhat: Dict[int, Any] = {}  # feature drafter: f̂ by node (ROOT: the root's)
        if self.features:
            root = DraftState(base, self.inp, self.lam, self.dout, shallow=list(shallow), true_len=base + 1)
            q_root = warp(self._feature_step(root), shape)[0]
            fhat[ROOT] = root.fhat[base]
        else:
            q_root = warp(self._lam_step(self.lam, self.dout, shallow[0], logits=True), shape)[0]

        def q_after(parents: List[int], tokens: List[int], nodes: List[int]) -> np.ndarray:
            s = None
            if not self.deferred:
                s = self.parts.run_input_tree(self.inp, [tokens[n] for n in nodes], parents, start)
                shallow.append(s)
            if self.features:
                return warp(self._feature_level(fhat, s, tokens, parents, nodes, start), shape)
            a = self.parts.run_adapter_tree(self.lam, s, parents, start)
            return warp(self._over_vocab(self.parts.run_output_tree(self.dout, a, parents, start, draft=True)), shape)

        rng = keyed_rng(self.seed, "tree_draft", base)
        tree = grow_tree(q_root, q_after, budget, max_depth, width, rng.random, greedy, eta)
        fed = self.inp.length - start  # nodes with their shallow state (Λ: all but the last level)
        if fed < len(tree.tokens):
            shallow.append(self.parts.run_input_tree(self.inp, [int(t) for t in tree.tokens[fed:]],
                                                     tree.parents.tolist(), start))
        self._timed(t0)
        return TreeDraft(base, tree, self.parts.cat(shallow), fed)

    def verify_tree(self, draft: "TreeDraft", logits: "TreeLogits") -> TreeVerdict:
        """Exact verification of a draft tree against the target's logits after the root (row 0) and after each
        node (hat_split.math.tree: greedy at temperature 0, recursive rejection sampling without replacement above,
        with a position-keyed stream). Only the rows the walk reads are computed: the accepted path's and the one
        after it."""
        t = draft.tree
        p = _Rows(lambda i: warp(logits[i][None], self.params)[0])
        if self.params.temperature == 0:
            return verify_tree_greedy(t.parents, t.tokens, _Rows(lambda i: int(np.argmax(p[i]))))
        rng = keyed_rng(self.seed, "tree_verify", draft.base)
        return verify_tree(t.parents, t.tokens, p, t.q, lambda: float(rng.random()))

    def keep_tree_path(self, draft: "TreeDraft", path: List[int], logits: Optional["TreeLogits"] = None) -> None:
        """After a tree's verdict, before its tokens are committed: every cache keeps the accepted nodes in place
        and drops the other branches; Λ reads the accepted nodes it had not (the last level's). The feature drafter
        instead keeps its true pairs only and the target's features of the path (from `logits`, the tree's)."""
        start = draft.base + 1
        self.inp.keep(start, path)
        if self.features:
            if logits is None:
                raise ValueError("the feature drafter keeps a tree's path with the tree's TreeLogits")
            self._keep_tree_pairs(draft.base, draft.shallow, path, logits.states)
            self.tout.keep(draft.base, [0] + [n + 1 for n in path])
            return
        held = [n for n in path if n < draft.fed]
        for cache in (self.lam, self.dout):
            cache.keep(start, held)
        self.tout.keep(draft.base, [0] + [n + 1 for n in path])
        t0 = time.perf_counter()
        for n in path[len(held):]:
            self._lam_step(self.lam, self.dout, draft.shallow[:, n + 1:n + 2], logits=False)
        self._timed(t0)

    # -- parallel drafting -----------------------------------------------------------------------------------------
    def candidates(self, state: DraftState, k: int) -> List[DraftState]:
        """Forks for the top-k alternatives to the last draft token (HAT §3.5), ready for `extend`.

        Ranked by the draft model's logits, not by the sampling distribution: at temperature 0 that is one-hot, yet
        the target's correction is still most likely among the draft's runners-up."""
        if not state.drafts or k < 1:
            return []
        L = len(state.drafts)
        ranked = top_tokens(state.last_logits, k + 1)  # by the draft's own scores: also at temperature 0
        order = [int(t) for t in ranked if int(t) != state.drafts[-1]][:k]
        out = []
        if order and len(state.shallow) < L + 1:  # deferred drafts' shallow states (they upload anyway)
            self.upload_states(state)
        for token in order:
            # before the last draft: input part without dL, Λ and tail already without it
            inp = state.inp.fork()
            inp.crop(state.base + L)
            c = DraftState(state.base + L, inp, state.lam.fork(), state.dout.fork(), fhat=dict(state.fhat),
                           true_len=state.true_len)
            c.shallow.append(self._input(c.inp, token))
            c.first = token
            out.append(c)
        return out

    def adopt(self, candidates: List[DraftState], token: int, n_accepted: int, draft_len: int) -> bool:
        """After the verdict: if the last draft was the one rejected and the emitted token starts a candidate, that
        continuation becomes the start of the next round's draft (taken over in `commit`)."""
        if n_accepted != draft_len - 1:
            return False
        for c in candidates:
            if c.first == token:
                self.adopted = c
                return True
        return False

    # -- internals -------------------------------------------------------------------------------------------------
    def _input(self, cache: PartCacheLike, token: int) -> Any:
        return self.parts.run_input(cache, [token])

    def _lam_step(self, lam: PartCacheLike, dout: PartCacheLike, shallow: Any, logits: bool) -> Optional[np.ndarray]:
        """Λ (and the draft's tail) over one shallow state; with `logits` the draft's `# [1, vocab]`, -inf outside its
        tokens when it drafts over a subset (q is then 0 there, and verification stays exact)."""
        out = self.parts.run_output(dout, self.parts.run_adapter(lam, shallow), 1 if logits else 0, draft=True)
        return self._over_vocab(out) if logits else None

    def _over_vocab(self, out: np.ndarray) -> np.ndarray:
        """Draft logits over a draft vocabulary `# [n, subset]` → `# [n, vocab]`, -inf elsewhere."""
        ids = self.parts.draft_ids
        if ids is None:
            return out
        full = np.full((out.shape[0], self.parts.vocab), -np.inf, dtype=np.float32)
        full[:, ids] = out
        return full

    def _truncate(self, state: DraftState, n: int) -> None:
        del state.drafts[n:], state.q[n:], state.conf[n:], state.shallow[n + 1:]
        state.fhat = {p: f for p, f in state.fhat.items() if p < state.base + n}
        state.inp.crop(min(state.inp.length, state.base + n + 1))
        for cache in (state.lam, state.dout):
            if cache.length > state.base + n:
                cache.crop(state.base + n)
        state.stopped = False

    def _timed(self, t0: float, prefill: bool = False) -> float:
        dt = board_time(time.perf_counter() - t0, self.slowdown, self.pause)
        self.compute_s += dt
        if prefill:
            self.prefill_s += dt
        return dt
