"""CUDA graphs of the cloud's decode / verify steps: a step of a given static shape is captured once and replayed
after, so its hundreds of kernel launches cost one (the eager per-layer Python is launch-bound on a GPU).

`StepGraphs.run(key, fn, inputs)` runs `fn(*inputs)`: on a CUDA device through the graph captured for `key` (inputs
copied into the graph's own tensors, the output copied out), elsewhere, or past `max_graphs` distinct keys, eagerly.
A capture that fails (a kernel that cannot be captured) is logged once and turns graphs off for the process: the
steps are exact either way.
The caller chooses keys so that equal keys mean equal shapes and equal static arguments (cloud_runtime.buckets);
`fn` may only do tensor work on its inputs and on state that stays at the same addresses (hat_split.models.slots).
Capturing runs `fn` twice first on a side stream (warm-up), so `fn` must be idempotent for equal inputs: a slot
step writes the same keys and values to the same places.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Hashable, Sequence, Tuple

from hat_split.models.placement import is_cuda

log = logging.getLogger("hatspec.graphs")


class StepGraphs:
    """Captured graphs of one kind of step, keyed by shape."""

    def __init__(self, device: Any, enabled: bool = True, max_graphs: int = 96):
        self.enabled = bool(enabled) and is_cuda(device)
        self.max_graphs = max_graphs
        self.graphs: Dict[Hashable, Tuple[Any, Sequence[Any], Any]] = {}  # key → (graph, static inputs, output)
        self.captures = self.replays = self.eager = 0
        self.failure = ""  # why capturing stopped, if it did
        self._pool = None

    def run(self, key: Hashable, fn: Callable[..., Any], inputs: Sequence[Any]) -> Any:
        if not self.enabled or (key not in self.graphs and len(self.graphs) >= self.max_graphs):
            self.eager += 1
            return fn(*inputs)
        entry = self.graphs.get(key)
        if entry is None:
            try:
                entry = self.graphs[key] = self._capture(fn, inputs)
            except RuntimeError as exc:  # a kernel that cannot be captured: this process runs steps eagerly
                self.enabled, self.failure = False, f"{type(exc).__name__}: {exc}"
                log.warning("CUDA graph capture failed, steps run eagerly from now on: %s", self.failure)
                self.eager += 1
                return fn(*inputs)
            self.captures += 1
        graph, static, out = entry
        for dst, src in zip(static, inputs):
            dst.copy_(src, non_blocking=True)
        graph.replay()
        self.replays += 1
        return out.clone()

    def _capture(self, fn: Callable[..., Any], inputs: Sequence[Any]) -> Tuple[Any, Sequence[Any], Any]:
        import torch

        static = [t.clone() for t in inputs]
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()  # one memory pool: the graphs never run concurrently
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(2):
                fn(*static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA work that other threads of this process do meanwhile (a device's model beside the cloud
        # in one process, a monitor asking for free memory) neither breaks the capture nor fails there
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = fn(*static)
        return graph, static, out

    def report(self) -> Dict[str, Any]:
        return {"graphs": len(self.graphs), "captures": self.captures, "replays": self.replays, "eager": self.eager,
                "failure": self.failure}
