"""`hat-bench speculative`: the core loop against its baselines, on the real Qwen pair, in one run.

Same prompts (token ids fixed once), greedy decoding, side by side:
  1. target alone (HF `generate`), draft alone (HF `generate`), HF assisted generation (`assistant_model=`) —
     in a child process that exits before the hatspec phase, so the machine's memory holds one set of models at a time;
  2. hatspec `sd` and `hlm` (and `llm`, `slm` for reference): a real `hat-cloud serve` process and the edge runtime in
     this process, over loopback TCP (profiles.bench.testbed).
Reports tokens/s, the measured acceptance rate α (accepted / examined draft positions: accepted + rounds that ended in
a rejection; accepted / drafted is reported too), mean draft length γ, the cost ratio c (draft time per
token / target time per token, both measured alone), the ideal speedup (1 − α^(γ+1)) / ((1 − α)(γc + 1)) and the
efficiency = measured speedup / ideal. Writes JSON (and prints a table).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Tuple

from edge_runtime.config import EdgeConfig, EngineConfig, LinkConfig
from hat_split.math.sampling import SamplingParams
from hat_split.math.verify import ideal_speedup
from hat_split.models.chat import encode
from hat_split.models.loading import load_model, load_tokenizer, quantize_weights, resolve_dtype
from profiles.bench.bench_args import parse_variants, variant_name
from profiles.bench.bench_cuhlm import add_parser as add_cuhlm_parser
from profiles.bench.bench_cuhlm import run as run_cuhlm
from profiles.bench.bench_edge import add_parser as add_edge_parser
from profiles.bench.bench_edge import run as run_edge
from profiles.bench.bench_engines import add_parser as add_engines_parser
from profiles.bench.bench_engines import run as run_engines
from profiles.bench.bench_fleet import add_parser as add_fleet_parser
from profiles.bench.bench_gpu import add_parser as add_gpu_parser
from profiles.bench.bench_gpu import run as run_gpu
from profiles.bench.bench_fleet import run as run_fleet
from profiles.bench.bench_hat import add_parser as add_hat_parser
from profiles.bench.bench_hat import run as run_hat
from profiles.bench.bench_qs import add_parser as add_qs_parser
from profiles.bench.bench_qs import run as run_qs
from profiles.bench.fuzz import add_parser as add_fuzz_parser
from profiles.bench.fuzz import run as run_fuzz
from profiles.bench.soak import add_parser as add_soak_parser
from profiles.bench.soak import run as run_soak
from profiles.bench.bench_tasks import add_parser as add_tasks_parser
from profiles.bench.bench_tasks import run as run_tasks
from profiles.bench.testbed import Testbed
from profiles.testbed.prompts import demo_prompts


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hat-bench", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("speculative", help="sd / hlm vs target alone and HF assisted generation")
    s.add_argument("--draft", default="qwen2.5-coder-0.5b")
    s.add_argument("--target", default="qwen2.5-coder-1.5b")
    s.add_argument("--prompts", type=int, default=6, help="real prompts, half HumanEval half ShareGPT")
    s.add_argument("--max-new-tokens", type=int, default=64)
    s.add_argument("--draft-len", default="4",
                   help="sd variants run one after another, separated by commas: γ (fixed) or γ@η (at most γ drafts, "
                        "ending after a token with draft probability < η), e.g. 3,4,8@0.5")
    s.add_argument("--weight-quant", default="none", choices=["none", "int8"], help="the draft's weights (edge and HF)")
    s.add_argument("--target-dtype", default="auto", help="dtype of the target everywhere (cloud and HF runs)")
    s.add_argument("--draft-dtype", default="float32", help="dtype of the draft everywhere (edge and HF runs)")
    s.add_argument("--protocols", default="sd,hlm,llm,slm")
    s.add_argument("--out", default="runs/bench_speculative.json")
    s.add_argument("--skip-hf", action="store_true", help="skip the Hugging Face baselines")
    add_cuhlm_parser(sub)
    add_qs_parser(sub)
    add_hat_parser(sub)
    add_fleet_parser(sub)
    add_gpu_parser(sub)
    add_edge_parser(sub)
    add_engines_parser(sub)
    add_fuzz_parser(sub)
    add_soak_parser(sub)
    add_tasks_parser(sub)
    h = sub.add_parser("_hf-phase", help=argparse.SUPPRESS)
    h.add_argument("--draft")
    h.add_argument("--target")
    h.add_argument("--ids")
    h.add_argument("--max-new-tokens", type=int)
    h.add_argument("--target-dtype")
    h.add_argument("--draft-dtype")
    h.add_argument("--weight-quant")
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
    with open(args.ids, encoding="utf-8") as f:
        prompts = json.load(f)
    target = load_model(args.target, dtype=args.target_dtype)
    draft = load_model(args.draft, dtype=args.draft_dtype)
    quantize_weights(draft.model, args.weight_quant)
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
    try:
        variants = parse_variants(args.draft_len)
    except ValueError as exc:
        print(f"hat-bench: --draft-len: {exc}", file=sys.stderr)
        return 2
    prompts = demo_prompts(args.prompts)
    tok = load_tokenizer(args.draft)
    ids = [encode(tok, p.text, p.chat) for p in prompts]
    args.target_dtype, args.draft_dtype = resolve_dtype(args.target_dtype), resolve_dtype(args.draft_dtype)
    report: dict = {"draft": args.draft, "target": args.target, "target_dtype": args.target_dtype,
                    "draft_dtype": args.draft_dtype, "max_new_tokens": args.max_new_tokens,
                    "weight_quant": args.weight_quant, "sd_variants": variants,
                    "prompts": [p.to_json() for p in prompts], "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_hf:
            ids_path, hf_out = os.path.join(tmp, "ids.json"), os.path.join(tmp, "hf.json")
            with open(ids_path, "w", encoding="utf-8") as f:
                json.dump(ids, f)
            print("hat-bench: Hugging Face baselines (child process) ...", flush=True)
            rc = subprocess.call([sys.executable, "-m", "profiles.bench.bench", "_hf-phase", "--draft", args.draft,
                                  "--target", args.target, "--ids", ids_path, "--max-new-tokens",
                                  str(args.max_new_tokens), "--out", hf_out, "--target-dtype", args.target_dtype,
                                  "--draft-dtype", args.draft_dtype, "--weight-quant", args.weight_quant])
            if rc:
                print(f"hat-bench: HF phase failed (exit {rc})", file=sys.stderr)
                return rc
            with open(hf_out, encoding="utf-8") as f:
                report["runs"].update({f"hf_{k}": v for k, v in json.load(f).items()})
        print("hat-bench: hatspec over loopback ...", flush=True)
        with Testbed(args.target, cloud_args=["--dtype", args.target_dtype]) as bed:
            cfg = EdgeConfig(model=args.draft, link=LinkConfig(bed.endpoint, security=bed.security()),
                             engine=EngineConfig(dtype=args.draft_dtype, weight_quant=args.weight_quant))
            with bed.runtime(cfg) as rt:
                rt.generate(ids[0], "sd", SamplingParams(0.0), 2)  # warm-up both processes
                for protocol in [p for p in args.protocols.split(",") if p]:
                    for variant in (variants if protocol == "sd" else [None]):
                        name = f"hatspec_{protocol}" + (f"_{variant_name(*variant)}" if variant else "")
                        if variant:
                            rt.config = dataclasses.replace(rt.config, draft_len=variant[0], draft_stop_prob=variant[1])
                        rows = []
                        for i, x in enumerate(ids):
                            r = rt.generate(x, protocol, SamplingParams(0.0), args.max_new_tokens, seed=0)
                            rows.append(r.to_json())
                            print(f"  {name:14s} prompt {i + 1}/{len(ids)}: {r.n} tokens in {r.total_s:.1f} s,"
                                  f" accepted/round {r.summary()['accepted_per_round']:.2f}", flush=True)
                        report["runs"][name] = rows
    summary = summarise(report["runs"], variants)
    report["summary"] = summary
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(summary, indent=1))
    print(f"hat-bench: report saved to {args.out}")
    return 0


def summarise(runs: Dict[str, list], variants: List[Tuple[int, float]]) -> dict:
    """tokens/s per run; α, γ, c, ideal speedup, efficiency and greedy identity per speculative run.

    For a γ@η run the draft length varies; its ideal speedup uses the mean draft length per round as γ.
    """
    rates = {name: _rate(rows) for name, rows in runs.items()}
    # the target alone: HF's, else ours; neither measured (--skip-hf without llm): no speedups
    base = next((b for b in ("hf_target", "hatspec_llm") if b in runs), None)
    summary: dict = {"tokens_per_s": rates, "baseline": base}
    if "hf_draft" in runs and "hf_target" in runs:
        c = rates["hf_target"] / rates["hf_draft"]  # draft time per token / target time per token
    elif "hatspec_slm" in runs and "hatspec_llm" in runs:
        c = rates["hatspec_llm"] / rates["hatspec_slm"]
    else:
        c = None
    summary["c"] = c
    for name, (gamma, eta) in [(f"hatspec_sd_{variant_name(*v)}", v) for v in variants] + [("hatspec_hlm", (1, 0))]:
        rows = runs.get(name)
        if not rows:
            continue
        drafted = sum(r["drafted"] for r in rows)
        accepted = sum(r["accepted"] for r in rows)
        rejected = sum(r["rejected"] for r in rows)
        rounds = sum(r["rounds"] for r in rows)
        alpha = accepted / (accepted + rejected) if drafted else 0.0  # per examined position (Leviathan's α)
        speedup = rates[name] / rates[base] if base else None
        # closed form: fixed γ, i.i.d. acceptance; not defined for confidence-stopped (γ@η) drafts
        ideal = ideal_speedup(alpha, gamma, c) if c is not None and not eta else None
        # what this run's own rounds would give with zero overhead: tokens per round / (drafts per round · c + 1)
        realized = (accepted + rounds) / rounds / (drafted / rounds * c + 1) if c is not None else None
        entry = {"alpha": alpha, "acceptance_rate": accepted / drafted if drafted else 0.0, "gamma": gamma, "eta": eta,
                 "mean_drafts_per_round": drafted / rounds, "accepted_per_round": accepted / rounds,
                 "speedup": speedup, "ideal_speedup": ideal,
                 "efficiency": speedup / ideal if ideal and speedup is not None else None,
                 "overhead_free_speedup": realized,
                 "efficiency_vs_overhead_free": speedup / realized if realized and speedup is not None else None}
        if "hf_target" in runs:
            same = [r["tokens"] == h["tokens"] for r, h in zip(rows, runs["hf_target"])]
            entry["identical_to_target_greedy"] = f"{sum(same)}/{len(same)}"
        if "hf_hf_assisted" in runs:
            entry["vs_hf_assisted"] = rates[name] / rates["hf_hf_assisted"]
        summary[name] = entry
    if "hf_hf_assisted" in runs and base:
        summary["hf_assisted_speedup"] = rates["hf_hf_assisted"] / rates[base]
    return summary


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "_hf-phase":
        return hf_phase(args)
    if args.command == "cuhlm":
        return run_cuhlm(args)
    if args.command in ("qs", "hat", "fleet", "edge", "engines", "fuzz", "soak", "gpu", "tasks"):
        try:
            return {"qs": run_qs, "hat": run_hat, "fleet": run_fleet, "edge": run_edge, "engines": run_engines,
                    "fuzz": run_fuzz, "soak": run_soak, "gpu": run_gpu,
                    "tasks": run_tasks}[args.command](args)
        except ValueError as exc:
            print(f"hat-bench {args.command}: {exc}", file=sys.stderr)
            return 2
    return speculative(args)


if __name__ == "__main__":
    sys.exit(main())
