"""auto's choices as a bench records them (`hat-bench auto --decisions`): every choice with every candidate's price
and the estimates it read, and the tokens its round committed, from edge_runtime.auto.DECISIONS, into the bench's
own report (stamped with its provenance), so a question about why auto chose what it did is answered by a command
of the project rather than by a wrapper outside it."""
from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from typing import Iterator, List, Optional

from edge_runtime.auto import DECISIONS


class Decisions(logging.Handler):
    """The choices DECISIONS records (`take`: those since the last take, in order, each with its round's tokens)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self._records: List[dict] = []
        self._guard = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        decision, tokens = getattr(record, "auto_decision", None), getattr(record, "auto_tokens", None)
        with self._guard:
            if decision is not None:
                self._records.append(dict(decision))
            elif tokens is not None:  # the round the request's last choice ran
                last = next((r for r in reversed(self._records) if r["request"] == tokens["request"]), None)
                if last is not None and "tokens" not in last:
                    last["tokens"] = tokens["tokens"]

    def take(self) -> List[dict]:
        """The choices recorded since the last take (the controller's identity left out: one request's)."""
        with self._guard:
            out, self._records = self._records, []
        return [{k: v for k, v in r.items() if k != "request"} for r in out]


@contextmanager
def recorded(on: bool) -> Iterator[Optional[Decisions]]:
    """A Decisions handler on DECISIONS for the block when `on` (its level and propagation as before after it: no
    other handler sees these records); else None, and DECISIONS stays off."""
    if not on:
        yield None
        return
    handler, before = Decisions(), (DECISIONS.level, DECISIONS.propagate)
    DECISIONS.setLevel(logging.DEBUG)
    DECISIONS.propagate = False
    DECISIONS.addHandler(handler)
    try:
        yield handler
    finally:
        DECISIONS.removeHandler(handler)
        DECISIONS.setLevel(before[0])
        DECISIONS.propagate = before[1]
