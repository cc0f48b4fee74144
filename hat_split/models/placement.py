"""Where a model runs: the compute device a role asks for (`auto | cpu | cuda | cuda:N`), resolved once at start, and
the one place tensors cross between the host's numpy arrays and that device.

`check_device` validates the name without torch (typed configs call it); `resolve_device` asks torch and refuses, in
one line, a CUDA device this process cannot use. Across the boundary: host arrays go to the device through pinned
memory without blocking the host (`to_device`), and come back as float32 numpy (`to_host`: one synchronising copy).
"""
from __future__ import annotations

import re
from typing import Any

import numpy as np

DEVICE_NAMES = "auto | cpu | cuda | cuda:N"
_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def check_device(name: str) -> None:
    """Refuse a device name that is none of auto, cpu, cuda, cuda:N (no torch needed)."""
    if not isinstance(name, str) or not _DEVICE.match(name):
        raise ValueError(f"device must be one of {DEVICE_NAMES}, got {name!r}")


def resolve_device(name: str) -> str:
    """The torch device string to place a model on: "auto" is the first CUDA GPU when this process sees one, else
    the CPU; a CUDA device that is not there is refused with why (a CPU-only torch, no GPU visible, an index out of
    range)."""
    check_device(name)
    if name == "cpu":
        return "cpu"
    import torch

    if name == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    if torch.version.cuda is None:
        raise ValueError(f"--device {name}: this torch ({torch.__version__}) is built without CUDA; use --device cpu "
                         f"or install a CUDA build of torch")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ValueError(f"--device {name}: no CUDA GPU is visible to this process (driver missing, or "
                         f"CUDA_VISIBLE_DEVICES hides them); use --device cpu")
    index = int(name.partition(":")[2] or 0)
    if index >= count:
        raise ValueError(f"--device {name}: this process sees {count} CUDA GPU(s), cuda:0 .. cuda:{count - 1}")
    return f"cuda:{index}"


def is_cuda(device: Any) -> bool:
    return str(device).startswith("cuda")


def model_device(model: Any) -> Any:
    """The device a loaded model's weights are on."""
    return next(model.parameters()).device


def device_name(model: Any) -> str:
    """Where a model runs, for a record: "cpu", or "cuda:N (<the GPU's name>)"."""
    device = model_device(model)
    if not is_cuda(device):
        return str(device)
    import torch

    return f"{device} ({torch.cuda.get_device_name(device)})"


def to_device(x: np.ndarray, device: Any, dtype: Any = None) -> Any:
    """A host array as a tensor on `device` (cast to `dtype` there when given). To a GPU it is copied once from pinned
    memory without blocking the host; later work on the device's stream is ordered after the copy."""
    import torch

    t = torch.from_numpy(np.ascontiguousarray(x))
    if is_cuda(device):
        t = t.pin_memory().to(device, non_blocking=True)
    return t if dtype is None else t.to(dtype)


def to_host(t: Any) -> np.ndarray:
    """A tensor as a float32 numpy array on the host (waits for the device's work that produced it)."""
    return t.detach().float().cpu().numpy()


def synchronize(device: Any) -> None:
    """Wait for the work queued on a CUDA device (timing a step); nothing elsewhere."""
    if is_cuda(device):
        import torch

        torch.cuda.synchronize(device)


def available_bytes(device: Any) -> int:
    """Memory free for new tensors on `device`: a GPU's free memory, or the host's available memory."""
    if is_cuda(device):
        import torch

        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    import psutil

    return int(psutil.virtual_memory().available)
