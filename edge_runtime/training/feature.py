"""`hat-distill --drafter feature`: train the feature drafter (hat_split.models.feature_drafter) over the teacher cache
with the training-time test, then evaluate it like Λ (held-out windows, greedy HAT acceptance) and write its artifact.

    hat-distill --drafter feature --model qwen2.5-coder-1.5b --m 2 --windows 1200 --steps 600 --unroll 3

The cache is hat-distill's own (the same windows, the same spec: one cache serves Λ and the feature drafter). The
drafter trains in float32 master weights; the frozen model's matmuls autocast to its dtype. The CE term runs over the
`--train-vocab` most frequent tokens of the training data (the teacher's distribution renormalised on them): the head's
vocabulary-wide matmul is most of a step otherwise, and the device drafts over such a subset anyway
(split.draft_vocab). A checkpoint every --checkpoint-every steps; --resume continues with the same data order.

--budget-s S fits the cache and the training into S seconds from the start of the command (the demo's recipe, sized by
the machine it runs on): the cache fills at most --windows windows until BUDGET_CACHE of the budget is spent (it stays
resumable: a later run with the same windows continues it), one step is timed, and the steps are as many as the rest
of the budget holds at that pace. The record says what the budget bought.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Dict, List

from edge_runtime.training.common import (TRAIN_FROM, copy_record, held_out_acceptance, resume,
                                          teacher_cache, train_steps, visit_order, vocab_ranking, windows)
from hat_split.files import strict_json
from hat_split.models.adapter import load_draft_vocab, save_draft_vocab
from hat_split.models.distill import autocast, ce_positions, teacher
from hat_split.models.feature_drafter import (FeatureDrafter, load_feature_drafter, read_feature_meta,
                                              save_feature_drafter, token_states, ttt_loss)
from hat_split.models.partition import head_rows
from hat_split.models.placement import device_name

BUDGET_CACHE = 0.5  # the share of --budget-s the teacher cache may take; the training gets the rest
RESUME_KEYS = ("model", "m", "tail", "seq_len", "batch", "windows", "train_windows", "seed", "unroll", "token_input",
               "train_vocab", "data")


def window_states(cache: Any, split: Any, drafter: FeatureDrafter, train: List[List[int]], idx: List[int]):
    """(features, token states) `# [B, n, hidden]` of windows `idx`: read from the teacher cache, or (cache None:
    --no-cache) the frozen model run live on them."""
    import torch

    tokens = torch.tensor([train[i] for i in idx], dtype=torch.long)
    t = teacher(split, tokens) if cache is None else cache.teacher(split, idx)
    return t.features, token_states(split, drafter, t.shallow, tokens)


def evaluate(split: Any, drafter: FeatureDrafter, eval_sets: List[Any], unroll: int, w_ce: float, rows: Any
             ) -> Dict[str, Any]:
    """Held-out loss and top-1 agreement (per unroll step) of the drafter with the target's own next token."""
    import torch

    stack = drafter.stack(split)
    sums: Dict[str, Any] = {"loss": 0.0, "smooth_l1": 0.0, "ce": 0.0, "top1": 0.0, "top1_steps": [0.0] * unroll}
    with torch.no_grad(), autocast(split):
        for feats, states in eval_sets:
            r = ttt_loss(split, drafter, stack, feats, states, unroll, w_ce, rows, train=False)
            for k in ("smooth_l1", "ce", "top1"):
                sums[k] += r[k] / len(eval_sets)
            sums["loss"] += float(r["loss"]) / len(eval_sets)
            sums["top1_steps"] = [a + b / len(eval_sets) for a, b in zip(sums["top1_steps"], r["top1_steps"])]
    return sums


def budget_steps(args, drafter: FeatureDrafter, loss_at: Any, used: int) -> Dict[str, Any]:
    """--budget-s: time one step (its gradient thrown away) and set args.steps to as many as the rest of the budget
    holds (at least 1); returns what the budget bought."""
    import torch

    t0 = time.perf_counter()
    r = loss_at(0, list(range(min(args.batch, used))), torch.Generator().manual_seed(args.seed))
    r["loss"].backward()
    drafter.zero_grad(set_to_none=True)
    step_s = time.perf_counter() - t0
    left = args.started + args.budget_s - time.perf_counter()
    args.steps = max(1, int(left / step_s))
    print(f"hat-distill: --budget-s {args.budget_s:g}: {used} windows cached, a step takes {step_s:.2f} s, so "
          f"{args.steps} steps", file=sys.stderr)
    return {"budget_s": args.budget_s, "windows": used, "step_s": step_s, "steps": args.steps}


def run(args, loaded: Any, split: Any, out: Path, dtype: str) -> int:
    """The feature drafter's training and evaluation (hat-distill's arguments, model and split)."""
    import torch

    from hat_split.files.provenance import provenance

    model, tok = loaded.model, loaded.tokenizer
    torch.manual_seed(args.seed)
    stamp = provenance()
    if args.eval_only:
        drafter = load_feature_drafter(out, split)
        meta = read_feature_meta(out)
        record, stamp["weights_from"] = meta["record"], meta.get("provenance")
        rows = head_rows(model, load_draft_vocab(out, args.train_vocab)) if args.train_vocab else None
    else:
        drafter = FeatureDrafter(model, args.token_input).float()
        opt = torch.optim.AdamW(drafter.parameters(), lr=args.lr, weight_decay=0.0)
        n_windows = args.windows or args.steps * args.batch
        print(f"hat-distill: {loaded.name} ({dtype}) cut m={args.m}: the feature drafter ({args.token_input}) has "
              f"{drafter.n_params():,} parameters; reading {n_windows} windows of {args.seq_len} tokens",
              file=sys.stderr)
        train = windows(tok, n_windows, args.seq_len, TRAIN_FROM, corpus=args.data,
                        conversations=args.conversations)
        used = args.train_windows or len(train)
        ranked = vocab_ranking(model, tok, train)  # of every window: one draft vocabulary for a data-scaling curve
        out.mkdir(parents=True, exist_ok=True)
        save_draft_vocab(out, ranked)
        rows = head_rows(model, load_draft_vocab(out, args.train_vocab)) if args.train_vocab else None
        start, history = 0, []
        if args.resume:
            start, history = resume(out, args, RESUME_KEYS, drafter, opt)
        t0 = time.perf_counter()
        deadline = args.started + BUDGET_CACHE * args.budget_s if args.budget_s else None
        cache = None if args.no_cache else teacher_cache(args, out, loaded.name, split, train, deadline)
        cache_s = time.perf_counter() - t0
        if args.budget_s:
            used = min(used, cache.done)
        stack = drafter.stack(split)

        def loss_at(step, idx, generator):
            feats, states = window_states(cache, split, drafter, train, idx)
            with autocast(split):
                return ttt_loss(split, drafter, stack, feats, states, args.unroll, args.w_ce, rows,
                                ce_positions(feats.shape[:2], args.ce_fraction, generator))

        budget = budget_steps(args, drafter, loss_at, used) if args.budget_s else None
        order = visit_order(used, args.steps * args.batch, args.seed)
        t0 = time.perf_counter()
        train_steps(args, out, drafter, opt, order, start, history, loss_at, "feature drafter")
        drafter.eval().requires_grad_(False)
        drafter.to(next(model.parameters()).dtype)
        record = {"drafter": "feature", "steps": args.steps, "batch": args.batch, "seq_len": args.seq_len,
                  "lr": args.lr, "w_ce": args.w_ce, "ce_fraction": args.ce_fraction, "unroll": args.unroll,
                  "token_input": args.token_input, "train_vocab": args.train_vocab, "dtype": dtype,
                  "device": device_name(model),
                  "windows": len(train), "train_windows": used,
                  "train_tokens": args.steps * args.batch * args.seq_len,
                  "train_data": args.data, "train_from_conversation": TRAIN_FROM,
                  "seconds": time.perf_counter() - t0,
                  "teacher_cache": None if cache is None else {"dtype": args.cache_dtype, "seconds": cache_s},
                  "history": history}
        if budget is not None:
            record["budget"] = {**budget, "seconds_used": time.perf_counter() - args.started}
    t_eval = time.perf_counter()
    eval_windows = windows(tok, args.eval_windows, args.seq_len, 0)
    eval_sets = []
    for w in eval_windows:
        t = teacher(split, torch.tensor([w], dtype=torch.long))
        eval_sets.append((t.features, token_states(split, drafter, t.shallow, torch.tensor([w]))))
    record["eval"] = evaluate(split, drafter, eval_sets, args.unroll, args.w_ce, rows)
    print(f"held-out windows: loss {record['eval']['loss']:.4f}, top-1 agreement {record['eval']['top1']:.3f} "
          "(per unroll step " + ", ".join(f"{x:.3f}" for x in record["eval"]["top1_steps"]) + ")", file=sys.stderr)
    record.update(held_out_acceptance(split, drafter, tok, args, out))
    suffix = f"_draft_vocab_{args.draft_vocab}" if args.draft_vocab else ""
    record["eval_seconds"] = time.perf_counter() - t_eval
    copy_record(args, save_feature_drafter(out, drafter, split, loaded.name, record, stamp) / "drafter.json")
    print(strict_json.dumps({"out": str(out), "params": drafter.n_params(), "eval": record["eval"],
                             "acceptance": record["acceptance" + suffix], "draft_vocab": args.draft_vocab}, indent=1))
    return 0
