"""`hat-bench tasks`: task accuracy of the lossy protocols against the target alone, on HumanEval and GSM8K.

Each task's first N evaluation problems (profiles.bench.tasks.evaluation_ids: never a calibration problem) are generated
greedily by default (--temperature 0: `llm` is deterministic) with every chosen protocol in turn per problem
(interleaved, so drift in the machine's speed hits all protocols alike), same seed for every protocol, by an
EdgeRuntime against a real `hat-cloud serve` (profiles.bench.rig). Protocols are bench_cuhlm's variants plus `sq`.

Scores: HumanEval pass@1 by running the problem's tests on the cut completion in the sandbox (code_exec); GSM8K exact
match of the final number (see task_scoring for the prompt and the cut). Per (task, protocol): the score with its 95 %
interval and n (profiles.bench.stats: a percentile bootstrap from 8 problems, a t interval below), the paired
difference vs `llm` on the same problems with its interval, the mean all-MiniLM-L6-v2 cosine vs the `llm` answer
(CU-HLM Table I's metric, here against the target's answer), the mean tokens/s and the skip rate. Each finished
(problem, protocol) is appended to <out>.jsonl, stamped with the run's provenance (commit, command, machine, taken when
the run starts), and skipped on a restart with the same settings; the report covers every matching record there for
the chosen tasks and problems.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Dict, List, Tuple

from edge_runtime.config import EdgeConfig, EngineConfig, LinkConfig, UncertaintyConfig
from hat_split.files.figures import NO_MATPLOTLIB, pyplot, save_figure
from hat_split.math.calibration import load as load_calibration
from hat_split.math.sampling import SamplingParams
from hat_split.models.chat import encode
from hat_split.models.loading import load_tokenizer, resolve_dtype
from profiles.bench.bench_args import names
from profiles.bench.operating_points import curve, nearest_random, rank, record_config, resolve, resolve_all
from profiles.bench.bench_cuhlm import VARIANTS
from profiles.bench.code_exec import check_humaneval, gsm8k_answer, gsm8k_correct
from profiles.bench.stats import ci_note, ci_text
from profiles.bench.task_scoring import (CutWatch, append_record, cut_completion, format_table, gsm8k_prompt,
                                         load_done, record_key, summarise)
from profiles.bench.tasks import evaluation_ids, gsm8k_problems, humaneval_problems
from profiles.bench.rig import Rig
from profiles.bench.provenance import provenance, write_report

PROTOCOLS: Dict[str, tuple] = {**VARIANTS, "sq": ("sq", {})}  # name -> (protocol, UncertaintyConfig overrides)
TASKS = ("humaneval", "gsm8k")


def add_parser(sub) -> None:
    s = sub.add_parser("tasks", help="HumanEval pass@1 and GSM8K exact match of the lossy protocols vs llm, with "
                                     "bootstrap and paired intervals; resumable")
    s.add_argument("--draft", default="qwen2.5-coder-0.5b")
    s.add_argument("--target", default="qwen2.5-coder-1.5b")
    s.add_argument("--tasks", default=",".join(TASKS), help=f"subset of {', '.join(TASKS)}")
    s.add_argument("--prompts", type=int, default=60, help="the first N evaluation problems of each task")
    s.add_argument("--protocols", default="llm,slm,uhlm,randhlm,cuhlm_offline,cuhlm_online,sq",
                   help=f"subset of {', '.join(PROTOCOLS)}; a skipping one may name an operating point: "
                        "uhlm@answer:0.5, cuhlm_online@answer-refit:1, uhlm@u:0.3, uhlm@token-refit:0.01, "
                        "randhlm@p:0.45 (profiles/bench/operating_points.py)")
    s.add_argument("--max-new-tokens", type=int, default=512,
                   help="per answer (both tasks; a HumanEval answer stops at its cut)")
    s.add_argument("--calibration", help="a hat-calibrate file (else the papers' line, threshold 0.5 and k* 30)")
    s.add_argument("--threshold-rule", default="risk-prone", choices=["risk-prone", "risk-averse", "risk-budget"])
    s.add_argument("--engine", default="torch", choices=["torch", "llamacpp"],
                   help="what runs both models: torch (the HF weights) or llamacpp (the registry's GGUF files, "
                        "quantised as shipped: the fastest on a CPU)")
    s.add_argument("--threads", type=int, default=0,
                   help="threads of the cloud and of the draft each (0: their default, every core)")
    s.add_argument("--weight-quant", default="int8", choices=["none", "int8"],
                   help="torch engine: the draft's weights (as cuhlm)")
    s.add_argument("--target-dtype", default="auto", help="torch engine: the target's dtype")
    s.add_argument("--seed", type=int, default=0, help="problem i runs with seed seed*1000+i under every protocol")
    s.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy (llm deterministic; an uploaded token is the target's argmax, so cuhlm's compressed "
                        "uploads equal uhlm's); > 0 samples, where CU-HLM's compression can change what is accepted")
    s.add_argument("--report-only", action="store_true",
                   help="generate nothing: report the records already in the .jsonl (a run stopped part-way)")
    s.add_argument("--out", default="runs/bench_tasks.json", help="JSON report (PNG and the .jsonl records beside)")


def problems(tasks: List[str], n: int) -> List[Tuple[str, object]]:
    """(task, problem) for the first `n` evaluation problems of each task, task by task."""
    out = []
    for task in tasks:
        table = humaneval_problems() if task == "humaneval" else gsm8k_problems()
        ids = evaluation_ids(task)[:n]
        out += [(task, table[i]) for i in ids]
    return out


def score(task: str, problem, text: str) -> dict:
    """{answer, score (1.0 / 0.0), detail} of one generated text."""
    if task == "humaneval":
        body = cut_completion(text)
        res = check_humaneval(problem, body)
        return {"answer": body, "score": float(res.passed), "detail": res.status}
    ok = gsm8k_correct(text, problem.solution)
    return {"answer": text, "score": float(ok), "detail": f"got {gsm8k_answer(text)}"}


def generate(args, tasks, protocols, base_unc, config, jsonl) -> None:
    done = load_done(jsonl, config)
    work = problems(tasks, args.prompts)
    todo = [(t, p, name) for t, p in work for name in protocols if (t, p.task_id, name) not in done]
    print(f"hat-bench tasks: {len(work)} problems × {len(protocols)} protocols, {len(todo)} to generate "
          f"({len(work) * len(protocols) - len(todo)} already in {jsonl})", flush=True)
    if not todo:
        return
    tok = load_tokenizer(args.target)
    params = SamplingParams(args.temperature)
    stamp = provenance("started_utc")  # on every record this run appends: a resumed file mixes runs
    cloud_args = ["--engine", args.engine, "--threads", str(args.threads)]
    if args.engine == "torch":
        cloud_args += ["--dtype", args.target_dtype]
        engine = EngineConfig(weight_quant=args.weight_quant, threads=args.threads)
    else:
        engine = EngineConfig(backend="llamacpp", threads=args.threads)
    with Rig(args.target, cloud_args=cloud_args) as bed:
        cfg = EdgeConfig(model=args.draft, link=LinkConfig(bed.endpoint, security=bed.security()), engine=engine,
                         uncertainty=base_unc)
        with bed.runtime(cfg) as rt:
            index = {(t, p.task_id): i for i, (t, p) in enumerate(work)}
            for k, (task, problem, name) in enumerate(todo):
                text = problem.prompt if task == "humaneval" else gsm8k_prompt(problem.question)
                ids = encode(tok, text, chat=task == "gsm8k")
                protocol, overrides = resolve(name, PROTOCOLS)
                rt.config = dataclasses.replace(rt.config, uncertainty=dataclasses.replace(base_unc, **overrides))
                seed = args.seed * 1000 + index[(task, problem.task_id)]
                stop = CutWatch() if task == "humaneval" else None
                r = rt.generate(ids, protocol, params, args.max_new_tokens, seed=seed,
                                on_text=stop and stop.add, should_stop=stop and stop.done)
                s = r.summary()
                rec = {"task": task, "task_id": problem.task_id, "protocol": name, "config": config, "seed": seed,
                       "text": r.text, **score(task, problem, r.text), "n_tokens": r.n,
                       "tokens_per_s": s["tokens_per_s"], "skipped": r.skipped, "total_s": r.total_s,
                       "finish_reason": r.finish_reason, "up_bytes": r.up_bytes, "down_bytes": r.down_bytes,
                       "round_trips": r.round_trips, "provenance": stamp}
                append_record(jsonl, rec)
                print(f"  [{k + 1}/{len(todo)}] {task} {problem.task_id} {name:14s} score {rec['score']:.0f} "
                      f"({rec['detail']}), {r.n} tokens in {r.total_s:.1f} s, skipped {r.skipped}", flush=True)


def cosines(records: List[dict]) -> Dict[tuple, float]:
    """MiniLM cosine of each record's answer vs the `llm` answer to the same problem (1.0 for llm itself)."""
    from profiles.bench.accuracy import Embedder

    base = {(r["task"], r["task_id"]): r["answer"] for r in records if r["protocol"] == "llm"}
    pairs = [r for r in records if (r["task"], r["task_id"]) in base]
    if not pairs:
        return {}
    sims = Embedder().similarity([r["answer"] for r in pairs], [base[(r["task"], r["task_id"])] for r in pairs])
    return {record_key(r): float(c) for r, c in zip(pairs, sims)}


def match_random(records: List[dict], curves: Dict[str, List[dict]]) -> Dict[str, List[dict]]:
    """{task: rows}: each skipping point that is not random, beside the randhlm point of the nearest skip rate, with
    their paired difference on the problems both ran (U-HLM's own baseline: skipping by uncertainty must beat chance
    at the same rate)."""
    out: Dict[str, List[dict]] = {}
    for task, points in curves.items():
        for p in points:
            rand = nearest_random(points, p["skip_rate"]) if p["protocol"] != "randhlm" else None
            if rand is None:
                continue
            pair = summarise([r for r in records if r["task"] == task and r["protocol"] in (p["name"], rand["name"])],
                             baseline=rand["name"])
            out.setdefault(task, []).append({"name": p["name"], "random": rand["name"], "skip_rate": p["skip_rate"],
                                             "random_skip_rate": rand["skip_rate"],
                                             "diff_vs_random": pair[task][p["name"]]["diff_vs_" + rand["name"]]})
    return out


def plot(path: str, summary: dict, curves: Dict[str, List[dict]]) -> str:
    """Per task: every protocol's score (bars with their intervals) and, below, score against skip rate for the
    skipping points (one line per protocol, the llm score as a dashed line)."""
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    fig, axes = plt.subplots(2, len(summary), figsize=(5 * len(summary), 8), squeeze=False)
    for ax, (task, points) in zip(axes[1], curves.items()):
        for protocol in sorted({p["protocol"] for p in points}):
            mine = [p for p in points if p["protocol"] == protocol]
            ax.plot([p["skip_rate"] for p in mine], [p["score"] for p in mine], "o-", label=protocol)
        if "llm" in summary[task]:
            ax.axhline(summary[task]["llm"]["score"]["mean"], ls="--", color="k", label="llm")
        ax.set_xlabel("skip rate (uploads saved)")
        ax.set_ylabel("pass@1" if task == "humaneval" else "exact match")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.legend(fontsize=7)
    for ax, (task, protos) in zip(axes[0], summary.items()):
        names_ = list(protos)
        means = [protos[p]["score"]["mean"] for p in names_]
        err = [[m - (protos[p]["score"]["lo"] if protos[p]["score"]["lo"] is not None else m) for p, m in
                zip(names_, means)],
               [(protos[p]["score"]["hi"] if protos[p]["score"]["hi"] is not None else m) - m for p, m in
                zip(names_, means)]]
        ax.bar(range(len(names_)), means, yerr=err, capsize=4)
        ax.set_xticks(range(len(names_)), names_, rotation=30, ha="right")
        ax.set_title(f"{task}\n{ci_note(protos[p]['score'] for p in names_)}", fontsize=9)  # two lines: the
        # intervals' note names each n, and two of them overran a 5-inch panel
        ax.set_ylabel("pass@1" if task == "humaneval" else "exact match")
        ax.set_ylim(0, 1)
    return save_figure(fig, axes, path)


def run(args) -> int:
    try:
        tasks = names(args.tasks, TASKS, "task")
        protocols = resolve_all(args.protocols, PROTOCOLS)
        if not tasks or not protocols or args.prompts < 1 or args.max_new_tokens < 1 or not 0 <= args.temperature <= 2:
            raise ValueError("need a task, a protocol, --prompts >= 1, --max-new-tokens >= 1 and --temperature in "
                             "[0, 2]")
        base_unc = UncertaintyConfig()
        if args.calibration:
            base_unc = base_unc.calibrated(load_calibration(args.calibration), args.threshold_rule)
    except (ValueError, RuntimeError) as exc:
        print(f"hat-bench tasks: {exc}", file=sys.stderr)
        return 2
    if args.threads < 0:
        print("hat-bench tasks: --threads must be >= 0", file=sys.stderr)
        return 2
    args.target_dtype = resolve_dtype(args.target_dtype)
    torch_engine = args.engine == "torch"
    config = {"draft": args.draft, "target": args.target, "engine": args.engine,
              "max_new_tokens": args.max_new_tokens, "seed": args.seed,
              "weight_quant": args.weight_quant if torch_engine else "gguf",
              "target_dtype": args.target_dtype if torch_engine else "gguf",
              "uncertainty": record_config(base_unc)}
    if args.temperature:  # greedy records carry no temperature (they predate the option)
        config["temperature"] = args.temperature
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    jsonl = os.path.splitext(args.out)[0] + ".jsonl"
    t0 = time.perf_counter()
    if not args.report_only:
        generate(args, tasks, protocols, base_unc, config, jsonl)
    wanted = {(t, p.task_id) for t, p in problems(tasks, args.prompts)}
    records = sorted((r for r in load_done(jsonl, config).values()
                      if (r["task"], r["task_id"]) in wanted and r["protocol"] in protocols),
                     key=lambda r: (r["task"], rank(r["protocol"], PROTOCOLS), r["task_id"]))
    if not records:
        print(f"hat-bench tasks: no finished record in {jsonl} for these settings, tasks, problems and protocols "
              "(records are matched by their config: the models, engine, length, seed and uncertainty settings)",
              file=sys.stderr)
        return 2
    summary = summarise(records, cosines(records))
    curves = curve(summary, PROTOCOLS)
    matched = match_random(records, curves)
    report = {"settings": {k: v for k, v in vars(args).items() if k != "func"}, "config": config,
              "summary": summary, "curve": curves, "matched_random": matched, "records": jsonl,
              "wall_s": time.perf_counter() - t0}
    write_report(args.out, report)
    note = plot(os.path.splitext(args.out)[0] + ".png", summary, curves)
    print(format_table(summary))
    for task, rows in matched.items():
        for m in rows:
            print(f"{task}: {m['name']} (skip {m['skip_rate']:.1%}) vs {m['random']} (skip "
                  f"{m['random_skip_rate']:.1%}): {ci_text(m['diff_vs_random'], '{:+.3f}', form='interval')}")
    print(f"hat-bench tasks: report saved to {args.out}" + (f" ({note})" if note else ""))
    return 0
