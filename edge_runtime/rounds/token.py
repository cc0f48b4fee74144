"""Rounds of the plain token protocols (`sd`, `hlm`, `llm`) over a TokenSession; `hlm` is also U-HLM's baseline."""
from __future__ import annotations

import time

import numpy as np

from edge_runtime.sessions.token import TokenSession
from hat_split.math.tree import check_tree
from hat_split.wire import dist_codec


def verify_round(session: TokenSession, draft_len: int, dist_format: str, stop_below: float = 0.0) -> None:
    """Draft up to `draft_len` tokens, send them with their distributions, commit the cloud's verdict; log the round
    (committed, drafted, wall time) for the speedup accounting."""
    t0, before = time.perf_counter(), len(session.generated)
    wire = dist_codec.FloatWire(session.drafter.wire_dtype, dist_format)
    drafts, rows = session.drafter.draft(session.cap_draft_len(draft_len), session.rng, stop_below, wire)
    session.verify(drafts, wire.pack(rows))
    session.counters.verify_log.append([len(session.generated) - before, len(drafts), time.perf_counter() - t0])


def tree_round(session: TokenSession, nodes: int, depth: int, width: int, dist_format: str,
               stop_below: float = 0.0) -> None:
    """Draft a tree (Drafter.draft_tree: at most `nodes` nodes, `depth` levels, `width` children per expanded node,
    within the cloud's limits and the request's remaining tokens), send it with the distributions its children were
    drawn from (none at temperature 0), commit the accepted path; logged as verify_round's rounds are, with the
    tree's depth as its drafted count (the draft's forwards: one per level, as a chain's per token)."""
    t0, before = time.perf_counter(), len(session.generated)
    welcome = session.client.welcome
    if not welcome.max_tree_nodes:
        raise ValueError("this cloud verifies no draft trees (an older cloud, max_tree_nodes 0, a llama.cpp cloud "
                         "whose sequence ids its sessions take, or a model the partition does not know): set "
                         "tree_nodes = 0 for chains")
    depth = max(1, min(depth, welcome.max_tree_depth, session.remaining - 1))
    tree, rows = session.drafter.draft_tree(min(nodes, welcome.max_tree_nodes), depth, width, session.rng,
                                            stop_below)
    holders = [0] + [int(p) + 1 for p in np.unique(tree.parents[tree.parents >= 0])]  # root, nodes with children
    wire = dist_codec.FloatWire(session.drafter.wire_dtype, dist_format)
    payload = (wire.pack([rows[i] for i in holders]) if rows else  # temperature 0: the cloud reads no row
               dist_codec.pack(np.zeros((0, welcome.vocab_size), np.float16), "sparse"))
    session.verify_tree(tree.parents, tree.tokens, payload)
    levels = int(check_tree(tree.parents, tree.tokens, len(tree.tokens), depth).max())  # the draft's forwards
    session.counters.verify_log.append([len(session.generated) - before, levels, time.perf_counter() - t0])


def round_sd(session: TokenSession) -> None:
    """Speculative decoding: γ drafts (fewer after a confidence stop) and their distributions per round; a draft tree
    when tree_nodes > 0."""
    c = session.config
    if c.tree_nodes:
        tree_round(session, c.tree_nodes, c.tree_depth, c.tree_width, c.dist_format, c.draft_stop_prob)
    else:
        verify_round(session, c.draft_len, c.dist_format, c.draft_stop_prob)


def round_hlm(session: TokenSession) -> None:
    """U-HLM §II baseline: one draft token and its full (dense) distribution every round."""
    verify_round(session, 1, "dense")


def round_llm(session: TokenSession) -> None:
    """Cloud only: the target decodes a chunk of tokens on its own."""
    session.generate(session.config.llm_chunk)
