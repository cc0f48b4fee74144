"""The local family's session: the device decodes alone, nothing crosses the link, there is no cloud to open or
close (and no link to drop)."""
from __future__ import annotations

from typing import List

from edge_runtime.sessions.base import Session


class LocalSession(Session):
    def open(self, prompt: List[int]) -> None:
        self.drafter.start(prompt)

    def reopen(self, prompt: List[int]) -> None:
        raise RuntimeError("a local session has no cloud session to reopen")

    def close(self, prompt: List[int]) -> None:
        """Nothing to close: no cloud session was opened."""
