"""One device's split-protocol session on the cloud (`hat`, `ushape`): the middle part's KV cache, nothing else.

The cloud never sees a token: it holds hidden states' keys and values for `position` positions of the device's
sequence (in this process, or spread over pipeline stages). Each `Hidden` request says where its states start
(`position`); positions past it (the device's rejected drafts) are cropped first, then the new shallow states run through layers [start, stop) in a batched step with other
sessions' work (cloud_runtime.batching) and the last `want` deep states go back.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field



@dataclass
class MiddleSession:
    session_id: int
    protocol: str
    hidden_format: str  # how deep states go back (hat_split.wire.hidden_codec)
    start: int  # the middle layers [start, stop)
    stop: int
    position: int = 0  # positions computed (the cache's length, wherever its layers live), as of the last reply
    step: int = 0
    last_active: float = field(default_factory=time.monotonic)
    compute_s: float = 0.0
    link_rtt_s: float = 0.0
    replied_at: float = 0.0
