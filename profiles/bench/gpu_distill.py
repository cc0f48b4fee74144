"""`hat-bench gpu --figures distill`: what training the feature drafter costs on a device, per model shape.

The same functions `hat-distill --drafter feature` runs (hat_split.models.distill.teacher, token_states, ttt_loss,
AdamW on float32 master weights under the frozen model's autocast), on random weights with the real shapes and random
tokens: a step's time does not depend on the values. Two figures per shape:

- the teacher: tokens per second of `teacher()` over a batch of windows (the teacher cache's fill rate; the cache's
  disk writes are not included);
- a training step of the feature drafter at each `--distill-unrolls` (the training-time test's steps), batch
  `--distill-batch` windows of `--distill-seq` tokens, the CE over a `--distill-vocab` head on a quarter of the
  positions (hat-distill's recipe): milliseconds per step and training positions per second. The batch's teacher
  states are on the device already (a cache read is a host-side copy of a few MB per step).

Steps are timed after one untimed step, with the device synchronised around them; peak device memory is recorded.
"""
from __future__ import annotations

import argparse
import time
from typing import Any, Dict

from hat_split.models.placement import available_bytes, is_cuda, synchronize

CE_FRACTION = 0.25  # hat-distill's --ce-fraction in the recipe (docs/HAT.md)
M = 2  # the cut: the device's input layers


def add_arguments(s: Any) -> None:
    s.add_argument("--distill-batch", type=int, default=4, help="distill figures: windows per training step")
    s.add_argument("--distill-seq", type=int, default=256, help="distill figures: tokens per window")
    s.add_argument("--distill-unrolls", default="1,3", help="distill figures: training-time test steps to time")
    s.add_argument("--distill-vocab", type=int, default=16384, help="distill figures: the CE's draft vocabulary")


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse distill figures' arguments that cannot run, before any model is built."""
    try:
        unrolls = [int(x) for x in args.distill_unrolls.split(",")]
    except ValueError:
        unrolls = []
    if not unrolls or min(unrolls) < 1:
        raise ValueError(f"--distill-unrolls: comma-separated counts >= 1, got {args.distill_unrolls!r}")
    if args.distill_batch < 1 or args.distill_seq < 8 or args.distill_vocab < 1:
        raise ValueError("--distill-batch and --distill-vocab must be >= 1 and --distill-seq >= 8")


def timed(fn: Any, device: str, steps: int) -> float:
    """Seconds per call of `fn` (one untimed call first), the device synchronised before and after."""
    fn()
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    synchronize(device)
    return (time.perf_counter() - t0) / steps


def measure_distill(model: Any, device: str, args: argparse.Namespace) -> Dict[str, Any]:
    """The teacher's tokens/s and the feature drafter's training step per unroll count, for one model."""
    import torch

    from hat_split.models.distill import autocast, ce_positions, teacher
    from hat_split.models.feature_drafter import FeatureDrafter, token_states, ttt_loss
    from hat_split.models.partition import SplitModel, head_rows

    model.requires_grad_(False)  # frozen, as in hat-distill
    b, n = args.distill_batch, args.distill_seq
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.config.vocab_size, (b, n), generator=gen)
    split = SplitModel(model, M, 0)
    steps = max(2, args.steps // 4)  # a training step is ~100 decode steps' work
    if is_cuda(device):
        torch.cuda.reset_peak_memory_stats(device)
    out: Dict[str, Any] = {"batch": b, "seq_len": n, "m": M, "ce_fraction": CE_FRACTION, "vocab": args.distill_vocab,
                           "timed_steps": steps}
    out["teacher_tok_s"] = b * n / timed(lambda: teacher(split, tokens), device, steps)
    t = teacher(split, tokens)
    drafter = FeatureDrafter(model).float()
    out["drafter_params"] = drafter.n_params()
    stack = drafter.stack(split)
    rows = head_rows(model, list(range(min(args.distill_vocab, model.config.vocab_size))))
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-4, weight_decay=0.0)
    out["train"] = {}
    for unroll in (int(x) for x in args.distill_unrolls.split(",")):
        def step(unroll: int = unroll) -> None:
            states = token_states(split, drafter, t.shallow, tokens)
            with autocast(split):
                r = ttt_loss(split, drafter, stack, t.features, states, unroll, 0.1, rows,
                             ce_positions((b, n), CE_FRACTION, gen))
            opt.zero_grad(set_to_none=True)
            r["loss"].backward()
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
            opt.step()

        s = timed(step, device, steps)
        out["train"][str(unroll)] = {"step_ms": 1e3 * s, "positions_per_s": b * n / s}
    if is_cuda(device):
        out["peak_memory_GB"] = torch.cuda.max_memory_allocated(device) / 1e9
    out["free_memory_GB"] = available_bytes(device) / 1e9
    return out
