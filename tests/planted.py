"""Broken verifiers, planted into a real `hat-cloud serve` or `hat-edge generate` process, so that the exactness tests
(tests/test_exactness.py) show they catch each one (tests/exactness.py: FAULTS and the law each gives).

    python -m tests.planted FAULT cloud ARGS...   # hat-cloud's main(ARGS) with FAULT in its verification (token
                                                   # protocols: the cloud verifies)
    python -m tests.planted FAULT edge ARGS...    # hat-edge's main(ARGS) with FAULT in the device's verification
                                                   # (split protocols: the device verifies with the cloud's states)

The fault wraps hat_split.math.verify.speculative_verify, which both sides call (the cloud through verify_rng, the
device's SplitDrafter directly); nothing in the product knows of it.

    python -m tests.planted auto-alternate edge ARGS...   # not a fault: protocol auto switching at every round
                                                           # boundary (sd γ = 3, llm 2 tokens, ksqs γ = 3, llm ...)
"""
from __future__ import annotations

import sys

import numpy as np

from tests.exactness import FAULTS, MIX


def broken(real, fault: str):
    """`real` (speculative_verify's signature) with `fault`."""
    from hat_split.math.sampling import sample

    rng = np.random.default_rng(20261125)

    def verify(draft_tokens, q, p, accept_u, resample_u, draft_lens=None, **kw):
        accept_u = np.asarray(accept_u, np.float64)
        if fault == "accept-all":
            accept_u = np.zeros_like(accept_u)  # u·q(x) < p(x) holds for every draft p gives any mass
        elif fault == "mix15":
            accept_u = np.where(rng.random(accept_u.shape) < MIX, 0.0, accept_u)
        res = real(draft_tokens, q, p, accept_u, resample_u, draft_lens, **kw)
        if fault == "resample-from-q":
            B, L = np.shape(draft_tokens)
            lens = np.full(B, L) if draft_lens is None else np.asarray(draft_lens)
            qb = np.broadcast_to(np.asarray(q, np.float64), (B, L, np.shape(q)[-1]))
            for b in np.nonzero(res.n_accepted < lens)[0]:
                n = int(res.n_accepted[b])
                res.tokens[b, n] = int(sample(qb[b, n][None], np.asarray(resample_u, np.float64)[b:b + 1])[0])
        return res

    return verify


ALTERNATE = "auto-alternate"


def alternate() -> None:
    """Protocol auto's controller replaced by a script, a round each: sd (γ = 3), llm (2 tokens), ksqs (γ = 3), llm."""
    import itertools

    from edge_runtime.auto import AutoController, Choice

    script = itertools.cycle([Choice("sd", 3, "forced", {}), Choice("llm", 2, "forced", {}),
                              Choice("ksqs", 3, "forced", {}), Choice("llm", 2, "forced", {})])
    AutoController.decide = lambda self, link, now=None, behind=0, remaining=0: next(script)


def plant(fault: str) -> None:
    if fault == ALTERNATE:
        return alternate()
    if fault not in FAULTS:
        raise SystemExit(f"unknown fault {fault!r}; choose {', '.join(FAULTS)} or {ALTERNATE}")
    import edge_runtime.split_drafter as drafter
    import hat_split.math.verify as verify

    bad = broken(verify.speculative_verify, fault)
    verify.speculative_verify = bad  # verify_rng (the cloud) looks it up at each call
    drafter.speculative_verify = bad  # the device imported the name


def main(argv) -> int:
    fault, side, *args = argv
    plant(fault)
    if side == "cloud":
        from cloud_runtime.cli import main as cloud_main

        return cloud_main(args)
    if side == "edge":
        from edge_runtime.cli import main as edge_main

        return edge_main(args)
    raise SystemExit(f"side must be cloud or edge, got {side!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
