"""TensorRT part runners: an engine built by `hat-export tensorrt`, run through the named-tensor API that TensorRT 8.5
(JetPack 5), 10.x (JetPack 6) and 11 share (`set_input_shape`, `set_tensor_address`, `execute_async_v3`).

The engine has two optimization profiles (export.tensorrt_build): "prefill" for chunks and "decode" for a few tokens;
one execution context per profile, picked by the number of new positions. Device buffers are torch CUDA tensors
(JetPack ships torch); KV caches stay on the GPU between calls (PartChainLM crops them by slicing), only the part's
main output comes back to the host.
"""
from __future__ import annotations

import os
from typing import Dict, List

import numpy as np

from edge_runtime.backends.part_lm import PartIO, PartRunner
from hat_split.extras import need
from hat_split.files import bundle as B


def tensorrt_version() -> str:
    """The installed TensorRT's version, or a RuntimeError saying it is absent."""
    try:
        import tensorrt as trt
    except ImportError:
        raise RuntimeError("TensorRT is not installed (on a Jetson it comes with JetPack; on x86 from NVIDIA's "
                           "index): the tensorrt backend is unavailable") from None
    return trt.__version__


class TrtPart(PartRunner):
    def __init__(self, path: str | os.PathLike):
        tensorrt_version()
        import tensorrt as trt

        torch = need("torch", "the tensorrt backend (its CUDA buffers; NVIDIA's PyTorch for Jetson wheel)")

        if not torch.cuda.is_available():
            raise RuntimeError("the tensorrt backend needs a CUDA device (torch.cuda.is_available() is False)")
        self.torch = torch
        self.logger = trt.Logger(trt.Logger.WARNING)
        with open(path, "rb") as f:
            self.engine = trt.Runtime(self.logger).deserialize_cuda_engine(f.read())
        if self.engine is None:
            raise RuntimeError(f"{path}: TensorRT could not deserialize the engine (built by another TensorRT version "
                               "or for another GPU: build it on this device with hat-export tensorrt)")
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        mode = trt.TensorIOMode.INPUT
        self.inputs = [n for n in names if self.engine.get_tensor_mode(n) == mode]
        self.outputs = [n for n in names if self.engine.get_tensor_mode(n) != mode]
        self.dtypes = {n: np.dtype(trt.nptype(self.engine.get_tensor_dtype(n))) for n in names}
        self.io = PartIO.from_inputs([(n, self.dtypes[n], tuple(self.engine.get_tensor_shape(n))) for n in self.inputs],
                                     self.outputs)
        self.contexts = []
        for k in range(self.engine.num_optimization_profiles):
            ctx = self.engine.create_execution_context()
            ctx.set_optimization_profile_async(k, torch.cuda.current_stream().cuda_stream)
            lo, _, hi = self.engine.get_tensor_profile_shape(B.X, k)
            self.contexts.append((int(lo[1]), int(hi[1]), ctx))
        self.providers = [f"tensorrt {trt.__version__}"]

    def _context(self, n: int):
        fits = [(hi - lo, ctx) for lo, hi, ctx in self.contexts if lo <= n <= hi]
        if not fits:
            raise ValueError(f"{n} new positions are outside every optimization profile of the engine "
                             f"({[(lo, hi) for lo, hi, _ in self.contexts]}); rebuild with a larger --max-chunk")
        return min(fits, key=lambda f: f[0])[1]

    def run(self, feed: Dict[str, np.ndarray]) -> List:
        torch = self.torch
        n = feed[B.X].shape[1]
        ctx = self._context(n)
        keep = []
        for name in self.inputs:
            value = feed[name]
            t = value if isinstance(value, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(value))
            t = t.to("cuda", non_blocking=True).contiguous()
            keep.append(t)
            ctx.set_input_shape(name, tuple(t.shape))
            ctx.set_tensor_address(name, t.data_ptr())
        outs = []
        for name in self.outputs:
            shape = tuple(ctx.get_tensor_shape(name))
            t = torch.empty(shape, dtype=getattr(torch, self.dtypes[name].name), device="cuda")
            ctx.set_tensor_address(name, t.data_ptr())
            outs.append(t)
        stream = torch.cuda.current_stream()
        if not ctx.execute_async_v3(stream.cuda_stream):
            raise RuntimeError("TensorRT execution failed")
        stream.synchronize()
        return [outs[0].cpu().numpy()] + outs[1:]
