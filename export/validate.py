"""Validation of exported parts against torch on real prompts: a prefill, chunks on top of the cache, single steps.

The reference is the torch model in float32 through the same part graphs (export.graphs.TorchPart, which tests hold
equal to the model itself); the candidate is the artifact chain of one precision. Both chains get the same feeds and
every part's output is compared after every feed: the largest |Δ| relative to the reference's largest magnitude, and
for logits, per position, the total variation distance between the two softmaxes (and KL, and the argmax agreement,
reported). An artifact whose figures miss its precision's thresholds is marked failed and a runtime refuses it
(hat_split.files.bundle.Manifest.usable).

Why mean TV and not the argmax agreement: a draft's worth is its acceptance, and a draft q verified against its own
float32 model p is accepted with probability 1 − TV(p, q) at T = 1 (hat_split.math.verify.acceptance_rate), so the
mean TV is the acceptance the artifact gives up. It moves continuously with the logits: a kernel that rounds a little
differently (AVX2 against AVX-512 int8 products, a Jetson's ARM cores) moves it a little. The argmax flips wholesale
at every near tie, so over the 8-16 positions of a regime the agreement of the same export swung across its old 65 %
limit between machines (62.5 % on an AVX2-only machine, 70-81 % here). It stays in the figures, not in the verdict.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from edge_runtime.backends.part_lm import empty_cache, run_part_outputs

# Per weight precision: the largest |Δ| / max|reference| of any part output, and the largest mean TV between the
# reference's and the artifact's next-token distributions in any regime. fp32 differs from torch by kernel order, fp16
# by rounding; int8 / int4 are weight-only block quantizations with int8 activation products (MatMulNBits accuracy
# level 4). The TV limits: what a quantized draft may give up in acceptance against its own float32 model. Measured
# on smollm2-135m (4 real prompts; 488 prefill, 32 chunk and 32 step positions; 2026-11-25, AVX-512): int8 0.022-0.030,
# int4 0.21-0.26, fp16 0.0009, fp32 0.0. A regime's mean over 16-32 positions has a standard error of at most
# 0.5 / sqrt(16) = 0.125 in the worst case and about 0.03 as measured (per-position sd ≈ 0.15 at int4), so int4's limit
# sits > 4 standard errors above its figures, int8's > 2 worst-case ones. Broken exports planted on smollm2-135m
# (tests/test_export.py) measure 0.43-0.98 in some regime: a cache that forgets the prompt, the first layer's attention
# lost, every MLP output scale off by 2; one mid-layer MLP lost measures 0.14-0.16, refused from int8 up and within
# int4's own loss.
THRESHOLDS: Dict[str, Dict[str, float]] = {
    "fp32": {"rel": 1e-3, "tv": 0.01},
    "fp16": {"rel": 5e-2, "tv": 0.02},
    "int8": {"rel": 0.25, "tv": 0.10},
    "int4": {"rel": 1.0, "tv": 0.40},
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


@dataclass
class FeatureChain:
    """The feature drafter's parts as validation feeds them, with PartChainLM's interface for `compare`: the input
    part over the tokens, the output part over its shallow states (standing in for the cloud's deep states: the
    same function either way) giving logits and features, and the feature part over the pairs (f_{p-1}, s_p), the
    feature before the first new position kept from the previous feed (zeros at position 0). last_outputs, in the
    parts' order: the shallow states, the draft logits, the output part's logits."""

    parts: List[Any]  # input, feature, output (exported with features): hat_split.files.bundle.PARTS order
    vocab_size: int
    window: Optional[int] = None
    last_outputs: List[np.ndarray] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        io = [p.io for p in self.parts]
        if len(io) != 3 or not io[0].tokens_in or not io[1].pairs_in or not io[2].features_out:
            raise ValueError("a feature chain is the input part, the feature part, and an output part that gives the "
                             "features")

    def new_state(self) -> Dict[str, Any]:
        return {"cache": [empty_cache(p) for p in self.parts], "length": 0, "feature": None}

    def forward(self, state: Dict[str, Any], tokens: Sequence[int], n_logits: int = 1) -> np.ndarray:
        inp, feat, out = self.parts
        caches, past = state["cache"], state["length"]
        shallow = run_part_outputs(inp, caches[0], np.asarray([list(tokens)], np.int64), past, 0, self.window)[0]
        logits, features = run_part_outputs(out, caches[2], shallow, past, n_logits, self.window)
        before = state["feature"] if state["feature"] is not None else np.zeros_like(features[:, :1])
        pairs = np.concatenate([before.astype(features.dtype), features[:, :-1]], axis=1)
        draft, _ = run_part_outputs(feat, caches[1], pairs, past, n_logits, self.window, tokens=shallow)
        state["feature"], state["length"] = features[:, -1:], past + len(tokens)
        self.last_outputs = [shallow, draft, logits]
        return np.asarray(draft[0], np.float32)


def validation_chain(parts: List[Any], vocab: int, window: Optional[int]) -> Any:
    """The chain `compare` feeds: a FeatureChain when the feature part is among `parts`, else a PartChainLM."""
    from edge_runtime.backends.part_lm import PartChainLM

    if any(p.io.pairs_in for p in parts):
        return FeatureChain(parts, vocab, window)
    return PartChainLM(parts, vocab, window)


def divergences(ref: np.ndarray, got: np.ndarray) -> tuple:
    """Per position, between the softmax of reference and candidate logits `# [n, vocab]`: the total variation
    distance and KL(reference || candidate) in nats, in float64."""
    def logp(x):
        x = np.asarray(x, np.float64)
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))
    lr, lg = logp(ref), logp(got)
    pr, pg = np.exp(lr), np.exp(lg)
    return 0.5 * np.abs(pr - pg).sum(-1), (pr * (lr - lg)).sum(-1)


def compare(reference, candidate, prompts: Sequence[Sequence[int]], schedule: Schedule = Schedule()) -> List[dict]:
    """Feed both PartChainLMs identically; per part and regime: max relative |Δ| (and argmax agreement for logits)."""
    n_parts = len(candidate.parts)
    if len(reference.parts) != n_parts:
        raise ValueError("reference and candidate chains differ in length")
    acc = [{r: {"rel": 0.0, "agree": [], "tv": [], "kl": [], "positions": 0} for r in REGIMES} for _ in range(n_parts)]
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
                    tv, kl = divergences(ref[0], got[0])
                    a["tv"] += list(tv)
                    a["kl"] += list(kl)
    out = []
    for i, per in enumerate(acc):
        row = {}
        for regime, a in per.items():
            row[regime] = {"max_rel_diff": a["rel"], "positions": a["positions"]}
            if a["agree"]:
                row[regime]["argmax_agreement"] = float(np.mean(a["agree"]))
                row[regime]["mean_tv"] = float(np.mean(a["tv"]))
                row[regime]["mean_kl"] = float(np.mean(a["kl"]))
        out.append(row)
    return out


def verdict(figures: dict, precision: str, logits: bool) -> tuple:
    """(passed, reason) of one part's figures against its precision's thresholds."""
    limits = THRESHOLDS[precision]
    for regime, f in figures.items():
        if f["max_rel_diff"] > limits["rel"]:
            return False, (f"{regime}: max |Δ| is {f['max_rel_diff']:.3g} of the reference's scale (limit "
                           f"{limits['rel']})")
        if logits and f.get("mean_tv", 0.0) > limits["tv"]:
            return False, (f"{regime}: the next-token distributions differ from torch's by a mean TV of "
                           f"{f['mean_tv']:.3f} over {f['positions']} positions (limit {limits['tv']})")
    return True, "within the thresholds"
