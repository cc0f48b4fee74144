"""Every decoding protocol, defined once: its name, family, round, whether its output is exact and whether it needs
the cloud. The device (edge_runtime: config validation, the round per request), the cloud (which sessions it opens,
its Welcome) and the docs read this table; nothing else lists protocol names.

"Protocol" here is always the decoding scheme chosen per request (`sd`, `hat`, ...). The message format that carries
it is the wire (hat_split.wire.messages), versioned on its own.

Families:
- `token`: token ids (and draft distributions) cross the link; the cloud runs the whole target (OpenSession, Verify,
  Generate).
- `split`: the model is cut (HAT); hidden states cross and tokens never leave the device (OpenSplit, Hidden).
- `local`: the device decodes alone; nothing crosses.

Stdlib only: the device imports it on Python 3.8.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

FAMILIES = ("token", "split", "local")
SUPPORTS = ("full", "topk", "conformal")  # hat_split.wire.sqs.LatticeWire's support rules


@dataclass(frozen=True)
class Protocol:
    name: str  # what a request names
    family: str  # one of FAMILIES
    round: str  # the device's round function for it (edge_runtime.protocols.ROUNDS is keyed by this)
    exact: bool  # the output follows the target's distribution exactly (local and cloud-only: True trivially)
    summary: str  # one line: what crosses the uplink per round (README, --help)
    support: str = ""  # the `qs` round's lattice support (SUPPORTS): the whole vocabulary, the top K, or a conformal
    # threshold (QS-SD; SQS-SD §3-4); "" for every other round
    sample_first: bool = False  # the `qs` round samples, then quantizes (the biased prior art) instead of the reverse

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"protocol {self.name!r}: family must be one of {FAMILIES}, got {self.family!r}")
        if (self.round == "qs") != (self.support in SUPPORTS):
            raise ValueError(f"protocol {self.name!r}: the qs round, and only it, names a support from {SUPPORTS}")

    @property
    def needs_cloud(self) -> bool:
        return self.family != "local"


_TABLE: Tuple[Protocol, ...] = (
    Protocol("sd", "token", "sd", True, "L draft tokens + their distributions"),
    Protocol("hlm", "token", "hlm", True, "one draft token + its full dense distribution (U-HLM baseline)"),
    Protocol("llm", "token", "llm", True, "nothing but the request: the cloud decodes alone"),
    Protocol("slm", "local", "slm", False, "nothing: the device decodes alone"),
    Protocol("uhlm", "token", "uhlm", False, "as hlm, skipped when the draft's uncertainty is low (U-HLM)"),
    Protocol("randhlm", "token", "randhlm", False, "as hlm, skipped at random (U-HLM's baseline)"),
    Protocol("cuhlm", "token", "cuhlm", False, "as uhlm, top-k(t) probabilities as packed bits (CU-HLM)"),
    Protocol("qs", "token", "qs", True, "L draft tokens + lattice-quantized distributions (QS-SD)", "full"),
    Protocol("ksqs", "token", "qs", True, "the same on the top-K support (K-SQS)", "topk"),
    Protocol("csqs", "token", "qs", True, "the same on a conformal-threshold support (C-SQS)", "conformal"),
    Protocol("sq", "token", "qs", False, "sample, then quantize (the lossy prior art, for comparison)", "full",
             sample_first=True),
    Protocol("ushape", "split", "ushape", True, "every token's hidden state up and back (HAT's baseline)"),
    Protocol("hat", "split", "hat", True, "hidden states of the chunked prompt and of the adapter's drafts (HAT)"),
)
PROTOCOLS: Dict[str, Protocol] = {p.name: p for p in _TABLE}
NAMES: Tuple[str, ...] = tuple(PROTOCOLS)
# Not a protocol: a request naming it lets the device choose among the exact ones, and switch at round boundaries,
# by the cost model (edge_runtime.auto, hat_split.math.costmodel). The cloud never sees the name.
AUTO = "auto"
REQUESTABLE: Tuple[str, ...] = NAMES + (AUTO,)


def of_family(family: str) -> Tuple[str, ...]:
    """The names of one family's protocols, in table order."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    return tuple(p.name for p in _TABLE if p.family == family)


def check_requestable(name: str) -> str:
    """`name` when a request may name it (a protocol or `auto`), else a ValueError that lists them."""
    if name not in REQUESTABLE:
        raise ValueError(f"unknown protocol {name!r}; choose from {', '.join(REQUESTABLE)}")
    return name


def get(name: str) -> Protocol:
    """The record of `name`, or a ValueError that lists the known names."""
    try:
        return PROTOCOLS[name]
    except KeyError:
        raise ValueError(f"unknown protocol {name!r}; choose from {', '.join(NAMES)}") from None
