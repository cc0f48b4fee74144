"""`hat-bench speculative`: the core loop against its baselines, on the real Qwen pair, in one run.

Same prompts (token ids fixed once), greedy decoding, side by side:
  1. target alone (HF `generate`), draft alone (HF `generate`), HF assisted generation (`assistant_model=`) —
     in a child process that exits before the hatspec phase, so the machine's memory holds one set of models at a time;
  2. hatspec `sd` and `hlm` (and `llm`, `slm` for reference): a real `hat-cloud serve` process and the edge runtime in
     this process, over loopback TCP.
Reports tokens/s, the measured acceptance rate α (accepted / drafted), draft length γ, the cost ratio c (draft time per
token / target time per token, both measured alone), the ideal speedup (1 − α^(γ+1)) / ((1 − α)(γc + 1)) and the
efficiency = measured speedup / ideal. Writes JSON (and prints a table).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Dict, List


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hat-bench", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("speculative", help="sd / hlm vs target alone and HF assisted generation")
    s.add_argument("--draft", default="qwen2.5-coder-0.5b")
    s.add_argument("--target", default="qwen2.5-coder-1.5b")
    s.add_argument("--prompts", type=int, default=6, help="real prompts, half HumanEval half ShareGPT")
    s.add_argument("--max-new-tokens", type=int, default=64)
    s.add_argument("--draft-len", type=int, default=4, help="γ for hatspec sd")
    s.add_argument("--protocols", default="sd,hlm,llm,slm")
    s.add_argument("--out", default="runs/bench_speculative.json")
    s.add_argument("--skip-hf", action="store_true", help="skip the Hugging Face baselines")
    h = sub.add_parser("_hf-phase", help=argparse.SUPPRESS)
    h.add_argument("--draft")
    h.add_argument("--target")
    h.add_argument("--ids")
    h.add_argument("--max-new-tokens", type=int)
    h.add_argument("--out")
    return ap


def _hf_generate(model, ids: List[int], n: int, eos, **kw):
    import torch

    x = torch.tensor([ids])
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(x, max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=eos[0], **kw)
    dt = time.perf_counter() - t0
    return out[0, len(ids):].tolist(), dt


def hf_phase(args) -> int:
    """Child process: HF baselines. Writes per-prompt tokens and times."""
    from hat_split.loading import load_model

    with open(args.ids, encoding="utf-8") as f:
        prompts = json.load(f)
    target = load_model(args.target)
    draft = load_model(args.draft)
    eos = target.model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos)
    res: Dict[str, list] = {"target": [], "draft": [], "hf_assisted": []}
    _hf_generate(target.model, prompts[0], 2, eos)  # warm-up (first-call allocations)
    _hf_generate(draft.model, prompts[0], 2, eos)
    for i, ids in enumerate(prompts):
        for name, model, kw in (("target", target.model, {}), ("draft", draft.model, {}),
                                ("hf_assisted", target.model, {"assistant_model": draft.model})):
            toks, dt = _hf_generate(model, ids, args.max_new_tokens, eos, **kw)
            res[name].append({"tokens": toks, "total_s": dt})
            print(f"  hf {name:12s} prompt {i + 1}/{len(prompts)}: {len(toks)} tokens in {dt:.1f} s", flush=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(res, f)
    return 0


def _rate(rows: List[dict]) -> float:
    return sum(len(r["tokens"]) for r in rows) / sum(r["total_s"] for r in rows)


def speculative(args) -> int:
    from cloud_runtime.process import CloudProcess
    from edge_runtime.config import EdgeConfig
    from edge_runtime.runtime import EdgeRuntime
    from hat_split.loading import load_tokenizer
    from hat_split.sampling import SamplingParams
    from hat_split.verify import ideal_speedup
    from profiles.prompts import demo_prompts

    prompts = demo_prompts(args.prompts)
    tok = load_tokenizer(args.draft)
    ids = []
    for p in prompts:
        if p.chat:
            text = tok.apply_chat_template([{"role": "user", "content": p.text}], tokenize=False,
                                           add_generation_prompt=True)
            ids.append(list(tok(text, add_special_tokens=False)["input_ids"]))
        else:
            ids.append(list(tok(p.text)["input_ids"]))
    report: dict = {"draft": args.draft, "target": args.target, "max_new_tokens": args.max_new_tokens,
                    "draft_len": args.draft_len, "prompts": [p.to_json() for p in prompts], "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_hf:
            ids_path, hf_out = os.path.join(tmp, "ids.json"), os.path.join(tmp, "hf.json")
            with open(ids_path, "w", encoding="utf-8") as f:
                json.dump(ids, f)
            print("hat-bench: Hugging Face baselines (child process) ...", flush=True)
            rc = subprocess.call([sys.executable, "-m", "scripts.bench", "_hf-phase", "--draft", args.draft,
                                  "--target", args.target, "--ids", ids_path, "--max-new-tokens",
                                  str(args.max_new_tokens), "--out", hf_out])
            if rc:
                print(f"hat-bench: HF phase failed (exit {rc})", file=sys.stderr)
                return rc
            with open(hf_out, encoding="utf-8") as f:
                report["runs"].update({f"hf_{k}": v for k, v in json.load(f).items()})
        print("hat-bench: hatspec over loopback ...", flush=True)
        with CloudProcess(args.target) as cloud:
            cfg = EdgeConfig(model=args.draft, server=cloud.endpoint, draft_len=args.draft_len)
            with EdgeRuntime(cfg) as rt:
                rt.generate(ids[0], "sd", SamplingParams(0.0), 2)  # warm-up both processes
                for protocol in [p for p in args.protocols.split(",") if p]:
                    rows = []
                    for i, x in enumerate(ids):
                        r = rt.generate(x, protocol, SamplingParams(0.0), args.max_new_tokens, seed=0)
                        rows.append(r.to_json())
                        print(f"  hatspec {protocol:4s} prompt {i + 1}/{len(ids)}: {r.n} tokens in {r.total_s:.1f} s,"
                              f" accepted/round {r.summary()['accepted_per_round']:.2f}", flush=True)
                    report["runs"][f"hatspec_{protocol}"] = rows
    runs = report["runs"]
    rates = {name: _rate(rows) for name, rows in runs.items()}
    base = "hf_target" if "hf_target" in runs else "hatspec_llm"
    summary: dict = {"tokens_per_s": rates, "baseline": base}
    if "hf_draft" in runs and "hf_target" in runs:
        c = rates["hf_target"] / rates["hf_draft"]  # draft time per token / target time per token
    elif "hatspec_slm" in runs and "hatspec_llm" in runs:
        c = rates["hatspec_llm"] / rates["hatspec_slm"]
    else:
        c = None
    summary["c"] = c
    for proto, gamma in (("sd", args.draft_len), ("hlm", 1)):
        rows = runs.get(f"hatspec_{proto}")
        if not rows:
            continue
        drafted = sum(r["drafted"] for r in rows)
        accepted = sum(r["accepted"] for r in rows)
        alpha = accepted / drafted if drafted else 0.0
        speedup = rates[f"hatspec_{proto}"] / rates[base]
        ideal = ideal_speedup(alpha, gamma, c) if c is not None else None
        entry = {"alpha": alpha, "gamma": gamma, "speedup": speedup, "ideal_speedup": ideal,
                 "efficiency": speedup / ideal if ideal else None,
                 "accepted_per_round": accepted / sum(r["rounds"] for r in rows)}
        if "hf_target" in runs:
            same = [r["tokens"] == h["tokens"] for r, h in zip(rows, runs["hf_target"])]
            entry["identical_to_target_greedy"] = f"{sum(same)}/{len(same)}"
        summary[proto] = entry
    if "hf_hf_assisted" in runs:
        summary["hf_assisted_speedup"] = rates["hf_hf_assisted"] / rates[base]
        if "hatspec_sd" in rates:
            summary["sd_vs_hf_assisted"] = rates["hatspec_sd"] / rates["hf_hf_assisted"]
    report["summary"] = summary
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(summary, indent=1))
    print(f"hat-bench: report saved to {args.out}")
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "_hf-phase":
        return hf_phase(args)
    return speculative(args)


if __name__ == "__main__":
    sys.exit(main())
