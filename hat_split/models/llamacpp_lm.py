"""A causal LM on llama.cpp (llama-cpp-python's low-level API): the GGUF file runs quantised, as llama.cpp runs it.

The same interface as hat_split.models.lm.CausalLM (`new_state`, `forward`, `crop`, `greedy`, `vocab_size`), so a
drafter or a verifier can run on either engine. One llama.cpp context serves every state: each `KVState` holds one
sequence id of that context (its `cache`), a forward appends the state's tokens to its sequence in one
`llama_decode` per `n_batch` chunk and returns the full logits rows asked for (exact speculative sampling needs the
whole row), and a crop removes the sequence's positions from the KV cache (`llama_memory_seq_rm`): the prefix is
never recomputed. A state's sequence id goes back to the pool when the state is garbage-collected.

llama-cpp-python is optional (scripts/install_llamacpp.sh builds it for this machine's CPU): a model needs it, and
hat_split.models.llamacpp_lib says how to install it.
"""
from __future__ import annotations

import ctypes
import gc
import os
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import List, Sequence, Tuple, Union

import numpy as np

from hat_split.models.llamacpp_lib import require_llama_cpp
from hat_split.models.llamacpp_rpc import rpc_devices
from hat_split.models.lm import CausalLM, KVState, check_crop, check_feed
from hat_split.models.registry import MODELS, gguf_path

def model_gguf(model: Union[str, Path]) -> Path:
    """The GGUF file llama.cpp runs for `model`: a registry name's assembled file, or a .gguf path as given."""
    if str(model) in MODELS:
        return gguf_path(str(model))
    if str(model).endswith(".gguf"):
        return Path(model)
    raise ValueError(f"llama.cpp runs GGUF files: give a registry model ({', '.join(MODELS)}) or a .gguf path, "
                     f"not {str(model)!r}")


@dataclass(frozen=True)
class LlamaCppSettings:
    """How the llama.cpp context is made (the role's config passes these whole)."""

    n_ctx: int = 4096  # KV positions of every sequence together (kv_unified): the longest prompt + answer, summed
    #                    over the sequences held at once
    n_batch: int = 512  # tokens per llama_decode: a longer chunk is fed in several calls
    n_threads: int = 0  # CPU threads; 0 = every core this process may use
    n_seq_max: int = 1  # states held at once (sequence ids): 1 on a device, one per session in a cloud
    flash_attn: bool = True  # llama.cpp's fused attention: faster on long contexts; its rounding differs slightly
    n_gpu_layers: int = -1  # layers on the offload devices (a CUDA build's GPUs, or the RPC servers); -1: all. A
    #                         CPU build has no offload device: everything runs on the CPU
    rpc: Tuple[str, ...] = ()  # HOST:PORT of RPC servers (hat_split.models.llamacpp_rpc): the layers are spread over
    #                            their devices instead of this machine's

    def __post_init__(self) -> None:
        if self.n_ctx < 8 or self.n_batch < 1 or self.n_threads < 0 or self.n_seq_max < 1:
            raise ValueError("llama.cpp needs n_ctx >= 8, n_batch >= 1, n_threads >= 0 and n_seq_max >= 1")


class LlamaCppLM:
    """A GGUF model on llama.cpp with per-state sequences on one context."""

    def __init__(self, gguf: Union[str, Path], settings: LlamaCppSettings = LlamaCppSettings()):
        L = require_llama_cpp()
        self._L = L
        self.path = Path(gguf)
        self.settings = settings
        if not self.path.is_file():
            raise ValueError(f"{self.path} does not exist")
        with self.path.open("rb") as fh:
            if fh.read(4) != b"GGUF":
                raise ValueError(f"{self.path} is not a GGUF file")
        L.llama_backend_init()
        mparams = L.llama_model_default_params()
        mparams.n_gpu_layers = settings.n_gpu_layers
        if settings.rpc:  # the RPC servers' devices, NULL-terminated; kept alive with the model
            devices = rpc_devices(settings.rpc)
            self._devices = (ctypes.c_void_p * (len(devices) + 1))(*devices, None)
            mparams.devices = ctypes.cast(self._devices, ctypes.c_void_p)
        self._model = L.llama_model_load_from_file(str(self.path).encode(), mparams)
        if not self._model:
            raise ValueError(f"llama.cpp could not load {self.path} as a model")
        cparams = L.llama_context_default_params()
        cparams.n_ctx = settings.n_ctx
        cparams.n_batch = cparams.n_ubatch = settings.n_batch
        cparams.n_seq_max = settings.n_seq_max
        cparams.kv_unified = True  # every sequence may use the whole n_ctx
        cparams.flash_attn_type = (L.LLAMA_FLASH_ATTN_TYPE_ENABLED if settings.flash_attn
                                   else L.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        threads = settings.n_threads or len(os.sched_getaffinity(0))
        cparams.n_threads = cparams.n_threads_batch = threads
        self._ctx = L.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            L.llama_model_free(self._model)
            raise ValueError(f"llama.cpp could not make a context of {settings.n_ctx} positions for {self.path}")
        self._memory = L.llama_get_memory(self._ctx)
        self.vocab_size = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self._model))  # width of a logits row
        self._batch = L.llama_batch_init(settings.n_batch, 0, 1)
        self._free: List[int] = list(range(settings.n_seq_max))
        self._closed = False

    def kv_bytes_per_position(self) -> int:
        """Bytes of the context's KV cache per position (f16 keys and values of every layer)."""
        L, m = self._L, self._model
        heads, kv_heads = L.llama_model_n_head(m), L.llama_model_n_head_kv(m)
        return 2 * L.llama_model_n_layer(m) * kv_heads * (L.llama_model_n_embd(m) // max(heads, 1)) * 2

    # -- states ----------------------------------------------------------------------------------------------------
    def new_state(self) -> KVState:
        """An empty state on a free sequence id (RuntimeError when n_seq_max states are alive)."""
        if not self._free:
            gc.collect()  # a dropped state held in a reference cycle frees its sequence at a collection
        if not self._free:
            raise RuntimeError(f"all {self.settings.n_seq_max} llama.cpp sequences are in use (n_seq_max)")
        seq = self._free.pop(0)
        self._L.llama_memory_seq_rm(self._memory, seq, -1, -1)
        state = KVState(cache=seq)
        weakref.finalize(state, self._release, seq)
        return state

    def _release(self, seq: int) -> None:
        if not self._closed:
            self._L.llama_memory_seq_rm(self._memory, seq, -1, -1)
            self._free.append(seq)

    # -- compute ---------------------------------------------------------------------------------------------------
    def forward(self, state: KVState, tokens: Sequence[int], n_logits: int = 1) -> np.ndarray:
        """Append `tokens` to the state's sequence; return float32 `# [n_logits, vocab]`, the logits of the last
        n_logits positions (0: an empty array)."""
        return self.forward_many([state], [tokens], [n_logits])[0]

    def forward_many(self, states: Sequence[KVState], feeds: Sequence[Sequence[int]],
                     n_logits: Sequence[int]) -> List[np.ndarray]:
        """Several states' chunks in as few `llama_decode` calls as n_batch allows (one batch, one sequence id per
        state): a cloud's step of many sessions. Returns each state's `# [n_logits_i, vocab]`; nothing changes when a
        feed is refused."""
        if not len(states) == len(feeds) == len(n_logits):
            raise ValueError("forward_many needs one feed and one n_logits per state")
        if len({id(s) for s in states}) != len(states):
            raise ValueError("a state may appear once per forward_many")
        for state, tokens, k in zip(states, feeds, n_logits):
            check_feed(len(tokens), k)
            bad = [t for t in tokens if not 0 <= int(t) < self.vocab_size]
            if bad:
                raise ValueError(f"token ids {bad[:5]} are outside the vocabulary of {self.vocab_size}")
            if state.length + len(tokens) > self.settings.n_ctx:
                raise ValueError(f"a context of {state.length + len(tokens)} positions is longer than the "
                                 f"{self.settings.n_ctx} configured (n_ctx)")
        # every position as (state index, index in its feed); rows wanted: the last n_logits of each feed
        items = [(i, j) for i, tokens in enumerate(feeds) for j in range(len(tokens))]
        outs = [np.empty((k, self.vocab_size), dtype=np.float32) for k in n_logits]
        L, b, step = self._L, self._batch, self.settings.n_batch
        t0 = time.perf_counter()
        for lo in range(0, len(items), step):
            chunk = items[lo:lo + step]
            wanted = []
            for slot, (i, j) in enumerate(chunk):
                first = len(feeds[i]) - n_logits[i]
                b.token[slot] = int(feeds[i][j])
                b.pos[slot] = states[i].length + j
                b.n_seq_id[slot] = 1
                b.seq_id[slot][0] = states[i].cache
                b.logits[slot] = j >= first
                if j >= first:
                    wanted.append((slot, i, j - first))
            b.n_tokens = len(chunk)
            rc = L.llama_decode(self._ctx, b)
            if rc == 1:  # the states' caches are then in an unknown state: their owner drops them
                raise RuntimeError(f"the KV cache is full: every state together holds at most n_ctx = "
                                   f"{self.settings.n_ctx} positions")
            if rc != 0:
                raise RuntimeError(f"llama_decode failed ({rc})")
            for slot, i, row in wanted:
                ptr = ctypes.cast(L.llama_get_logits_ith(self._ctx, slot), ctypes.POINTER(ctypes.c_float))
                outs[i][row] = np.ctypeslib.as_array(ptr, shape=(self.vocab_size,))
        dt = time.perf_counter() - t0
        total = max(1, len(items))
        for state, tokens in zip(states, feeds):
            state.length += len(tokens)
            state.forward_s += dt * len(tokens) / total  # the step's time, shared by tokens
            state.forward_tokens += len(tokens)
        return outs

    def crop(self, state: KVState, length: int) -> None:
        """Drop the state's positions >= length from the KV cache (rejected drafts)."""
        check_crop(state, length)
        if length < state.length:
            if not self._L.llama_memory_seq_rm(self._memory, state.cache, length, -1):
                raise RuntimeError(f"llama.cpp could not remove positions {length}.. of sequence {state.cache}")
            state.length = length

    def eog_ids(self) -> List[int]:
        """The tokens that end a generation, as the GGUF file declares them (end of sequence, end of turn)."""
        vocab = self._L.llama_model_get_vocab(self._model)
        return [t for t in range(self.vocab_size) if self._L.llama_vocab_is_eog(vocab, t)]

    greedy = CausalLM.greedy  # the same reference loop over new_state / forward
    warm_up = CausalLM.warm_up

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._L.llama_batch_free(self._batch)
            self._L.llama_free(self._ctx)
            self._L.llama_model_free(self._model)

    def __enter__(self) -> "LlamaCppLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
