"""What the cloud keeps per device session, plain Python (no torch): the model's caches live in the runner, keyed by
the same (device identity, session id).

- `TokenSession` (`sd`, `hlm`, `llm`, ...): the target's state (hat_split.math.target_state: committed tokens,
  sampling, the cloud's random stream); the cache covers a prefix of the committed tokens, the runner says how much.
- `MiddleSession` (`hat`, `ushape`): the middle part's bookkeeping, nothing else. The cloud never sees a token: it
  holds hidden states' keys and values for `position` positions of the device's sequence (in this process, or spread
  over pipeline stages). Each `Hidden` request says where its states start (`position`); positions past it (the
  device's rejected drafts) are cropped first, then the new shallow states run through layers [start, stop) in a
  batched step with other sessions' work and the last `want` deep states go back.

Both keep what the uplink estimate and the idle timer need (cloud_runtime.handlers, cloud_runtime.server).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Hashable, List, Optional

from hat_split.math.target_state import TargetState


@dataclass
class TokenSession:
    session_id: int
    protocol: str
    target: TargetState  # committed tokens, sampling parameters, the cloud's random stream
    device: Hashable = None  # the device it belongs to (cloud_runtime.quotas): its quotas and fair share
    step: int = 0  # last request step served
    last_active: float = field(default_factory=time.monotonic)  # monotonic time of the last answer or request
    compute_s: float = 0.0  # model time spent on this session (its share of each batched step), seconds
    link_rtt_s: float = 0.0  # the device's tiny-message round trip (OpenSession): baseline of the uplink estimate
    replied_at: float = 0.0  # perf_counter() when the last reply to this session left
    logprobs: Optional[int] = None  # k: replies carry the committed tokens' log-probabilities (OpenSession.logprobs)

    @property
    def tokens(self) -> List[int]:
        """The committed sequence: prompt + generated."""
        return self.target.tokens


@dataclass
class MiddleSession:
    session_id: int
    protocol: str
    hidden_format: str  # how deep states go back (hat_split.wire.hidden_codec)
    start: int  # the middle layers [start, stop)
    stop: int
    device: Hashable = None  # the device it belongs to (cloud_runtime.quotas): its quotas and fair share
    position: int = 0  # positions computed (the cache's length, wherever its layers live), as of the last reply
    step: int = 0  # last request step served
    last_active: float = field(default_factory=time.monotonic)  # monotonic time of the last answer or request
    compute_s: float = 0.0  # model time spent on this session (its share of each batched step), seconds
    link_rtt_s: float = 0.0  # the device's tiny-message round trip (OpenSplit): baseline of the uplink estimate
    replied_at: float = 0.0  # perf_counter() when the last reply to this session left
