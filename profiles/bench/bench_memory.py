"""`hat-bench memory`: what the C heap keeps and what giving its free pages back costs (hat_split/heap.py); the
measurements behind docs/SECURITY.md's "Memory" figures (results/memory/).

`hat-bench memory probe`: the RSS of one device host process (a soak host's shape), with and without the agents
giving freed heap pages back after each request. Ten agents in this process share SmolLM2-135M (float32, one torch
thread), each behind a link emulator (wifi-near, wifi-far, lte in turn) to a CurveZMQ cloud of the same model; a
Poisson load of one request per 3 s on a random agent, prompts drawn from the soak's pool (ShareGPT chats of 32-384
tokens), 32 new tokens, protocols sd / llm / uhlm / qs / cuhlm. RSS is sampled every 30 s after a garbage collection;
the summary reads the samples after the first 2 minutes (so `--duration` wants more than 150 s).

`hat-bench memory trim-cost`: what one `hat_split.heap.trim` costs a cloud-like process and what it returns: the
model loaded as the cloud loads it (2 torch threads), then for each prompt length a prefill and two greedy tokens
(activations and a KV cache allocated and freed), RSS read, one trim timed, RSS read again; for the soak's cloud and
the real pair's target (the sentence on the cloud's trim, CloudConfig.heap_trim_s).

    hat-bench memory probe --duration 480 --out results/memory/with_trim.json
    hat-bench memory probe --duration 480 --no-trim --out results/memory/without_trim.json
    hat-bench memory trim-cost --out results/memory/cloud_trim_cost.json
"""
from __future__ import annotations

import gc
import random
import threading
import time
from typing import List, Tuple

import numpy as np
import psutil

import hat_split.heap as heap
from edge_runtime.api.agent import AgentConfig
from edge_runtime.config import EdgeConfig, EngineConfig, LinkConfig
from hat_split.models.lm import CausalLM
from hat_split.models.loading import load_model, load_tokenizer
from hat_split.prompt_sets import long_chat_prompts
from profiles.bench.provenance import write_report
from profiles.bench.rig import Rig
from profiles.bench.soak import stream_completion
from testbed.links import get_link_profile

# probe: the host's model, its agents' links (in turn) and names, the protocols its requests draw from
MODEL, LINKS, DEVICES = "smollm2-135m", ("wifi-near", "wifi-far", "lte"), [f"d{i}" for i in range(10)]
PROTOCOLS = ("sd", "llm", "uhlm", "qs", "cuhlm")
# trim-cost: the soak's cloud and the real pair's target, as name:dtype; prompt lengths in tokens, in this order
MODELS = "smollm2-135m:float32,qwen2.5-coder-1.5b:bfloat16"
PROMPTS = (256, 1500, 700, 1500, 384, 1024)


def add_parser(sub) -> None:
    s = sub.add_parser("memory", help="a device host's RSS with and without heap trimming; one trim's cost")
    kinds = s.add_subparsers(dest="memory_command", required=True)
    p = kinds.add_parser("probe", help="RSS of one process of 10 agents under load, every 30 s")
    p.add_argument("--duration", type=float, default=480.0, help="seconds of load (the summary skips the first 120)")
    p.add_argument("--no-trim", dest="trim", action="store_false",
                   help="the control: the agents keep the heap pages they freed")
    p.add_argument("--out", default="", help="default: results/memory/with_trim.json, or without_trim.json")
    t = kinds.add_parser("trim-cost", help="one heap trim's time and the RSS it returns, after prompts of each length")
    t.add_argument("--models", default=MODELS, help="name:dtype, comma separated")
    t.add_argument("--out", default="results/memory/cloud_trim_cost.json")


def run(args) -> int:
    if args.memory_command == "probe":
        out = args.out or f"results/memory/{'with' if args.trim else 'without'}_trim.json"
        probe(args.duration, out, args.trim)
    else:
        models = [tuple(m.strip().split(":", 1)) for m in args.models.split(",") if m.strip()]
        if not models or any(len(m) != 2 for m in models):
            raise ValueError(f"--models: name:dtype, comma separated, not {args.models!r}")
        trim_cost(models, args.out)
    return 0


# -- probe -------------------------------------------------------------------------------------------------------
def probe(duration_s: float, out: str, trim: bool) -> None:
    import torch

    torch.set_num_threads(1)
    if not trim:
        heap.trim = lambda: 0.0  # the control: the agents keep what they freed
    proc, rng, stop, samples, done = psutil.Process(), random.Random(0), threading.Event(), [], [0]
    pool = long_chat_prompts(load_tokenizer(MODEL), 24, 32, 384)
    with Rig(MODEL, cloud_args=["--dtype", "float32", "--threads", "1"], secure=True, devices=DEVICES) as bed:
        loaded = load_model(MODEL, dtype="float32", quiet=True)
        agents = []
        for i, name in enumerate(DEVICES):
            emu = bed.add_link(get_link_profile(LINKS[i % len(LINKS)]), control=True)
            link = LinkConfig(emu.address, device_id=name, security=bed.security(name), link_policy="wait",
                              heartbeat_s=3.0, request_timeout_s=120.0, reconnect_timeout_s=600.0)
            edge = EdgeConfig(model=MODEL, link=link, engine=EngineConfig(threads=1, dtype="float32"), draft_len=8)
            agents.append(bed.agent(AgentConfig(edge, port=0, report_interval_s=10.0), loaded))

        def one(agent, body) -> None:
            stream_completion(agent.address, body, 120)
            done[0] += 1

        def load() -> None:
            threads = []
            while not stop.is_set():
                time.sleep(rng.expovariate(1 / 3.0))
                body = {"prompt": rng.choice(pool), "max_tokens": 32, "temperature": 0.0, "stream": True,
                        "hatspec": {"protocol": rng.choice(PROTOCOLS)}}
                threads.append(threading.Thread(target=one, args=(rng.choice(agents), body)))
                threads[-1].start()
            for t in threads:
                t.join()

        loader = threading.Thread(target=load)
        loader.start()
        t0 = time.time()
        while time.time() - t0 < duration_s:
            time.sleep(30)
            gc.collect()
            samples.append({"t_s": time.time() - t0, "requests": done[0], "rss_mb": proc.memory_info().rss / 2**20,
                            "threads": threading.active_count()})
            print(samples[-1], flush=True)
        stop.set()
        loader.join()
    t = np.array([s["t_s"] for s in samples])
    rss = np.array([s["rss_mb"] for s in samples])
    late = t >= 120  # after warm-up
    summary = {"trim": trim, "requests": done[0], "rss_first_mb": float(rss[0]), "rss_mean_after_2min_mb":
               float(rss[late].mean()), "rss_max_after_2min_mb": float(rss[late].max()),
               "slope_after_2min_mb_per_min": float(np.polyfit(t[late] / 60, rss[late], 1)[0])}
    print(summary)
    write_report(out, {"samples": samples, "summary": summary})


# -- trim-cost ---------------------------------------------------------------------------------------------------
def measure(name: str, dtype: str) -> list:
    """For each of PROMPTS: a prefill and two greedy tokens, then one trim's time and the RSS it returned."""
    lm = CausalLM(load_model(name, dtype=dtype).model)
    proc = psutil.Process()
    rows = []
    for n in PROMPTS:
        lm.greedy(list(range(1000, 1000 + n)), 2)
        before = proc.memory_info().rss
        seconds = heap.trim()
        rows.append({"prompt_tokens": n, "trim_ms": seconds * 1e3, "rss_before_mb": before / 2 ** 20,
                     "returned_mb": (before - proc.memory_info().rss) / 2 ** 20})
        print(f"{name} {n:5d} tokens: trim {rows[-1]['trim_ms']:.1f} ms, returned {rows[-1]['returned_mb']:.0f} MB "
              f"of {rows[-1]['rss_before_mb']:.0f}", flush=True)
    del lm
    heap.trim()
    return rows


def trim_cost(models: List[Tuple[str, str]], out: str) -> None:
    import torch

    torch.set_num_threads(2)
    write_report(out, {"threads": 2, "models": {f"{n} {d}": measure(n, d) for n, d in models}})
