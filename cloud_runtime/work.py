"""The model work as the cloud's request handling sees it, plain Python and numpy (no torch): the terms the server,
its handlers and the work runner share, so that none of them imports another for its types.

- `ModelWork`: the work runner, `CloudServer.work`: sessions' KV caches by key, model work queued with the rows it
  wants back, computed one step at a time (cloud_runtime.batching.Batcher: batched layer-by-layer steps, in this
  process or pipeline stages; cloud_runtime.cache_runner.CacheRunner: a model on its own caches, e.g. llama.cpp).
- `Pending`: a request whose model work is queued; the runner hands it back with the work's rows, and the finisher
  of the request's handler (cloud_runtime.token_handlers, cloud_runtime.split_handlers) builds the reply from it.
- `ModelFacts`: what the handlers know of the target, read once from the loaded model (cloud_runtime.server).
- `Key`: a session's key everywhere in the cloud, (device identity, session id).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, List, Optional, Protocol, Sequence, Tuple

import numpy as np

from hat_split.math.chunking import DelayModel
from hat_split.math.logprobs import Logprobs
from hat_split.wire import messages as P

Key = Tuple[bytes, int]  # (device identity, session id)


@dataclass(frozen=True)
class ModelFacts:
    """What the handlers know of the target, read once from the loaded model."""

    name: str  # the model's name in the Welcome
    vocab_fingerprint: str  # hat_split.models.loading.vocab_fingerprint: a device's vocabulary must match it
    vocab_size: int  # token ids must be below this (the logits' width)
    layers: int  # decoder layers: a token session runs [0, layers)
    hidden_size: int  # width of the split protocols' states
    fingerprint: str = ""  # hat_split.models.partition.model_fingerprint: a device's parts must come from this model
    split_refusal: str = ""  # why the split protocols cannot run on this model; "" when they can
    tree_refusal: str = ""  # why this model verifies no draft trees; "" when it does
    max_tree_nodes: int = 1024  # the most nodes one tree may have on this model's caches (llama.cpp: the sequence
    #                             ids its sessions leave free, a path per leaf)

    def tree_nodes(self, config_nodes: int) -> int:
        """The largest draft tree a Verify may carry here: the config's (CloudConfig.tree_nodes) within the model's
        own limit; 0 when the model takes no trees."""
        return 0 if self.tree_refusal else min(config_nodes, self.max_tree_nodes)


@dataclass
class Pending:
    """A request whose model work is queued: what its reply needs once the work comes back."""

    identity: bytes
    msg: Any  # the request
    session: Any  # TargetSession or MiddleSession; its compute_s gets this work's share of each step
    uplink_bps: float = 0.0  # the rate the request's upload saw (Verdict, Deep)
    compute_s: float = 0.0  # compute time of the steps this request took part in
    draft: List[int] = field(default_factory=list)  # Verify: the drafts
    parents: Optional[np.ndarray] = None  # Verify of a draft tree: each draft's parent `# [L]` (None: a chain)
    q: Optional[np.ndarray] = None  # Verify: the drafts' distributions `# [L, vocab]`
    generated: List[int] = field(default_factory=list)  # Generate: the tokens sampled so far
    logprobs: List[Logprobs] = field(default_factory=list)  # Generate: theirs, when the session asked
    probs: List[float] = field(default_factory=list)  # Generate: each one's probability as drawn (TargetState.drawn_p)
    received_at: float = 0.0  # when the request was read (sessions.Arrival.at): the reply's held_s counts from here
    unseen_s: float = 0.0  # ... and how long before it may have arrived (Arrival.unseen_s): the reply's unseen_s


class ModelWork(Protocol):
    """The model side (cloud_runtime.batching.Batcher, cloud_runtime.cache_runner.CacheRunner): sessions' caches by
    key, work queued with the rows it wants back. `submit_states` is only called for split sessions, which a model
    without `ModelFacts.split_refusal` alone opens (the Batcher)."""

    stages: int  # pipeline stages of the middle part
    load: DelayModel  # HAT state monitoring (eq. 1-2), fed by every step it computes
    stats: Any  # cloud_runtime.batching.StepStats of its steps
    scheduler: Any  # cloud_runtime.scheduler.Scheduler that plans its steps
    launches: int  # batches (steps) launched so far
    wake_socket: Any  # a ZeroMQ socket readable when a pipeline batch is back; None: steps finish inside step()

    # -- what the handlers use --
    def open(self, key: Hashable, start: int, stop: int, owner: Hashable = None) -> None: ...

    def close(self, key: Hashable) -> None: ...

    def held(self, key: Hashable) -> Tuple[int, int]: ...  # (positions computed, positions queued)

    def held_bytes(self, key: Hashable) -> int: ...  # bytes of KV cache a session holds (context and queued)

    def kv_cost(self, start: int, stop: int) -> int: ...  # bytes of KV cache per position of layers [start, stop)

    def crop(self, key: Hashable, length: int) -> None: ...

    def keep(self, key: Hashable, start: int, rows: Sequence[int]) -> None: ...  # a tree's path kept (Batcher only)

    def submit_tokens(self, key: Hashable, tokens: Sequence[int], logits: int, tag: Pending,
                      tree: Optional[Sequence[int]] = None) -> None: ...  # tree: Batcher only

    def submit_states(self, key: Hashable, states: np.ndarray, want: int, tag: Pending,
                      tree: Optional[Sequence[int]] = None) -> None: ...

    # -- what the server's loop uses --
    @property
    def kv_used(self) -> int: ...  # KV positions held by every session

    @property
    def busy(self) -> bool: ...  # work queued or in pipeline stages

    @property
    def can_launch(self) -> bool: ...  # a step could start now

    def step(self) -> Any: ...  # cloud_runtime.batching.Finished: the works done, failed and sessions dropped

    def shutdown(self) -> None: ...


def cloud_state(work: ModelWork) -> P.CloudState:
    """The cloud's load as devices see it (HAT §3.2): μ, g(μ) and the pipeline's stages."""
    return P.CloudState(work.load.mu or 0.0, work.load.g_mu(), work.stages)


def cloud_cost(work: ModelWork, device: Hashable = None, others: int = 0, pace: float = 0.0) -> P.CloudCost:
    """What a step costs now (hat_split.wire.messages.CloudCost) as `device` sees it: g's points, μ, the sessions
    with work waiting, the KV positions free, the `others` devices using the cloud besides it
    (cloud_runtime.sessions.SessionTable.others_active) and their positions per step, the share of the last seconds
    spent in steps (StepStats.duty), for the devices' cost models; and the operator's fleet pace
    (CloudConfig.fleet_pace_tokens_per_s)."""
    return P.CloudCost([list(p) for p in work.load.points()], work.load.mu or 0.0, work.scheduler.waiting,
                       work.scheduler.kv_free, others, work.scheduler.others_positions(device), work.stats.duty(),
                       pace)
