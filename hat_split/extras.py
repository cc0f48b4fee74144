"""Optional dependencies by the extra that installs them, and the one-line error when one is missing.

A device installs the core and one engine extra (`hatspec[edge-onnx]`, or `[edge-trt]` beside JetPack's TensorRT);
anything a command needs beyond that is imported through `need`, which names the extra to install instead of
raising a bare ModuleNotFoundError from deep inside a call. No third-party import here: a device imports this first.
"""
from __future__ import annotations

import importlib
import platform
import sys
from types import ModuleType

# module → the extra that provides it (pyproject.toml's [project.optional-dependencies])
EXTRA_OF = {
    "onnxruntime": "edge-onnx",
    "tokenizers": "edge-onnx",
    "jinja2": "edge-onnx",
    "torch": "models",
    "transformers": "models",
    "gguf": "models",
    "safetensors": "models",
    "onnx": "export",
    "onnxscript": "export",
    "matplotlib": "bench",
    "jtop": "jetson",
}
# modules no extra installs: where they come from instead
ELSEWHERE = {
    "tensorrt": "TensorRT comes with JetPack on a Jetson (on x86, NVIDIA's tensorrt wheel); a venv made by "
                "hat-flash --software sees it (--system-site-packages)",
    "llama_cpp": "llama-cpp-python is built from source for this CPU: bash scripts/install_llamacpp.sh",
}


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message says what to install (one line)."""


def install_hint(module: str) -> str:
    top = module.split(".")[0]
    if top in ELSEWHERE:
        return ELSEWHERE[top]
    extra = EXTRA_OF.get(top)
    return f"pip install 'hatspec[{extra}]'" if extra else f"pip install {top}"


def need(module: str, purpose: str) -> ModuleType:
    """`module`, imported; or MissingExtra: '<purpose> needs <module>, which is not installed: <install hint>'."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        missing = getattr(exc, "name", None) or module
        if missing.split(".")[0] != module.split(".")[0]:
            raise  # the module is there but one of its own imports failed: that traceback is the useful one
        raise MissingExtra(f"{purpose} needs {module}, which is not installed: {install_hint(module)}") from None


def require_python(command: str, minimum: tuple = (3, 10)) -> None:
    """MissingExtra when this Python is older than what `command` needs (the cloud, export and training need torch and
    transformers: Python >= 3.10; a device's side runs on 3.8)."""
    if sys.version_info[:2] < minimum:
        raise MissingExtra(f"{command} needs Python >= {'.'.join(map(str, minimum))} (this is "
                           f"{platform.python_version()}); on a JetPack 5 device (Python 3.8) run the device's side: "
                           "hat-edge with a bundle")
