"""llama-cpp-python, the optional package behind the llama.cpp engine: whether it is installed, and the module with
llama.cpp's own log quietened (errors only, unless the application set a level)."""
from __future__ import annotations

import importlib.util
import logging

INSTALL_HINT = "llama-cpp-python is not installed: bash scripts/install_llamacpp.sh builds it for this CPU"
FALLBACK_NOTE = ("the llamacpp engine was asked for, but llama-cpp-python is not installed (bash "
                 "scripts/install_llamacpp.sh builds it for this CPU): running the torch engine instead")


def llama_cpp_installed() -> bool:
    """Whether the llamacpp engine can run here (the CLIs fall back to torch, saying so, when it cannot)."""
    return importlib.util.find_spec("llama_cpp") is not None


def require_llama_cpp():
    """The llama_cpp module, or an ImportError that says how to install it."""
    try:
        import llama_cpp
    except ImportError:
        raise ImportError(INSTALL_HINT) from None
    quiet = logging.getLogger("llama-cpp-python")  # the bindings print llama.cpp's log through it: errors only,
    if quiet.level == logging.NOTSET:  # unless the application set a level
        quiet.setLevel(logging.ERROR)
    return llama_cpp
