"""The RSS of one device host process (a soak host's shape), with and without the agents giving freed heap pages
back after each request (hat_split/heap.py). Not part of the package: the experiment behind docs/SECURITY.md's
"Memory" figures, kept beside its output.

Ten agents in this process share SmolLM2-135M (float32, one torch thread), each behind a link emulator (wifi-near,
wifi-far, lte in turn) to a CurveZMQ cloud of the same model; a Poisson load of one request per 3 s on a random agent,
prompts drawn from the soak's pool (ShareGPT chats of 32-384 tokens), 32 new tokens, protocols sd / llm / uhlm / qs /
cuhlm. RSS is sampled every 30 s after a garbage collection.

    python results/memory/host_probe.py 480 results/memory/with_trim.json
    python results/memory/host_probe.py 480 results/memory/without_trim.json --no-trim
"""
from __future__ import annotations

import gc
import os
import random
import sys
import threading
import time

import numpy as np
import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import hat_split.heap as heap  # noqa: E402
from edge_runtime.api.agent import AgentConfig  # noqa: E402
from edge_runtime.config import EdgeConfig, EngineConfig, LinkConfig  # noqa: E402
from hat_split.models.loading import load_model, load_tokenizer  # noqa: E402
from profiles.bench.provenance import write_report  # noqa: E402
from profiles.bench.soak import stream_completion  # noqa: E402
from profiles.bench.testbed import Testbed  # noqa: E402
from testbed.links import get_link_profile  # noqa: E402
from testbed.prompts import long_chat_prompts  # noqa: E402

MODEL, LINKS, DEVICES = "smollm2-135m", ("wifi-near", "wifi-far", "lte"), [f"d{i}" for i in range(10)]
PROTOCOLS = ("sd", "llm", "uhlm", "qs", "cuhlm")


def main(duration_s: float, out: str, trim: bool) -> None:
    import torch

    torch.set_num_threads(1)
    if not trim:
        heap.trim = lambda: 0.0  # the control: the agents keep what they freed
    proc, rng, stop, samples, done = psutil.Process(), random.Random(0), threading.Event(), [], [0]
    pool = long_chat_prompts(load_tokenizer(MODEL), 24, 32, 384)
    with Testbed(MODEL, cloud_args=["--dtype", "float32", "--threads", "1"], secure=True, devices=DEVICES) as bed:
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


if __name__ == "__main__":
    main(float(sys.argv[1]), sys.argv[2], "--no-trim" not in sys.argv[3:])
