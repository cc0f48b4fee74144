"""The statistics of the end-to-end exactness tests (tests/test_exactness.py): is every generated token distributed as
the target's p, given the tokens before it?

An exact protocol's output is a sample of the target's autoregressive law, so at every position t the token x_t, given
everything before it (the prefix, and the round structure the protocol chose from it), follows p_t. Pick for each
position a set A_t that is a function of the prefix only: under exactness the indicator 1[x_t ∈ A_t] has mean
p_t(A_t) given the past, so S = Σ_t (1[x_t ∈ A_t] − p_t(A_t)) is a martingale with variance Σ_t p_t(A_t)(1 − p_t(A_t)),
and Z = S / sd is close to N(0, 1) over a few hundred positions (the martingale central limit theorem). One long
generation therefore tests hundreds of positions at once, each conditioned on its own prefix, the first drafted one
(the second token of a split protocol, after the cloud's first) among them.

A_t = {x : d_t(x) > p_t(x)} for a decoy law d_t (the draft's q_t when a verifier is tested), and empty where
TV(p_t, d_t) < 0.3: there no fault moves much mass, and the position would only add variance. Every fault that lets the
draft through where it should not moves mass from p_t towards q_t, i.e. into A_t; `FAULTS` are three such faults and
`fault_law` their output law at a drafted position:
- "accept-all": every draft accepted: the output follows q_t (TV(p_t, q_t) more mass in A_t);
- "resample-from-q": the token after a rejection drawn from the draft's q_t, not from norm((p_t − q_t)+):
  min(p_t, q_t) + TV(p_t, q_t)·q_t;
- "mix15": a 15 % mixture with the draft, 0.85·p_t + 0.15·q_t (0.15·TV(p_t, q_t) more mass in A_t).
Only drafted positions carry the fault (a bonus token is drawn from p_{L+1} alone), so the test is run over the
drafted positions (`drafted_positions`: selecting them by the round structure, which the prefix decides, keeps S a
martingale).

`power` is the probability that the test rejects under a fault, by the normal approximation on the positions the run
visited: S shifts by Σ_t (law_t(A_t) − p_t(A_t)) with variance Σ_t law_t(A_t)(1 − law_t(A_t)). A faulty run visits
other positions and drafts fewer of them where it accepts more (every accepted draft makes a bonus more likely):
`power` takes the shift and variances per position from the run and scales them to the drafted positions a run of
the same length has under the fault (`drafted_share` at the fault's acceptance).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Sequence, Tuple

import numpy as np

Z_CRIT = 4.0  # |Z| above this rejects: a correct verifier fails with probability 6.3e-5 per test
FAULTS = ("accept-all", "resample-from-q", "mix15")
MIX = 0.15
MIN_TV = 0.3  # positions whose decoy is nearer the target than this are left out of the test (A_t empty)


def tv_rows(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Total variation distance per row. p, q `# [n, V]`."""
    return 0.5 * np.abs(np.asarray(p, np.float64) - np.asarray(q, np.float64)).sum(-1)


def fault_law(p: np.ndarray, q: np.ndarray, fault: str) -> np.ndarray:
    """The law of the token a faulty verifier emits at a drafted position. p, q `# [n, V]` -> `# [n, V]`."""
    p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)
    if fault == "accept-all":
        return q
    if fault == "resample-from-q":
        return np.minimum(p, q) + tv_rows(p, q)[:, None] * q
    if fault == "mix15":
        return (1 - MIX) * p + MIX * q
    raise ValueError(f"unknown fault {fault!r}; choose {', '.join(FAULTS)}")


@dataclass
class Drift:
    """The test on n positions: how many tokens fell in A_t, how many exactness expects, its sd and Z."""

    n: int
    observed: float
    expected: float
    sd: float

    @property
    def z(self) -> float:
        """±inf when no variance was expected and the count still moved (a token the target gives no mass)."""
        if self.sd > 0:
            return (self.observed - self.expected) / self.sd
        return math.copysign(math.inf, self.observed - self.expected) if self.observed != self.expected else 0.0

    def __str__(self) -> str:
        return f"{self.observed:.0f} in A vs {self.expected:.1f} ± {self.sd:.1f} expected, Z = {self.z:+.2f} " \
               f"(n = {self.n} positions)"


def _a_sets(p: np.ndarray, d: np.ndarray, min_tv: float) -> Tuple[np.ndarray, np.ndarray]:
    """A_t `# [n, V]` and p_t(A_t) `# [n]`: {x : d_t(x) > p_t(x)} where TV(p_t, d_t) ≥ min_tv, else empty (a
    position where the decoy is near the target adds variance and no shift)."""
    p, d = np.asarray(p, np.float64), np.asarray(d, np.float64)
    a = (d > p) & (tv_rows(p, d) >= min_tv)[:, None]
    return a, (p * a).sum(-1)


def drift(tokens: Sequence[int], p: np.ndarray, d: np.ndarray, min_tv: float = MIN_TV) -> Drift:
    """The test of `tokens` (one per row) against the target laws p `# [n, V]`, with A_t from the decoy d `# [n, V]`."""
    a, pa = _a_sets(p, d, min_tv)
    hit = a[np.arange(len(tokens)), np.asarray(tokens, np.int64)]
    return Drift(len(tokens), float(hit.sum()), float(pa.sum()), float(np.sqrt((pa * (1 - pa)).sum())))


def _phi(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def acceptance(p: np.ndarray, q: np.ndarray, fault: str = "") -> float:
    """The mean probability that a draft is accepted at the positions of p, q `# [n, V]`: 1 − TV(p, q) for a correct
    verifier (and "resample-from-q", which changes what follows a rejection only), 1 for "accept-all", and
    0.15 + 0.85·(1 − TV) for "mix15"."""
    beta = float(1.0 - tv_rows(p, q).mean())
    return {"accept-all": 1.0, "mix15": MIX + (1 - MIX) * beta}.get(fault, beta)


def drafted_share(a: float, draft_len: int) -> float:
    """The expected share of a run's tokens that sit at drafted positions, for rounds of `draft_len` drafts each
    accepted with probability a: 1 − (bonus tokens per round) / (tokens per round) = 1 − a^L (1 − a) / (1 − a^(L+1));
    L / (L + 1) at a = 1."""
    if a >= 1.0:
        return draft_len / (draft_len + 1.0)
    return 1.0 - a ** draft_len * (1 - a) / (1 - a ** (draft_len + 1))


def power(p: np.ndarray, q: np.ndarray, fault: str, tokens: int, draft_len: int, z_crit: float = Z_CRIT) -> float:
    """P(|Z| > z_crit) when the verifier has `fault`, from the drafted positions p, q `# [n, V]` of a run of `tokens`
    tokens with drafts of `draft_len`: their per-position shift and variances, scaled to the drafted positions such
    a run has under the fault (`drafted_share`: an accepting fault leaves more bonus tokens, which carry no fault)."""
    keep = drafted_share(acceptance(p, q, fault), draft_len) * tokens / len(p)
    return power_of_law(p, q, fault_law(p, q, fault), keep, z_crit)


def power_of_law(p: np.ndarray, d: np.ndarray, law: np.ndarray, keep: float = 1.0, z_crit: float = Z_CRIT,
                 min_tv: float = MIN_TV) -> float:
    """P(|Z| > z_crit) of the test with decoy d when the tokens follow `law` instead of p (all `# [n, V]`), the
    positions' shift and variances scaled by `keep`; 0 when no position is tested (every A_t empty)."""
    a, pa = _a_sets(p, d, min_tv)
    la = (np.asarray(law, np.float64) * a).sum(-1)
    shift = keep * float((la - pa).sum())
    sd0 = math.sqrt(keep * float((pa * (1 - pa)).sum()))
    sd1 = math.sqrt(keep * float((la * (1 - la)).sum()))
    if sd0 == 0.0:
        return 0.0
    if sd1 == 0.0:
        return float(abs(shift) > z_crit * sd0)
    return _phi((shift - z_crit * sd0) / sd1) + _phi((-shift - z_crit * sd0) / sd1)


def round_shapes(result: dict) -> List[Tuple[int, int]]:
    """(tokens committed, drafts sent) of each verification round of a `hat-edge generate --json` result (sd, hlm,
    hat: its verify_log; qs, ksqs, csqs: its round_log, where a round commits its accepted drafts and one more)."""
    if result.get("verify_log"):
        return [(int(c), int(d)) for c, d, _ in result["verify_log"]]
    return [(min(int(r["accepted"]) + 1, int(r["L"]) + 1), int(r["L"])) for r in result["round_log"]]


def drafted_positions(result: dict, first: int = 0) -> np.ndarray:
    """Indices (into the generated tokens) of the positions whose token a verification decided from a draft: in a
    round of L drafts committing c tokens, its first min(c, L); the (L+1)-th, if committed, is the bonus. `first`:
    tokens generated before the first round (a split protocol's first token comes from the prefill)."""
    out, at, n = [], first, len(result["tokens"])
    for c, d in round_shapes(result):
        c = min(c, n - at)  # the last round's tokens past the request's length are not committed
        out += range(at, at + min(c, d))
        at += c
    if at != len(result["tokens"]):
        raise AssertionError(f"the rounds commit {at} tokens, the result holds {len(result['tokens'])}")
    return np.asarray(out, np.int64)


FAR_DRAFT_SEEDS = (3, 4, 5, 6, 7, 8)  # `llama_cpp_far_draft_run` tries them in turn


def llama_cpp_far_draft_run(smollm2, gguf, n: int, cloud_args: Sequence[str] = (), **edge_fields):
    """A T = 1 `sd` generation of n tokens through `hat-cloud serve --engine llamacpp` (its own process, SmolLM2's
    GGUF file) from a torch draft far from it (SmolLM2 with Gaussian noise, sd 0.06, on its head, which is also its
    embedding table: mean TV(p, q) 0.66); EdgeConfig `edge_fields` (draft_len, tree_nodes …). Returns the result and
    the target's p and the draft's q `# [n, V]` along the generated tokens (p from a fresh llama.cpp evaluation).
    The generation is the first of FAR_DRAFT_SEEDS' to run n tokens without an end token (seed 3 ended early on an
    AVX2-only machine: a sampled path follows the logits' last bits), as a fixed seed was chosen for it before."""
    import copy
    import dataclasses

    import torch

    from cloud_runtime.process import CloudProcess
    from edge_runtime.config import EdgeConfig, LinkConfig
    from edge_runtime.runtime import EdgeRuntime
    from hat_split.math.sampling import SamplingParams, warp
    from hat_split.models.llamacpp_lm import LlamaCppLM, LlamaCppSettings
    from hat_split.models.lm import CausalLM
    from hat_split.net.security import LinkSecurity

    ids = list(smollm2.tokenizer("def fibonacci(n):\n")["input_ids"])
    draft = copy.deepcopy(smollm2.model)
    torch.manual_seed(0)
    with torch.no_grad():
        draft.lm_head.weight.add_(0.06 * torch.randn_like(draft.lm_head.weight))
    with CloudProcess("smollm2-135m", extra_args=["--engine", "llamacpp", "--n-ctx", "1024", *cloud_args], threads=1,
                      ready_timeout_s=300) as cloud:
        config = EdgeConfig(model="smollm2-135m", link=LinkConfig(cloud.endpoint, security=LinkSecurity.plaintext()),
                            **edge_fields)
        with EdgeRuntime(config, dataclasses.replace(smollm2, model=draft)) as rt:
            for seed in FAR_DRAFT_SEEDS:  # the first whose generation runs n tokens: which one does depends on the
                # target's logits, and llama.cpp's differ in their last bits from one CPU's SIMD to another's
                res = rt.generate(ids, "sd", SamplingParams(1.0), n, seed=seed)
                if len(res.tokens) == n:
                    break
    tokens = res.tokens
    assert len(tokens) == n, f"every generation of seeds {FAR_DRAFT_SEEDS} ended early (an end token)"
    with LlamaCppLM(gguf, LlamaCppSettings(n_ctx=1024, n_batch=512, n_threads=2)) as target:
        p = warp(target.forward(target.new_state(), ids + tokens[:-1], n_logits=n), SamplingParams(1.0))
    q_lm = CausalLM(draft)
    q = warp(q_lm.forward(q_lm.new_state(), ids + tokens[:-1], n_logits=n), SamplingParams(1.0))
    return res, p, q


def assert_greedy(target, prompt, tokens, slack=1.5):
    """Greedy `sd` on a llama.cpp cloud commits the target's argmax up to llama.cpp's own numerics. Its sequences
    share one KV cache (kv_unified): after a tree's keep, or beside another session's cells, drafts and crops, a
    session's cells sit elsewhere in the cache than a fresh evaluation's, and llama.cpp's CPU attention sums over the
    cache's cells in their order (float16 with flash attention), moving logits by up to ~1.2 (docs/TREES.md), so at
    a near-tie the run may take the runner-up.
    Every committed token must be within `slack` logits of the argmax of a fresh evaluation of its own prefix, and
    most must be the argmax (a wrong mask, a wrongly kept path or another session's cells miss by far more, at most
    positions)."""
    logits = target.forward(target.new_state(), list(prompt) + list(tokens[:-1]), n_logits=len(tokens))
    picked = logits[np.arange(len(tokens)), tokens]
    assert (picked >= logits.max(1) - slack).all(), (picked - logits.max(1)).min()
    assert (logits.argmax(1) == np.asarray(tokens)).mean() >= 0.8
