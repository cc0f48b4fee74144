"""`hat-demo`: a cloud process and an edge process generating together over an emulated link, on real models.

    cloud:  hat-cloud serve --model <target> --engine <engine>    (separate process, ZeroMQ ROUTER)
    link:   LinkEmulator(<profile>) relaying 127.0.0.1:<link> → cloud   (user-space: rate, delay, jitter)
            (both, and the run's CurveZMQ keys, from profiles.bench.rig.Rig)
    edge:   hat-edge generate --model <draft> --server <link> --protocol sd,hlm,llm,slm --json ...   (separate process)

Both sides run the fastest engine installed (`--engine auto`): llama.cpp on the GGUF files when llama-cpp-python is
there (the bootstrap builds it), else torch; the demo prints which.

Then the split protocols (`--split-protocols ushape,hat`) on the target cut at layer --m: a torch cloud holding the
middle layers, and an edge process holding the input layers, the head and HAT's draft module (`--adapter`, made by
hat-distill: by default the feature drafter in runs/adapters/<target>-m<m>-feature, drafting over its 16k most frequent
tokens, else Λ in runs/adapters/<target>-m<m>; the bootstrap distils a feature drafter in a 5-minute budget when there
is neither). They run at this machine's speed (no board emulation;
`hat-bench hat` emulates a slower device). `hat` runs without parallel drafting (DEMO_HAT_FLAGS), as device and
cloud share this machine's cores (drafting while the cloud verifies would take the cloud's cores, not idle ones as on
a board of its own: on two cores it halved hat's tokens/s), and by default with the measured cost rule for its draft
lengths (`--hat-draft-stop cost`: a draft is sent only when its expected tokens repay what drafts cost on this
machine, so a poor drafter costs little; `eta` for HAT's eq. 5; docs/HAT.md).

Streams each answer as it is accepted, then prints and saves per protocol: tokens/s, time to first token, accepted
drafts per round, uplink/downlink bytes per generated token (counted from the real frames by the edge, and on the
emulated wire by the relay), and round trips per token.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from typing import Dict, List

from hat_split.models import registry
from hat_split.models.llamacpp_lib import INSTALL_HINT, llama_cpp_installed
from hat_split.net.security import cli_args
from hat_split.prompt_sets import demo_prompts
from hat_split.protocols import AUTO, get, of_family
from edge_runtime.config import DRAFT_STOPS
from profiles.bench.rig import Rig
from testbed.links import get_link_profile
from profiles.bench.provenance import write_report

DEFAULT_PROTOCOLS = "sd,hlm,uhlm,cuhlm,llm,slm,auto"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hat-demo", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b", help="device model (default %(default)s)")
    ap.add_argument("--target", default="qwen2.5-coder-1.5b", help="cloud model (default %(default)s)")
    ap.add_argument("--profile", default="wifi-near", help="link profile (`hat-link --list`; default %(default)s)")
    ap.add_argument("--protocols", default=DEFAULT_PROTOCOLS, help="comma-separated (default %(default)s)")
    ap.add_argument("--prompts", type=int, default=4, help="number of real prompts, half HumanEval half ShareGPT")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--draft-len", type=int, default=4)
    ap.add_argument("--engine", default="auto", choices=["auto", "torch", "llamacpp"],
                    help="what runs both models (default %(default)s: llama.cpp when installed, else torch)")
    ap.add_argument("--weight-quant", default="int8", choices=["none", "int8"],
                    help="torch engine: the draft's weights (default %(default)s: ~2x faster drafting on CPU)")
    ap.add_argument("--split-protocols", default="ushape,hat",
                    help="protocols run on the target's cut, after the token protocols ('' for none)")
    ap.add_argument("--m", type=int, default=2, help="layers of the target on the device for the split protocols")
    ap.add_argument("--adapter", default="", help="HAT's draft module: a hat-distill directory (default "
                    "runs/adapters/<target>-m<m>-feature when it holds a feature drafter, else "
                    "runs/adapters/<target>-m<m>)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hat-draft-stop", choices=DRAFT_STOPS, default="cost",
                    help="how hat's drafts end: cost (the measured cost rule) or eta (HAT eq. 5); default %(default)s")
    ap.add_argument("--threads", type=int, default=0, help="torch threads per process (0: torch default)")
    ap.add_argument("--out", default="runs/demo.json", help="where to save the JSON report (default %(default)s)")
    return ap


def aggregate(results: List[dict]) -> Dict[str, dict]:
    """Per protocol: totals over prompts, then ratios of the totals (so long answers weigh more, as in a stream)."""
    by: Dict[str, dict] = {}
    for r in results:
        a = by.setdefault(r["protocol"], {"prompts": 0, "tokens": 0, "total_s": 0.0, "ttft_s": [], "rounds": 0,
                                          "drafted": 0, "accepted": 0, "up_bytes": 0, "down_bytes": 0,
                                          "round_trips": 0, "skipped": 0, "cloud_s": 0.0, "ran": {}})
        a["prompts"] += 1
        a["cloud_s"] += r["cloud_compute_s"] - r["cloud_prefill_s"]
        for seg in r.get("auto", []):  # protocol auto: tokens per protocol it ran
            a["ran"][seg["protocol"]] = a["ran"].get(seg["protocol"], 0) + seg["tokens"]
        for k in ("tokens", "rounds", "drafted", "accepted", "up_bytes", "down_bytes", "round_trips", "skipped"):
            a[k] += len(r["tokens"]) if k == "tokens" else r[k]
        a["total_s"] += r["total_s"]
        a["ttft_s"].append(r["ttft_s"])
    out = {}
    for name, a in by.items():
        n = max(a["tokens"], 1)
        out[name] = {
            "prompts": a["prompts"],
            "tokens": a["tokens"],
            "tokens_per_s": a["tokens"] / a["total_s"] if a["total_s"] else 0.0,
            "ttft_s_mean": sum(a["ttft_s"]) / len(a["ttft_s"]),
            "accepted_per_round": a["accepted"] / a["rounds"] if a["drafted"] else None,
            "acceptance_rate": a["accepted"] / a["drafted"] if a["drafted"] else None,
            "up_bytes_per_token": a["up_bytes"] / n,
            "down_bytes_per_token": a["down_bytes"] / n,
            "round_trips_per_token": a["round_trips"] / n,
            "skip_rate": a["skipped"] / n,
            "cloud_ms_per_token": 1e3 * a["cloud_s"] / n,  # the cloud's step time per token, prompt excluded
            **({"auto_ran": a["ran"]} if a["ran"] else {}),
        }
    return out


def format_table(agg: Dict[str, dict]) -> str:
    cols = [("protocol", "{}"), ("tok/s", "{:.2f}"), ("TTFT s", "{:.2f}"), ("acc/round", "{:.2f}"),
            ("up B/tok", "{:.0f}"), ("down B/tok", "{:.0f}"), ("RT/tok", "{:.2f}"), ("skipped", "{:.0%}"),
            ("cloud ms/tok", "{:.0f}")]
    keys = [None, "tokens_per_s", "ttft_s_mean", "accepted_per_round", "up_bytes_per_token", "down_bytes_per_token",
            "round_trips_per_token", "skip_rate", "cloud_ms_per_token"]
    rows = [[c for c, _ in cols]]
    for name, a in agg.items():
        row = [name]
        for (_, fmt), k in zip(cols[1:], keys[1:]):
            v = a[k]
            row.append("-" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v))
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows)


def auto_line(agg: Dict[str, dict], results: List[dict]) -> str:
    """What protocol auto ran (tokens per protocol), its last reason, and how it did against the fastest exact row."""
    exact = {name: a["tokens_per_s"] for name, a in agg.items() if name != AUTO and get(name).exact}
    ran = ", ".join(f"{p} {n} tokens" for p, n in agg[AUTO]["auto_ran"].items())
    last = [r for r in results if r["protocol"] == AUTO][-1]["auto"][-1]["reason"]
    line = f"auto ran {ran}; last choice: {last}"
    if exact:
        best = max(exact, key=exact.get)
        line += f"\nauto at {agg[AUTO]['tokens_per_s'] / exact[best]:.2f}x the fastest exact row ({best})"
    return line


def planned(args) -> str:
    """When each protocol would win on a Jetson + an A6000 server, by the cost model (hat-bench plan): a line each."""
    from profiles.bench import plan

    try:
        lines = plan.wins(draft=args.draft, target=args.target, m=args.m)
    except (ValueError, OSError, KeyError) as exc:  # a model without a config, a missing measurement
        return f"(no estimate for a Jetson + GPU server: {exc})"
    return ("\non a Jetson + an RTX A6000 server (ESTIMATES of the cost model with the acceptance measured here, "
            "hat-bench plan; devices per cloud at a mean TBT <= 100 ms):\n"
            + "\n".join(f"  {v}" for v in lines.values()))


def pick_engine(asked: str) -> str:
    """The engine both sides run: llamacpp when asked or, for auto, when llama-cpp-python is installed; else torch."""
    if asked != "auto":
        return asked
    return "llamacpp" if llama_cpp_installed() else "torch"


DEMO_HAT_FLAGS = ["--no-parallel-draft"]  # device and cloud on the same cores: nothing idle to draft on
DEMO_DRAFT_VOCAB = 16384  # the feature drafter's draft head in the demo: its most frequent training tokens


def demo_drafter(target: str, m: int) -> str:
    """The demo's draft module: the feature drafter's directory when it holds one, else Λ's when it holds one, else
    the feature drafter's (where the bootstrap distils one)."""
    feature = str(registry.default_adapter_dir(target, m, 0, "feature"))
    lam = str(registry.default_adapter_dir(target, m))
    if os.path.isfile(os.path.join(feature, "drafter.json")) or not os.path.isfile(os.path.join(lam, "adapter.json")):
        return feature
    return lam


FULL_RECIPE_TOP1 = 0.435  # the full recipe's held-out top-1 on the 1.5B cut (docs/HAT.md, 1200 windows, 600 steps)


def drafter_line(adapter: str, stop: str = "cost") -> str:
    """What the hat row drafted with: the module, what trained it, its held-out top-1 beside the full recipe's, so a
    short demo recipe's slow `hat` row is read for what it is."""
    for name, kind in (("drafter.json", "feature drafter"), ("adapter.json", "Λ")):
        path = os.path.join(adapter, name)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                record = json.load(f).get("record", {})
            break
    else:
        return f"hat: drafted with {adapter}"
    budget = record.get("budget")
    how = (f"the demo recipe: {budget['windows']} windows and {budget['steps']} steps in {budget['budget_s']:g} s"
           if budget else f"{record.get('train_windows', record.get('windows', '?'))} windows, "
           f"{record.get('steps', '?')} steps")
    top1 = (record.get("eval") or {}).get("top1")
    line = f"hat: drafted with the {kind} in {adapter} ({how}; held-out top-1 " + \
           (f"{top1:.3f}" if isinstance(top1, float) else "?") + f", the full recipe's {FULL_RECIPE_TOP1})"
    if budget:
        line += ("; it drafts poorly, so " + ("the cost rule sends few of its drafts and hat runs about as fast as "
                                              "ushape" if stop == "cost" else "hat here pays for drafts the cloud "
                                              "rejects") + ": the full recipe (docs/HAT.md) writes the same directory")
    return line


def draft_vocab_flags(adapter: str) -> List[str]:
    """A feature drafter drafts over its DEMO_DRAFT_VOCAB most frequent training tokens (fewer when its data had
    fewer): a draft step then reads a small head, not the whole vocabulary's."""
    ranked = os.path.join(adapter, "draft_vocab.npy")
    if not os.path.isfile(os.path.join(adapter, "drafter.json")) or not os.path.isfile(ranked):
        return []
    import numpy as np

    return ["--draft-vocab", str(min(DEMO_DRAFT_VOCAB, len(np.load(ranked, mmap_mode="r"))))]


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    engine = pick_engine(args.engine)
    try:
        profile = get_link_profile(args.profile)
        protocols = [p for p in args.protocols.split(",") if p]
        split_protocols = [p for p in args.split_protocols.split(",") if p]
        split_names = of_family("split")
        token_names = of_family("token") + of_family("local") + (AUTO,)
        bad = [p for p in protocols if p not in token_names] + [p for p in split_protocols if p not in split_names]
        if bad or not protocols + split_protocols:
            raise ValueError(f"unknown protocol(s) {bad}; --protocols: {', '.join(token_names)}; "
                             f"--split-protocols: {', '.join(split_names)}")
        adapter = args.adapter or demo_drafter(args.target, args.m)
        if "hat" in split_protocols and not any(os.path.isfile(os.path.join(adapter, f))
                                                for f in ("adapter.json", "drafter.json")):
            raise ValueError(f"no HAT draft module at {adapter}: distil one (`hat-distill --drafter feature --model "
                             f"{args.target} --m {args.m}`; the bootstrap's demo does), or leave hat out of "
                             "--split-protocols")
        for name in (args.draft, args.target):
            if name in registry.MODELS and not registry.is_installed(name):
                raise ValueError(f"model {name} is not installed: run `hat-models install {name}`")
    except (KeyError, ValueError) as exc:
        print(f"hat-demo: {exc}", file=sys.stderr)
        return 2

    prompts = demo_prompts(args.prompts)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    missing = args.engine == "auto" and engine == "torch"
    t0 = time.perf_counter()
    results: List[dict] = []
    wire: Dict[str, dict] = {}
    try:
        if protocols:
            print(f"hat-demo: engines: cloud {engine}, device {engine}"
                  f"{f' ({INSTALL_HINT})' if missing else ''}", flush=True)
            extra = ["--draft-len", str(args.draft_len),
                     *(["--weight-quant", args.weight_quant] if engine == "torch" else [])]
            results += _side(args, profile, prompts, args.target, engine, args.draft, protocols, extra, wire)
        if split_protocols:
            print(f"hat-demo: split protocols {', '.join(split_protocols)}: {args.target} cut at layer {args.m}, "
                  f"torch on both sides, adapter {adapter}; hat drafts by the {args.hat_draft_stop} rule, without "
                  "parallel drafting (device and cloud share these cores)", flush=True)
            extra = ["--m", str(args.m), *(["--adapter", adapter, *draft_vocab_flags(adapter), *DEMO_HAT_FLAGS,
                                           "--hat-draft-stop", args.hat_draft_stop]
                                           if "hat" in split_protocols else [])]
            results += _side(args, profile, prompts, args.target, "torch", args.target, split_protocols, extra, wire)
    except RuntimeError as exc:
        print(f"hat-demo: {exc}", file=sys.stderr)
        return 1
    agg = aggregate(results)
    report = {
        "draft": args.draft,
        "target": args.target,
        "link_profile": profile.name,
        "engine": {"cloud": engine, "device": engine, "split_protocols": "torch"},
        "adapter": adapter if "hat" in split_protocols else None,
        "settings": {k: getattr(args, k) for k in ("max_new_tokens", "temperature", "top_p", "draft_len", "seed",
                                                   "hat_draft_stop")},
        "prompts": [p.to_json() for p in prompts],
        "per_protocol": agg,
        "relay_wire_stats": wire,
        "results": results,
        "wall_s": time.perf_counter() - t0,
    }
    write_report(args.out, report)
    print(f"\n=== per protocol, {len(prompts)} real prompts, link {profile.name}, draft {args.draft}, "
          f"target {args.target}, engine {engine}"
          + (f"; {', '.join(split_protocols)} on torch, the target cut at layer {args.m}" if split_protocols else "")
          + " ===")
    print(format_table(agg))
    if AUTO in agg:
        print(auto_line(agg, results))
    print(planned(args))
    if "hat" in split_protocols:
        print(drafter_line(adapter, args.hat_draft_stop))
    print(f"\nhat-demo: report saved to {args.out}")
    return 0


def _side(args, profile, prompts, cloud_model: str, engine: str, device_model: str, protocols: List[str],
          extra: List[str], wire: Dict[str, dict]) -> List[dict]:
    """A cloud on `engine`, the emulated link, and one edge process running `protocols`."""
    print(f"hat-demo: starting the cloud ({cloud_model}, {engine}) ...", flush=True)
    # the link is CurveZMQ-encrypted, the demo device in the cloud's allow-list: keys made for this run
    with Rig(cloud_model, cloud_args=["--engine", engine], threads=args.threads, link=profile,
                 devices=["demo-device"], secure=True) as bed:
        print(f"hat-demo: {bed.cloud.ready_info}", flush=True)
        print(f"hat-demo: link {profile.name} ({profile.description}) at {bed.endpoint}", flush=True)
        prompts_file, edge_json = os.path.join(bed.dir, "prompts.json"), os.path.join(bed.dir, "edge.json")
        with open(prompts_file, "w", encoding="utf-8") as f:
            json.dump([p.to_json() for p in prompts], f)
        cmd = [sys.executable, "-m", "edge_runtime.cli", "generate", "--model", device_model,
               "--server", bed.endpoint, "--protocol", ",".join(protocols), "--prompts-file", prompts_file,
               "--max-new-tokens", str(args.max_new_tokens), "--temperature", str(args.temperature),
               "--top-p", str(args.top_p), "--seed", str(args.seed), "--threads", str(args.threads),
               "--backend", engine, "--json", edge_json, *extra, *cli_args(bed.security("demo-device"), "device")]
        rc = subprocess.call(cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        wire[",".join(protocols)] = bed.link.stats()
        if rc != 0:
            raise RuntimeError(f"the edge process failed (exit {rc})")
        with open(edge_json, encoding="utf-8") as f:  # in the run's directory: read before it goes
            return json.load(f)["results"]


if __name__ == "__main__":
    sys.exit(main())
