"""`hat-bench engines`: the torch and llama.cpp engines of hatspec against llama.cpp itself, in one run, interleaved.

The same held-out HumanEval prompts (token ids fixed once), greedy, the same threads everywhere:

1. each model alone (the draft and the target): hatspec's torch engine (the registry's weights, the dtypes the device
   and the cloud use by default) and its llama.cpp engine (the packaged GGUF) decode N tokens after the prompt, one
   forward per token; beside them `llama-bench` on the same GGUF (decode of N tokens at the prompts' mean depth);
2. the hybrid, over each link (loopback and emulated ones): `llm` and `sd` (every γ, and confidence-stopped γ@η) with
   both sides on the torch engine and both on llama.cpp — two clouds up at once, the engines taking turns on every
   prompt; over loopback beside them llama.cpp's own speculative decoding (`llama-speculative`, same pair, same γ).

Interleaved: on every prompt every system runs in turn, the order rotated by one per prompt (prompt i starts at system
i mod k), so drift of the machine and the order itself spread over all of them; llama-bench and llama-speculative are
a process per turn and take their turn like the others.

llama.cpp's programs are built from the source vendored in the installed llama-cpp-python release
(`scripts/install_llamacpp.sh --tools`, cached). Decode rates exclude the prompt everywhere (llama.cpp's figures do):
hatspec's are (tokens − 1) / (time after the first token). Reports tokens/s, acceptance (accepted / drafted), tokens
per round, and each side's share of a request's time (device compute, cloud compute, the rest: link and overhead);
the goals of the llama.cpp engine as ratios. Medians as before, and beside them ("..._ci", "alone_ci", "goals_ci") the
mean over prompts (models alone: over rounds × prompts) with its 95 % interval, n and method (profiles.bench.stats: a
t interval below 8 values); a ratio of two systems is the mean of the per-prompt ratios (paired: same prompt, same
turn). Writes JSON and a PNG.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import statistics
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from cloud_runtime.config import CloudConfig
from edge_runtime.config import EdgeConfig, EngineConfig
from hat_split.files.figures import NO_MATPLOTLIB, pyplot, save_figure
from hat_split.math.sampling import SamplingParams
from hat_split.math.verify import ideal_speedup
from hat_split.models.chat import encode
from hat_split.models.llamacpp_lm import LlamaCppLM, LlamaCppSettings
from hat_split.models.lm import CausalLM
from hat_split.models.loading import load_model, load_tokenizer
from hat_split.models.registry import gguf_path
from hat_split.prompt_sets import humaneval_prompts
from profiles.bench.bench_args import LLAMACPP_SCRIPT, cpu_name, names, parse_variants, variant_name
from profiles.bench.rig import Rig
from testbed.links import LINK_PROFILES
from profiles.bench.provenance import write_report
from profiles.bench.stats import ci_text, interval, rotated
from hat_split.files import strict_json

ENGINES = ("torch", "llamacpp")
LOOPBACK = "loopback"
LLAMA_BENCH, LLAMA_SPECULATIVE = "llama-bench", "llama-speculative"


def add_parser(sub) -> None:
    s = sub.add_parser("engines", help="torch vs llama.cpp engines vs llama.cpp itself: models alone, llm, sd")
    s.add_argument("--draft", default="qwen2.5-coder-0.5b")
    s.add_argument("--target", default="qwen2.5-coder-1.5b")
    s.add_argument("--prompts", type=int, default=3, help="held-out HumanEval prompts")
    s.add_argument("--max-new-tokens", type=int, default=64)
    s.add_argument("--threads", type=int, default=2, help="threads of every engine, each side")
    s.add_argument("--draft-len", default="2,4,6,8,8@0.5", help="sd variants: γ or γ@η (confidence-stopped)")
    s.add_argument("--links", default=f"{LOOPBACK},wifi-far,lte", help=f"{LOOPBACK} and/or link profiles")
    s.add_argument("--engines", default=",".join(ENGINES))
    s.add_argument("--repeats", type=int, default=2, help="rounds of the models-alone phase")
    s.add_argument("--no-llama-tools", action="store_true", help="skip llama-bench and llama-speculative")
    s.add_argument("--out", default="runs/bench_engines.json")


def llama_tools() -> Path:
    """The folder holding llama-bench and llama-speculative (built and cached on first use)."""
    out = subprocess.run(["bash", str(LLAMACPP_SCRIPT), "--tools"], stdout=subprocess.PIPE, text=True, check=True)
    return Path(out.stdout.strip().splitlines()[-1])


# -- 1. models alone -------------------------------------------------------------------------------------------------

def decode_rate(lm, ids: List[int], n: int) -> float:
    """Greedy decode of n tokens after prefilling `ids` (one forward per token, logits to the host): tokens/s."""
    state = lm.new_state()
    token = int(lm.forward(state, ids)[-1].argmax())
    t0 = time.perf_counter()
    for _ in range(n):
        token = int(lm.forward(state, [token])[-1].argmax())
    return n / (time.perf_counter() - t0)


def llama_bench_rates(tools: Path, gguf: Path, n: int, depth: int, threads: int) -> Tuple[float, float]:
    """llama-bench on the GGUF: (decode tokens/s of n tokens at `depth`, prompt tokens/s of a `depth`-token prompt)."""
    rates = []
    for test in (["-p", "0", "-n", str(n), "-d", str(depth)], ["-p", str(depth), "-n", "0"]):
        out = subprocess.run([str(tools / "llama-bench"), "-m", str(gguf), *test, "-t", str(threads), "-r", "1",
                              "-o", "json"], capture_output=True, text=True, check=True)
        rates.append(float(json.loads(out.stdout)[0]["avg_ts"]))
    return rates[0], rates[1]


def models_alone(args, ids: List[List[int]], tools: Optional[Path], engines: Sequence[str]) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    depth = round(statistics.mean(len(x) for x in ids))
    runners: Dict[str, Dict[str, object]] = {}
    for role, name, dtype in (("draft", args.draft, EngineConfig().dtype),
                              ("target", args.target, CloudConfig.__dataclass_fields__["dtype"].default)):
        runners[role] = {}
        if "torch" in engines:
            runners[role]["torch"] = CausalLM(load_model(name, dtype=dtype).model)
        if "llamacpp" in engines:
            runners[role]["llamacpp"] = LlamaCppLM(gguf_path(name), LlamaCppSettings(n_threads=args.threads))
    rates: Dict[str, Dict[str, List[float]]] = {role: {} for role in runners}
    for r in range(args.repeats):  # every system once per round and prompt, in rotated turns: drift spreads over all
        for role, name in (("draft", args.draft), ("target", args.target)):
            systems = [*runners[role], *([LLAMA_BENCH] if tools is not None else [])]
            for i, x in enumerate(ids):
                for system in rotated(systems, r * len(ids) + i):
                    if system == LLAMA_BENCH:  # decode at the prompts' mean depth, one process per turn
                        tg, pp = llama_bench_rates(tools, gguf_path(name), args.max_new_tokens, depth, args.threads)
                        rates[role].setdefault(LLAMA_BENCH, []).append(tg)
                        rates[role].setdefault("llama-bench-prompt", []).append(pp)
                    else:
                        rates[role].setdefault(system, []).append(
                            decode_rate(runners[role][system], x, args.max_new_tokens))
            print(f"  alone round {r + 1}/{args.repeats} {role}: " + ", ".join(
                f"{k} {statistics.median(v):.1f}" for k, v in rates[role].items()) + " tok/s", flush=True)
    for role in runners.values():
        for lm in role.values():
            getattr(lm, "close", lambda: None)()
    return {"depth": depth, "tokens_per_s": rates}


# -- 2. hybrid -------------------------------------------------------------------------------------------------------

def shares(result) -> dict:
    """Each side's share of the request's time: device compute, cloud compute, the rest (link and overhead)."""
    total = result.total_s or 1.0
    device, cloud = result.device_compute_s / total, result.cloud_compute_s / total
    return {"device": device, "cloud": cloud, "link_and_overhead": max(0.0, 1.0 - device - cloud)}


def run_entry(result) -> dict:
    s = result.summary()
    return {"tokens": result.tokens, "n": result.n, "total_s": result.total_s, "ttft_s": result.ttft_s,
            "open_s": result.open_s, "tokens_per_s": s["tokens_per_s"],
            "decode_tokens_per_s": s["after_open_tokens_per_s"],
            "drafted": result.drafted, "accepted": result.accepted, "rejected": result.rejected,
            "rounds": result.rounds,
            "share": shares(result)}


SPEC_PATTERNS = {"prompt_s": r"encoded\s+\d+ tokens in\s+([\d.]+) seconds", "n": r"decoded\s+(\d+) tokens in",
                 "decode_s": r"decoded\s+\d+ tokens in\s+([\d.]+) seconds", "drafted": r"n_drafted = (\d+)",
                 "accepted": r"n_accept\s+= (\d+)"}


def llama_speculative(tools: Path, args, text: str, gamma: int) -> dict:
    """llama.cpp's own speculative decoding of `text` with the same pair, greedy, draft length gamma."""
    cmd = [str(tools / "llama-speculative"), "-m", str(gguf_path(args.target)), "-md", str(gguf_path(args.draft)),
           "-p", text, "-n", str(args.max_new_tokens), "--spec-draft-n-max", str(gamma), "--spec-draft-n-min", "0",
           "--temp", "0", "-t", str(args.threads), "-td", str(args.threads), "-c", "4096", "--seed", "0"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"llama-speculative failed ({out.returncode}): {out.stderr[-800:]}")
    found = {k: re.search(p, out.stderr) for k, p in SPEC_PATTERNS.items()}
    missing = [k for k, m in found.items() if m is None]
    if missing:
        raise RuntimeError(f"llama-speculative printed no {missing}: {out.stderr[-800:]}")
    got = {k: float(m.group(1)) for k, m in found.items()}
    return {**got, "tokens_per_s": got["n"] / (got["prompt_s"] + got["decode_s"]),
            "decode_tokens_per_s": got["n"] / got["decode_s"]}


def run_label(variant: Optional[Tuple[int, float]]) -> str:
    return "llm" if variant is None else f"sd_{variant_name(*variant)}"


def hybrid_systems(engines: Sequence[str], variants: List[Tuple[int, float]],
                   speculative: bool) -> List[Tuple[Optional[Tuple[int, float]], str]]:
    """(variant, engine) of every hybrid run on one prompt: `llm` (variant None) then each sd variant, every engine;
    after each γ without η llama-speculative where `speculative`. Rotated per prompt by the caller."""
    out: List[Tuple[Optional[Tuple[int, float]], str]] = []
    for variant in [None, *variants]:
        out += [(variant, engine) for engine in engines]
        if speculative and variant is not None and not variant[1]:
            out.append((variant, LLAMA_SPECULATIVE))
    return out


def hybrid(args, ids: List[List[int]], texts: List[str], tools: Optional[Path], engines: Sequence[str],
           links: Sequence[str], variants: List[Tuple[int, float]]) -> dict:
    out: Dict[str, Dict[str, List[dict]]] = {}
    params = SamplingParams(0.0)
    for link in links:
        print(f"hat-bench engines: hybrid over {link} ...", flush=True)
        runs: Dict[str, List[dict]] = {}
        with contextlib.ExitStack() as stack:
            rts = {}
            for engine in engines:
                bed = stack.enter_context(Rig(args.target, cloud_args=["--engine", engine], threads=args.threads,
                                                  link=None if link == LOOPBACK else link))
                config = EdgeConfig(model=args.draft, link=bed.link_config(),
                                    engine=EngineConfig(backend=engine, threads=args.threads))
                rts[engine] = bed.runtime(config)
                rts[engine].generate(ids[0], "sd", params, 4)  # warm-up: both processes, the link
            systems = hybrid_systems(list(rts), variants, link == LOOPBACK and tools is not None)
            for i, x in enumerate(ids):
                for variant, engine in rotated(systems, i):
                    label = run_label(variant)
                    if engine == LLAMA_SPECULATIVE:
                        runs.setdefault(f"{engine}/{label}", []).append(
                            llama_speculative(tools, args, texts[i], variant[0]))
                        continue
                    rt = rts[engine]
                    if variant is not None:
                        rt.config = dataclasses.replace(rt.config, draft_len=variant[0], draft_stop_prob=variant[1])
                    r = rt.generate(x, "llm" if variant is None else "sd", params, args.max_new_tokens, seed=0)
                    gamma, eta = variant or (0, 0.0)
                    runs.setdefault(f"{engine}/{label}", []).append({**run_entry(r), "gamma": gamma, "eta": eta})
                print(f"  {link} prompt {i + 1}/{len(ids)}: " + ", ".join(
                    f"{k} {v[-1]['decode_tokens_per_s']:.1f}" for k, v in runs.items()) + " tok/s", flush=True)
        out[link] = runs
    return out


# -- summary -------------------------------------------------------------------------------------------------------

def _median(rows: List[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def ratio_ci(a: Sequence[float], b: Sequence[float]) -> Optional[dict]:
    """The mean of the paired ratios a_i / b_i (sample i of both from the same prompt and turn) with its interval; None
    where there is nothing to pair (no samples, different counts) or a baseline sample is zero."""
    if not a or len(a) != len(b) or not all(b):
        return None
    return interval([x / y for x, y in zip(a, b)])


def summarise(alone: dict, runs: Dict[str, Dict[str, List[dict]]], n: int) -> dict:
    """Medians of every run (tokens/s with the prompt, and after it), acceptance, tokens per round and shares; the
    llama.cpp engine's goals as ratios. Beside them the means over prompts with their intervals: "alone_ci" (every
    sample of the models alone), "..._ci" of each hybrid run, "goals_ci" (paired per-prompt ratios)."""
    samples = alone["tokens_per_s"]
    rates = {role: {k: statistics.median(v) for k, v in by.items()} for role, by in samples.items()}
    out: dict = {"alone": rates, "hybrid": {},
                 "alone_ci": {role: {k: interval(v) for k, v in by.items()} for role, by in samples.items()}}
    for role, r in rates.items():  # llama.cpp's own request: the prompt, then n tokens
        if "llama-bench" in r:
            r["llama-bench-request"] = n / (alone["depth"] / r["llama-bench-prompt"] + n / r["llama-bench"])
    for link, by_run in runs.items():
        table = {}
        for name, rows in by_run.items():
            drafted = sum(r.get("drafted", 0) for r in rows)
            entry = {"tokens_per_s": _median(rows, "tokens_per_s"),
                     "decode_tokens_per_s": _median(rows, "decode_tokens_per_s"),
                     "acceptance": sum(r.get("accepted", 0) for r in rows) / drafted if drafted else None,
                     "tokens_per_s_ci": interval([r["tokens_per_s"] for r in rows]),
                     "decode_tokens_per_s_ci": interval([r["decode_tokens_per_s"] for r in rows])}
            if drafted:  # per prompt: that prompt's accepted / drafted
                entry["acceptance_ci"] = interval([r["accepted"] / r["drafted"] for r in rows if r.get("drafted")])
            if "share" in rows[0]:
                entry["tokens_per_round"] = sum(r["n"] for r in rows) / max(1, sum(r["rounds"] for r in rows))
                entry["share"] = {k: statistics.mean(r["share"][k] for r in rows) for k in rows[0]["share"]}
                engine = name.split("/")[0]
                if drafted and not rows[0]["eta"] and {"draft", "target"} <= set(rates) and engine in rates["draft"]:
                    # the closed-form ceiling over this engine's target alone (a verify costing one target step)
                    accepted, rejected = sum(r["accepted"] for r in rows), sum(r["rejected"] for r in rows)
                    entry["alpha"] = accepted / max(1, accepted + rejected)
                    entry["c"] = rates["target"][engine] / rates["draft"][engine]
                    entry["ideal_speedup"] = ideal_speedup(entry["alpha"], rows[0]["gamma"], entry["c"])
            table[name] = entry
        out["hybrid"][link] = table
    out["goals"] = goals(out)
    out["goals_ci"] = goals_ci(out, alone, runs)
    return out


def _best(table: Dict[str, dict], prefix: str, key: str) -> Tuple[Optional[str], Optional[float]]:
    """The run under `prefix` with the highest median `key`, and that median."""
    found = {k: v[key] for k, v in table.items() if k.startswith(prefix)}
    top = max(found, key=found.get) if found else None
    return top, found.get(top)


def goals(summary: dict) -> dict:
    """The llama.cpp engine's goals as measured ratios, prompt included ("request") and after it ("decode"); None
    where a side was not run."""
    alone, loop = summary["alone"], summary["hybrid"].get(LOOPBACK, {})
    target, draft = alone.get("target", {}), alone.get("draft", {})

    def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
        return a / b if a and b else None

    llm = loop.get("llamacpp/llm", {})
    out = {"draft_engine_vs_llama_bench (>= 0.9)": ratio(draft.get("llamacpp"), draft.get("llama-bench")),
           "target_engine_vs_llama_bench": ratio(target.get("llamacpp"), target.get("llama-bench")),
           "cloud_llm_decode_vs_llama_bench_target (>= 0.9)": ratio(llm.get("decode_tokens_per_s"),
                                                                     target.get("llama-bench")),
           "cloud_llm_request_vs_llama_bench_target_request": ratio(llm.get("tokens_per_s"),
                                                                     target.get("llama-bench-request"))}
    for key, what in (("tokens_per_s", "request"), ("decode_tokens_per_s", "decode")):
        sd, sd_rate = _best(loop, "llamacpp/sd_", key)
        spec, spec_rate = _best(loop, f"{LLAMA_SPECULATIVE}/", key)
        out[f"best_sd_{what}"] = sd
        out[f"best_sd_vs_best_llama_speculative_{what} (>= 1.0)"] = ratio(sd_rate, spec_rate)
        out[f"best_sd_vs_llamacpp_llm_{what} (>= 1.5)"] = ratio(sd_rate, llm.get(key))
    return out


def goals_ci(summary: dict, alone: dict, runs: Dict[str, Dict[str, List[dict]]]) -> dict:
    """The goals' ratios as means of paired per-sample ratios with their intervals (same keys as `goals`' ratios): an
    engine alone against llama-bench per round and prompt (they took turns), a hybrid run against another per prompt
    over loopback (the best runs `goals` chose). None where the samples are not paired: the hybrid `llm` against
    llama-bench alone (different phases), or a side not run."""
    samples = alone["tokens_per_s"]
    target, draft = samples.get("target", {}), samples.get("draft", {})
    loop, chosen = runs.get(LOOPBACK, {}), summary["hybrid"].get(LOOPBACK, {})

    def paired(a: Optional[str], b: Optional[str], key: str) -> Optional[dict]:
        if a not in loop or b not in loop:
            return None
        return ratio_ci([r[key] for r in loop[a]], [r[key] for r in loop[b]])

    out = {"draft_engine_vs_llama_bench (>= 0.9)": ratio_ci(draft.get("llamacpp", []), draft.get(LLAMA_BENCH, [])),
           "target_engine_vs_llama_bench": ratio_ci(target.get("llamacpp", []), target.get(LLAMA_BENCH, [])),
           "cloud_llm_decode_vs_llama_bench_target (>= 0.9)": None,
           "cloud_llm_request_vs_llama_bench_target_request": None}
    for key, what in (("tokens_per_s", "request"), ("decode_tokens_per_s", "decode")):
        sd, _ = _best(chosen, "llamacpp/sd_", key)
        spec, _ = _best(chosen, f"{LLAMA_SPECULATIVE}/", key)
        out[f"best_sd_vs_best_llama_speculative_{what} (>= 1.0)"] = paired(sd, spec, key)
        out[f"best_sd_vs_llamacpp_llm_{what} (>= 1.5)"] = paired(sd, "llamacpp/llm", key)
    return out


def format_table(summary: dict) -> str:
    """The headline figures as printed: medians, and means with their 95 % intervals, n and method."""
    def num(x: Optional[float], fmt: str = ".1f") -> str:
        return "-" if x is None else format(x, fmt)

    lines = ["\n models alone: decode tokens/s, median and mean ± 95% CI (n = rounds × prompts)"]
    for role, by in summary["alone_ci"].items():
        lines += [f"  {role:6s} {k:20s} {num(summary['alone'][role][k]):>8s}  {ci_text(v, '{:.1f}')}"
                  for k, v in by.items()]
    for link, table in summary["hybrid"].items():
        lines.append(f"  {'hybrid over ' + link:26s} {'tok/s: median, mean ± 95% CI':>32s} "
                     f"{'decode tok/s: the same':>32s} {'acceptance':>28s}")
        for name, e in table.items():
            acc = ci_text(e.get("acceptance_ci")) if "acceptance_ci" in e else num(e["acceptance"], ".2f")
            lines.append(f"  {name:26s} {num(e['tokens_per_s']):>7s} {ci_text(e['tokens_per_s_ci'], '{:.1f}'):>24s} "
                         f"{num(e['decode_tokens_per_s']):>7s} {ci_text(e['decode_tokens_per_s_ci'], '{:.1f}'):>24s} "
                         f"{acc:>28s}")
    lines.append(" goals: ratio of medians, and the mean of paired per-prompt ratios ± 95% CI")
    for key, v in summary["goals"].items():
        if key in summary["goals_ci"]:
            lines.append(f"  {key:56s} {num(v, '.2f'):>6s}  {ci_text(summary['goals_ci'][key])}")
        else:
            lines.append(f"  {key:56s} {v or '-'}")
    return "\n".join(lines)


def figure(summary: dict, path: str) -> str:
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    links = list(summary["hybrid"])
    fig, axes = plt.subplots(1, len(links) + 1, figsize=(4.2 * (len(links) + 1), 3.8), squeeze=False)
    ax = axes[0][0]
    rows = [(f"{role}\n{engine}", v) for role, rates in summary["alone"].items() for engine, v in rates.items()
            if "-prompt" not in engine and "-request" not in engine]
    ax.bar(range(len(rows)), [v for _, v in rows], color="tab:gray")
    ax.set_xticks(range(len(rows)), [k for k, _ in rows], fontsize=6, rotation=45, ha="right")
    ax.set_title("models alone (decode)", fontsize=9)
    ax.set_ylabel("tokens/s")
    for ax, link in zip(axes[0][1:], links):
        table = summary["hybrid"][link]
        labels = sorted({k.split("/", 1)[1] for k in table}, key=lambda s: (s != "llm", s))
        engines = sorted({k.split("/", 1)[0] for k in table})
        width = 0.8 / max(1, len(engines))
        for j, engine in enumerate(engines):
            ax.bar([i + j * width for i in range(len(labels))],
                   [table.get(f"{engine}/{lab}", {}).get("decode_tokens_per_s", 0.0) for lab in labels],
                   width, label=engine)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(labels))], labels, fontsize=6, rotation=45, ha="right")
        ax.set_title(f"hybrid over {link} (after the prompt)", fontsize=9)
    return save_figure(fig, axes, path, 7)


def run(args) -> int:
    engines = names(args.engines, ENGINES, "engine")
    links = names(args.links, [LOOPBACK, *LINK_PROFILES], "link")
    variants = parse_variants(args.draft_len)
    if args.prompts < 1 or args.max_new_tokens < 2 or args.repeats < 1 or args.threads < 1:
        raise ValueError("--prompts, --repeats and --threads must be >= 1 and --max-new-tokens >= 2")
    tools = None if args.no_llama_tools else llama_tools()
    prompts = humaneval_prompts(args.prompts)
    tok = load_tokenizer(args.draft)
    ids = [encode(tok, p.text, p.chat) for p in prompts]
    print(f"hat-bench engines: models alone, {args.repeats} round(s) ...", flush=True)
    alone = models_alone(args, ids, tools, engines)
    runs = hybrid(args, ids, [p.text for p in prompts], tools, engines, links, variants)
    summary = summarise(alone, runs, args.max_new_tokens)
    report = {"draft": args.draft, "target": args.target, "threads": args.threads,
              "max_new_tokens": args.max_new_tokens, "prompts": [p.source for p in prompts],
              "cpu": cpu_name(), "alone": alone, "hybrid": runs, "summary": summary}
    write_report(args.out, report)
    note = figure(summary, os.path.splitext(args.out)[0] + ".png")
    print(strict_json.dumps(summary, indent=1))
    print(format_table(summary))
    print(f"hat-bench engines: report saved to {args.out}" + (f" ({note})" if note else ""))
    return 0
