"""`hat-bench hat`: HAT's ablation (paper 004, Table 5) and its speculative-decoding table (Table 4) on a real model
with its distilled adapter, over emulated WiFi links, in one run.

Rows (protocol, prompt chunking, parallel drafting), as Table 5:
  U-shape (ushape, one chunk), +SD (hat, one chunk, no PD), +PC (ushape, chunked), +SD+PC (hat, chunked, no PD),
  +SD+PD (hat, one chunk, PD), HAT (hat, chunked, PD); and HAT int8: HAT with 8-bit hidden states on the wire;
  with `--draft-vocab N`, "HAT vNk": HAT drafting over the adapter's N most frequent tokens (beyond the paper);
  with `--feature-drafter DIR`, "+SD F" and "HAT F" (and "HAT F vNk"): the same rows drafting with the feature drafter
  (hat_split.models.feature_drafter) instead of Λ, and Table 4 for it beside Λ's; with `--cost-rule`, "ROW cost"
  beside every HAT chain row: its draft lengths by the measured cost rule (hat_split.math.draft_stop) instead of η.
Chunked rows use the cloud's chunk size (hat_split.math.chunking.chunk_size from its delay model and the device's β_up).
Each row runs the same long held-out ShareGPT prompts (whole conversation histories, templated), greedy by default,
interleaved prompt by prompt, the order of the rows (and backends) rotating by one per prompt (stats.rotated), so
that drift of the machine hits every row alike. The link emulator shapes both
directions to the named profile. A warm-up request per link gives the cloud's delay model and the device's link
estimates their first observations, as a running fleet has.

The device is slower than the cloud, as a Jetson is beside a GPU server: its compute runs on this machine and is
stretched by `--slowdown`, by default the ratio of the memory bandwidths of `--device-profile` and `--cloud-gpu`
(hardware: an AGX Orin 32GB, HAT's device, against an RTX A6000, HAT's cloud GPU: 3.75x). The stretch is a sleep
with torch's OpenMP workers waiting passively (hat_split.models.lm.wait_passively), so the device's emulated time
leaves the cores to the cloud; the cloud gets `--threads` threads (the cores), the device `--device-threads`. The
device's real compute (1 / slowdown of its emulated time) still takes the cloud's cores when both work at once
(parallel drafting, chunked prefill); `--cloud-cores N` pins the cloud to N cores and the device to the others, as on
separate hardware (the cloud then runs on fewer cores). Every table states the emulated factor and the cores.

Reported per link and row: TTFT and TBT (mean over requests; TBT = decode time / (tokens − 1)), their change against
U-shape, accept length (accepted drafts per round, HAT's "accept length") and tokens per round, bytes up and down per
token, prompt chunks, parallel-drafting hits; whether each request's tokens equal U-shape's (greedy: they must, up to
float ties); Table 4: accept length, trained parameters of Λ, decode speedup (TBT of U-shape / TBT of +SD).
Beside each mean, `<key>_ci`: the mean of its per-request values with a 95 % interval, n and method (stats.interval:
a t interval below 8 requests); changes against U-shape and the decode speedup take the per-prompt ratio on the same
prompt (paired).
`--backends torch,onnxruntime:int8,...` runs the device's parts on several backends side by side (a hat-export
`--bundle` of the same model and Λ for onnxruntime / TensorRT), interleaved prompt by prompt, one table per link and
backend. Writes JSON and a PNG beside it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from typing import Dict, List, Optional

import numpy as np

from edge_runtime.config import EdgeConfig, EngineConfig, LinkConfig, SplitConfig
from hat_split.files.figures import NO_MATPLOTLIB, pyplot
from hat_split.math.sampling import SamplingParams
from hat_split.math.tree import parse_shapes, shape_name
from hat_split.models.lm import wait_passively
from hat_split.prompt_sets import long_chat_prompts
from profiles.bench.bench_args import adapter_dir, names
from profiles.bench.stats import ci_note, ci_text, interval, paired_ratio, rotated
from profiles.bench.rig import Rig
from hardware.device_profiles import cloud_gpus, get_profile, speed_ratio
from testbed.links import get_link_profile
from profiles.bench.provenance import write_report

VARIANTS = {  # name: (protocol, SplitConfig fields) — HAT Table 5's rows, then the 8-bit codec
    "U-shape": ("ushape", {"chunking": "off"}),
    "+SD": ("hat", {"chunking": "off", "parallel_draft": False}),
    "+PC": ("ushape", {"chunking": "auto"}),
    "+SD+PC": ("hat", {"chunking": "auto", "parallel_draft": False}),
    "+SD+PD": ("hat", {"chunking": "off", "parallel_draft": True}),
    "HAT": ("hat", {"chunking": "auto", "parallel_draft": True}),
    "HAT int8": ("hat", {"chunking": "auto", "parallel_draft": True, "hidden_format": "int8"}),
}


def add_parser(sub) -> None:
    s = sub.add_parser("hat", help="HAT Table 5 ablation and Table 4 over emulated WiFi links")
    s.add_argument("--model", default="qwen2.5-coder-1.5b")
    s.add_argument("--m", type=int, default=2, help="layers of the device's input part")
    s.add_argument("--adapter", default="", help="hat-distill artifact (default runs/adapters/<model>-m<m>)")
    s.add_argument("--feature-drafter", default="", metavar="DIR",
                   help="a `hat-distill --drafter feature` directory: adds the rows +SD F, HAT F (and HAT F vNk)")
    s.add_argument("--prompts", type=int, default=4, help="held-out ShareGPT conversation prompts")
    s.add_argument("--min-prompt-tokens", type=int, default=300)
    s.add_argument("--max-prompt-tokens", type=int, default=2000)
    s.add_argument("--max-new-tokens", type=int, default=128, help="HAT §4.1: 128")
    s.add_argument("--links", default="wifi-near,wifi-far", help="link profiles (hat-link --list)")
    s.add_argument("--variants", default="",
                   help="rows to run, comma separated (default: every row, with those --draft-vocab and "
                        "--feature-drafter add)")
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--eta", type=float, default=0.6, help="drafting threshold η (HAT eq. 5)")
    s.add_argument("--draft-vocab", type=int, default=0, metavar="N",
                   help="add a row: HAT drafting over the adapter's N most frequent tokens (split.draft_vocab)")
    s.add_argument("--trees", default="", metavar="NxDxW,...",
                   help="add rows: HAT with Λ (and with --feature-drafter's drafter) drafting trees (split.tree_nodes, "
                        "tree_depth, tree_width), e.g. 16x4x4; over --draft-vocab's head when given")
    s.add_argument("--cost-rule", action="store_true",
                   help="add a \"ROW cost\" row beside every HAT chain row: its draft lengths by the measured cost "
                        "rule (split.draft_stop = cost, hat_split.math.draft_stop) instead of η")
    s.add_argument("--threads", type=int, default=2, help="torch threads of the cloud (2: the cores here)")
    s.add_argument("--device-threads", type=int, default=0, help="torch threads of the device (0: --threads)")
    s.add_argument("--cloud-cores", type=int, default=0,
                   help="N > 0: pin the cloud to the first N cores this process may use and the device to the rest "
                        "(threads: one per core on each side), so that the device's real compute never takes the "
                        "cloud's cores, as on separate hardware; 0: both share every core")
    s.add_argument("--device-profile", default="agx-orin-32gb", help="the emulated device (hat-profile list)")
    s.add_argument("--cloud-gpu", default="a6000", help="the cloud GPU it is compared with (hardware/"
                                                           "cloud_gpus.toml)")
    s.add_argument("--slowdown", type=float, default=0.0,
                   help="device compute stretch (0: the memory-bandwidth ratio of --device-profile to --cloud-gpu; "
                        "1: the device runs at this machine's speed)")
    s.add_argument("--dtype", default="auto",
                   help="model dtype on both sides (auto: bfloat16 where the CPU multiplies it, else float32)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--backends", default="torch",
                   help="what runs the device's parts, comma separated, each torch (--model, --adapter) or "
                        "onnxruntime:PRECISION / tensorrt:PRECISION (a --bundle's artifacts); several run side by "
                        "side, interleaved prompt by prompt, one table per link and backend")
    s.add_argument("--bundle", default="", help="hat-export bundle with input, adapter and output parts")
    s.add_argument("--out", default="runs/bench_hat.json")


def cores_text(device: dict) -> str:
    """Where each side runs, for the tables' headers."""
    if device.get("cloud_cores"):
        return (f"cloud on core(s) {device['cloud_cores']} ({device['cloud_threads']} threads), device on core(s) "
                f"{device['device_cores']} ({device['device_threads']} threads)")
    return f"both on every core: cloud {device['cloud_threads']} threads, device {device['device_threads']}"


def vocab_row(n: int) -> str:
    """The table row of HAT drafting over n tokens: "HAT v32k"."""
    return f"HAT v{n // 1024}k" if n % 1024 == 0 else f"HAT v{n}"


def parse_backends(text: str, bundle: str) -> List[tuple]:
    """`torch,onnxruntime:int8` → [("torch", ""), ("onnxruntime", "int8")]; ValueError on an unknown backend or a
    bundle backend without --bundle."""
    out = []
    for item in [x.strip() for x in text.split(",") if x.strip()]:
        backend, _, precision = item.partition(":")
        if backend not in ("torch", "onnxruntime", "tensorrt"):
            raise ValueError(f"unknown backend {backend!r} in --backends; choose torch, onnxruntime:P, tensorrt:P")
        if backend != "torch" and not bundle:
            raise ValueError(f"backend {backend} runs a hat-export bundle: give --bundle DIR")
        out.append((backend, precision))
    if not out:
        raise ValueError("give at least one backend")
    return out


def backend_label(backend: str, precision: str, dtype: str) -> str:
    return f"{backend} {precision or 'fp32'}" if backend != "torch" else f"torch {dtype}"


def _request_row(r) -> dict:
    row = r.to_json()
    row["tbt_s"] = (r.total_s - r.ttft_s) / (r.n - 1) if r.n > 1 else float("nan")
    return row


def _change(ci: dict) -> dict:
    """A ratio's interval as a change: ratio - 1."""
    return {k: (v - 1.0 if v is not None and k in ("mean", "lo", "hi") else v) for k, v in ci.items()}


def _decode_rate(rows: List[dict], key: str) -> List[Optional[float]]:
    """Per request: row[key] per decode round (the prefill round gives the first token), None with no decode round."""
    return [r[key] / (r["rounds"] - 1) if r["rounds"] > 1 else None for r in rows]


def summarise(runs: Dict[str, List[dict]]) -> dict:
    """Per row: means over requests, and changes against U-shape where it ran; `<key>_ci` beside them."""
    out: dict = {}
    for name, rows in runs.items():
        rounds = sum(r["rounds"] for r in rows)
        decode_rounds = rounds - len(rows)  # the first token of each request comes from the prefill round
        n = sum(r["n_tokens"] for r in rows)
        s = {"ttft_s": float(np.mean([r["ttft_s"] for r in rows])),
             "tbt_s": float(np.nanmean([r["tbt_s"] for r in rows])),
             "tokens": n,
             "tokens_per_round": (n - len(rows)) / max(decode_rounds, 1),
             "up_bytes_per_token": sum(r["up_bytes"] for r in rows) / max(n, 1),
             "down_bytes_per_token": sum(r["down_bytes"] for r in rows) / max(n, 1),
             "prefill_chunks": float(np.mean([r["prefill_chunks"] for r in rows])),
             "cloud_compute_s": float(np.mean([r["cloud_compute_s"] for r in rows])),
             "device_compute_s": float(np.mean([r["device_compute_s"] for r in rows])),
             "n_requests": len(rows),
             "ttft_s_ci": interval([r["ttft_s"] for r in rows]),
             "tbt_s_ci": interval([r["tbt_s"] for r in rows]),
             "tokens_per_round_ci": interval([(r["n_tokens"] - 1) / (r["rounds"] - 1) if r["rounds"] > 1 else None
                                              for r in rows]),
             "up_bytes_per_token_ci": interval([r["up_bytes"] / r["n_tokens"] if r["n_tokens"] else None
                                                for r in rows]),
             "down_bytes_per_token_ci": interval([r["down_bytes"] / r["n_tokens"] if r["n_tokens"] else None
                                                  for r in rows])}
        if any(r["drafted"] for r in rows):
            s["accept_length"] = sum(r["accepted"] for r in rows) / max(decode_rounds, 1)
            s["accept_length_ci"] = interval(_decode_rate(rows, "accepted"))
            s["drafts_per_round"] = sum(r["drafted"] for r in rows) / max(decode_rounds, 1)
            s["pd_hit_rate"] = sum(r["pd_hits"] for r in rows) / max(decode_rounds, 1)
            s["pd_steps_per_round"] = sum(r["pd_steps"] for r in rows) / max(decode_rounds, 1)
        out[name] = s
    base = out.get("U-shape")
    if base:
        for name, s in out.items():
            s["ttft_change"] = s["ttft_s"] / base["ttft_s"] - 1.0
            s["tbt_change"] = s["tbt_s"] / base["tbt_s"] - 1.0
            for key in ("ttft", "tbt"):  # per prompt: this row's over U-shape's on the same prompt
                s[f"{key}_change_ci"] = _change(paired_ratio([r[f"{key}_s"] for r in runs[name]],
                                                             [r[f"{key}_s"] for r in runs["U-shape"]]))
            same = sum(a["tokens"] == b["tokens"] for a, b in zip(runs[name], runs["U-shape"]))
            s["same_tokens_as_ushape"] = f"{same}/{len(runs[name])}"
    return out


def emulated_device(args) -> dict:
    """The device's slowdown and where it comes from."""
    if args.slowdown and args.slowdown < 1.0:
        raise ValueError(f"--slowdown must be >= 1 (or 0 for the profiles' ratio), got {args.slowdown}")
    profile = get_profile(args.device_profile)
    gpu = cloud_gpus().get(args.cloud_gpu)
    ratio = speed_ratio(profile, args.cloud_gpu)
    factor = args.slowdown or ratio
    source = ("given (--slowdown)" if args.slowdown else
              f"{profile.module} {profile.memory_bandwidth_gbs:g} GB/s vs {gpu.name} {gpu.memory_bandwidth_gbs:g} GB/s")
    out = {"slowdown": factor, "source": source, "profile": profile.name, "cloud_gpu": args.cloud_gpu,
           "bandwidth_ratio": ratio, "device_threads": args.device_threads or args.threads,
           "cloud_threads": args.threads, "cloud_cores": [], "device_cores": []}
    if args.cloud_cores:
        cores = sorted(os.sched_getaffinity(0))
        if not 0 < args.cloud_cores < len(cores):
            raise ValueError(f"--cloud-cores {args.cloud_cores}: the device needs a core of its own; this process may "
                             f"use {len(cores)} core(s), so give 1..{len(cores) - 1} (or 0 to share them)")
        out["cloud_cores"], out["device_cores"] = cores[:args.cloud_cores], cores[args.cloud_cores:]
        out["cloud_threads"], out["device_threads"] = len(out["cloud_cores"]), len(out["device_cores"])
    return out


def run(args) -> int:
    device = emulated_device(args)
    if device["device_cores"]:  # before torch starts its threads: they inherit it
        os.sched_setaffinity(0, device["device_cores"])
    device["openmp_waits"] = wait_passively(device["slowdown"])  # before torch loads in this (the device's) process
    rows = dict(VARIANTS)
    if args.draft_vocab:  # beyond the paper: the draft's head over the data's most frequent tokens
        rows[vocab_row(args.draft_vocab)] = ("hat", {**VARIANTS["HAT"][1], "draft_vocab": args.draft_vocab})
    tree_rows(rows, args.trees, args.draft_vocab)  # beyond the paper: draft trees
    feature_meta = feature_rows(rows, args.feature_drafter, args.draft_vocab, args.trees)
    if args.cost_rule:  # beyond the paper: draft lengths by what drafts were worth and cost on this connection
        rows.update({f"{name} cost": ("hat", {**fields, "draft_stop": "cost"}) for name, (protocol, fields)
                     in list(rows.items()) if name.startswith("HAT") and protocol == "hat"
                     and not fields.get("tree_nodes")})
    variants = names(args.variants, rows, "variant") if args.variants else list(rows)
    links = [get_link_profile(name) for name in args.links.split(",") if name]
    if not links:
        raise ValueError("give at least one link profile")
    backends = parse_backends(args.backends, args.bundle)
    needs_adapter = any(b == "torch" for b, _ in backends) and any(rows[v][0] == "hat" and "adapter" not in rows[v][1]
                                                                   for v in variants)
    adapter = adapter_dir(args.adapter, args.model, args.m, needs_adapter)  # a bundle brings its own Λ
    adapter_meta: dict = {}
    if os.path.exists(os.path.join(adapter, "adapter.json")):
        with open(os.path.join(adapter, "adapter.json"), encoding="utf-8") as f:
            adapter_meta = json.load(f)
    params = SamplingParams(args.temperature)
    report: dict = {"args": vars(args), "adapter": adapter, "adapter_record": adapter_meta.get("record"),
                    "adapter_provenance": adapter_meta.get("provenance"),
                    "trained_parameters": adapter_meta.get("params"), "device": device, "links": {}, "tables": {},
                    "feature_drafter": args.feature_drafter or None,
                    "feature_record": feature_meta.get("record"), "feature_provenance": feature_meta.get("provenance"),
                    "feature_parameters": feature_meta.get("params")}
    print(f"hat-bench hat: the device is emulated {device['slowdown']:.2f}x slower than the cloud "
          f"({device['source']}); {cores_text(device)}", flush=True)
    t_start, cpu_start = time.perf_counter(), time.process_time()
    with Rig(args.model, cloud_args=["--dtype", args.dtype], threads=device["cloud_threads"],
                 cloud_cpus=device["cloud_cores"]) as bed:
        for link in links:
            with bed.add_link(link) as emu:
                base = SplitConfig(m=args.m, adapter=adapter, draft_stop_prob=args.eta, up_bps=8 * link.rate("up"),
                                   down_bps=8 * link.rate("down"), slowdown=device["slowdown"])
                with contextlib.ExitStack() as stack:
                    rts = {}
                    for backend, precision in backends:
                        engine = EngineConfig(backend=backend, bundle=args.bundle if backend != "torch" else "",
                                              precision=precision or "fp32", dtype=args.dtype,
                                              threads=device["device_threads"])
                        cfg = EdgeConfig(model=args.model, link=LinkConfig(emu.address, security=bed.security()),
                                         engine=engine, split=base)
                        rts[backend_label(backend, precision, args.dtype)] = stack.enter_context(bed.runtime(cfg))
                    if "prompts" not in report:
                        ids = long_chat_prompts(next(iter(rts.values())).engine.tokenizer, args.prompts + 1,
                                                args.min_prompt_tokens, args.max_prompt_tokens)
                        report["prompts"] = {"tokens": [len(x) for x in ids[1:]], "warm_up_tokens": len(ids[0])}
                    # warm-up with the first row that drafts (the rows' own draft module), else the first row
                    warm = next((v for v in variants if rows[v][0] == "hat"), variants[0])
                    warm_split = dataclasses.replace(base, **rows[warm][1])
                    for rt in rts.values():
                        for _ in range(2):  # warm-up: the cloud's g() gets a prefill and decode steps, the device β
                            rt.config = dataclasses.replace(rt.config, split=warm_split)
                            rt.generate(ids[0], rows[warm][0], params, 16, seed=args.seed)
                    runs: Dict[str, Dict[str, List[dict]]] = {b: {v: [] for v in variants} for b in rts}
                    systems = [(label, v) for label in rts for v in variants]
                    for i, x in enumerate(ids[1:]):
                        for label, v in rotated(systems, i):
                            rt = rts[label]
                            protocol, fields = rows[v]
                            rt.config = dataclasses.replace(rt.config, split=dataclasses.replace(base, **fields))
                            r = rt.generate(x, protocol, params, args.max_new_tokens, seed=args.seed + i)
                            runs[label][v].append(_request_row(r))
                            row = runs[label][v][-1]
                            print(f"  {link.name} {label} prompt {i + 1}/{args.prompts} ({len(x)} tok) {v:9s}: "
                                  f"TTFT {row['ttft_s'] * 1e3:7.1f} ms, TBT {row['tbt_s'] * 1e3:6.1f} ms, {r.n} "
                                  f"tokens, {r.prefill_chunks} chunk(s), accepted {r.accepted}/{r.drafted} in "
                                  f"{r.rounds} rounds", flush=True)
            for label, by_variant in runs.items():
                key = link.name if len(runs) == 1 else f"{link.name} {label}"
                report["links"][key] = {"profile": dataclasses.asdict(link), "backend": label, "runs": by_variant}
                report["tables"][key] = summarise(by_variant)
    report["seconds"] = time.perf_counter() - t_start
    # this process is the device (and the link relay): its CPU time against the device time it reported
    device["process_cpu_s"] = time.process_time() - cpu_start
    device["reported_compute_s"] = sum(r["device_compute_s"] for link in report["links"].values()
                                       for rows in link["runs"].values() for r in rows)
    report["table4"] = table4(report)
    write_report(args.out, report)
    print_tables(report)
    note = plot(os.path.splitext(args.out)[0] + ".png", report["tables"])
    print(f"hat-bench hat: {report['seconds']:.0f} s; the device process used {device['process_cpu_s']:.0f} CPU-s "
          f"while reporting {device['reported_compute_s']:.0f} s of (emulated) device compute; wrote {args.out}"
          + (f" ({note})" if note else ""))
    return 0


FEATURE_SUFFIX = " F"  # the rows drafting with the feature drafter


def tree_rows(rows: dict, trees: str, draft_vocab: int, directory: str = "") -> None:
    """Add a row per tree shape of `trees` ("16x4x4,..."): HAT drafting trees with Λ, or with the feature drafter in
    `directory` ("HAT F t16d4w4"), over the --draft-vocab head when given."""
    head = "HAT" + (FEATURE_SUFFIX if directory else "")
    if draft_vocab:
        head = vocab_row(draft_vocab).replace("HAT", head, 1)
    for nodes, depth, width in parse_shapes(trees):
        fields = {**VARIANTS["HAT"][1], "parallel_draft": False, "draft_vocab": draft_vocab, "tree_nodes": nodes,
                  "tree_depth": depth, "tree_width": width}
        if directory:
            fields["adapter"] = directory
        rows[f"{head} {shape_name(nodes, depth, width)}"] = ("hat", fields)


def feature_rows(rows: dict, directory: str, draft_vocab: int, trees: str = "") -> dict:
    """Add the feature drafter's rows (+SD F, HAT F, HAT F vNk with a draft vocabulary, HAT F tNdDwW per tree shape)
    to `rows`; its record (drafter.json), or {} without one. ValueError when the directory holds no feature
    drafter."""
    if not directory:
        return {}
    from hat_split.models.feature_drafter import read_feature_meta

    meta = read_feature_meta(directory)
    for name in ("+SD", "HAT"):
        protocol, fields = VARIANTS[name]
        rows[name + FEATURE_SUFFIX] = (protocol, {**fields, "adapter": directory})
    if draft_vocab:
        rows[f"HAT{FEATURE_SUFFIX} v{vocab_row(draft_vocab).split(' v')[1]}"] = (
            "hat", {**VARIANTS["HAT"][1], "adapter": directory, "draft_vocab": draft_vocab})
    tree_rows(rows, trees, draft_vocab, directory)
    return meta


def table4(report: dict) -> dict:
    """Per link (and drafter): accept length and decode speedup of +SD over U-shape, with the draft module's trained
    parameters; the speedup's interval from the per-prompt ratios (U-shape's TBT over +SD's on the same prompt)."""
    out = {}
    for link, t in report["tables"].items():
        for row, params, key in (("+SD", report["trained_parameters"], link),
                                 ("+SD" + FEATURE_SUFFIX, report.get("feature_parameters"), f"{link}, feature")):
            if row in t and "U-shape" in t and params:
                runs = report["links"][link]["runs"]
                out[key] = {"accept_length": t[row]["accept_length"], "tokens_per_round": t[row]["tokens_per_round"],
                            "decode_speedup": t["U-shape"]["tbt_s"] / t[row]["tbt_s"], "trained_parameters": params,
                            "accept_length_ci": t[row].get("accept_length_ci"),
                            "decode_speedup_ci": paired_ratio([r["tbt_s"] for r in runs["U-shape"]],
                                                              [r["tbt_s"] for r in runs[row]])}
    return out


def print_tables(report: dict) -> None:
    d = report["device"]
    for link, t in report["tables"].items():
        print(f"\n[{link}] prompts {report['prompts']['tokens']} tokens; device emulated {d['slowdown']:.2f}x slower "
              f"than the cloud ({d['source']}); {cores_text(d)}")
        cis = [s[key] for s in t.values() for key in ("ttft_s_ci", "tbt_s_ci")]
        print(f"  TTFT, TBT: mean over requests ± the larger half of its interval ({ci_note(cis)})")
        print(f"  {'row':11s} {'TTFT ms':>16s} {'Δ':>6s} {'TBT ms':>14s} {'Δ':>6s} {'acc/rd':>6s} {'tok/rd':>6s} "
              f"{'up B/tok':>9s} {'chunks':>6s} {'PD hit':>6s} same")
        for name, s in t.items():
            print(f"  {name:11s} {ci_text(s['ttft_s_ci'], '{:.1f}', 1e3, with_n=False):>16s} "
                  f"{100 * s.get('ttft_change', 0):+5.0f}% {ci_text(s['tbt_s_ci'], '{:.1f}', 1e3, with_n=False):>14s} "
                  f"{100 * s.get('tbt_change', 0):+5.0f}% {s.get('accept_length', 0):6.2f} "
                  f"{s['tokens_per_round']:6.2f} "
                  f"{s['up_bytes_per_token']:9.0f} {s['prefill_chunks']:6.1f} {s.get('pd_hit_rate', 0):6.2f} "
                  f"{s.get('same_tokens_as_ushape', '')}")
    for link, row in report["table4"].items():
        print(f"[Table 4, {link}] accept length {row['accept_length']:.2f}, "
              f"tokens/round {row['tokens_per_round']:.2f}, "
              f"decode speedup {row['decode_speedup']:.2f}x (per prompt {ci_text(row['decode_speedup_ci'])}), "
              f"trained parameters {row['trained_parameters']:,}")


def plot(path: str, tables: dict) -> str:
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    links = list(tables)
    rows = list(next(iter(tables.values())))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.8 / len(links)
    for j, link in enumerate(links):
        xs = np.arange(len(rows)) + j * width
        axes[0].bar(xs, [tables[link][r]["ttft_s"] * 1e3 for r in rows], width, label=link)
        axes[1].bar(xs, [tables[link][r]["tbt_s"] * 1e3 for r in rows], width, label=link)
    for ax, title in zip(axes, ("TTFT (ms)", "TBT (ms)")):
        ax.set_xticks(np.arange(len(rows)) + 0.4 - width / 2)
        ax.set_xticklabels(rows, rotation=20)
        ax.set_title(f"{title}, HAT Table 5 rows")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return ""
