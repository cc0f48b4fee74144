"""`hat-bench edge`: draft decode speed of the device backends on this CPU, side by side with llama.cpp, in one run.

The same model and prompt on every backend: torch fp32 (and torch's dynamic int8), onnxruntime fp32 / int8 / int4
from a hat-export bundle (exported and validated first when missing), and llama.cpp (llama-cpp-python, the model's
packaged GGUF, built by scripts/install_llamacpp.sh and cached by pip). Each measurement prefills the prompt, then
decodes --new-tokens tokens one forward at a time, greedy (logits to the host and an argmax, as a draft does); the
backends take turns for --repeats rounds so drift on a noisy machine spreads over all of them (round r starts at
backend r mod k, so none always runs first). Reports tokens/s (median over rounds, and the mean over rounds with its
95 % interval, n and method: profiles.bench.stats), per-token latency mean / P50 / P90, prefill time, each backend's
speed relative to llama.cpp (the ratio of medians, and the mean of the per-round ratios with its interval: paired, both
ran in the same round), and whether its greedy tokens equal torch fp32's. Writes JSON.
"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import numpy as np

from edge_runtime.backends.onnx_backend import OrtPart
from edge_runtime.backends.part_lm import PartChainLM
from hat_split.files import bundle as M
from hat_split.models.lm import CausalLM
from hat_split.models.loading import load_model, quantize_weights
from hat_split.models.registry import gguf_path
from hat_split.prompt_sets import validation_prompts
from profiles.bench.bench_args import LLAMACPP_SCRIPT, cpu_name, names
from profiles.bench.stats import ci_text, interval, paired_ratio, percentile, rotated
from profiles.bench.provenance import write_report

BACKENDS = ("torch-fp32", "torch-int8", "ort-fp32", "ort-int8", "ort-int4", "llamacpp")


def add_parser(sub) -> None:
    s = sub.add_parser("edge", help="draft decode tokens/s: torch, onnxruntime fp32/int8/int4, llama.cpp")
    s.add_argument("--model", default="smollm2-135m")
    s.add_argument("--backends", default=",".join(BACKENDS), help=f"of {', '.join(BACKENDS)}")
    s.add_argument("--bundle", default="", help="hat-export bundle (default runs/bundles/<model>; exported if absent)")
    s.add_argument("--threads", type=int, default=2, help="threads for every backend")
    s.add_argument("--prompt-tokens", type=int, default=64)
    s.add_argument("--new-tokens", type=int, default=64)
    s.add_argument("--repeats", type=int, default=3)
    s.add_argument("--out", default="runs/bench_edge.json")


class Decoder:
    """One backend: `prefill(ids)` then `step(token) -> logits # [vocab]`."""

    def __init__(self, prefill: Callable, step: Callable, info: dict):
        self.prefill, self.step, self.info = prefill, step, info


def _lm_decoder(lm, info: dict) -> Decoder:
    holder = {}

    def prefill(ids):
        holder["s"] = lm.new_state()
        return lm.forward(holder["s"], ids, n_logits=1)[-1]

    return Decoder(prefill, lambda t: lm.forward(holder["s"], [t], n_logits=1)[-1], info)


def _llamacpp_decoder(model: str, threads: int, n_ctx: int) -> Decoder:
    import llama_cpp

    path = gguf_path(model)
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=512,
                logits_all=False, verbose=False)

    def last_logits():  # the row eval() wrote; `eval_logits` would copy every row into Python lists
        return llm.scores[llm.n_tokens - 1]

    def prefill(ids):
        llm.reset()
        llm.eval(ids)
        return last_logits()

    def step(token):
        llm.eval([token])
        return last_logits()

    return Decoder(prefill, step, {"gguf": path.name, "llama_cpp_python": llama_cpp.__version__})


def _ensure_llamacpp() -> None:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print(f"hat-bench edge: building llama-cpp-python ({LLAMACPP_SCRIPT}; minutes the first time, cached after)",
              flush=True)
        subprocess.run(["bash", str(LLAMACPP_SCRIPT)], check=True)


def measure(dec: Decoder, prompt: List[int], n: int) -> dict:
    t0 = time.perf_counter()
    logits = dec.prefill(prompt)
    prefill_s = time.perf_counter() - t0
    tokens, lat = [], []
    for _ in range(n):
        token = int(np.argmax(logits))
        tokens.append(token)
        t0 = time.perf_counter()
        logits = dec.step(token)
        lat.append(time.perf_counter() - t0)
    return {"prefill_s": prefill_s, "latency_s": lat, "tokens": tokens}


def run(args) -> int:
    import torch

    backends = names(args.backends, BACKENDS, "backend")
    if min(args.threads, args.prompt_tokens, args.new_tokens, args.repeats) < 1:
        raise ValueError("threads, prompt tokens, new tokens and repeats must be >= 1")
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, dtype="float32")
    prompt = validation_prompts(loaded.tokenizer, 1, min_tokens=args.prompt_tokens,
                                max_tokens=args.prompt_tokens)[0]
    decoders: Dict[str, Decoder] = {}
    if "torch-fp32" in backends:
        decoders["torch-fp32"] = _lm_decoder(CausalLM(loaded.model), {"torch": torch.__version__})
    if "torch-int8" in backends:
        q = load_model(args.model, dtype="float32")
        quantize_weights(q.model, "int8")
        decoders["torch-int8"] = _lm_decoder(CausalLM(q.model), {"torch": torch.__version__,
                                                                  "quantization": "dynamic int8 linear layers"})
    ort = [b for b in backends if b.startswith("ort-")]
    if ort:
        bundle = Path(args.bundle or f"runs/bundles/{args.model}")
        precisions = [b[4:] for b in ort]
        have = M.read(bundle) if (bundle / M.MANIFEST).exists() else None
        missing = [p for p in precisions if have is None or not any(
            (a.part, a.precision, a.backend) == ("draft", p, "onnx") for a in have.artifacts)]
        if missing:  # the exporter as a user runs it: hat-export, validated on real prompts
            print(f"hat-bench edge: exporting {args.model} ({', '.join(missing)}) into {bundle}", flush=True)
            rc = subprocess.call([sys.executable, "-m", "export.cli", "onnx", "--model", args.model, "--out",
                                  str(bundle), "--parts", "draft", "--precision", ",".join(missing), "--prompts", "4"])
            if rc != 0:
                raise ValueError(f"hat-export could not make the bundle {bundle} (exit {rc}; its message is above)")
        man = M.load(bundle)
        for b, p in zip(ort, precisions):
            a = man.find("draft", p)
            part = OrtPart(bundle / a.path, ["CPUExecutionProvider"], args.threads)
            decoders[b] = _lm_decoder(PartChainLM([part], man.model["vocab"]),
                                      {"providers": part.providers, "artifact_status": a.status,
                                       "validation": a.validation.get("regimes"), "quantization": a.quantization})
    if "llamacpp" in backends:
        _ensure_llamacpp()
        decoders["llamacpp"] = _llamacpp_decoder(args.model, args.threads, args.prompt_tokens + args.new_tokens + 8)

    for dec in decoders.values():  # warm-up: first-call allocations and page-ins are not measured
        measure(dec, prompt[:8], 4)
    runs: Dict[str, List[dict]] = {b: [] for b in decoders}
    for r in range(args.repeats):
        for b in rotated(list(decoders), r):
            runs[b].append(measure(decoders[b], prompt, args.new_tokens))
            print(f"  round {r + 1}/{args.repeats} {b:10s} {args.new_tokens / sum(runs[b][-1]['latency_s']):7.1f} "
                  "tok/s", flush=True)
    report = {"args": vars(args), "prompt_tokens": len(prompt), "cpu": cpu_name(),
              "backends": summarise(runs, args.new_tokens, {b: dec.info for b, dec in decoders.items()})}
    write_report(args.out, report)
    print(format_table(report["backends"]))
    print(f"hat-bench edge: wrote {args.out}")
    return 0


# -- summary (pure) --------------------------------------------------------------------------------------------

def summarise(runs: Dict[str, List[dict]], new_tokens: int, info: Optional[Dict[str, dict]] = None) -> dict:
    """{backend: row} of `measure` results per round (round r at index r in every backend's list): tokens/s (median and
    mean with its interval), latency, prefill, the same tokens as torch fp32, and vs llama.cpp (ratio of medians and
    the per-round ratios' mean with its interval)."""
    reference = runs.get("torch-fp32", [{}])[0].get("tokens")
    backends: Dict[str, dict] = {}
    for b, rs in runs.items():
        lat = np.concatenate([r["latency_s"] for r in rs])
        tps = [new_tokens / sum(r["latency_s"]) for r in rs]
        backends[b] = {
            "tokens_per_s": float(np.median(tps)), "tokens_per_s_rounds": tps,
            "latency_mean_ms": 1e3 * float(lat.mean()), "latency_p50_ms": 1e3 * percentile(lat, 50),
            "latency_p90_ms": 1e3 * percentile(lat, 90),
            "prefill_ms": 1e3 * float(np.median([r["prefill_s"] for r in rs])),
            "same_tokens_as_torch_fp32": None if reference is None else rs[0]["tokens"] == reference,
            **(info or {}).get(b, {})}
    if "llamacpp" in backends:
        base = backends["llamacpp"]
        for row in backends.values():
            row["vs_llamacpp"] = row["tokens_per_s"] / base["tokens_per_s"]
    for b, row in backends.items():
        row["tokens_per_s_ci"] = interval(row["tokens_per_s_rounds"])
        row["prefill_ms_ci"] = interval([1e3 * r["prefill_s"] for r in runs[b]])
        if "llamacpp" in backends:  # paired by round: both ran in the same turn of the machine
            row["vs_llamacpp_ci"] = paired_ratio(row["tokens_per_s_rounds"],
                                                 backends["llamacpp"]["tokens_per_s_rounds"])
    return backends


def format_table(backends: Dict[str, dict]) -> str:
    """The printed table: tokens/s (median; mean ± 95 % CI over rounds, n), latency, prefill, vs llama.cpp."""
    lines = [f"\n {'backend':10s} {'tok/s':>7s} {'mean ± 95% CI':>25s} {'lat mean/P50/P90 ms':>22s} "
             f"{'prefill ms':>10s} {'vs llama.cpp':>12s} {'per round ± 95% CI':>25s} same tokens"]
    for b, row in backends.items():
        vs = row.get("vs_llamacpp")
        vs_ci = ci_text(row.get("vs_llamacpp_ci"))
        lines.append(f" {b:10s} {row['tokens_per_s']:7.1f} {ci_text(row['tokens_per_s_ci'], '{:.1f}'):>25s} "
                     f"{row['latency_mean_ms']:8.1f}{row['latency_p50_ms']:7.1f}{row['latency_p90_ms']:7.1f} "
                     f"{row['prefill_ms']:10.1f} {'-' if vs is None else f'{vs:.2f}x':>12s} {vs_ci:>25s} "
                     f"{row['same_tokens_as_torch_fp32']}")
    return "\n".join(lines)

