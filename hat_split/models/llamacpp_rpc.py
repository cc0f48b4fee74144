"""llama.cpp's RPC backend through ggml's C API (ctypes on the libraries llama-cpp-python ships): a cloud larger than
one machine for GGUF targets.

Each host runs an RPC server (`hat-cloud rpc-server`, the same ggml server code as llama.cpp's `rpc-server` program)
that lends its compute device (its GPUs, else its CPU) to one client; the cloud's llama.cpp context loads the model
with those remote devices as its offload devices, and llama.cpp spreads the layers over them in proportion to their
free memory and runs them in turn for every `llama_decode` (a pipeline over the network, one step at a time).

The RPC protocol has no authentication or encryption: servers listen on loopback or a private network only. ggml
aborts the client process when a server cannot be reached or is lost mid-step; the servers are probed before the
model loads (a clear error), and a cloud that lost one must be restarted.
llama-cpp-python must be built with GGML_RPC=ON (scripts/install_llamacpp.sh does).
"""
from __future__ import annotations

import ctypes
import functools
import os
import socket
from pathlib import Path
from typing import List, Sequence, Tuple

from hat_split.models.llamacpp_lib import require_llama_cpp

DEVICE_CPU, DEVICE_GPU, DEVICE_IGPU, DEVICE_ACCEL = 0, 1, 2, 3  # enum ggml_backend_dev_type


def parse_endpoints(text: str) -> Tuple[str, ...]:
    """'HOST:PORT,HOST:PORT' as a tuple of endpoints (ValueError naming the bad one)."""
    out = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"an RPC server is HOST:PORT (a port in 1..65535), got {item!r}")
        out.append(item)
    return tuple(out)


@functools.lru_cache(maxsize=None)
def _ggml():
    """libggml of the installed llama-cpp-python, its functions typed (RuntimeError without the RPC backend)."""
    L = require_llama_cpp()
    if not L.llama_supports_rpc():
        raise RuntimeError("this llama-cpp-python has no RPC backend: rebuild it with GGML_RPC=ON "
                           "(bash scripts/install_llamacpp.sh)")
    lib = ctypes.CDLL(str(Path(L.__file__).parent / "lib" / "libggml.so"))
    vp, cp, sz = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t
    for name, res, args in [("ggml_backend_reg_by_name", vp, [cp]), ("ggml_backend_reg_get_proc_address", vp, [vp, cp]),
                            ("ggml_backend_reg_dev_count", sz, [vp]), ("ggml_backend_reg_dev_get", vp, [vp, sz]),
                            ("ggml_backend_dev_count", sz, []), ("ggml_backend_dev_get", vp, [sz]),
                            ("ggml_backend_dev_type", ctypes.c_int, [vp]), ("ggml_backend_dev_name", cp, [vp]),
                            ("ggml_backend_dev_by_type", vp, [ctypes.c_int]), ("ggml_backend_load_all", None, [])]:
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    L.llama_backend_init()
    return lib


def _rpc_function(lib, name: str, restype, argtypes):
    reg = lib.ggml_backend_reg_by_name(b"RPC")
    address = lib.ggml_backend_reg_get_proc_address(reg, name.encode()) if reg else None
    if not address:
        raise RuntimeError(f"llama.cpp's RPC backend has no {name}")
    return ctypes.CFUNCTYPE(restype, *argtypes)(address)


def rpc_devices(endpoints: Sequence[str]) -> List[int]:
    """The compute devices the RPC servers at `endpoints` lend (ggml_backend_dev_t handles, in order): what a model's
    `devices` list takes. RuntimeError naming a server that cannot be reached."""
    lib = _ggml()
    add_server = _rpc_function(lib, "ggml_backend_rpc_add_server", ctypes.c_void_p, [ctypes.c_char_p])
    devices = []
    for endpoint in endpoints:
        _probe(endpoint)  # ggml aborts the whole process on a server it cannot reach: look first
        reg = add_server(endpoint.encode())
        n = lib.ggml_backend_reg_dev_count(reg) if reg else 0
        if not n:
            raise RuntimeError(f"the RPC server at {endpoint} cannot be reached (is `hat-cloud rpc-server` running "
                               f"there, with the same llama.cpp version?)")
        devices += [lib.ggml_backend_reg_dev_get(reg, i) for i in range(n)]
    return devices


def _probe(endpoint: str, timeout_s: float = 5.0) -> None:
    host, _, port = endpoint.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout_s).close()
    except OSError as exc:
        raise RuntimeError(f"the RPC server at {endpoint} cannot be reached ({exc}): start `hat-cloud rpc-server "
                           f"--host HOST --port PORT` there") from None


def serve(host: str, port: int, threads: int = 0) -> None:
    """Run an RPC server on host:port lending this machine's accelerators (its CPU when it has none); never returns
    (the process is stopped by a signal)."""
    lib = _ggml()
    lib.ggml_backend_load_all()
    devices = [lib.ggml_backend_dev_get(i) for i in range(lib.ggml_backend_dev_count())]
    devices = [d for d in devices if lib.ggml_backend_dev_type(d) not in (DEVICE_CPU, DEVICE_ACCEL)]
    devices = devices or [lib.ggml_backend_dev_by_type(DEVICE_CPU)]
    start = _rpc_function(lib, "ggml_backend_rpc_start_server", None,
                          [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_void_p])
    array = (ctypes.c_void_p * len(devices))(*devices)
    start(f"{host}:{port}".encode(), None, threads or len(os.sched_getaffinity(0)), len(devices), array)


def device_names(devices: Sequence[int]) -> List[str]:
    lib = _ggml()
    return [lib.ggml_backend_dev_name(d).decode() for d in devices]
