"""`hat-bench cuhlm`: U-HLM and CU-HLM against their baselines on the real pair, in one run (CU-HLM Table I, Fig. 10).

Phases, all on the same evaluation prompts (disjoint from `hat-calibrate`'s), same seeds:
  1. every variant over loopback TCP with a real `hat-cloud serve` process: LLM, SLM, HLM, Rand-HLM, U-HLM, CU-HLM
     offline / online / exact; bytes are counted from the real frames;
  2. a few variants again over the link emulator at the ergodic uplink rate of chosen average SNRs (Rayleigh, W), to
     set measured transport beside the channel model;
  3. with the cloud gone: the target scores the generated sequences once (teacher forcing) for the true skip rate, and
     all-MiniLM-L6-v2 embeds responses and references for the accuracy metric.
Reported per variant: accuracy (mean cosine vs the dataset's reference answer, and relative to LLM), transmission
rate TR (uploads per token), true skip rate TSR (mean acceptance probability min(1, y_d/x_d) of skipped tokens), skip
rate, k mean / min / max, uplink bytes per token and as % of HLM, measured tokens/s, and the throughput of eq. 6 vs
average SNR under Rayleigh and Rician fading from the real per-round payload bits and the measured compute times.
Beside each pooled figure, `<key>_ci`: the mean of its per-prompt values with a 95 % interval, n (the prompts that
have the value) and method (profiles.bench.stats: bootstrap from 8 values, t below); figures against another variant
("vs LLM", "% of HLM") take the per-prompt ratio on the same prompt and the interval of those. Per prompt every
variant runs in turn, the order rotating by one per prompt (`rotated`), so a drift of the machine's speed falls on
every variant alike.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import os
import sys
import time
from typing import Dict, List, Optional

import numpy as np

from edge_runtime.config import EdgeConfig, EngineConfig, LinkConfig, UncertaintyConfig
from hat_split.files.figures import NO_MATPLOTLIB, pyplot
from hat_split.math.calibration import load as load_calibration
from hat_split.math.sampling import SamplingParams, warp
from hat_split.models.chat import encode
from hat_split.models.lm import CausalLM
from hat_split.models.loading import load_model, load_tokenizer, resolve_dtype
from hat_split.prompt_sets import evaluation_prompts
from profiles.bench.accuracy import Embedder
from profiles.bench.bench_args import names, numbers
from profiles.bench.rig import Rig
from testbed.channel import Channel, token_throughput
from testbed.links import LinkProfile
from profiles.bench.provenance import write_report
from profiles.bench.stats import ci_note, ci_text, interval, paired_diff, paired_ratio, rotated
from hat_split.files import strict_json


# name -> (protocol, UncertaintyConfig overrides)
VARIANTS: Dict[str, tuple] = {
    "llm": ("llm", {}),
    "slm": ("slm", {}),
    "hlm": ("hlm", {}),
    "randhlm": ("randhlm", {}),
    "uhlm": ("uhlm", {}),
    "cuhlm_offline": ("cuhlm", {"k_mode": "offline"}),
    "cuhlm_online": ("cuhlm", {"k_mode": "online"}),
    "cuhlm_exact": ("cuhlm", {"k_mode": "online", "exact": True}),
}
SKIPPING = ("randhlm", "uhlm", "cuhlm")


def add_parser(sub) -> None:
    s = sub.add_parser("cuhlm", help="U-HLM / CU-HLM vs LLM, SLM, HLM, Rand-HLM: accuracy, TR, TSR, k, payload, "
                                     "throughput vs SNR")
    s.add_argument("--draft", default="qwen2.5-coder-0.5b")
    s.add_argument("--target", default="qwen2.5-coder-1.5b")
    s.add_argument("--prompts", type=int, default=8, help="evaluation prompts with reference answers")
    s.add_argument("--max-new-tokens", type=int, default=64)
    s.add_argument("--temperature", type=float, default=1.0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--variants", default=",".join(VARIANTS), help=f"subset of {', '.join(VARIANTS)}")
    s.add_argument("--calibration", help="a hat-calibrate file (else the papers' line, threshold 0.5 and k* 30)")
    s.add_argument("--threshold-rule", default="risk-prone", choices=["risk-prone", "risk-averse", "risk-budget"])
    s.add_argument("--u-threshold", type=float, help="skip threshold; overrides the calibrated one")
    s.add_argument("--snr-db", default="-20,-15,-10,-5,0,5,10", help="average SNRs for the channel model")
    s.add_argument("--bandwidth-mhz", type=float, default=10.0, help="uplink bandwidth W")
    s.add_argument("--rician-k-db", type=float, default=10.0)
    s.add_argument("--emulate-snr-db", default="0,10", help="SNRs also run over the link emulator ('' = none)")
    s.add_argument("--emulate-variants", default="hlm,uhlm,cuhlm_online")
    s.add_argument("--emulate-prompts", type=int, default=2)
    s.add_argument("--weight-quant", default="int8", choices=["none", "int8"])
    s.add_argument("--target-dtype", default="auto")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--out", default="runs/bench_cuhlm.json", help="JSON report (PNG beside it)")


def _variant_names(text: str) -> List[str]:
    return names(text, VARIANTS, "variant")


def _generate_all(rt, variants, ids, params, max_new, seed, base_unc, label) -> Dict[str, list]:
    """Every variant on every prompt, the variants in turn per prompt in `rotated` order; rows in prompt order."""
    runs: Dict[str, list] = {name: [None] * len(ids) for name in variants}
    for i, x in enumerate(ids):
        for name in rotated(variants, i):
            protocol, overrides = VARIANTS[name]
            rt.config = dataclasses.replace(rt.config, uncertainty=dataclasses.replace(base_unc, **overrides))
            r = rt.generate(x, protocol, params, max_new, seed=seed * 1000 + i)
            runs[name][i] = r.to_json()
            print(f"  {label} {name:14s} prompt {i + 1}/{len(ids)}: {r.n} tokens in {r.total_s:.1f} s, "
                  f"skipped {r.skipped}, up {r.up_bytes} B", flush=True)
    return runs


def run_models(args, variants, ids, base_unc) -> dict:
    """Phases 1 and 2: the loopback runs and the emulated-link runs."""
    params = SamplingParams(args.temperature, 0, args.top_p)
    out: dict = {"loopback": {}, "emulated": {}}
    with Rig(args.target, cloud_args=["--dtype", args.target_dtype]) as bed:
        cfg = EdgeConfig(model=args.draft, link=LinkConfig(bed.endpoint, security=bed.security()),
                         engine=EngineConfig(weight_quant=args.weight_quant), uncertainty=base_unc)
        with bed.runtime(cfg) as rt:
            rt.generate(ids[0], "hlm", params, 2, seed=0)  # warm-up of both processes
            out["loopback"] = _generate_all(rt, variants, ids, params, args.max_new_tokens, args.seed, base_unc,
                                            "loopback")
            loaded = rt.engine.loaded
        for snr in numbers(args.emulate_snr_db):
            ch = Channel("rayleigh", snr, args.bandwidth_mhz * 1e6)
            rate = ch.mean_rate() / 8  # bytes/s
            profile = LinkProfile(f"rayleigh-{snr:g}dB", rate, rate, 0.0, 0.0, "ergodic rate of the channel model")
            with bed.add_link(profile) as link:
                ecfg = dataclasses.replace(cfg, server=link.address, weight_quant="none")  # `loaded` is quantized
                with bed.runtime(ecfg, loaded=loaded) as rt:
                    runs = _generate_all(rt, _variant_names(args.emulate_variants), ids[: args.emulate_prompts], params,
                                         args.max_new_tokens, args.seed, base_unc, f"{snr:g} dB")
            out["emulated"][f"{snr:g}"] = {"up_rate_bytes_per_s": rate, "runs": runs}
    return out


def true_skip_probs(args, ids, runs: Dict[str, list]) -> Dict[str, List[List[float]]]:
    """Per skipping variant and prompt: min(1, y_d / x_d) of each skipped token, y_d from one teacher-forced target
    pass ([] for a prompt with no skipped token)."""
    params = SamplingParams(args.temperature, 0, args.top_p)
    todo = {n: rows for n, rows in runs.items() if VARIANTS[n][0] in SKIPPING}
    if not todo:
        return {}
    lm = CausalLM(load_model(args.target, dtype=args.target_dtype).model)
    out: Dict[str, List[List[float]]] = {}
    for name, rows in todo.items():
        out[name] = []
        for x, row in zip(ids, rows):
            probs: List[float] = []
            out[name].append(probs)
            if not row["skip_log"]:
                continue
            toks = row["tokens"]
            logits = lm.forward(lm.new_state(), list(x) + toks[:-1], n_logits=len(toks))  # row i predicts toks[i]
            for index, x_d in row["skip_log"]:
                i = int(index)
                y_d = float(warp(logits[i:i + 1], params)[0, toks[i]])
                probs.append(min(1.0, y_d / x_d) if x_d > 0 else 1.0)
    return out


def _per(rows: List[dict], num: str, den: str) -> List[Optional[float]]:
    """Per row: row[num] / row[den] (None where row[den] is 0)."""
    return [r[num] / r[den] if r[den] else None for r in rows]


def summarise(args, runs: Dict[str, list], tsr: Dict[str, List[float]], accuracy: Dict[str, List[float]],
              tsr_by_prompt: Optional[Dict[str, List[List[float]]]] = None) -> dict:
    """Per variant: the pooled figures (tokens over all prompts) and, as `<key>_ci`, per-prompt means with intervals.
    `tsr` pools the skipped tokens' acceptance probabilities; `tsr_by_prompt` (true_skip_probs) gives them per prompt
    for `true_skip_rate_ci` (None without it)."""
    def total(rows, key):
        return sum(r[key] for r in rows)

    hlm_like = [r for n, rows in runs.items() if VARIANTS[n][0] not in ("llm", "slm") for r in rows]
    # shared compute constants (the paper's τ_SLM, τ_LLM): per draft token on the device, per upload on the cloud
    tau_slm = (total(hlm_like, "device_compute_s") - total(hlm_like, "device_prefill_s")) / max(
        total(hlm_like, "n_tokens"), 1) if hlm_like else float("nan")
    tau_llm = (total(hlm_like, "cloud_compute_s") - total(hlm_like, "cloud_prefill_s")) / max(
        total(hlm_like, "rounds"), 1) if hlm_like else float("nan")
    if "slm" in runs and not hlm_like:
        tau_slm = sum(r["total_s"] - r["ttft_s"] for r in runs["slm"]) / max(total(runs["slm"], "n_tokens"), 1)
    hlm_bpt = total(runs["hlm"], "up_bytes") / total(runs["hlm"], "n_tokens") if "hlm" in runs else None
    llm_acc = float(np.mean(accuracy["llm"])) if "llm" in accuracy else None
    rng = np.random.default_rng(args.seed)
    snrs = numbers(args.snr_db)
    summary: dict = {"tau_slm_s": tau_slm, "tau_llm_s": tau_llm, "variants": {}}
    for name, rows in runs.items():
        protocol = VARIANTS[name][0]
        n = total(rows, "n_tokens")
        uploads = total(rows, "rounds") if protocol not in ("llm", "slm") else None
        ks = [k for r in rows for k in r["upload_ks"]]
        acc = float(np.mean(accuracy[name])) if name in accuracy else None
        bpt = _per(rows, "up_bytes", "n_tokens")
        e = {
            "tokens": n,
            "tokens_per_s": n / total(rows, "total_s"),
            "accuracy": acc,
            "accuracy_vs_llm": acc / llm_acc if acc is not None and llm_acc else None,
            "transmission_rate": uploads / n if uploads is not None else None,
            "skip_rate": total(rows, "skipped") / n,
            "true_skip_rate": float(np.mean(tsr[name])) if tsr.get(name) else None,
            "alpha": total(rows, "accepted") / total(rows, "drafted") if total(rows, "drafted") else None,
            "k_mean": float(np.mean(ks)) if ks else None,
            "k_min": int(min(ks)) if ks else None,
            "k_max": int(max(ks)) if ks else None,
            "up_bytes_per_token": total(rows, "up_bytes") / n,
            "payload_vs_hlm": total(rows, "up_bytes") / n / hlm_bpt if hlm_bpt else None,
            "throughput_vs_snr": {},  # tokens / total expected latency (a wall clock's view)
            "throughput_vs_snr_per_round": {},  # the papers' mean of per-round eq. 6 throughput
            "n_prompts": len(rows),
            "tokens_per_s_ci": interval(_per(rows, "n_tokens", "total_s")),
            "accuracy_ci": interval(accuracy[name]) if name in accuracy else None,
            "accuracy_vs_llm_ci": paired_ratio(accuracy[name], accuracy["llm"])
            if name in accuracy and "llm" in accuracy else None,
            "accuracy_diff_vs_llm_ci": paired_diff(accuracy[name], accuracy["llm"])
            if name in accuracy and "llm" in accuracy else None,
            "transmission_rate_ci": interval(_per(rows, "rounds", "n_tokens")) if uploads is not None else None,
            "skip_rate_ci": interval(_per(rows, "skipped", "n_tokens")),
            "true_skip_rate_ci": interval([float(np.mean(p)) if p else None for p in tsr_by_prompt[name]])
            if tsr_by_prompt and tsr_by_prompt.get(name) else None,
            "alpha_ci": interval(_per(rows, "accepted", "drafted")) if total(rows, "drafted") else None,
            "k_mean_ci": interval([float(np.mean(r["upload_ks"])) if r["upload_ks"] else None for r in rows])
            if ks else None,
            "up_bytes_per_token_ci": interval(bpt),
            "payload_vs_hlm_ci": paired_ratio(bpt, _per(runs["hlm"], "up_bytes", "n_tokens")) if hlm_bpt else None,
            "throughput_vs_snr_ci": {},  # per fading and SNR: the interval of the per-prompt throughputs
            "throughput_vs_snr_per_round_ci": {},
        }
        for fading, per_round in itertools.product(("rayleigh", "rician"), (False, True)):
            curve, cis = [], []
            for snr in snrs:
                if protocol == "llm":
                    curve.append(1.0 / tau_llm)
                    cis.append(None)  # a constant of the model, no sample
                    continue
                if protocol == "slm":
                    curve.append(1.0 / tau_slm)
                    cis.append(None)
                    continue
                ch = Channel(fading, snr, args.bandwidth_mhz * 1e6, args.rician_k_db)
                tps = []
                for r in rows:
                    bits = [8 * b for b in r["round_up_bytes"]]
                    tps.append(token_throughput(r["n_tokens"], bits, tau_slm, tau_llm, ch, rng, per_round=per_round))
                curve.append(float(np.mean(tps)))
                cis.append(interval(tps))
            key = "throughput_vs_snr_per_round" if per_round else "throughput_vs_snr"
            e[key][fading] = dict(zip([f"{s:g}" for s in snrs], curve))
            e[key + "_ci"][fading] = dict(zip([f"{s:g}" for s in snrs], cis))
        summary["variants"][name] = e
    return summary


def emulated_summary(args, emulated: dict, tau_slm: float, tau_llm: float) -> dict:
    """Measured tokens/s over the emulated link beside the model's prediction at the same (non-fading) rate."""
    out = {}
    rng = np.random.default_rng(args.seed)
    for snr, block in emulated.items():
        rate_bits = block["up_rate_bytes_per_s"] * 8
        flat = Channel("none", 10 * math.log10(2 ** (rate_bits / (args.bandwidth_mhz * 1e6)) - 1),
                       args.bandwidth_mhz * 1e6)
        rows_out = {}
        for name, rows in block["runs"].items():
            n = sum(r["n_tokens"] for r in rows)
            decode_s = sum(r["total_s"] - r["ttft_s"] for r in rows)
            predicted = [token_throughput(r["n_tokens"], [8 * b for b in r["round_up_bytes"]], tau_slm, tau_llm, flat,
                                          rng, draws=1, per_round=False) for r in rows]
            decode = [(r["n_tokens"] - 1) / (r["total_s"] - r["ttft_s"]) if r["total_s"] > r["ttft_s"] else None
                      for r in rows]
            rows_out[name] = {"measured_tokens_per_s": n / sum(r["total_s"] for r in rows),  # prompt included
                              "measured_decode_tokens_per_s": (n - len(rows)) / decode_s if decode_s > 0 else None,
                              "model_decode_tokens_per_s_at_this_rate": float(np.mean(predicted)),  # n / Σ latency
                              "up_bytes_per_token": sum(r["up_bytes"] for r in rows) / n,
                              "measured_tokens_per_s_ci": interval(_per(rows, "n_tokens", "total_s")),
                              "measured_decode_tokens_per_s_ci": interval(decode),
                              "model_decode_tokens_per_s_at_this_rate_ci": interval(predicted),
                              "up_bytes_per_token_ci": interval(_per(rows, "up_bytes", "n_tokens"))}
        out[snr] = {"up_rate_bytes_per_s": block["up_rate_bytes_per_s"], "variants": rows_out}
    return out


def plot(path: str, summary: dict) -> str:
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, fading in zip(axes, ("rayleigh", "rician")):
        for name, e in summary["variants"].items():
            curve = e["throughput_vs_snr"][fading]
            ax.semilogy([float(s) for s in curve], list(curve.values()), marker="o", label=name)
        ax.set_title(f"{fading} fading" + (" (K = 10 dB)" if fading == "rician" else ""))
        ax.set_xlabel("average SNR (dB)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("token throughput (tokens / total latency, eq. 5-6)")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return ""


TABLE_INTERVALS = ("accuracy", "accuracy_vs_llm", "transmission_rate", "true_skip_rate", "tokens_per_s")


def format_table(summary: dict) -> str:
    """One row per variant; the columns of TABLE_INTERVALS show the mean over prompts ± its 95 % interval."""
    cols = [("variant", None, "{}"), ("n", None, "{}"), ("acc", "accuracy", "{:.3f}"),
            ("vs LLM", "accuracy_vs_llm", "{:.1%}"), ("TR", "transmission_rate", "{:.1%}"),
            ("TSR", "true_skip_rate", "{:.1%}"), ("α", "alpha", "{:.2f}"), ("k mean", "k_mean", "{:.0f}"),
            ("k range", None, "{}"), ("up B/tok", "up_bytes_per_token", "{:.0f}"),
            ("% of HLM", "payload_vs_hlm", "{:.3%}"), ("tok/s", "tokens_per_s", "{:.2f}")]
    rows = [[c for c, _, _ in cols]]
    for name, e in summary["variants"].items():
        row = []
        for c, key, fmt in cols:
            if c == "variant":
                row.append(name)
            elif c == "n":
                row.append(str(e["n_prompts"]))
            elif c == "k range":
                row.append(f"{e['k_min']}-{e['k_max']}" if e["k_min"] is not None else "-")
            elif key in TABLE_INTERVALS and e.get(key + "_ci"):
                row.append(ci_text(e[key + "_ci"], fmt, with_n=False))
            else:
                v = e[key]
                row.append("-" if v is None else fmt.format(v))
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    cis = [e.get(key + "_ci") for e in summary["variants"].values() for key in TABLE_INTERVALS]
    note = (f"{', '.join(TABLE_INTERVALS)}: mean over the prompts (per-prompt ratios against LLM) ± the larger half "
            f"of its interval ({ci_note(cis)}); the other columns pool all tokens")
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows) + "\n" + note


def run(args) -> int:
    try:
        variants = _variant_names(args.variants)
        _variant_names(args.emulate_variants)
        numbers(args.snr_db), numbers(args.emulate_snr_db)
        base_unc = UncertaintyConfig()
        if args.calibration:
            base_unc = base_unc.calibrated(load_calibration(args.calibration), args.threshold_rule)
        if args.u_threshold is not None:
            base_unc = dataclasses.replace(base_unc, u_threshold=args.u_threshold)
        if args.prompts < 1 or args.max_new_tokens < 1 or not args.temperature >= 0:
            raise ValueError("--prompts and --max-new-tokens must be >= 1, --temperature >= 0")
        prompts = evaluation_prompts(args.prompts)
    except (ValueError, RuntimeError) as exc:
        print(f"hat-bench cuhlm: {exc}", file=sys.stderr)
        return 2
    args.target_dtype = resolve_dtype(args.target_dtype)
    tok = load_tokenizer(args.draft)
    ids = [encode(tok, p.text, p.chat) for p in prompts]
    t0 = time.perf_counter()
    print(f"hat-bench cuhlm: {len(prompts)} prompts, variants {', '.join(variants)}; "
          f"u_th = {base_unc.u_threshold:.3f}, "
          f"β = {base_unc.beta_a:.3f}·u + {base_unc.beta_b:.3f}, k* = {base_unc.k_offline}", flush=True)
    models = run_models(args, variants, ids, base_unc)
    runs = models["loopback"]
    print("hat-bench cuhlm: scoring skipped tokens with the target ...", flush=True)
    tsr_by_prompt = true_skip_probs(args, ids, runs)
    tsr = {name: [p for probs in per for p in probs] for name, per in tsr_by_prompt.items()}
    print("hat-bench cuhlm: embedding responses and references ...", flush=True)
    emb = Embedder()
    refs = [p.reference for p in prompts]
    accuracy = {name: emb.similarity([r["text"] for r in rows], refs).tolist() for name, rows in runs.items()}
    summary = summarise(args, runs, tsr, accuracy, tsr_by_prompt)
    summary["emulated"] = emulated_summary(args, models["emulated"], summary["tau_slm_s"], summary["tau_llm_s"])
    report = {"settings": {k: v for k, v in vars(args).items() if k != "func"},
              "uncertainty": dataclasses.asdict(base_unc), "prompts": [p.to_json() for p in prompts],
              "summary": summary, "accuracy_per_prompt": accuracy, "true_skip_probs": tsr,
              "true_skip_probs_per_prompt": tsr_by_prompt, "runs": runs,
              "emulated_runs": models["emulated"], "wall_s": time.perf_counter() - t0}
    write_report(args.out, report)
    note = plot(os.path.splitext(args.out)[0] + ".png", summary)
    print(format_table(summary))
    print(f"τ_SLM {summary['tau_slm_s'] * 1e3:.1f} ms, τ_LLM {summary['tau_llm_s'] * 1e3:.1f} ms")
    print(strict_json.dumps(summary["emulated"], indent=1))
    print(f"hat-bench cuhlm: report saved to {args.out}" + (f" ({note})" if note else ""))
    return 0
