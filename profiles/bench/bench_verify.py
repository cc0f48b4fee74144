"""`hat-bench verify`: one batched verification of a step's drafts against one verification per draft.

The cloud's step computes many sessions' rows at once; `speculative_verify` could then verify all their drafts in one
call (B rows, as vLLM's rejection sampler does) instead of one call per session (B = 1, what the cloud and the device
do). This measures both on the same inputs, interleaved, at real vocabulary sizes (SmolLM2's 49152, Qwen2.5's 151936)
and step sizes, with the ratio and its interval per cell, and writes results/verify/bench_verify.json.
"""
from __future__ import annotations

import time

import numpy as np

from hat_split.math.verify import speculative_verify
from profiles.bench.provenance import write_report
from profiles.bench.stats import mean_ci, paired_ratio

OUT = "results/verify/bench_verify.json"


def add_parser(sub) -> None:
    s = sub.add_parser("verify", help="batched vs per-draft speculative verification (the cloud's step)")
    s.add_argument("--vocab", default="49152,151936", help="vocabulary sizes, comma separated")
    s.add_argument("--batch", default="1,8,32", help="drafts verified per step (sessions), comma separated")
    s.add_argument("--draft-len", type=int, default=4)
    s.add_argument("--repeats", type=int, default=9, help="interleaved (batched, per draft) timing pairs per cell")
    s.add_argument("--out", default=OUT)


def _inputs(rng: np.random.Generator, B: int, L: int, V: int):
    """Peaked, model-like distributions and drafts sampled from q."""
    def dist(shape):
        z = rng.standard_normal(shape, dtype=np.float32) * 3
        e = np.exp(z - z.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)
    q, p = dist((B, L, V)), dist((B, L + 1, V))
    x = np.stack([[int(rng.choice(V, p=q[b, j].astype(np.float64) / q[b, j].sum(dtype=np.float64)))
                   for j in range(L)] for b in range(B)])
    return x, q, p, rng.random((B, L)), rng.random(B)


def run(args) -> int:
    rng = np.random.default_rng(0)
    cells = []
    for V in (int(v) for v in args.vocab.split(",")):
        for B in (int(b) for b in args.batch.split(",")):
            x, q, p, au, ru = _inputs(rng, B, args.draft_len, V)

            def batched():
                return speculative_verify(x, q, p, au, ru)

            def per_draft():
                return [speculative_verify(x[b:b + 1], q[b:b + 1], p[b:b + 1], au[b:b + 1], ru[b:b + 1])
                        for b in range(B)]

            one, rows = batched(), per_draft()  # warm-up, and the same answer both ways
            assert all(one.row(b) == rows[b].row(0) for b in range(B))
            times = {"batched": [], "per_draft": []}
            for _ in range(args.repeats):  # interleaved: a drift in the machine's load hits both alike
                for name, fn in (("batched", batched), ("per_draft", per_draft)):
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
            cell = {"vocab": V, "batch": B, "draft_len": args.draft_len,
                    "batched_ms": mean_ci([t * 1e3 for t in times["batched"]]),
                    "per_draft_ms": mean_ci([t * 1e3 for t in times["per_draft"]]),
                    "per_draft_over_batched": paired_ratio(times["per_draft"], times["batched"])}
            cells.append(cell)
            r = cell["per_draft_over_batched"]
            print(f"V={V:6d} B={B:3d}: batched {cell['batched_ms']['mean']:8.2f} ms, per draft "
                  f"{cell['per_draft_ms']['mean']:8.2f} ms, per draft / batched {r['mean']:.2f} "
                  f"[{r['lo']:.2f}, {r['hi']:.2f}] (n={r['n']}, {r['method']})", flush=True)
    write_report(args.out, {"args": vars(args), "cells": cells})
    print(f"hat-bench verify: wrote {args.out}")
    return 0
