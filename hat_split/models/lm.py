"""A causal LM with an explicit, croppable KV cache: the compute both halves share.

This is the only place where the token protocols touch torch. Everything above it (verification, codecs, the wire
protocol, the scheduler) sees numpy arrays. One `CausalLM` wraps one loaded Hugging Face model; each generation
session owns a `KVState`, so one model can serve many sessions (the cloud) or one (the device).

Cache convention used everywhere in hatspec: a session's committed sequence is `tokens`; its KV cache covers a prefix
`tokens[:cache_len]`. Feeding `tokens[cache_len:]` (plus any draft tokens) brings the cache up to date and yields the
logits for the next positions. After a verification the cache is cropped back to the accepted prefix, so rejected
draft positions never leak into later steps.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, List, Sequence

import numpy as np

from hat_split.models.hf_cache import cache_kwargs, output_cache
from hat_split.models.loading import output_size
from hat_split.models.placement import to_host


def check_feed(n: int, n_logits: int) -> None:
    """A forward of n tokens returning the logits of the last n_logits positions: refuse what cannot be done."""
    if n == 0:
        raise ValueError("forward needs at least one token")
    if not 0 <= n_logits <= n:
        raise ValueError(f"n_logits={n_logits} must be in [0, {n}]")


def check_crop(state: "KVState", length: int) -> None:
    """A cache can be cropped to any length it holds, no further."""
    if not 0 <= length <= state.length:
        raise ValueError(f"cannot crop a cache of {state.length} positions to {length}")


def board_time(seconds: float, slowdown: float, sleep: Callable[[float], None] = time.sleep) -> float:
    """Emulate a board `slowdown` times slower: sleep the difference and return the stretched compute time. `sleep`
    may watch for a reply meanwhile (edge_runtime.client.CloudClient.wait), as a real board's CPU would.

    The sleep must leave the cores to the cloud beside it: call `wait_passively` before torch loads, or torch's
    OpenMP workers spin through every sleep and burn a core."""
    if slowdown > 1.0:
        sleep((slowdown - 1.0) * seconds)
        return seconds * slowdown
    return seconds


OMP_WAIT = "OMP_WAIT_POLICY"


def wait_passively(slowdown: float) -> str:
    """Load torch with its OpenMP workers waiting passively when a slowed board (slowdown > 1) will sleep between
    computations: otherwise each worker spins through the sleep (measured: a full core per extra second of emulated
    time at 2 threads). The OpenMP runtime reads the policy once, as torch loads it, so this runs before anything
    imports torch; the environment is restored at once, so processes started later (a cloud) are not affected. A
    policy the user set is kept. Returns what happened, for the log."""
    if slowdown <= 1.0:
        return "not slowed"
    if OMP_WAIT in os.environ:
        return f"{OMP_WAIT}={os.environ[OMP_WAIT]} (set by the user)"
    if "torch" in sys.modules:
        return "torch was loaded before the board slowdown was known: its OpenMP workers spin through the waits"
    os.environ[OMP_WAIT] = "PASSIVE"
    try:
        import torch  # noqa: F401  (the OpenMP runtime reads the policy now)
    finally:
        del os.environ[OMP_WAIT]
    return "passive"


@dataclass
class KVState:
    """One session's KV cache and how many positions it covers."""

    cache: Any = None  # transformers DynamicCache, created on first use
    length: int = 0  # number of positions held in the cache
    forward_s: float = 0.0  # accumulated model time of this session (seconds)
    forward_tokens: int = 0  # accumulated tokens fed through the model


@dataclass
class CausalLM:
    """A loaded causal LM (`transformers` model) plus the helpers to run it on a KVState."""

    model: Any
    vocab_size: int = field(init=False)  # size of the logits' last dim (may exceed the tokenizer's vocab)

    def __post_init__(self) -> None:
        self.vocab_size = output_size(self.model)

    def warm_up(self) -> None:
        """One throwaway forward: pages in memory-mapped weights and first-call allocations before timing starts."""
        self.forward(self.new_state(), [0, 0], n_logits=1)

    def new_state(self) -> KVState:
        return KVState()

    def forward(self, state: KVState, tokens: Sequence[int], n_logits: int = 1) -> np.ndarray:
        """Append `tokens` to the cache; return the logits of the last `n_logits` positions.

        tokens: the positions state.length .. state.length + len(tokens) - 1.
        Returns float32 `# [n_logits, vocab]` (n_logits <= len(tokens); 0 returns an empty array and skips the head).
        A multi-token chunk on top of an existing cache gets a causal mask aligned to the cache's end (transformers
        builds it from the cache position), so chunked and one-by-one feeding agree up to float rounding.
        """
        import torch
        from transformers import DynamicCache

        n = len(tokens)
        check_feed(n, n_logits)
        if state.cache is None:  # full layers everywhere: a sliding-window layer cannot crop back past its window,
            state.cache = DynamicCache()  # and the model's own masks apply the window (Gemma 3's local layers)
        device = self.model.device
        ids = torch.tensor([list(tokens)], dtype=torch.long).to(device)  # [1, n]
        positions = torch.arange(state.length, state.length + n, dtype=torch.long, device=device)  # [n]
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model(
                input_ids=ids,
                use_cache=True,
                **cache_kwargs(self.model, state.cache),
                cache_position=positions,
                position_ids=positions[None],
                logits_to_keep=max(n_logits, 1),
            )
        state.cache = output_cache(out)
        state.length += n
        state.forward_s += time.perf_counter() - t0
        state.forward_tokens += n
        if n_logits == 0:
            return np.zeros((0, self.vocab_size), dtype=np.float32)
        return to_host(out.logits[0, -n_logits:])  # [n_logits, vocab]

    def greedy(self, ids: Sequence[int], n: int, eos: Sequence[int] = ()) -> List[int]:
        """The model's own greedy continuation of `ids`: n tokens, or fewer ending with one of `eos` (the reference
        every exact protocol must reproduce at temperature 0)."""
        state, out = self.new_state(), []
        logits = self.forward(state, ids)
        while len(out) < n:
            out.append(int(logits[-1].argmax()))
            if out[-1] in eos:
                break
            logits = self.forward(state, [out[-1]])
        return out

    def crop(self, state: KVState, length: int) -> None:
        """Drop cached positions >= length (rejected drafts)."""
        check_crop(state, length)
        if length < state.length:
            state.cache.crop(length - state.length)  # transformers 5: a negative count removes that many
            state.length = length
