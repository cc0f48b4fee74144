"""Validation of exported parts against torch on real prompts: a prefill, chunks on top of the cache, single steps.

The reference is the torch model in float32 through the same part graphs (export.graphs.TorchPart, which tests hold
equal to the model itself); the candidate is the artifact chain of one precision. Both chains get the same feeds and
every part's output is compared after every feed: the largest |Δ| relative to the reference's largest magnitude, and
for logits the agreement of the argmax. An artifact whose figures miss its precision's thresholds is marked failed
and a runtime refuses it (hat_split.files.bundle.Manifest.usable).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence

import numpy as np

# Largest |Δ| / max|reference| per part output, and the least argmax agreement of logits, per weight precision.
# fp32 differs from torch only by kernel order; fp16 by rounding; int8 / int4 are weight-only block quantizations
# whose top-1 agreement with float32 is the figure that matters for drafting (a disagreeing draft is rejected, never
# wrong: verification keeps the output exact).
THRESHOLDS: Dict[str, Dict[str, float]] = {
    "fp32": {"rel": 1e-3, "agree": 0.99},
    "fp16": {"rel": 5e-2, "agree": 0.95},
    "int8": {"rel": 0.25, "agree": 0.90},
    "int4": {"rel": 1.0, "agree": 0.65},  # smollm2-135m measures 70-81 % (a 135M model loses much at 4 bits)
}
REGIMES = ("prefill", "chunks", "steps")


@dataclass
class Schedule:
    """How each prompt is fed: all but the last chunk_tokens + steps tokens at once, then chunks, then single steps."""

    chunk: int = 4
    chunk_tokens: int = 8
    steps: int = 8

    def feeds(self, prompt: Sequence[int]) -> List[tuple]:
        """[(regime, tokens)] covering the prompt; the prompt must be longer than chunk_tokens + steps."""
        tail = self.chunk_tokens + self.steps
        if len(prompt) <= tail:
            raise ValueError(f"validation prompts need more than {tail} tokens, got {len(prompt)}")
        cut = len(prompt) - tail
        out = [("prefill", list(prompt[:cut]))]
        mid = prompt[cut:cut + self.chunk_tokens]
        out += [("chunks", list(mid[i:i + self.chunk])) for i in range(0, len(mid), self.chunk)]
        out += [("steps", [t]) for t in prompt[cut + self.chunk_tokens:]]
        return out


def compare(reference, candidate, prompts: Sequence[Sequence[int]], schedule: Schedule = Schedule()) -> List[dict]:
    """Feed both PartChainLMs identically; per part and regime: max relative |Δ| (and argmax agreement for logits)."""
    n_parts = len(candidate.parts)
    if len(reference.parts) != n_parts:
        raise ValueError("reference and candidate chains differ in length")
    acc = [{r: {"rel": 0.0, "agree": [], "positions": 0} for r in REGIMES} for _ in range(n_parts)]
    for prompt in prompts:
        rs, cs = reference.new_state(), candidate.new_state()
        for regime, tokens in schedule.feeds(prompt):
            reference.forward(rs, tokens, n_logits=len(tokens))
            candidate.forward(cs, tokens, n_logits=len(tokens))
            for i, (ref, got) in enumerate(zip(reference.last_outputs, candidate.last_outputs)):
                ref, got = np.asarray(ref, np.float32), np.asarray(got, np.float32)
                a = acc[i][regime]
                scale = float(np.abs(ref).max()) or 1.0
                a["rel"] = max(a["rel"], float(np.abs(ref - got).max()) / scale)
                a["positions"] += ref.shape[1]
                if candidate.parts[i].io.logits_out:
                    a["agree"] += list(ref[0].argmax(-1) == got[0].argmax(-1))
    out = []
    for i, per in enumerate(acc):
        row = {}
        for regime, a in per.items():
            row[regime] = {"max_rel_diff": a["rel"], "positions": a["positions"]}
            if a["agree"]:
                row[regime]["argmax_agreement"] = float(np.mean(a["agree"]))
        out.append(row)
    return out


def verdict(figures: dict, precision: str, logits: bool) -> tuple:
    """(passed, reason) of one part's figures against its precision's thresholds."""
    limits = THRESHOLDS[precision]
    for regime, f in figures.items():
        if f["max_rel_diff"] > limits["rel"]:
            return False, (f"{regime}: max |Δ| is {f['max_rel_diff']:.3g} of the reference's scale (limit "
                           f"{limits['rel']})")
        if logits and f.get("argmax_agreement", 1.0) < limits["agree"]:
            return False, (f"{regime}: argmax agrees with torch on {100 * f['argmax_agreement']:.1f} % of positions "
                           f"(limit {100 * limits['agree']:.0f} %)")
    return True, "within the thresholds"
