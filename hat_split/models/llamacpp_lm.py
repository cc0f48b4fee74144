"""A causal LM on llama.cpp (llama-cpp-python's low-level API): the GGUF file runs quantised, as llama.cpp runs it.

The same interface as hat_split.models.lm.CausalLM (`new_state`, `forward`, `crop`, `greedy`, `vocab_size`), so a
drafter or a verifier can run on either engine. One llama.cpp context serves every state: each `KVState` holds one
sequence id of that context (its `cache`), a forward appends the state's tokens to its sequence in one
`llama_decode` per `n_batch` chunk and returns the full logits rows asked for (exact speculative sampling needs the
whole row), and a crop removes the sequence's positions from the KV cache (`llama_memory_seq_rm`): the prefix is
never recomputed. A state's sequence id goes back to the pool when the state is garbage-collected.

Draft trees (`forward_tree`, `keep`, and trees in `forward_many`) run on sequence-id sets, a sequence per path
(planned by hat_split.models.llamacpp_tree). `keep` moves the accepted path's cells into the state's own sequence
and removes the tree's sequences: the other branches' cells are freed, the path's stay where they are, nothing is
recomputed.

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
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from hat_split.models.llamacpp_lib import require_llama_cpp
from hat_split.models.llamacpp_tree import SeqTree, TreePlan, plan_tree
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
    n_seq_max: int = 1  # sequence ids: states held at once (1 on a device, one per session in a cloud) plus the
    #                     paths of the draft trees cached at once (a tree of N nodes needs at most N)
    flash_attn: bool = True  # llama.cpp's fused attention: faster on long contexts; its rounding differs slightly
    n_gpu_layers: int = -1  # layers on the offload devices (a CUDA build's GPUs, or the RPC servers); -1: all. A
    #                         CPU build has no offload device: everything runs on the CPU
    rpc: Tuple[str, ...] = ()  # HOST:PORT of RPC servers (hat_split.models.llamacpp_rpc): the layers are spread over
    #                            their devices instead of this machine's

    def __post_init__(self) -> None:
        if self.n_ctx < 8 or self.n_batch < 1 or self.n_threads < 0 or self.n_seq_max < 1:
            raise ValueError("llama.cpp needs n_ctx >= 8, n_batch >= 1, n_threads >= 0 and n_seq_max >= 1")


def max_sequences() -> int:
    """The most sequence ids a llama.cpp context may have (LLAMA_MAX_SEQ of the installed build)."""
    return int(require_llama_cpp().llama_max_parallel_sequences())


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
        self._batch = L.llama_batch_init(settings.n_batch, 0, settings.n_seq_max)
        self._free: List[int] = list(range(settings.n_seq_max))
        self._trees: Dict[int, SeqTree] = {}  # a state's sequence → the draft tree cached after it, until keep / crop
        self._closed = False

    def kv_bytes_per_position(self) -> int:
        """Bytes of the context's KV cache per position (f16 keys and values of every layer)."""
        L, m = self._L, self._model
        heads, kv_heads = L.llama_model_n_head(m), L.llama_model_n_head_kv(m)
        return 2 * L.llama_model_n_layer(m) * kv_heads * (L.llama_model_n_embd(m) // max(heads, 1)) * 2

    @property
    def free_sequences(self) -> int:
        """Sequence ids free now: for new states, or for draft trees' paths (one per leaf of a tree)."""
        return len(self._free)

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
            self._drop_tree(seq)
            self._L.llama_memory_seq_rm(self._memory, seq, -1, -1)
            self._free.append(seq)

    def _drop_tree(self, seq: int) -> None:
        """Remove the tree cached after sequence `seq` (its cells and sequences), if any."""
        tree = self._trees.pop(seq, None)
        for s in tree.seqs if tree is not None else ():
            self._L.llama_memory_seq_rm(self._memory, s, -1, -1)
            self._free.append(s)

    # -- compute ---------------------------------------------------------------------------------------------------
    def forward(self, state: KVState, tokens: Sequence[int], n_logits: int = 1) -> np.ndarray:
        """Append `tokens` to the state's sequence; return float32 `# [n_logits, vocab]`, the logits of the last
        n_logits positions (0: an empty array)."""
        return self.forward_many([state], [tokens], [n_logits])[0]

    def forward_tree(self, state: KVState, parents: Sequence[int], tokens: Sequence[int], start: int) -> np.ndarray:
        """A draft tree's new nodes (the last len(tokens) entries of `parents`, the tree so far; −1 = below the
        state's last position) on a tree begun at cache position `start`; float32 logits `# [len(tokens), vocab]`
        after each new node (hat_split.models.tree_lm.TreeLM's interface)."""
        if not tokens:
            raise ValueError("a tree step needs at least one node")
        return self.forward_many([state], [tokens], [len(tokens)], [(parents, start)])[0]

    def forward_many(self, states: Sequence[KVState], feeds: Sequence[Sequence[int]], n_logits: Sequence[int],
                     trees: Optional[Sequence[Optional[Tuple[Sequence[int], int]]]] = None) -> List[np.ndarray]:
        """Several states' chunks in as few `llama_decode` calls as n_batch allows (one batch, one sequence id per
        state): a cloud's step of many sessions. trees[i]: None for a chain, or (parents of the tree so far, the
        position it began at) when feed i is that tree's last len(feed) nodes (`forward_tree`). Returns each
        state's `# [n_logits_i, vocab]`; nothing changes when a feed is refused."""
        trees = list(trees) if trees is not None else [None] * len(states)
        if not len(states) == len(feeds) == len(n_logits) == len(trees):
            raise ValueError("forward_many needs one feed, one n_logits and one tree (or None) per state")
        if len({id(s) for s in states}) != len(states):
            raise ValueError("a state may appear once per forward_many")
        for state, tokens, k, tree in zip(states, feeds, n_logits, trees):
            check_feed(len(tokens), k)
            bad = [t for t in tokens if not 0 <= int(t) < self.vocab_size]
            if bad:
                raise ValueError(f"token ids {bad[:5]} are outside the vocabulary of {self.vocab_size}")
            if state.length + len(tokens) > self.settings.n_ctx:
                raise ValueError(f"a context of {state.length + len(tokens)} positions is longer than the "
                                 f"{self.settings.n_ctx} configured (n_ctx)")
            if tree is None and state.cache in self._trees:
                raise ValueError("this state holds a draft tree: keep its accepted path or crop it first")
            if tree is not None and len(tokens) > self.settings.n_batch:
                raise ValueError(f"a tree step of {len(tokens)} nodes is longer than one batch (n_batch = "
                                 f"{self.settings.n_batch})")
        plans = [None if t is None else plan_tree(self._trees.get(s.cache), s.cache, s.length, t[0], len(f), t[1])
                 for s, f, t in zip(states, feeds, trees)]
        need = sum(p.taken for p in plans if p is not None)
        if need > len(self._free):
            raise RuntimeError(f"the draft trees of this step need {need} llama.cpp sequences, {len(self._free)} are "
                               f"free (n_seq_max = {self.settings.n_seq_max})")
        taken = [self._free.pop(0) for _ in range(need)]
        at = 0
        for plan in plans:  # the taken sequences get their ids, and the prefixes are marked as theirs
            if plan is not None:
                plan.bind(taken[at:at + plan.taken])
                at += plan.taken
                for src, dst, end in plan.copies:
                    self._L.llama_memory_seq_cp(self._memory, src, dst, -1, end)
        try:
            outs = self._decode(states, feeds, n_logits, plans)
        except RuntimeError:
            for s in taken:  # the states' caches are in an unknown state: their owner drops them
                self._L.llama_memory_seq_rm(self._memory, s, -1, -1)
                self._free.append(s)
            raise
        for state, plan in zip(states, plans):
            if plan is not None:
                self._trees[state.cache] = plan.tree
        return outs

    def _decode(self, states: Sequence[KVState], feeds: Sequence[Sequence[int]], n_logits: Sequence[int],
                plans: Sequence[Optional[TreePlan]]) -> List[np.ndarray]:
        """The batches: every position as (state index, index in its feed), a tree's nodes never split between two
        llama_decode calls; the rows wanted are the last n_logits of each feed."""
        chunks: List[List[Tuple[int, int]]] = [[]]
        step = self.settings.n_batch
        for i, tokens in enumerate(feeds):
            if plans[i] is not None and len(chunks[-1]) + len(tokens) > step:
                chunks.append([])
            for j in range(len(tokens)):
                if len(chunks[-1]) == step:
                    chunks.append([])
                chunks[-1].append((i, j))
        outs = [np.empty((k, self.vocab_size), dtype=np.float32) for k in n_logits]
        L, b = self._L, self._batch
        t0 = time.perf_counter()
        for chunk in chunks:
            if not chunk:
                continue
            wanted = []
            for slot, (i, j) in enumerate(chunk):
                first = len(feeds[i]) - n_logits[i]
                b.token[slot] = int(feeds[i][j])
                plan = plans[i]
                seqs = [states[i].cache] if plan is None else plan.seq_ids[j]
                b.pos[slot] = states[i].length + j if plan is None else plan.positions[j]
                b.n_seq_id[slot] = len(seqs)
                for k, s in enumerate(seqs):
                    b.seq_id[slot][k] = s
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
        total = max(1, sum(len(f) for f in feeds))
        for state, tokens in zip(states, feeds):
            state.length += len(tokens)
            state.forward_s += dt * len(tokens) / total  # the step's time, shared by tokens
            state.forward_tokens += len(tokens)
        return outs

    def keep(self, state: KVState, start: int, rows: Sequence[int]) -> None:
        """Of the draft tree cached on the state, keep the positions from `start` on that are `rows` (offsets from
        start; with the tree's nodes before start, a path from its top): their cells join the state's sequence in
        place, every other node's cells are freed."""
        tree = self._trees.get(state.cache)
        if tree is None:  # a chain (a tree none of whose nodes were cached): rows in place are a crop
            if [int(r) for r in rows] != list(range(len(rows))) or not 0 <= start + len(rows) <= state.length:
                raise ValueError(f"this state holds no draft tree: rows {list(rows)} after position {start} are not "
                                 "its positions in place")
            self.crop(state, start + len(rows))
            return
        if not tree.start <= start <= state.length:
            raise ValueError(f"cannot keep from position {start}: the tree holds positions {tree.start}.."
                             f"{state.length - 1}")
        kept = list(range(start - tree.start)) + [start - tree.start + int(r) for r in rows]
        for k, node in enumerate(kept):
            if not 0 <= node < len(tree.parents) or tree.parents[node] != (kept[k - 1] if k else -1):
                raise ValueError(f"rows {list(rows)} after position {start} are not a path of the draft tree "
                                 "from its top")
        if kept:
            last = kept[-1]
            self._L.llama_memory_seq_cp(self._memory, tree.seq_of[last], state.cache, tree.start,
                                        tree.start + tree.depth[last] + 1)
        self._drop_tree(state.cache)
        state.length = tree.start + len(kept)

    def crop(self, state: KVState, length: int) -> None:
        """Drop the state's positions >= length from the KV cache (rejected drafts); a draft tree goes whole (a
        length inside it is refused: keep its path instead)."""
        check_crop(state, length)
        tree = self._trees.get(state.cache)
        if tree is not None:
            if tree.start < length < state.length:
                raise ValueError(f"cannot crop a draft tree (positions {tree.start}..{state.length - 1}) to "
                                 f"{length}: keep its accepted path")
            if length < state.length:
                self._drop_tree(state.cache)
                state.length = min(state.length, tree.start)
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
