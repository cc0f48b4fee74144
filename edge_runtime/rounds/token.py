"""Rounds of the plain token protocols (`sd`, `hlm`, `llm`) over a TokenSession; `hlm` is also U-HLM's baseline."""
from __future__ import annotations

import time

from edge_runtime.sessions.token import TokenSession
from hat_split.wire import dist_codec


def verify_round(session: TokenSession, draft_len: int, dist_format: str, stop_below: float = 0.0) -> None:
    """Draft up to `draft_len` tokens, send them with their distributions, commit the cloud's verdict; log the round
    (committed, drafted, wall time) for the speedup accounting."""
    t0, before = time.perf_counter(), len(session.generated)
    wire = dist_codec.FloatWire(session.drafter.wire_dtype, dist_format)
    drafts, rows = session.drafter.draft(session.cap_draft_len(draft_len), session.rng, stop_below, wire)
    session.verify(drafts, wire.pack(rows))
    session.counters.verify_log.append([len(session.generated) - before, len(drafts), time.perf_counter() - t0])


def round_sd(session: TokenSession) -> None:
    """Speculative decoding: γ drafts (fewer after a confidence stop) and their distributions per round."""
    c = session.config
    verify_round(session, c.draft_len, c.dist_format, c.draft_stop_prob)


def round_hlm(session: TokenSession) -> None:
    """U-HLM §II baseline: one draft token and its full (dense) distribution every round."""
    verify_round(session, 1, "dense")


def round_llm(session: TokenSession) -> None:
    """Cloud only: the target decodes a chunk of tokens on its own."""
    session.generate(session.config.llm_chunk)
