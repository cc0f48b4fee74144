"""Every protocol the device speaks, by name: its round function (see edge_runtime.generation for the contract), and
for the split protocols their own session opening and closing."""
from __future__ import annotations

from typing import Callable, Dict

from edge_runtime.generation import Generation, round_hlm, round_llm, round_sd, round_slm
from edge_runtime.hat import close_split, open_split, reopen_split, round_hat, round_ushape
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
    "ushape": round_ushape,  # HAT's baseline: hidden states up and down for every token
    "hat": round_hat,  # HAT: Λ drafts, the middle part verifies over hidden states
}
SPLIT_PROTOCOLS = ("ushape", "hat")  # tokens never leave the device; the drafter is an edge_runtime.split_drafter
OPENERS = {name: open_split for name in SPLIT_PROTOCOLS}  # their own session open and (chunked) prefill
CLOSERS = {name: close_split for name in SPLIT_PROTOCOLS}
REOPENERS = {name: reopen_split for name in SPLIT_PROTOCOLS}  # after a link drop (generation.resume)
LOCAL_PROTOCOLS = ("slm",)  # need no cloud
