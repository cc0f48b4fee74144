"""The static shapes of the cloud's captured decode / verify steps (plain Python and numpy: no torch).

A batched step over slot sessions (hat_split.models.slots) has three sizes: rows (sessions), positions per row (1 for
a decode, γ + 1 for a verify) and width (key positions attended: the longest row's end). A captured graph
(hat_split.models.graphs) exists per shape, so each size is rounded up to a bucket: rows and positions to powers of
two, width to powers of two from `min_width` up to the slot length. A step whose sizes lie beyond the buckets runs
eagerly at its own sizes. Padding rows and positions are described by `pad_step`: where each query's key and value
are written (padding goes to the scratch slot) and at which position it sits.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import numpy as np

Segment = Tuple[int, int, int]  # (slot, positions held before the step, positions in the step)


def powers_of_two(lo: int, hi: int) -> Tuple[int, ...]:
    """lo, 2·lo, 4·lo, … up to the first value >= hi, that last one replaced by hi (hi itself is a bucket)."""
    if not 1 <= lo:
        raise ValueError(f"buckets start at >= 1, got {lo}")
    out, v = [], lo
    while v < hi:
        out.append(v)
        v *= 2
    out.append(hi)
    return tuple(out)


def bucket(value: int, sizes: Sequence[int]) -> Optional[int]:
    """The smallest size >= value; None when value is beyond the largest."""
    for s in sizes:
        if s >= value:
            return s
    return None


@dataclass(frozen=True)
class Buckets:
    rows: Tuple[int, ...]  # sessions per step
    tokens: Tuple[int, ...]  # positions per row
    width: Tuple[int, ...]  # key positions attended

    @classmethod
    def make(cls, max_rows: int, max_tokens: int, length: int, min_width: int = 128,
             also_tokens: Sequence[int] = ()) -> "Buckets":
        """Buckets for steps of up to max_rows sessions of up to max_tokens positions on slots of `length`;
        also_tokens: more position buckets (a chain verify's own size, so that it pads no further)."""
        if min(max_rows, max_tokens, length) < 1:
            raise ValueError(f"buckets need rows, tokens and length >= 1, got {max_rows}, {max_tokens}, {length}")
        tokens = sorted(set(powers_of_two(1, max_tokens)) | {t for t in also_tokens if 1 <= t <= max_tokens})
        return cls(powers_of_two(1, max_rows), tuple(tokens), powers_of_two(min(min_width, length), length))

    def shape(self, rows: int, tokens: int, width: int) -> Optional[Tuple[int, int, int]]:
        """The bucketed (rows, tokens, width) of a step, or None (run it eagerly) when one size is beyond them."""
        shape = (bucket(rows, self.rows), bucket(tokens, self.tokens), bucket(width, self.width))
        return None if None in shape else shape  # type: ignore[return-value]

    @property
    def count(self) -> int:
        return len(self.rows) * len(self.tokens) * len(self.width)


def exact_shape(segments: Sequence[Segment]) -> Tuple[int, int, int]:
    """(rows, tokens, width) of a step at its own sizes."""
    return len(segments), max(n for _, _, n in segments), max(past + n for _, past, n in segments)


@dataclass(frozen=True)
class StepIndex:
    """Where a padded step's queries read and write (lists, `# [rows]` and `# [rows][tokens]`), and what they see."""

    rows: List[int]  # the slot each row attends over
    write_slot: List[List[int]]  # the slot each query's key and value go to
    write_pos: List[List[int]]  # … at this position
    positions: List[List[int]]  # each query's absolute position (rotary, mask)
    past: List[int] = field(default_factory=list)  # positions each row's slot held before the step
    ancestors: np.ndarray = field(default_factory=lambda: np.zeros((0, 0, 0), np.uint8))  # uint8 [rows, tokens,
    # tokens]: 1 where query i may see the step's key j (j = i or an ancestor: a chain's j <= i, a tree's ancestors)


def pad_step(segments: Sequence[Segment], rows: int, tokens: int, scratch: int,
             trees: Optional[Sequence[Optional[Sequence[int]]]] = None) -> StepIndex:
    """The index of a step padded to `rows` x `tokens`: segment i's n_i real queries write their slot at positions
    past_i .. past_i + n_i − 1; its padding queries continue its positions but write the scratch slot; padding rows
    read and write only the scratch slot. trees[i]: the parents of segment i's positions when they are a draft tree
    (hat_split.math.tree; −1: below the slot's end): each sits at past_i + its depth − 1 and sees its ancestors only.
    The ancestor masks are arrays, built in O(rows · tokens²) vectorised work: a 2k-position prompt chunk's is 4 MB
    and a few milliseconds, where lists of lists took half a second."""
    if len(segments) > rows or any(n > tokens for _, _, n in segments):
        raise ValueError(f"{len(segments)} segments of up to {max(n for _, _, n in segments)} positions do not fit "
                         f"a {rows} x {tokens} step")
    out = StepIndex([], [], [], [], [], np.empty((rows, tokens, tokens), np.uint8))
    out.ancestors[:] = np.tri(tokens, dtype=np.uint8)  # every row a chain, until a tree replaces its nodes' rows
    for r in range(rows):
        slot, past, n = segments[r] if r < len(segments) else (scratch, 0, 0)
        tree = trees[r] if trees is not None and r < len(segments) else None
        out.rows.append(slot)
        out.past.append(past)
        out.write_slot.append([slot if i < n else scratch for i in range(tokens)])
        out.write_pos.append([past + i if i < n else i for i in range(tokens)])
        if not tree:
            out.positions.append([past + i for i in range(tokens)])
            continue
        depth = _tree_rows(tree, out.ancestors[r])
        out.positions.append([past + depth[i] - 1 if i < n else past + i for i in range(tokens)])
    return out


def _tree_rows(parents: Sequence[int], anc: np.ndarray) -> List[int]:
    """Depths of a tree's nodes; writes its nodes' ancestor rows into `anc # [tokens, tokens]` (a chain's mask on
    entry: the padding queries after the tree stay a chain)."""
    depth: List[int] = []
    for i, p in enumerate(parents):
        p = int(p)
        if not -1 <= p < i:
            raise ValueError(f"node {i}'s parent {p} is not an earlier node")
        depth.append(1 if p < 0 else depth[p] + 1)
        anc[i] = anc[p] if p >= 0 else 0
        anc[i, i] = 1
    return depth
