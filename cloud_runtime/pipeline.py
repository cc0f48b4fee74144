"""Pipeline-parallel middle layers (HAT §3.3, §4.5): the model's layers cut into P consecutive stages, one
torch.distributed process each, launched by torchrun (`hat-cloud serve --pipeline P`). On CPUs the stages talk over
gloo; on CUDA each stage holds the GPU of its local rank and the states go GPU to GPU over NCCL (descriptors still
over gloo: the process group has both backends). Several nodes: torchrun's own rendezvous (docs/GPU.md).

Rank 0 is the server: it owns the socket, the scheduler and stage 0 (layers [0, b1)); rank r owns layers
[b_r, b_{r+1}). A batch goes 0 → 1 → … → P−1 and its outputs come back from P−1 to rank 0. Rank 0 plans the next
batch as soon as its own stage is free, so up to P batches are in flight and the stages overlap (the scheduler
starts each segment where the session's planned positions end; every stage processes batches in order, so each
session's KV cache of a stage's layers grows in order too).

Between stages a batch travels as three messages: an int64 length, a msgpack descriptor (step, the segments' jobs,
the cache operations every stage applies first, each stage's model time) and the segments' states concatenated
along positions, sent as raw bytes in the model's dtype. Outputs come back on a second process group ([0, P−1]) so
that rank 0's receiver thread never shares a communicator with its sends.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import astuple
from datetime import timedelta
from typing import Any, Dict, List, Optional, Sequence, Tuple

import msgspec
import numpy as np
import zmq

from cloud_runtime.runner import Job, KvLayout, StageRunner
from hat_split.models.partition import free_layers
from hat_split.models.placement import is_cuda, resolve_device

log = logging.getLogger("hatspec.cloud")
IDLE_TIMEOUT = timedelta(days=30)  # a stage waits this long for its next batch (an idle server is not an error)


def stage_bounds(n_layers: int, stages: int) -> List[int]:
    """Layer boundaries b_0 = 0 < b_1 < … < b_P = n_layers. Layer 0 never leaves a device (a split keeps at least one
    layer there), so layers [1, n) are shared out as evenly as possible, the later stages taking the remainder."""
    if not 1 <= stages <= n_layers - 1:
        raise ValueError(f"{stages} pipeline stages cannot share the {n_layers - 1} layers a cloud may run")
    per, extra = divmod(n_layers - 1, stages)
    bounds = [0, 1 + per]
    for r in range(1, stages):
        bounds.append(bounds[-1] + per + (1 if r >= stages - extra else 0))
    return bounds


def stage_device(device: str, stages: int) -> str:
    """The device of this process's stage: on CUDA (device cuda, or auto with a GPU) the GPU of torchrun's local
    rank, refused when this node has fewer GPUs than it runs stages (NCCL needs one GPU per rank); else the CPU."""
    import torch

    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return "cpu"
    resolve_device("cuda")  # refuses a torch or a machine without CUDA
    local = int(os.environ.get("LOCAL_RANK", "0"))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", str(stages)))
    gpus = torch.cuda.device_count()
    if per_node > gpus:
        raise ValueError(f"--pipeline {stages}: this node runs {per_node} stages on CUDA but sees {gpus} GPU(s); "
                         f"NCCL needs one GPU per stage: use more GPUs or nodes (docs/GPU.md), or --device cpu (gloo)")
    return f"cuda:{local}"


def init(stages: int, device: str = "cpu") -> Tuple[int, Any]:
    """Join torchrun's process group (gloo; on CUDA gloo for descriptors and NCCL for the GPU's tensors); returns
    (rank, the [0, P−1] group outputs come back on)."""
    import torch
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "0"))
    if world != stages:
        raise RuntimeError(f"--pipeline {stages} needs {stages} processes under torchrun; WORLD_SIZE is "
                           f"{world or 'unset'}")
    if is_cuda(device):
        torch.cuda.set_device(torch.device(device))
        dist.init_process_group("cpu:gloo,cuda:nccl", timeout=IDLE_TIMEOUT, device_id=torch.device(device))
    else:
        dist.init_process_group("gloo", timeout=IDLE_TIMEOUT)
    back = dist.new_group([0, stages - 1], timeout=IDLE_TIMEOUT)
    return dist.get_rank(), back


def place_stage(model: Any, rank: int, stages: int, device: str) -> None:
    """Keep what stage `rank` runs and move it to `device`: the stage's layers, and on rank 0 (the server) also the
    embeddings and the head; the other layers are freed first, so a GPU only ever holds its own slice."""
    import torch

    bounds = stage_bounds(model.config.num_hidden_layers, stages)
    lo, hi = bounds[rank], bounds[rank + 1]
    free_layers(model, [i for i in range(len(model.model.layers)) if not lo <= i < hi])
    if rank > 0:
        model.model.embed_tokens = torch.nn.Identity()
        model.lm_head = torch.nn.Identity()
    model.to(device)


# -- the wire between stages --------------------------------------------------------------------------------------
def _send(desc: Dict[str, Any], x: Optional[Any], dst: int, group: Any = None) -> List[Any]:
    """Start sending a descriptor and the states `# [1, total, hidden]` (None: none); returns the handles to wait."""
    import torch
    import torch.distributed as dist

    payload = torch.from_numpy(np.frombuffer(msgspec.msgpack.encode(desc), dtype=np.uint8).copy())
    handles = [dist.isend(torch.tensor([payload.numel()], dtype=torch.int64), dst, group=group),
               dist.isend(payload, dst, group=group)]
    if x is not None:
        handles.append(dist.isend(x.contiguous().view(torch.uint8), dst, group=group))
    return handles


def _recv(src: int, dtype: Any, hidden: int, group: Any = None, device: Any = "cpu") -> Tuple[Dict[str, Any],
                                                                                              Optional[Any]]:
    import torch
    import torch.distributed as dist

    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src, group=group)
    payload = torch.empty(int(size), dtype=torch.uint8)
    dist.recv(payload, src, group=group)
    desc = msgspec.msgpack.decode(payload.numpy().tobytes())
    if desc.get("stop"):
        return desc, None
    total = sum(job[4] for job in desc["jobs"])
    raw = torch.empty(1, total, hidden * torch.empty(0, dtype=dtype).element_size(), dtype=torch.uint8,
                      device=device)
    dist.recv(raw, src, group=group)
    return desc, raw.view(dtype)


def _split(x: Any, jobs: Sequence[Job]) -> List[Any]:
    out, at = [], 0
    for job in jobs:
        out.append(x[:, at:at + job.n])
        at += job.n
    return out


def _jobs(desc: Dict[str, Any]) -> List[Job]:
    return [Job(*j) for j in desc["jobs"]]


# -- rank 0 --------------------------------------------------------------------------------------------------------
class PipelineExecutor:
    """Rank 0's side: runs stage 0 of each batch and sends it on; a thread receives what the last stage returns."""

    def __init__(self, model: Any, stages: int, back_group: Any, layout: KvLayout = KvLayout()):
        import torch

        self.bounds = stage_bounds(model.config.num_hidden_layers, stages)
        self.runner = StageRunner(model, 0, self.bounds[1], layout)
        self.depth = stages
        self.hidden = int(model.config.hidden_size)
        self._dtype = next(model.parameters()).dtype
        self._back = back_group
        self._ops: List[Tuple[str, int, int]] = []
        self._sends: Dict[int, Tuple[float, List[Any]]] = {}  # step → (launch time, send handles keeping tensors)
        self._done: "queue.Queue[Any]" = queue.Queue()
        self._closed = False
        # the receiver thread pokes this socket when a batch is back, so the server's poller wakes without spinning
        self._wake_address = f"inproc://pipeline-return-{id(self)}"
        self.wake_socket = zmq.Context.instance().socket(zmq.PAIR)
        self.wake_socket.bind(self._wake_address)
        self._thread = threading.Thread(target=self._receive, name="pipeline-return", daemon=True)
        self._thread.start()
        torch.distributed.barrier()  # every stage has loaded its layers

    @property
    def stages(self) -> int:
        return self.depth

    def apply(self, ops: Sequence[Tuple[str, int, int]]) -> None:
        """Apply cache operations here now, on the other stages before the next batch."""
        self.runner.apply(ops)
        self._ops.extend(ops)

    def launch(self, step: int, jobs: Sequence[Job], xs: Sequence[Any]) -> None:
        import torch

        launched_at = time.perf_counter()
        outs, compute_s = self.runner.run(jobs, xs)
        desc = {"step": step, "jobs": [list(astuple(j)) for j in jobs], "ops": self._ops, "times": [compute_s]}
        self._ops = []
        self._sends[step] = (launched_at, _send(desc, torch.cat(outs, dim=1), 1))

    def collect(self) -> List[Tuple[int, List[Any], float, Tuple[float, ...]]]:
        out = []
        while True:
            try:
                self.wake_socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
        while True:
            try:
                item = self._done.get_nowait()
            except queue.Empty:
                return out
            if isinstance(item, BaseException):
                raise RuntimeError(f"a pipeline stage failed: {item}") from item
            desc, x = item
            launched_at, handles = self._sends.pop(desc["step"])
            for handle in handles:
                handle.wait()
            out.append((desc["step"], _split(x, _jobs(desc)), time.perf_counter() - launched_at,
                        tuple(desc["times"])))

    def _receive(self) -> None:
        wake = zmq.Context.instance().socket(zmq.PAIR)
        wake.setsockopt(zmq.LINGER, 0)
        wake.connect(self._wake_address)
        try:
            while True:
                desc, x = _recv(self.depth - 1, self._dtype, self.hidden, self._back, self.runner.device)
                if desc.get("stop"):
                    return
                self._done.put((desc, x))
                wake.send(b"")
        except Exception as exc:  # the last stage went away
            if not self._closed:
                log.error("pipeline return path failed: %s", exc)
                self._done.put(exc)
                wake.send(b"")
        finally:
            wake.close()

    def close(self) -> None:
        """Stop every stage (best effort: a stage already gone is not waited for)."""
        if self._closed:
            return
        self._closed = True
        try:
            _send({"stop": True}, None, 1)
        except Exception as exc:
            log.warning("could not stop the pipeline stages: %s", exc)
        self._thread.join(timeout=10)
        self.wake_socket.close(linger=0)


# -- ranks 1 .. P-1 ------------------------------------------------------------------------------------------------
def serve_stage(model: Any, rank: int, stages: int, back_group: Any, layout: KvLayout = KvLayout()) -> None:
    """A worker stage's loop: receive a batch from rank − 1, run its layers, pass it on (the last stage: back to rank
    0), until told to stop."""
    import torch

    bounds = stage_bounds(model.config.num_hidden_layers, stages)
    lo, hi = bounds[rank], bounds[rank + 1]
    dtype = next(model.parameters()).dtype  # the stage's layers only: place_stage freed the others
    runner = StageRunner(model, lo, hi, layout)
    hidden = int(model.config.hidden_size)
    last = rank == stages - 1
    torch.distributed.barrier()
    log.info("pipeline stage %d of %d: layers [%d, %d)", rank, stages, lo, hi)
    while True:
        desc, x = _recv(rank - 1, dtype, hidden, device=runner.device)
        if desc.get("stop"):
            for h in _send(desc, None, 0 if last else rank + 1, back_group if last else None):
                h.wait()
            return
        runner.apply([tuple(op) for op in desc["ops"]])
        jobs = _jobs(desc)
        outs, compute_s = runner.run(jobs, _split(x, jobs))
        desc["times"].append(compute_s)
        for h in _send(desc, torch.cat(outs, dim=1), 0 if last else rank + 1, back_group if last else None):
            h.wait()
