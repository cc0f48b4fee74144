"""One device's split-protocol session on the cloud (`hat`, `ushape`): the middle part's KV cache, nothing else.

The cloud never sees a token: it holds hidden states' keys and values for `cache.length` positions of the device's
sequence. Each `Hidden` request says where its states start (`position`); positions past it (the device's rejected
drafts) are cropped first, then the new shallow states run through layers [start, stop) and the last `want` deep
states go back.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from hat_split.partition import PartCache, Stack


@dataclass
class MiddleSession:
    stack: Stack
    session_id: int
    protocol: str
    hidden_format: str  # how deep states go back (hat_split.hidden_codec)
    cache: PartCache = field(default_factory=PartCache)
    step: int = 0
    last_active: float = field(default_factory=time.monotonic)
    compute_s: float = 0.0
    link_rtt_s: float = 0.0
    replied_at: float = 0.0

    @property
    def position(self) -> int:
        return self.cache.length

    def run(self, position: int, states: np.ndarray, want: int) -> np.ndarray:
        """Crop to `position`, run shallow states `# [n, hidden]`; return the last `want` deep states float32."""
        import torch

        if not 0 <= position <= self.cache.length:
            raise ValueError(f"position {position} outside the {self.cache.length} positions held")
        if not 0 <= want <= states.shape[0]:
            raise ValueError(f"want={want} must be in [0, {states.shape[0]}]")
        self.cache.crop(position)
        dtype = self.stack.model.model.embed_tokens.weight.dtype
        t0 = time.perf_counter()
        deep = self.stack.forward(self.cache, torch.from_numpy(np.ascontiguousarray(states)).to(dtype)[None])
        out = deep[0, deep.shape[1] - want:].float().numpy() if want else np.zeros((0, states.shape[1]), np.float32)
        self.compute_s += time.perf_counter() - t0
        return out
