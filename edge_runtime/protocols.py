"""Every protocol the device speaks, by name: its round function (see edge_runtime.generation for the contract)."""
from __future__ import annotations

from typing import Callable, Dict

from edge_runtime.generation import Generation, round_hlm, round_llm, round_sd, round_slm
from edge_runtime.qs import round_qs
from edge_runtime.uhlm import round_cuhlm, round_randhlm, round_uhlm

ROUNDS: Dict[str, Callable[[Generation], None]] = {
    "sd": round_sd,
    "hlm": round_hlm,
    "llm": round_llm,
    "slm": round_slm,
    "uhlm": round_uhlm,
    "randhlm": round_randhlm,
    "cuhlm": round_cuhlm,
    "qs": round_qs,  # QS-SD: the whole vocabulary on the lattice
    "ksqs": round_qs,  # K-SQS: top-K support
    "csqs": round_qs,  # C-SQS: conformal threshold support
    "sq": round_qs,  # sample, then quantize: the lossy prior art (biased; for comparison)
}
LOCAL_PROTOCOLS = ("slm",)  # need no cloud
