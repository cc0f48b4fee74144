"""`hat-bench capacity`: how many devices one cloud serves within an SLA (SpecEdge's capacity metric), measured on
this machine for llm, sd and auto.

A real cloud process (the target on llama.cpp) pinned to its own core(s) behind the link emulator. The devices are
emulated in this process on the other core(s), each an EdgeRuntime of its own (its connection, its sessions, its auto
estimates) whose draft model is played back (profiles.bench.recorded_draft): the real draft model's greedy drafts
from every prefix a greedy request reaches, recorded once here, each forward sleeping what the real model took. So N
devices cost this machine sleeps, as N boards would cost their own hardware, while the cloud does all of its real
work (prefill, verification, decoding, batching the devices' steps). Greedy decoding only (what the recording
covers). The cloud batches the devices' steps and so rounds near ties either way (docs/TREES.md): the drafts are
recorded along the lone target's answer and along its answer after the runner-up at every near tie
(--branch-margin), so a request that took the runner-up still drafts what the real model would.

For each N of --devices and each protocol (in a rotating order), N devices run --requests requests each, back to
back, on the recorded prompts, device i starting i/N of a lone llm request's time after the first (arrivals spread
as a steady stream's are, rather than N prompts at the same instant). Per cell: TTFT (request to its first token)
and TBT (each commit's gap since the previous one, shared by the tokens it brought) as P50/P99 with n, tokens/s per
device, the cloud's tokens/s in all, the cloud's own compute per generated token (its step seconds over the cell,
from its /metrics: what a fleet operator pays for, prefill included), the drafts that left the recording, and for
auto (auto@P) the tokens each of its choices produced over the cell (`auto_tokens`: "sd γ=4", "llm", …).
Capacity per protocol and per SLA of --sla (TTFT P99 and TBT P99 bounds): the largest N such that at every size up
to it both P99s are within the SLA with no failed request. `auto@P` runs auto with the requests' SLA pace P tok/s
(GenerationRequest.sla_tokens_per_s: the least cloud compute a token that keeps it); `auto~P` runs auto, its
requests naming no pace, on a cloud of its own started with `--fleet-pace-tokens-per-s P` (the operator's pace for
such requests while other devices use the cloud), beside the other columns' and pinned to the same core(s).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import threading
import time
from typing import Dict, List, NamedTuple

import numpy as np

from hat_split.wire.messages import MAX_PACE
from profiles.bench.provenance import write_report


def add_parser(sub) -> None:
    s = sub.add_parser("capacity", help="devices one cloud serves within an SLA: llm, sd, auto (emulated devices)")
    s.add_argument("--draft", default="qwen2.5-coder-0.5b")
    s.add_argument("--target", default="qwen2.5-coder-1.5b")
    s.add_argument("--protocols", default="llm,sd,auto",
                   help="comma-separated; auto@P: auto with the request's SLA pace P tok/s (sla_tokens_per_s: the "
                        "least cloud compute a token that keeps it)")
    s.add_argument("--devices", default="1,2,4,8,12", help="fleet sizes N, comma-separated")
    s.add_argument("--requests", type=int, default=3, help="requests per device per cell")
    s.add_argument("--prompts", type=int, default=4)
    s.add_argument("--max-new-tokens", type=int, default=32)
    s.add_argument("--draft-len", type=int, default=4, help="sd's γ (auto chooses its own, at most --gamma)")
    s.add_argument("--gamma", type=int, default=8, help="the longest draft recorded")
    s.add_argument("--link", default="wifi-near", help="the link profile every device's traffic crosses")
    s.add_argument("--sla", default="4:250,6:500,10:1000",
                   help="SLAs as TTFT_S:TBT_MS pairs (P99 bounds), comma-separated; default %(default)s")
    s.add_argument("--branch-margin", type=float, default=1.0,
                   help="also record the draft after the runner-up wherever the target's top two logits are closer "
                        "than this (a batched cloud may round such a near tie either way); 0: the lone path only")
    s.add_argument("--cloud-cores", type=int, default=1)
    s.add_argument("--out", default="runs/capacity/bench_capacity.json")


def run(args: argparse.Namespace) -> int:
    from cloud_runtime.process import free_port
    from edge_runtime.config import EdgeConfig, EngineConfig
    from edge_runtime.engine import Engine
    from hat_split.math.sampling import SamplingParams
    from hat_split.models.llamacpp_lm import LlamaCppLM, LlamaCppSettings, model_gguf
    from hat_split.prompt_sets import demo_prompts
    from hat_split.protocols import check_requestable
    from profiles.bench.recorded_draft import RecordedLM, branches, record
    from profiles.bench.rig import Rig

    protocols = [p for p in args.protocols.split(",") if p]
    if not protocols:
        raise ValueError("--protocols: none given")
    for name in protocols:
        check_requestable(column(name).protocol)  # a ValueError naming the known ones
    slas = parse_slas(args.sla)
    try:
        sizes = sorted({int(n) for n in args.devices.split(",") if n.strip()})
    except ValueError:
        raise ValueError(f"--devices: comma-separated fleet sizes, got {args.devices!r}") from None
    if not sizes or sizes[0] < 1 or args.requests < 1 or args.gamma < args.draft_len or not args.branch_margin >= 0:
        raise ValueError("--devices: positive sizes; --requests >= 1; --gamma >= --draft-len; --branch-margin >= 0")
    cores = sorted(os.sched_getaffinity(0))
    if not 0 < args.cloud_cores < len(cores):
        raise ValueError(f"--cloud-cores: 1..{len(cores) - 1} (the devices need a core of their own)")
    cloud_cores, device_cores = cores[:args.cloud_cores], cores[args.cloud_cores:]
    os.sched_setaffinity(0, device_cores)
    greedy = SamplingParams(0.0)
    t_start = time.perf_counter()
    clouds: Dict[float, tuple] = {}  # a fleet pace (0: none) -> its cloud's rig and metrics port
    with contextlib.ExitStack() as stack:
        for pace in sorted({0.0} | {column(name).fleet_pace for name in protocols}):
            port = free_port()
            extra = ["--fleet-pace-tokens-per-s", f"{pace:g}"] if pace else []
            clouds[pace] = (stack.enter_context(Rig(
                args.target, cloud_args=["--engine", "llamacpp", "--metrics-port", str(port), *extra],
                threads=len(cloud_cores), cloud_cpus=cloud_cores, link=args.link)), port)
        bed = clouds[0.0][0]  # the cloud without a fleet pace: the recording's, and every column's but auto~P's
        base = EdgeConfig(model=args.draft, link=bed.link_config(), draft_len=args.draft_len, overlap_prefill="on",
                          engine=EngineConfig(backend="llamacpp", threads=len(device_cores)))
        real = bed.runtime(base)
        prompts, recording, lone, n_branches = [], None, [], 0
        settings = LlamaCppSettings(n_ctx=4096, n_threads=len(device_cores))
        lone_target = LlamaCppLM(model_gguf(args.target), settings) if args.branch_margin > 0 else None
        with (lone_target or contextlib.nullcontext()) as alone:
            for p in demo_prompts(args.prompts):
                ids = list(real.encode_prompt(p.text, chat=p.chat))
                t0 = time.perf_counter()
                target = real.generate(ids, "llm", greedy, args.max_new_tokens, seed=0).tokens
                lone.append(time.perf_counter() - t0)
                rec = record(real.engine.lm, ids, target, args.gamma)
                forks = branches(alone, ids, target, args.branch_margin) if alone is not None else []
                for at, fork in forks:  # the runner-up at a near tie: the draft along the target's answer after it
                    rec.merge(record(real.engine.lm, ids, fork, args.gamma, start=at))
                n_branches += len(forks)
                if recording is None:
                    recording = rec
                else:
                    recording.merge(rec)
                prompts.append((ids, target))
                print(f"recorded {len(rec.next_token)} drafts of a {len(ids)}-token prompt ({len(forks)} branches at "
                      f"near ties): draft step {1e3 * rec.step_s:.1f} ms, prefill "
                      f"{1e3 * rec.prefill_s_per_token:.2f} ms/token", flush=True)
        real.close()
        e = real.engine
        cells: List[dict] = []
        for k, n in enumerate(sizes):
            order = protocols[k % len(protocols):] + protocols[:k % len(protocols)]
            for name in order:
                engines = [Engine(RecordedLM(recording), e.tokenizer, e.vocab_size, e.model_name, e.fingerprint,
                                  e.eos_ids) for _ in range(n)]
                rig, port = clouds[column(name).fleet_pace]
                steps_before = cloud_step_s(port)
                cell = _cell(rig, base, engines, name, prompts, args, spread_s=sum(lone) / len(lone))
                cell["cloud_step_s"] = cloud_step_s(port) - steps_before
                cell["cloud_ms_per_token"] = 1e3 * cell["cloud_step_s"] / max(1, cell["tokens"])
                cells.append(cell)
                print(f"N={n:>3} {name:>5}: TTFT P99 {cell['ttft_s']['p99']:.2f} s, TBT P99 "
                      f"{1e3 * cell['tbt_s']['p99']:.0f} ms, {cell['tokens_per_s_per_device']:.2f} tok/s a device, "
                      f"{cell['cloud_tokens_per_s']:.2f} in all, cloud {cell['cloud_ms_per_token']:.0f} ms a token, "
                      f"failed {cell['failed']}, drafts off the recording "
                      f"{cell['recording_misses']}" + (f"; auto ran {_ran_text(cell['auto_tokens'])}"
                                                         if "auto_tokens" in cell else ""), flush=True)
    report = {"args": vars(args), "cores": {"cloud": cloud_cores, "device": device_cores},
              "slas": [{"ttft_p99_s": t, "tbt_p99_s": b} for t, b in slas],
              "recording": {"entries": len(recording.next_token), "branches": n_branches,
                            "draft_step_s": recording.step_s,
                            "prefill_s_per_token": recording.prefill_s_per_token, "lone_llm_request_s": lone},
              "cells": cells, "capacity": {sla_label(t, b): capacity(cells, protocols, t, b) for t, b in slas},
              "wall_s": time.perf_counter() - t_start}
    write_report(args.out, report)
    for label, per in report["capacity"].items():
        print(f"capacity within {label}: " + ", ".join(
            f"{name} {c['devices']} devices ({c['cloud_tokens_per_s']:.2f} tok/s in all)" for name, c in per.items()))
    print(f"wrote {args.out}")
    return 0


def _cell(bed, base, engines, protocol: str, prompts, args, spread_s: float) -> dict:
    """N emulated devices, one thread each, `args.requests` requests each, device i starting i/N of spread_s after
    the first."""
    from dataclasses import replace

    from edge_runtime.auto import tokens_by_choice
    from edge_runtime.request import GenerationRequest
    from edge_runtime.runtime import EdgeRuntime
    from hat_split.math.sampling import SamplingParams

    name, sla = column(protocol)[:2]
    ttft: List[float] = []
    tbt: List[float] = []
    tokens, failed, mismatched = [0], [0], [0]
    segments: List[dict] = []  # what auto ran, every request's choices
    lock = threading.Lock()

    def device(i: int, engine) -> None:
        config = replace(base, link=bed.link_config(f"cap-{i}"))
        with EdgeRuntime(config, engine) as rt:
            time.sleep(i * spread_s / len(engines))
            for r in range(args.requests):
                ids, target = prompts[(i + r) % len(prompts)]
                stamps: List[tuple] = []
                t0 = time.perf_counter()
                try:
                    res = rt.run(GenerationRequest(tuple(ids), name, SamplingParams(0.0), args.max_new_tokens,
                                                   seed=0, sla_tokens_per_s=sla, on_tokens=lambda toks, _lp:
                                                   stamps.append((time.perf_counter(), len(toks)))))
                except Exception:  # noqa: BLE001  a failed request counts against the SLA
                    with lock:
                        failed[0] += 1
                    continue
                with lock:
                    tokens[0] += res.n
                    segments.extend(res.auto or ())
                    mismatched[0] += list(res.tokens) != list(target)
                    if stamps:
                        ttft.append(stamps[0][0] - t0)
                    tbt.extend(between_tokens(stamps))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=device, args=(i, eng), daemon=True) for i, eng in enumerate(engines)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    n = len(engines)
    cell = {"devices": n, "protocol": protocol, "requests": n * args.requests, "failed": failed[0], "tokens": tokens[0],
            "not_the_targets": mismatched[0], "ttft_s": _pcts(ttft), "tbt_s": _pcts(tbt), "wall_s": wall,
            "cloud_tokens_per_s": tokens[0] / wall, "tokens_per_s_per_device": tokens[0] / wall / n}
    cell["recording_misses"] = sum(e.lm.misses for e in engines)
    if name == "auto":
        cell["auto_tokens"] = tokens_by_choice(segments)  # which protocols and knobs the cell's tokens came from
    return cell


def _ran_text(by_choice: Dict[str, int]) -> str:
    return ", ".join(f"{name} ×{n}" for name, n in by_choice.items()) or "nothing"


def cloud_step_s(port: int) -> float:
    """The cloud's compute in steps so far, from its Prometheus endpoint on this host."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
        return step_seconds_of(reply.read().decode())


def step_seconds_of(text: str) -> float:
    """hatspec_cloud_step_seconds_sum of a /metrics page (docs/METRICS.md)."""
    for line in text.splitlines():
        if line.startswith("hatspec_cloud_step_seconds_sum"):
            return float(line.split()[-1])
    raise ValueError("the cloud's /metrics has no hatspec_cloud_step_seconds_sum")


class Column(NamedTuple):
    """A --protocols entry: the protocol, the SLA pace its requests name, and the fleet pace of the cloud it runs on
    (tok/s; 0: none)."""

    protocol: str
    sla: float = 0.0
    fleet_pace: float = 0.0


def column(name: str) -> Column:
    """"auto@4": auto whose requests keep 4 tok/s at the least cloud compute a token (sla_tokens_per_s); "auto~4":
    auto whose requests name no pace, on a cloud started with --fleet-pace-tokens-per-s 4 (the operator's pace for
    them); any other name: the protocol as it is."""
    for mark, field in (("@", "sla"), ("~", "fleet_pace")):
        protocol, at, pace = name.partition(mark)
        if not at:
            continue
        try:
            value = float(pace)
        except ValueError:
            value = -1.0
        if protocol != "auto" or not 0 < value <= MAX_PACE:
            raise ValueError(f"--protocols: {name!r}: a pace goes with auto, as auto@P (the requests' SLA) or auto~P "
                             f"(the cloud's fleet pace) with 0 < P <= {MAX_PACE:g} tok/s")
        return Column(protocol, **{field: value})
    return Column(name)


def between_tokens(commits: List[tuple]) -> List[float]:
    """TBT of every token after the first commit: each commit's gap since the previous one, shared by the tokens it
    brought (commits: (time, tokens) in order)."""
    out: List[float] = []
    for (prev, _), (t, m) in zip(commits, commits[1:]):
        out.extend([(t - prev) / m] * m)
    return out


def _pcts(xs: List[float]) -> dict:
    if not xs:
        return {"n": 0, "p50": float("nan"), "p99": float("nan")}
    a = np.asarray(xs)
    return {"n": int(a.size), "p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99))}


def parse_slas(text: str) -> List[tuple]:
    """"TTFT_S:TBT_MS,..." → [(ttft_s, tbt_s), ...]."""
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        try:
            ttft, tbt = (float(v) for v in item.split(":"))
        except ValueError:
            raise ValueError(f"--sla: TTFT_S:TBT_MS pairs, comma-separated, got {item!r}") from None
        if not (ttft > 0 and tbt > 0):
            raise ValueError(f"--sla: bounds must be > 0, got {item!r}")
        out.append((ttft, tbt / 1e3))
    if not out:
        raise ValueError("--sla: no SLA given")
    return out


def sla_label(ttft_s: float, tbt_s: float) -> str:
    return f"TTFT P99 <= {ttft_s:g} s, TBT P99 <= {1e3 * tbt_s:g} ms"


def within(cell: dict, ttft_s: float, tbt_s: float) -> bool:
    return bool(not cell["failed"] and cell["ttft_s"]["n"] and cell["tbt_s"]["n"]
                and cell["ttft_s"]["p99"] <= ttft_s and cell["tbt_s"]["p99"] <= tbt_s)


def capacity(cells: List[dict], protocols: List[str], ttft_s: float, tbt_s: float) -> Dict[str, dict]:
    """Per protocol: the largest N such that every measured size up to it is within the SLA (0 when the smallest is
    not), and the cloud's tokens/s there."""
    out = {}
    for name in protocols:
        best = None
        for c in sorted((c for c in cells if c["protocol"] == name), key=lambda c: c["devices"]):
            if not within(c, ttft_s, tbt_s):
                break
            best = c
        out[name] = {"devices": best["devices"] if best else 0,
                     "cloud_tokens_per_s": best["cloud_tokens_per_s"] if best else 0.0}
    return out
