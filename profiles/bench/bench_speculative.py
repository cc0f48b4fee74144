"""`hat-bench speculative`: speculative decoding (`sd` variants, `hlm`) against the target alone, with speedup
accounting that cannot pass its bound unnoticed (hat_split.math.speedup, docs/SPEEDUP.md) and intervals over prompts.

Systems, side by side on the same prompts (token ids fixed once), greedy:
  1. Hugging Face: target alone, draft alone, assisted generation (`assistant_model=`) — in a child process that
     exits before the hatspec phase, so the machine holds one set of models at a time; per prompt the three run in
     turn;
  2. hatspec (`--engine torch`, or `--engine llamacpp`: both sides on the GGUF files, one thread each, no HF
     phase): `llm` (the target alone through the same cloud and link: the baseline every speedup is taken against),
     `slm` (the draft alone through the same code path: its per-token time includes the draft's overheads), every
     `sd` variant and `hlm`; a real `hat-cloud serve` process and the edge runtime in this process over loopback
     (profiles.bench.rig). Per prompt every system runs in turn, the order rotating from prompt to prompt, so a
     drift in the machine's speed falls on all of them alike.
γ is chosen on tuning prompts (hat_split.prompt_sets.calibration_prompts: disjoint from the reported ones): with more
than one `sd` variant, each runs on them first and the fastest is "chosen"; every variant is reported, and the
headline is the chosen one's figure on the reported prompts, never the best of them.

Per speculative run: α per examined position, γ, c = t_d / T (T: `llm`'s time per token after its request opened,
t_d: `slm`'s), the measured decode speedup T·Σn_i/Σw_i over its verification rounds with its bound Σn_i/Σ(γ_i c + 1)
and the closed-form ideal (a value above the bound is listed under "problems", never clipped), and end-to-end
speedups per prompt (tokens/s of the run over the baseline's on the same prompt) with 95 % intervals, n and method
(profiles.bench.stats), against hatspec's `llm`, HF's target alone and HF assisted generation.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional, Tuple

from edge_runtime.config import EdgeConfig, EngineConfig, LinkConfig
from hat_split.math.sampling import SamplingParams
from hat_split.math.speedup import speedup_report
from hat_split.math.tree import parse_shapes, shape_name
from hat_split.models.chat import encode
from hat_split.models.llamacpp_lib import INSTALL_HINT, llama_cpp_installed
from hat_split.models.loading import load_tokenizer, resolve_dtype
from hat_split.prompt_sets import calibration_prompts, evaluation_prompts
from profiles.bench.bench_args import parse_variants, variant_name
from profiles.bench.provenance import write_report
from profiles.bench.stats import ci_text, paired_ratio, rotated
from profiles.bench.rig import Rig
from hat_split.files import strict_json

BASELINE = "hatspec_llm"
DRAFT_ALONE = "hatspec_slm"


def add_parser(sub) -> None:
    s = sub.add_parser("speculative", help="sd / hlm vs the target alone (ours, HF's) and HF assisted generation, "
                                           "with bounded speedup accounting and intervals")
    s.add_argument("--draft", default="qwen2.5-coder-0.5b")
    s.add_argument("--target", default="qwen2.5-coder-1.5b")
    s.add_argument("--prompts", type=int, default=8, help="reported prompts, half HumanEval half ShareGPT")
    s.add_argument("--tune-prompts", type=int, default=4,
                   help="prompts (disjoint from the reported ones) that choose γ among the sd variants; 0: no choice")
    s.add_argument("--max-new-tokens", type=int, default=64)
    s.add_argument("--draft-len", default="4",
                   help="sd variants, separated by commas: γ (fixed) or γ@η (at most γ drafts, ending after a token "
                        "with draft probability < η), e.g. 3,4,8@0.5")
    s.add_argument("--trees", default="",
                   help="sd draft-tree variants, separated by commas: NODESxDEPTHxWIDTH (tree_nodes, tree_depth, "
                        "tree_width), e.g. 8x4x2,16x4x4,32x8x4; the cloud runs growing caches (--kv-layout dynamic)")
    s.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature of every system (above 0 each prompt's seed is its index: the same "
                        "for every system; the HF baselines stay greedy)")
    s.add_argument("--link", default="", help="a link profile (testbed.links, e.g. wifi-far, lte) in front of the "
                                              "cloud; empty: loopback")
    s.add_argument("--engine", default="torch", choices=["torch", "llamacpp"],
                   help="what runs both sides: torch (the HF weights; HF baselines beside) or llamacpp (the registry's "
                        "GGUF files on llama.cpp, one thread each side; trees on sequence-id sets; no HF baselines)")
    s.add_argument("--weight-quant", default="none", choices=["none", "int8"], help="the draft's weights (edge and HF)")
    s.add_argument("--target-dtype", default="auto", help="dtype of the target everywhere (cloud and HF runs)")
    s.add_argument("--draft-dtype", default="float32", help="dtype of the draft everywhere (edge and HF runs)")
    s.add_argument("--protocols", default="sd,hlm", help="speculative protocols besides llm and slm (always run)")
    s.add_argument("--out", default="runs/bench_speculative.json")
    s.add_argument("--skip-hf", action="store_true", help="skip the Hugging Face baselines")


def add_hf_phase_parser(sub) -> None:
    h = sub.add_parser("_hf-phase", help=argparse.SUPPRESS)
    for flag in ("--draft", "--target", "--ids", "--target-dtype", "--draft-dtype", "--weight-quant", "--out"):
        h.add_argument(flag)
    h.add_argument("--max-new-tokens", type=int)


def _hf_generate(model, ids: List[int], n: int, eos, **kw):
    import time

    import torch

    x = torch.tensor([ids])
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(x, max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=eos[0], **kw)
    return out[0, len(ids):].tolist(), time.perf_counter() - t0


def hf_phase(args) -> int:
    """Child process: the HF baselines, the three in turn per prompt. Writes per-prompt tokens and times."""
    from hat_split.models.loading import load_model, quantize_weights

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
    systems = [("target", target.model, {}), ("draft", draft.model, {}),
               ("hf_assisted", target.model, {"assistant_model": draft.model})]
    for i, ids in enumerate(prompts):
        for name, model, kw in systems[i % 3:] + systems[:i % 3]:
            toks, dt = _hf_generate(model, ids, args.max_new_tokens, eos, **kw)
            res[name].append({"tokens": toks, "total_s": dt})
            print(f"  hf {name:12s} prompt {i + 1}/{len(prompts)}: {len(toks)} tokens in {dt:.1f} s", flush=True)
    with open(args.out, "w", encoding="utf-8") as f:
        strict_json.dump(res, f)
    return 0


def sd_variants(variants: List[Tuple[int, float]], trees: List[Tuple[int, int, int]]) -> Dict[str, dict]:
    """Each sd run's name and the EdgeConfig fields it sets: chains (γ, η), then draft trees."""
    out = {f"hatspec_sd_{variant_name(g, e)}": {"draft_len": g, "draft_stop_prob": e, "tree_nodes": 0}
           for g, e in variants}
    out.update({f"hatspec_sd_{shape_name(*t)}": dict(zip(("tree_nodes", "tree_depth", "tree_width"), t))
                for t in trees})
    return out


def _system_names(protocols: List[str], by_name: Dict[str, dict]) -> List[str]:
    out = [BASELINE, DRAFT_ALONE]
    for p in protocols:
        out += list(by_name) if p == "sd" else [f"hatspec_{p}"]
    return out


def _run_one(rt, name: str, ids: List[int], variants_by_name: dict, max_new_tokens: int, temperature: float = 0.0,
             seed: int = 0):
    protocol = name.split("_")[1]
    variant = variants_by_name.get(name)
    if variant:
        rt.config = dataclasses.replace(rt.config, **variant)
    return rt.generate(ids, protocol, SamplingParams(temperature), max_new_tokens, seed=seed)


def _interleaved(rt, names: List[str], prompts: List[List[int]], variants_by_name: dict, max_new_tokens: int,
                 label: str, temperature: float = 0.0) -> Dict[str, list]:
    """Every system on every prompt, the systems in turn per prompt, the order rotating by one per prompt; prompt i
    runs with seed i for every system."""
    rows: Dict[str, list] = {n: [None] * len(prompts) for n in names}
    for i, ids in enumerate(prompts):
        for name in rotated(names, i):
            r = _run_one(rt, name, ids, variants_by_name, max_new_tokens, temperature, i)
            rows[name][i] = r.to_json()
            print(f"  {label} {name:22s} prompt {i + 1}/{len(prompts)}: {r.n} tokens in {r.total_s:.2f} s, "
                  f"{r.summary()['tokens_per_s']:.2f} tok/s", flush=True)
    return rows


def _rate(rows: List[dict]) -> float:
    return sum(len(r["tokens"]) for r in rows) / sum(r["total_s"] for r in rows)


def _per_token_after_open(rows: List[dict]) -> float:
    """Seconds per token after the request opened (prompt and session set-up excluded)."""
    return sum(r["total_s"] - r.get("open_s", 0.0) for r in rows) / sum(len(r["tokens"]) for r in rows)


def choose(tuning: Dict[str, list]) -> Optional[str]:
    """The sd variant with the highest tokens/s on the tuning prompts (None without tuning runs)."""
    sd = {name: _rate(rows) for name, rows in tuning.items() if name.startswith("hatspec_sd_")}
    return max(sd, key=sd.get) if sd else None


def ratio_ci(rows: List[dict], base: List[dict]) -> dict:
    """Per-prompt speedup (tokens/s over the baseline's on the same prompt): mean, 95 % interval, n, method; and the
    aggregate ratio (all tokens over all time)."""
    def rates(rs: List[dict]) -> List[float]:
        return [len(r["tokens"]) / r["total_s"] for r in rs]

    return {**paired_ratio(rates(rows), rates(base)), "aggregate": _rate(rows) / _rate(base)}


def summarise(runs: Dict[str, list], chosen: Optional[str] = None) -> dict:
    """Rates, α, γ, c, the bounded decode speedup and the end-to-end speedups with intervals, per speculative run."""
    rates = {name: _rate(rows) for name, rows in runs.items()}
    summary: dict = {"tokens_per_s": rates, "baseline": BASELINE if BASELINE in runs else None, "chosen": chosen}
    T = _per_token_after_open(runs[BASELINE]) if BASELINE in runs else None
    t_d = _per_token_after_open(runs[DRAFT_ALONE]) if DRAFT_ALONE in runs else None
    summary.update({"T_s": T, "t_d_s": t_d, "c": t_d / T if T and t_d is not None else None})
    if "hf_hf_assisted" in runs:
        for base in ("hf_target", BASELINE):
            if base in runs:
                summary[f"hf_assisted_vs_{base}"] = ratio_ci(runs["hf_hf_assisted"], runs[base])
    for name, rows in runs.items():
        if not name.startswith("hatspec_") or name in (BASELINE, DRAFT_ALONE):
            continue
        log = [entry for r in rows for entry in r.get("verify_log", [])]
        entry: dict = {"rounds": len(log), "tokens": sum(len(r["tokens"]) for r in rows)}
        if log and T is not None and t_d is not None:
            rep = speedup_report([int(e[0]) for e in log], [int(e[1]) for e in log], [e[2] for e in log], T, t_d)
            entry.update({"alpha": rep.alpha, "gamma": rep.gamma, "tokens_per_round": rep.tokens_per_round,
                          "decode_speedup": rep.measured, "bound": rep.bound, "ideal": rep.ideal,
                          "efficiency": rep.efficiency, "short_rounds": rep.short_rounds,
                          "problems": list(rep.problems)})
        drafted = sum(r["drafted"] for r in rows)
        entry["acceptance_rate"] = sum(r["accepted"] for r in rows) / drafted if drafted else None
        entry.update(_per_token(rows))
        for base in (BASELINE, "hf_target", "hf_hf_assisted"):
            if base in runs:
                entry[f"vs_{base}"] = ratio_ci(rows, runs[base])
        if BASELINE in runs:
            same = [r["tokens"] == b["tokens"] for r, b in zip(rows, runs[BASELINE])]
            entry["identical_to_llm"] = f"{sum(same)}/{len(same)}"
        summary[name] = entry
    return summary


def _per_token(rows: List[dict]) -> dict:
    """What does not depend on the hardware, over a run's rows: committed tokens per verification round and per round
    trip, uplink bytes per token, and the positions the cloud computed per token (each round's drafts or tree nodes
    plus the position after the last committed token)."""
    tokens = sum(len(r["tokens"]) for r in rows)
    rounds, trips, up = (sum(r.get(k, 0) for r in rows) for k in ("rounds", "round_trips", "up_bytes"))
    return {"tokens_per_round": tokens / rounds if rounds else None,
            "tokens_per_round_trip": tokens / trips if trips else None,
            "up_bytes_per_token": up / tokens if tokens and up else None,
            "cloud_positions_per_token": (sum(r["drafted"] for r in rows) + rounds) / tokens if rounds else None}


def format_table(summary: dict) -> str:
    def ci(d: Optional[dict]) -> str:
        return ci_text(d, form="interval")

    def num(x, fmt=".2f") -> str:
        return "-" if x is None else format(x, fmt)

    lines = [f"{'run':24s} {'tok/s':>6s} {'alpha':>5s} {'gamma':>5s} {'decode x':>8s} {'bound':>5s} {'eff':>4s}  "
             f"{'tok/rnd':>7s} {'B up/tok':>8s} {'pos/tok':>7s}  "
             f"{'vs llm [95% CI]':>34s}  {'vs HF target':>34s}  {'vs HF assisted':>34s}"]
    for name, e in summary.items():
        if not isinstance(e, dict) or "rounds" not in e:
            continue
        mark = " *" if name == summary.get("chosen") else ""
        lines.append(f"{name + mark:24s} {summary['tokens_per_s'][name]:6.2f} {num(e.get('alpha')):>5s} "
                     f"{num(e.get('gamma'), '.1f'):>5s} {num(e.get('decode_speedup')):>8s} {num(e.get('bound')):>5s} "
                     f"{num(e.get('efficiency')):>4s}  {num(e.get('tokens_per_round')):>7s} "
                     f"{num(e.get('up_bytes_per_token'), '.0f'):>8s} {num(e.get('cloud_positions_per_token')):>7s}  "
                     f"{ci(e.get('vs_' + BASELINE)):>34s}  "
                     f"{ci(e.get('vs_hf_target')):>34s}  {ci(e.get('vs_hf_hf_assisted')):>34s}")
        lines += [f"    problem: {p}" for p in e.get("problems", [])]
    lines.append(f"c = {num(summary.get('c'), '.3f')} (T = {num(summary.get('T_s'), '.4f')} s, t_d = "
                 f"{num(summary.get('t_d_s'), '.4f')} s); * = γ chosen on the tuning prompts")
    return "\n".join(lines)


def _hf_runs(args, ids: List[List[int]], tmp: str) -> Optional[Dict[str, list]]:
    """The HF baselines' rows, None when the child failed (it printed why)."""
    ids_path, hf_out = os.path.join(tmp, "ids.json"), os.path.join(tmp, "hf.json")
    with open(ids_path, "w", encoding="utf-8") as f:
        strict_json.dump(ids, f)
    print("hat-bench speculative: Hugging Face baselines (child process) ...", flush=True)
    rc = subprocess.call([sys.executable, "-m", "profiles.bench.bench", "_hf-phase", "--draft", args.draft,
                          "--target", args.target, "--ids", ids_path, "--max-new-tokens", str(args.max_new_tokens),
                          "--out", hf_out, "--target-dtype", args.target_dtype, "--draft-dtype", args.draft_dtype,
                          "--weight-quant", args.weight_quant])
    if rc:
        return None
    with open(hf_out, encoding="utf-8") as f:
        return {f"hf_{k}": v for k, v in json.load(f).items()}


def run(args) -> int:
    variants = parse_variants(args.draft_len)  # a ValueError names the bad item
    by_name = sd_variants(variants, parse_shapes(args.trees))
    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")
    protocols = [p for p in args.protocols.split(",") if p]
    if not set(protocols) <= {"sd", "hlm"}:
        raise ValueError(f"--protocols: sd and hlm are the speculative ones, got {protocols}")
    if args.prompts < 1 or args.tune_prompts < 0 or args.max_new_tokens < 2:
        raise ValueError("need --prompts >= 1, --tune-prompts >= 0 and --max-new-tokens >= 2")
    tok = load_tokenizer(args.draft)
    prompts = evaluation_prompts(args.prompts)
    ids = [encode(tok, p.text, p.chat) for p in prompts]
    tune_ids = ([encode(tok, p.text, p.chat) for p in calibration_prompts(args.tune_prompts)]
                if len(by_name) > 1 and args.tune_prompts and "sd" in protocols else [])
    args.target_dtype, args.draft_dtype = resolve_dtype(args.target_dtype), resolve_dtype(args.draft_dtype)
    names = _system_names(protocols, by_name)
    report: dict = {"settings": {k: v for k, v in vars(args).items() if k != "func"}, "sd_variants": by_name,
                    "prompts": [p.to_json() for p in prompts], "runs": {}}
    llamacpp = args.engine == "llamacpp"
    if llamacpp and not llama_cpp_installed():
        raise ValueError(INSTALL_HINT)
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_hf and not llamacpp:
            hf = _hf_runs(args, ids, tmp)
            if hf is None:
                print("hat-bench speculative: the Hugging Face phase failed (above)", file=sys.stderr)
                return 1
            report["runs"].update(hf)
        print(f"hat-bench speculative: hatspec over {args.link or 'loopback'} ...", flush=True)
        cloud_args = (["--engine", "llamacpp", "--n-ctx", "8192"] if llamacpp else
                      ["--dtype", args.target_dtype, "--kv-layout", "dynamic"])
        engine = (EngineConfig(backend="llamacpp", n_ctx=4096, threads=1) if llamacpp else
                  EngineConfig(dtype=args.draft_dtype, weight_quant=args.weight_quant))
        with Rig(args.target, cloud_args=cloud_args, threads=1 if llamacpp else 0, link=args.link or None) as bed:
            cfg = EdgeConfig(model=args.draft, link=LinkConfig(bed.endpoint, security=bed.security()), engine=engine)
            with bed.runtime(cfg) as rt:
                rt.generate(ids[0], "sd", SamplingParams(0.0), 2)  # warm-up both processes
                if tune_ids:
                    sd_names = [n for n in names if n in by_name]
                    report["tuning"] = _interleaved(rt, sd_names, tune_ids, by_name, args.max_new_tokens, "tune",
                                                    args.temperature)
                report["runs"].update(_interleaved(rt, names, ids, by_name, args.max_new_tokens, "eval",
                                                   args.temperature))
    sd_runs = [n for n in names if n in by_name]
    chosen = choose(report.get("tuning", {})) or (sd_runs[0] if len(sd_runs) == 1 else None)
    report["summary"] = summarise(report["runs"], chosen)
    if report.get("tuning"):
        report["summary"]["tuning_tokens_per_s"] = {n: _rate(r) for n, r in report["tuning"].items()}
    write_report(args.out, report)
    print(format_table(report["summary"]))
    print(f"hat-bench speculative: report saved to {args.out}")
    return 0
