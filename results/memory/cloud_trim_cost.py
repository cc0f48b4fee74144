"""What one `hat_split.heap.trim` costs a cloud-like process and what it returns: the model loaded as the cloud
loads it (2 torch threads), then for each prompt length a prefill and two greedy tokens (activations and a KV cache
allocated and freed), RSS read, one trim timed, RSS read again. Not part of the package: the measurement behind
docs/SECURITY.md's sentence on the cloud's trim (CloudConfig.heap_trim_s), kept beside its output.

    python results/memory/cloud_trim_cost.py results/memory/cloud_trim_cost.json
"""
from __future__ import annotations

import os
import sys

import psutil
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import hat_split.heap as heap  # noqa: E402
from hat_split.models.lm import CausalLM  # noqa: E402
from hat_split.models.loading import load_model  # noqa: E402
from profiles.bench.provenance import write_report  # noqa: E402

MODELS = (("smollm2-135m", "float32"), ("qwen2.5-coder-1.5b", "bfloat16"))  # the soak's cloud, the real pair's target
PROMPTS = (256, 1500, 700, 1500, 384, 1024)


def measure(name: str, dtype: str) -> list:
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


def main(out: str) -> None:
    torch.set_num_threads(2)
    write_report(out, {"threads": 2, "models": {f"{n} {d}": measure(n, d) for n, d in MODELS}})


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "results/memory/cloud_trim_cost.json")
