"""Draft trees: their shape, their attention mask, how the device draws a node's children, and exact verification.
Pure numpy.

A tree of N drafted nodes hangs below the root, the last committed token. Node i holds a token and its parent's index
(`parents[i]`, −1 for a child of the root), and every parent comes before its children (parents[i] < i): a list in
that order cannot hold a cycle. The children of a node are kept in the order they were drawn.

**Drawing children** (`draw_children`). At T > 0 the k children of a node are k draws *without replacement* from the
draft's distribution q at that node, in draw order (Gumbel-top-k: the k largest log q + Gumbel noise are a sequential
sample without replacement). How many children a node gets must be decided before they are drawn (from the node's
path probability, a budget: never from the children's own values), or verification is no longer exact.

**Verification** (`verify_tree`): from the root, at each node the children are tried in draw order by recursive
rejection sampling without replacement (Jeon et al. 2024, "Recursive Speculative Decoding"; SpecInfer's multi-step
speculative sampling is the same rule for children drawn with replacement): with target p and draft q at the node,
child i (token x_i) is accepted with probability min(1, p_i(x_i) / q_i(x_i)), where q_i is q with the tokens of
children 1..i−1 removed and renormalised, p_1 = p, and after a rejection p_{i+1} = norm(max(0, p_i − q_i)). An
accepted child becomes the node; when every child is rejected, or the node has none, one token is drawn from the
current p_i (the resampled or bonus token). The committed path is then distributed as the target's own sampling,
whatever the tree's shape. At T = 0 (`verify_tree_greedy`) the path follows the children equal to the target's
argmax.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from hat_split.math.sampling import sample

ROOT = -1  # the parent index of the root's children


def check_tree(parents, tokens, max_nodes: int, max_depth: int) -> np.ndarray:
    """The depth of every node (1 for the root's children) `# [N]`; ValueError naming what is wrong with the tree:
    shapes, a parent that is not an earlier node (out of range, or a cycle), more than max_nodes nodes, a node deeper
    than max_depth, or two siblings with the same token."""
    par = np.asarray(parents)
    tok = np.asarray(tokens)
    if par.ndim != 1 or tok.ndim != 1 or par.shape != tok.shape:
        raise ValueError(f"a tree needs parents and tokens as two lists of one length, got shapes {par.shape} and "
                         f"{tok.shape}")
    if not (np.issubdtype(par.dtype, np.integer) and np.issubdtype(tok.dtype, np.integer)) and par.size:
        raise ValueError("a tree's parents and tokens must be integers")
    n = int(par.size)
    if n == 0:
        raise ValueError("a tree needs at least one node")
    if n > max_nodes:
        raise ValueError(f"the tree has {n} nodes; at most {max_nodes} are taken")
    depth = np.zeros(n, dtype=np.int64)
    seen: dict = {}
    for i in range(n):
        p = int(par[i])
        if not ROOT <= p < i:
            raise ValueError(f"node {i}'s parent {p} is not an earlier node (parents must come first: -1 for the "
                             f"root, else 0..{i - 1}); a cycle or an index out of range")
        depth[i] = 1 if p == ROOT else depth[p] + 1
        if depth[i] > max_depth:
            raise ValueError(f"node {i} is {depth[i]} deep; at most {max_depth} are taken")
        key = (p, int(tok[i]))
        if key in seen:
            raise ValueError(f"node {i} repeats the token {int(tok[i])} of its sibling {seen[key]}")
        seen[key] = i
    return depth


def ancestor_mask(parents) -> np.ndarray:
    """`# [N, N]` bool: node i attends to node j iff j is i or one of its ancestors (the tree's causal mask; every
    node also attends to the whole committed sequence, which this mask does not cover)."""
    par = np.asarray(parents, dtype=np.int64)
    n = par.size
    mask = np.eye(n, dtype=bool)
    for i in range(n):
        if par[i] != ROOT:
            mask[i] |= mask[par[i]]  # parents come first: their rows are complete
    return mask


def children_of(parents) -> List[List[int]]:
    """children_of(parents)[v + 1]: the children of node v in draw order (index 0: the root's)."""
    out: List[List[int]] = [[] for _ in range(len(parents) + 1)]
    for i, p in enumerate(parents):
        out[int(p) + 1].append(i)
    return out


def path_to(parents, node: int) -> List[int]:
    """The nodes from the root's child down to `node`."""
    out = []
    while node != ROOT:
        out.append(node)
        node = int(parents[node])
    return out[::-1]


def top_tokens(q: np.ndarray, k: int) -> np.ndarray:
    """The k most probable tokens of q `# [V]`, most probable first, ties by the smaller id: what
    np.argsort(-q, kind="stable")[:k] gives, in O(V) (a partition, then a sort of the k-th value's ties and above)
    rather than a sort of the vocabulary (some 10 ms a row of 151,936, several rows a tree level)."""
    q = np.asarray(q)
    k = min(int(k), q.size)
    if k < 1:
        return np.zeros(0, dtype=np.int64)
    kth = np.partition(q, q.size - k)[q.size - k]  # the k-th largest value
    candidates = np.flatnonzero(q >= kth)  # ascending ids, every tie with the k-th included
    return candidates[np.argsort(-q[candidates], kind="stable")][:k].astype(np.int64)


def draw_children(q: np.ndarray, k: int, uniforms: np.ndarray) -> np.ndarray:
    """k tokens drawn without replacement from q `# [V]`, in draw order (Gumbel-top-k), with k uniforms in (0, 1)
    per token `# [V]`; fewer when q has fewer than k tokens of positive probability."""
    q = np.asarray(q, dtype=np.float64)
    u = np.asarray(uniforms, dtype=np.float64)
    if q.ndim != 1 or u.shape != q.shape:
        raise ValueError(f"q and the uniforms must be one vector each of one length, got {q.shape} and {u.shape}")
    if k < 1:
        raise ValueError(f"a node drawn needs k >= 1 children, got {k}")
    u = np.clip(u, np.finfo(np.float64).tiny, 1.0 - np.finfo(np.float64).eps)
    with np.errstate(divide="ignore"):
        keys = np.log(q) - np.log(-np.log(u))  # log q + Gumbel noise; −inf where q = 0
    k = min(k, int(np.count_nonzero(q > 0)))
    top = np.argpartition(-keys, k - 1)[:k] if k < q.size else np.arange(q.size)
    return top[np.argsort(-keys[top], kind="stable")][:k].astype(np.int64)


@dataclass
class TreeVerdict:
    path: List[int]  # the accepted nodes, root's child first
    token: int  # the resampled or bonus token after them


def verify_tree_greedy(parents, tokens, argmax: np.ndarray) -> TreeVerdict:
    """T = 0: argmax `# [N + 1]` is the target's argmax after the root (index 0) and after each node (index i + 1);
    the path follows the child whose token is that argmax."""
    kids = children_of(parents)
    node, path = ROOT, []
    while True:
        want = int(argmax[node + 1])
        nxt = next((c for c in kids[node + 1] if int(tokens[c]) == want), None)
        if nxt is None:
            return TreeVerdict(path, want)
        path.append(nxt)
        node = nxt


def verify_tree(parents, tokens, p: np.ndarray, q: np.ndarray, uniform: Callable[[], float]) -> TreeVerdict:
    """T > 0: p, q `# [N + 1, V]` the target's and the draft's distributions after the root (row 0) and after each
    node (row i + 1; q's rows of leaves are not read); uniform() gives the next uniform in [0, 1) (a session's
    stream: one per child tried, one for the final token)."""
    kids = children_of(parents)
    node, path = ROOT, []
    while True:
        p_i = np.asarray(p[node + 1], dtype=np.float64)
        q_i = np.asarray(q[node + 1], dtype=np.float64)
        accepted = None
        for c in kids[node + 1]:
            x = int(tokens[c])
            if q_i[x] <= 0:
                raise ValueError(f"node {c}'s token {x} has no draft probability left at its parent: the children "
                                 "were not drawn without replacement from q")
            q_n = q_i / q_i.sum()
            p_n = p_i / p_i.sum()
            if uniform() * q_n[x] < p_n[x]:
                accepted = c
                break
            residual = np.maximum(p_n - q_n, 0.0)
            if residual.sum() <= 0:  # p_i == q_i: acceptance was certain; float rounding only
                residual = p_n
            p_i = residual
            q_i = q_n.copy()
            q_i[x] = 0.0
            if q_i.sum() <= 0:  # every token of q drawn: nothing is left to try
                break
        if accepted is None:
            return TreeVerdict(path, int(sample(p_i[None], np.array([uniform()]))[0]))
        path.append(accepted)
        node = accepted


def below_chain(chain_len: int, parents) -> List[int]:
    """The parents of `chain_len` positions in a chain (the last the root) followed by a tree hanging below the root:
    what a model runs in one forward when it verifies a tree after the tokens its cache lacks."""
    return list(range(-1, chain_len - 1)) + [chain_len + int(p) if p >= 0 else chain_len - 1 for p in parents]


def parse_shapes(text: str) -> List[Tuple[int, int, int]]:
    """"16x4x4,32x8x4" → [(16, 4, 4), (32, 8, 4)]: (nodes, depth, width) per tree shape ("" → none); ValueError
    naming an item that is not three integers >= 1."""
    out = []
    for item in (x.strip() for x in str(text).split(",")):
        if not item:
            continue
        try:
            v = tuple(int(x) for x in item.split("x"))
        except ValueError:
            v = ()
        if len(v) != 3 or min(v) < 1:
            raise ValueError(f"{item!r} is not NODESxDEPTHxWIDTH with each >= 1 (e.g. 16x4x4)")
        out.append(v)
    return out


def shape_name(nodes: int, depth: int, width: int) -> str:
    """(16, 4, 4) → "t16d4w4"."""
    return f"t{nodes}d{depth}w{width}"


def chain(tokens: Sequence[int]) -> Tuple[np.ndarray, np.ndarray]:
    """A chain of drafts as a tree: (parents, tokens)."""
    n = len(tokens)
    return np.arange(-1, n - 1, dtype=np.int64), np.asarray(tokens, dtype=np.int64)


@dataclass
class GrownTree:
    parents: np.ndarray  # [N] int64
    tokens: np.ndarray  # [N] int64
    rows: List[np.ndarray]  # N + 1 rows `# [V]`: the draft's distribution after the root (row 0) and after each node
    # (row i + 1; zeros for the last level's nodes, whose distribution no child was drawn from and verification
    # never reads)
    path_prob: np.ndarray  # [N]: the product of q along each node's path (the frontier's ranking)

    @cached_property
    def q(self) -> np.ndarray:
        """`# [N + 1, V]` the rows stacked, when something reads them (sampled verification): greedy verification
        reads none, and stacking a 32-node tree's rows of 151,936 float64 costs some 30 ms a round."""
        return np.stack(self.rows)


def grow_tree(q_root: np.ndarray, q_after: Callable[[List[int], List[int], List[int]], np.ndarray], budget: int,
              max_depth: int,
              width: int, uniform: Optional[Callable[[int], np.ndarray]], greedy: bool,
              stop_below: float = 0.0) -> GrownTree:
    """A draft tree of at most `budget` nodes and `max_depth` levels, grown a level at a time with at most `width`
    new nodes per level, one node kept for each level still to come while the budget allows (so the main line
    reaches max_depth; EAGLE-2's dynamic tree, kept exact at T > 0):

    a level's nodes go where they are expected to be accepted most: a candidate is the j-th child of a frontier node
    v, scored by v's path probability times the j-th largest value of q_v; the first child of the main line (the
    chain a chain draft would have drawn: the root's first child, its first child, ...) is always taken, then the
    best other candidates up to `width`, so each node gets k_v children, fixed before any is drawn — from q_v
    itself and the path probabilities already drawn, never from the children's own values (a shape chosen from
    those would change the law the verifier sees). A node's first child is a plain draw from q_v, so the tree holds
    the chain of its depth and accepts at least as much as that chain, at every temperature.
    Children are the top-k_v tokens of q_v when `greedy` (the scores are then the children's own path probabilities:
    EAGLE-2's top-k re-ranking of a level), else k_v draws without replacement (draw_children, `uniform(V)` a vector
    of uniforms). stop_below = η > 0 ends the tree after the level whose main-line node has q below η (HAT eq. 5's
    rule for the chain the tree holds; decided from drawn nodes only, so exact). q_root `# [V]` is the draft's
    distribution after the root; q_after(parents, tokens, nodes) returns
    `# [len(nodes), V]` after each of a level's new nodes, given the tree so far (one batched forward of the draft
    per level, on the engine)."""
    if budget < 1 or max_depth < 1 or width < 1:
        raise ValueError(f"a tree needs budget, depth and width >= 1, got {budget}, {max_depth}, {width}")
    q_root = np.asarray(q_root, dtype=np.float64)
    parents: List[int] = []
    tokens: List[int] = []
    probs: List[float] = []
    rows = [q_root]
    frontier = [ROOT]  # nodes whose children may be drawn at this level
    main = ROOT  # the main line: the root's first child, its first child, ... (what a chain would have drafted)
    main_q = 1.0  # the draft probability of the main line's newest token
    for depth in range(1, max_depth + 1):
        # at most `width`, and a node kept for each level still to come: the main line reaches max_depth
        take = min(width, max(1, budget - len(parents) - (max_depth - depth)), budget - len(parents))
        if take <= 0 or not frontier:
            break
        top = {v: rows[v + 1][top_tokens(rows[v + 1], take)] for v in frontier}  # each node's best values, known
        # before drawing
        scored = [(-(probs[v] if v != ROOT else 1.0) * float(x) if (v, j) != (main, 0) else -np.inf, i, j, v)
                  for i, v in enumerate(frontier) for j, x in enumerate(top[v]) if x > 0]
        chosen = sorted(scored)[:take]
        level: List[int] = []
        first_of_main = None
        for v in frontier:
            k = sum(1 for c in chosen if c[3] == v)
            if not k:
                continue
            q_v = rows[v + 1]
            if greedy:
                kids = top_tokens(q_v, k)
            elif uniform is None:
                raise ValueError("a sampled tree needs uniforms")
            else:
                kids = draw_children(q_v, k, uniform(q_v.size))
            base = probs[v] if v != ROOT else 1.0
            if v == main:
                first_of_main, main_q = len(parents), float(q_v[kids[0]])
            for x in kids:
                parents.append(v)
                tokens.append(int(x))
                probs.append(base * float(q_v[x]))
                level.append(len(parents) - 1)
        if not level or first_of_main is None:
            break
        main = first_of_main
        if depth == max_depth or len(parents) >= budget or main_q < stop_below:
            # no level follows (the budget, the depth, or the main line's new token below η: where its chain would
            # have stopped): the leaves' rows are never read
            rows.extend(np.zeros((len(level), q_root.size)))
            break
        after = np.asarray(q_after(parents, tokens, level), dtype=np.float64)
        if after.shape != (len(level), q_root.size):
            raise ValueError(f"q_after gave shape {after.shape} for {len(level)} nodes of a vocabulary of "
                             f"{q_root.size}")
        rows.extend(after)
        frontier = level
    return GrownTree(np.asarray(parents, dtype=np.int64), np.asarray(tokens, dtype=np.int64), rows,
                     np.asarray(probs, dtype=np.float64))
