"""`hat-profile sweep`: draft speed and energy on this device for each power mode × draft backend × draft length.

For each power mode asked for (nvpmodel -m, root on a Jetson; the mode is verified and the original one restored at
the end), each draft backend (torch with --model, or a hat-export --bundle's artifacts on onnxruntime / TensorRT) and
each draft length L, the draft does what it does in speculative decoding: from a fixed prompt it drafts L tokens one
forward at a time (greedy, logits to the host), then its cache is cropped back to the prompt as after a rejection;
`--rounds` such drafts per cell. The power sampler (hardware.power) runs beside the workload; per cell: draft
tokens/s, per-token latency mean / P50 / P90, mean power, joules per token and CPU load.

What cannot run here is recorded, not invented: a mode that cannot be set (not a Jetson, not root, needs a reboot)
gets its reason and no cells; power and energy are None with the sampler's reason when no power monitor exists.
Writes JSON and a PNG beside it.
"""
from __future__ import annotations

import os
import time
from typing import Dict, List, Optional, Tuple

import numpy as np

from edge_runtime.backends.loader import open_bundle
from edge_runtime.config import EdgeConfig, EngineConfig
from hat_split.files.figures import NO_MATPLOTLIB, pyplot, save_figure
from hat_split.models.lm import CausalLM
from hat_split.models.loading import load_model
from profiles.bench.bench_args import numbers
from profiles.bench.stats import percentile
from hardware import jetson_control as J
from hardware.device_profiles import get_profile
from hardware.power import open_sampler
from profiles.bench.provenance import write_report

PROMPT = ("def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n    out = []\n"
          "    i = j = 0\n    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:\n")


def add_arguments(s) -> None:
    s.add_argument("--profile", default="", help="device profile (hat-profile list; default: detect this board)")
    s.add_argument("--modes", default="current",
                   help="power modes by id or name, comma separated; 'all' (the profile's), or 'current' (no switch)")
    s.add_argument("--allow-reboot-modes", action="store_true",
                   help="also try modes that need a reboot (nvpmodel would reboot the board: off by default)")
    s.add_argument("--backends", default="torch",
                   help="torch (--model) and/or onnxruntime:PRECISION / tensorrt:PRECISION (--bundle), comma separated")
    s.add_argument("--model", default="smollm2-135m")
    s.add_argument("--bundle", default="")
    s.add_argument("--draft-lengths", default="1,4,8")
    s.add_argument("--rounds", type=int, default=8, help="drafts per cell")
    s.add_argument("--prompt-tokens", type=int, default=64)
    s.add_argument("--threads", type=int, default=0, help="threads of every backend (0: its default)")
    s.add_argument("--settle-s", type=float, default=2.0, help="seconds after a mode switch before measuring")
    s.add_argument("--interval-s", type=float, default=0.05, help="power sampling interval")
    s.add_argument("--out", default="runs/profile_sweep.json")


def _decoders(args, backends: List[Tuple[str, str]]):
    """(label, lm, tokenizer) per backend; the LMs have CausalLM's interface (forward / crop / new_state)."""
    out = []
    for backend, precision in backends:
        if backend == "torch":
            if args.threads:
                import torch

                torch.set_num_threads(args.threads)
            loaded = load_model(args.model, dtype="float32")
            out.append(("torch fp32", CausalLM(loaded.model), loaded.tokenizer))
        else:
            engine = EngineConfig(backend=backend, bundle=args.bundle, precision=precision or "fp32",
                                  threads=args.threads)
            cfg = EdgeConfig(model=args.bundle, engine=engine)
            bundle = open_bundle(cfg)
            lm = bundle.draft_lm()
            out.append((f"{backend} {cfg.engine.precision}", lm, bundle.tokenizer))
    return out


def draft_cell(lm, prompt: List[int], length: int, rounds: int) -> dict:
    """`rounds` drafts of `length` tokens from the prompt's cache, each cropped away after; per-token latencies."""
    state = lm.new_state()
    logits = lm.forward(state, prompt, n_logits=1)
    base = state.length
    lat: List[float] = []
    t_start = time.perf_counter()
    for _ in range(rounds):
        row = logits[-1]
        for _ in range(length):
            t0 = time.perf_counter()
            row = lm.forward(state, [int(np.argmax(row))], n_logits=1)[-1]
            lat.append(time.perf_counter() - t0)
        lm.crop(state, base)
    t_end = time.perf_counter()
    a = np.asarray(lat)
    return {"t0": t_start, "t1": t_end, "tokens": len(lat), "tokens_per_s": len(lat) / float(a.sum()),
            "latency_mean_ms": 1e3 * float(a.mean()), "latency_p50_ms": 1e3 * percentile(a, 50),
            "latency_p90_ms": 1e3 * percentile(a, 90)}


def _modes(args, profile) -> List[Tuple[Optional[int], str]]:
    """(id, label) to visit; id None: the current mode, unswitched."""
    if args.modes == "current":
        return [(None, "current")]
    if profile is None:
        raise ValueError("--modes other than 'current' need a device profile (--profile, or a board hatspec detects)")
    if args.modes == "all":
        return [(m.id, m.name) for m in profile.modes]
    return [(profile.mode(k.strip()).id, profile.mode(k.strip()).name) for k in args.modes.split(",") if k.strip()]


def run(args) -> int:
    lengths = numbers(args.draft_lengths, int)
    if not lengths or min(lengths) < 1 or args.rounds < 1:
        raise ValueError("draft lengths and rounds must be >= 1")
    backends = []
    for item in [x.strip() for x in args.backends.split(",") if x.strip()]:
        backend, _, precision = item.partition(":")
        if backend not in ("torch", "onnxruntime", "tensorrt"):
            raise ValueError(f"unknown backend {backend!r}; use torch, onnxruntime:P or tensorrt:P")
        if backend != "torch" and not args.bundle:
            raise ValueError(f"backend {backend} needs --bundle")
        backends.append((backend, precision))
    report: dict = {"args": vars(args), "device": {}, "modes": []}
    try:
        board = J.detect_board()
        report["device"]["board"] = {"model": board.model, "l4t": board.l4t, "profile": board.profile}
    except J.JetsonControlError as exc:
        board = None
        report["device"]["board"] = {"unavailable": str(exc)}
    name = args.profile or (board.profile if board else "")
    profile = get_profile(name) if name else None
    report["device"]["profile"] = profile.name if profile else None
    try:
        original = J.query_mode()
        report["device"]["mode_at_start"] = {"name": original[0], "id": original[1]}
    except J.JetsonControlError as exc:
        original = None
        report["device"]["mode_at_start"] = {"unavailable": str(exc)}
    modes = _modes(args, profile)
    if original is None and any(m is not None for m, _ in modes):  # modes cannot be switched here: measure what is
        modes = [(None, "current")] + modes  # (each named mode is then recorded with the reason)
    decoders = _decoders(args, backends)
    tokenizer = decoders[0][2]
    ids = tokenizer(PROMPT)["input_ids"]
    prompt = (ids * (args.prompt_tokens // len(ids) + 1))[:args.prompt_tokens]
    for _, lm, _ in decoders:  # warm-up: first-call allocations are not measured
        draft_cell(lm, prompt[:8], 2, 1)
    sampler = open_sampler(interval_s=args.interval_s)
    report["sampler"] = sampler.describe()
    print(f"hat-profile sweep: sampler {sampler.backend.name} (power: {sampler.backend.power_source}); "
          f"{len(modes)} mode(s) × {len(decoders)} backend(s) × {len(lengths)} draft length(s)", flush=True)
    t_start = time.perf_counter()
    try:
        with sampler:
            for mode_id, label in modes:
                entry: dict = {"mode": label, "id": mode_id, "cells": []}
                report["modes"].append(entry)
                if mode_id is not None:
                    if profile.mode(mode_id).reboot and not args.allow_reboot_modes:
                        entry["unavailable"] = "switching to this mode needs a reboot (--allow-reboot-modes)"
                        print(f"  mode {label}: skipped ({entry['unavailable']})", flush=True)
                        continue
                    try:
                        J.set_mode(mode_id, reboot=args.allow_reboot_modes)
                    except J.JetsonControlError as exc:
                        entry["unavailable"] = str(exc)
                        print(f"  mode {label}: not measured ({exc})", flush=True)
                        continue
                    time.sleep(args.settle_s)
                for backend, lm, _ in decoders:
                    for length in lengths:
                        cell = draft_cell(lm, prompt, length, args.rounds)
                        w = sampler.window(cell.pop("t0"), cell.pop("t1"))
                        cell.update(backend=backend, draft_len=length, power_mw=w["power_mw"],
                                    cpu_pct=w["cpu_pct"], samples=w["samples"],
                                    energy_per_token_j=(None if w["energy_j"] is None
                                                        else w["energy_j"] / cell["tokens"]))
                        entry["cells"].append(cell)
                        power = "-" if cell["power_mw"] is None else f"{cell['power_mw']:.0f} mW"
                        print(f"  mode {label:12s} {backend:18s} L={length:2d}: {cell['tokens_per_s']:7.1f} tok/s, "
                              f"{cell['latency_mean_ms']:6.1f} ms/token, power {power}", flush=True)
    finally:
        if original is not None and any(m is not None for m, _ in modes):
            try:
                J.set_mode(original[1])
                report["device"]["mode_restored"] = original[0]
            except J.JetsonControlError as exc:
                report["device"]["mode_restored"] = f"failed: {exc}"
    report["seconds"] = time.perf_counter() - t_start
    write_report(args.out, report)
    note = plot(os.path.splitext(args.out)[0] + ".png", report)
    print(f"hat-profile sweep: {report['seconds']:.0f} s; wrote {args.out}" + (f" ({note})" if note else ""))
    return 0


def plot(path: str, report: dict) -> str:
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for entry in report["modes"]:
        series: Dict[str, List[dict]] = {}
        for c in entry["cells"]:
            series.setdefault(c["backend"], []).append(c)
        for backend, cells in series.items():
            xs = [c["draft_len"] for c in cells]
            axes[0].plot(xs, [c["tokens_per_s"] for c in cells], marker="o", label=f"{entry['mode']} {backend}")
            energy = [c["energy_per_token_j"] for c in cells]
            if all(e is not None for e in energy):
                axes[1].plot(xs, energy, marker="o", label=f"{entry['mode']} {backend}")
    axes[0].set(xlabel="draft length L", ylabel="draft tokens/s", title="draft speed")
    unavailable = report.get("sampler", {}).get("unavailable", {}).get("power")
    axes[1].set(xlabel="draft length L", ylabel="J / token",
                title="energy per token" + (" (power not measurable here)" if unavailable else ""))
    return save_figure(fig, axes, path, 7)
