"""Draft trees as llama.cpp sequence-id sets, planned in plain Python (hat_split.models.llamacpp_lm runs the plans).

Every root-to-tip path of a tree is a sequence of its own: it holds the state's prefix (marked by a copy from the
state's sequence) and the path's nodes at positions start + depth. A node in a batch carries the ids of every path
through it, the one it is masked by first; a new node reuses its parent's sequence while the parent is that path's
tip (a first child), and otherwise takes a new sequence that copies the path up to its deepest cached ancestor and is
added to its ancestors in the same batch. So a tree of N nodes holds one sequence per leaf.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple


@dataclass
class SeqTree:
    """A draft tree cached on a state: its nodes' parents and depths, and the sequences of its paths."""

    start: int  # the state's length when the tree began: the position of a depth-0 node
    parents: List[int] = field(default_factory=list)
    depth: List[int] = field(default_factory=list)
    seq_of: List[int] = field(default_factory=list)  # a sequence through each node (its cells: the node's path)
    tips: Dict[int, int] = field(default_factory=dict)  # sequence → the node its path ends at

    @property
    def seqs(self) -> List[int]:
        return list(self.tips)


@dataclass
class TreePlan:
    """What one tree feed does, worked out before anything changes: how many sequences it takes from the pool (named
    −1, −2, … until `bind` gives them their ids), prefix copies to make, and each new node's position and sequence
    ids (the masking one first)."""

    tree: SeqTree
    copies: List[Tuple[int, int, int]]  # (source, destination, end position; −1 = all)
    positions: List[int]
    seq_ids: List[List[int]]
    taken: int  # sequences it needs from the pool

    def bind(self, free: Sequence[int]) -> None:
        """Give the sequences this plan takes (−1, −2, …) the first `taken` ids of `free`."""
        ids = {-1 - j: int(free[j]) for j in range(self.taken)}
        self.seq_ids = [[ids.get(s, s) for s in row] for row in self.seq_ids]
        self.tree.seq_of = [ids.get(s, s) for s in self.tree.seq_of]
        self.tree.tips = {ids.get(s, s): n for s, n in self.tree.tips.items()}
        self.copies = [(ids.get(src, src), ids[dst], end) for src, dst, end in self.copies]


def plan_tree(held: Optional[SeqTree], own: int, length: int, parents: Sequence[int], n_new: int,
              start: int) -> TreePlan:
    """How the last n_new nodes of the tree `parents` (begun at `start`; −1: below the state's last position) join
    the tree `held` on a state of sequence `own` and `length` positions (None: a new tree); a ValueError when they
    cannot."""
    parents = [int(p) for p in parents]
    old = 0 if held is None else len(held.parents)
    if held is None and start != length:
        raise ValueError(f"a new draft tree begins at the state's length {length}, not at {start}")
    if held is not None and (start != held.start or parents[:old] != held.parents):
        raise ValueError("a tree step must extend the draft tree this state holds (same start, same earlier nodes)")
    if len(parents) != old + n_new:
        raise ValueError(f"a tree of {len(parents)} nodes cannot have {n_new} new after {old} cached")
    tree = (SeqTree(start) if held is None else
            SeqTree(start, list(held.parents), list(held.depth), list(held.seq_of), dict(held.tips)))
    copies: List[Tuple[int, int, int]] = []
    positions: List[int] = []
    seq_ids: List[List[int]] = []
    taken = 0
    for i in range(old, len(parents)):
        p = parents[i]
        if not -1 <= p < i:
            raise ValueError(f"node {i}'s parent {p} is not an earlier node or -1")
        tree.parents.append(p)
        tree.depth.append(0 if p < 0 else tree.depth[p] + 1)
        positions.append(start + tree.depth[i])
        tip = next((s for s, n in tree.tips.items() if n == p), None) if p >= 0 else None
        if tip is None:  # a new path: a sequence of its own holding the prefix and the node's cached ancestors
            taken += 1
            tip = -taken
            anc = p
            while anc >= old:  # ancestors in this batch carry the new sequence too
                seq_ids[anc - old].append(tip)
                anc = tree.parents[anc]
            copies.append((own, tip, -1) if anc < 0 else (tree.seq_of[anc], tip, start + tree.depth[anc] + 1))
        tree.tips[tip] = i
        tree.seq_of.append(tip)
        seq_ids.append([tip])
    return TreePlan(tree, copies, positions, seq_ids, taken)


def paths(parents: Sequence[int]) -> int:
    """The sequences a tree fed in one batch takes: one per leaf (a node no other node names as its parent)."""
    return len(parents) - len({int(p) for p in parents if p >= 0})
