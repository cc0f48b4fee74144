"""The local protocol's round (`slm`) over a LocalSession."""
from __future__ import annotations

from edge_runtime.sessions.local import LocalSession


def round_slm(session: LocalSession) -> None:
    """Device only: the draft model generates on its own, nothing crosses the link."""
    session.counters.rounds += 1
    session.commit_local()
