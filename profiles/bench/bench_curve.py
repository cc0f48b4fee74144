"""`hat-bench curve`: what CurveZMQ costs, encrypted against plaintext, measured side by side in one run.

1. The socket alone: two DEALER/ROUTER pairs over loopback TCP, one with CurveZMQ (fresh keys), one plaintext, a
   thread echoing on each. For each message size (`--sizes`: a verify of a few tokens, a sparse distribution, a dense
   float16 distribution, a chunk of hidden states) both pairs echo for `--socket-seconds` in turn, `--repeats` times
   alternating which goes first: round trips per second (each repeat's kept) and MB/s, and the ratio encrypted /
   plaintext per repeat with its 95 % interval, n and method (profiles.bench.stats: t below 8 repeats).
2. Requests: two clouds of the same model, one CurveZMQ (the device in its allow-list, as `hat-cloud serve` runs by
   default) and one `--plaintext`, an EdgeRuntime on each sharing the device's loaded model. For every prompt and
   protocol the two run in turn (the side that goes first alternates): tokens/s, time to first token and link bytes
   per token per side, and the per-prompt ratios encrypted / plaintext with 95 % intervals (n = prompts).
   The default model cuts at `--m` for `ushape`, whose hidden states are the protocol family with the most bytes on
   the link.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Dict, List, Tuple

from edge_runtime.config import EdgeConfig, EngineConfig, SplitConfig
from hat_split.math.sampling import SamplingParams
from hat_split.models.chat import encode
from hat_split.models.loading import load_model
from hat_split.prompt_sets import evaluation_prompts
from profiles.bench.bench_args import names, numbers
from profiles.bench.provenance import write_report
from profiles.bench.stats import ci_note, ci_text, interval, paired_ratio
from profiles.bench.rig import Rig

DEVICE = "curve-bench"
SIDES = ("curve", "plaintext")


def add_parser(sub) -> None:
    s = sub.add_parser("curve", help="CurveZMQ's cost: encrypted vs plaintext sockets and requests, side by side")
    s.add_argument("--model", default="smollm2-135m", help="the cloud's model, also the device's (draft and cut)")
    s.add_argument("--m", type=int, default=2, help="layers of the device's input part (ushape)")
    s.add_argument("--protocols", default="sd,llm,ushape")
    s.add_argument("--prompts", type=int, default=8)
    s.add_argument("--max-new-tokens", type=int, default=32)
    s.add_argument("--sizes", default="64,4096,65536,1048576", help="socket part: message sizes, bytes")
    s.add_argument("--socket-seconds", type=float, default=0.5, help="socket part: seconds per size, side and repeat")
    s.add_argument("--repeats", type=int, default=6, help="socket part: repeats per size")
    s.add_argument("--threads", type=int, default=1, help="torch threads of the cloud and of the device each")
    s.add_argument("--out", default="runs/bench_curve.json")


# -- the socket alone --------------------------------------------------------------------------------------------
def _pair(ctx, curve: bool):
    """A connected (DEALER, ROUTER) over loopback TCP, CurveZMQ or plaintext, and the ROUTER's echo thread."""
    import zmq

    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    if curve:
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        router.curve_server, router.curve_secretkey = True, server_secret
        dealer.curve_serverkey, dealer.curve_publickey, dealer.curve_secretkey = (server_public, client_public,
                                                                                  client_secret)
    for sock in (router, dealer):
        sock.linger = 0
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer.connect(f"tcp://127.0.0.1:{port}")

    def echo() -> None:
        while True:
            frames = router.recv_multipart(copy=False)
            if len(frames[1]) == 0:
                return
            router.send_multipart(frames, copy=False)

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    return dealer, router, thread


def _echo_for(dealer, payload: bytes, seconds: float) -> Tuple[int, float]:
    n, t0 = 0, time.perf_counter()
    while True:
        dealer.send(payload, copy=False)
        dealer.recv(copy=False)
        n += 1
        dt = time.perf_counter() - t0
        if dt >= seconds:
            return n, dt


def socket_part(sizes: List[int], seconds: float, repeats: int) -> dict:
    import zmq

    ctx = zmq.Context()
    pairs = {side: _pair(ctx, side == "curve") for side in SIDES}
    try:
        for dealer, _, _ in pairs.values():  # the handshake and first allocations, outside the timing
            _echo_for(dealer, b"x" * 64, 0.05)
        out = {}
        for size in sizes:
            payload = os.urandom(size)
            rates: Dict[str, List[float]] = {side: [] for side in SIDES}
            for r in range(repeats):
                for side in (SIDES if r % 2 == 0 else SIDES[::-1]):
                    n, dt = _echo_for(pairs[side][0], payload, seconds)
                    rates[side].append(n / dt)
            ratio = paired_ratio(rates["curve"], rates["plaintext"])
            out[str(size)] = {**{f"{side}_round_trips_per_s": sum(v) / len(v) for side, v in rates.items()},
                              **{f"{side}_round_trips_per_s_repeats": v for side, v in rates.items()},
                              **{f"{side}_mb_per_s": 2 * size * sum(v) / len(v) / 1e6 for side, v in rates.items()},
                              "ratio": ratio,
                              "curve_extra_us_per_round_trip": 1e6 * (1 / (sum(rates["curve"]) / repeats)
                                                                      - 1 / (sum(rates["plaintext"]) / repeats))}
            print(f"  socket {size:8d} B: curve {out[str(size)]['curve_round_trips_per_s']:9.0f} rt/s, plaintext "
                  f"{out[str(size)]['plaintext_round_trips_per_s']:9.0f} rt/s, "
                  f"ratio {ci_text(ratio, '{:.3f}', form='interval')}",
                  flush=True)
        return out
    finally:
        for dealer, router, thread in pairs.values():
            dealer.send(b"")  # an empty message ends the echo thread
            thread.join(5)
            dealer.close()
            router.close()
        ctx.term()


# -- requests ------------------------------------------------------------------------------------------------------
def request_part(args, protocols: List[str]) -> Tuple[Dict[str, Dict[str, list]], list]:
    loaded = load_model(args.model, dtype="float32", quiet=True)
    prompts = evaluation_prompts(args.prompts)
    ids = [encode(loaded.tokenizer, p.text, p.chat) for p in prompts]
    cloud_args = ["--dtype", "float32"]
    rows: Dict[str, Dict[str, list]] = {p: {side: [] for side in SIDES} for p in protocols}
    with Rig(args.model, cloud_args=cloud_args, threads=args.threads, secure=True, devices=[DEVICE]) as secure, \
            Rig(args.model, cloud_args=cloud_args, threads=args.threads) as plain:
        runtimes = {}
        for side, bed in (("curve", secure), ("plaintext", plain)):
            cfg = EdgeConfig(model=args.model, link=bed.link_config(DEVICE if side == "curve" else ""),
                             engine=EngineConfig(threads=args.threads, dtype="float32"),
                             split=SplitConfig(m=args.m, parallel_draft=False))
            runtimes[side] = bed.runtime(cfg, loaded)
            for protocol in protocols:  # warm-up: the handshake, first allocations on both sides
                runtimes[side].generate(ids[0], protocol, SamplingParams(0.0), 2, seed=0)
        for i, x in enumerate(ids):
            for protocol in protocols:
                for side in (SIDES if (i + protocols.index(protocol)) % 2 == 0 else SIDES[::-1]):
                    r = runtimes[side].generate(x, protocol, SamplingParams(0.0), args.max_new_tokens, seed=i)
                    rows[protocol][side].append({"tokens": r.n, "total_s": r.total_s, "ttft_s": r.ttft_s,
                                                 "tokens_per_s": r.summary()["tokens_per_s"],
                                                 "up_bytes": r.up_bytes, "down_bytes": r.down_bytes,
                                                 "text": r.text})
                    print(f"  {protocol:7s} prompt {i + 1}/{len(ids)} {side:9s}: {r.n} tokens, "
                          f"{r.summary()['tokens_per_s']:.2f} tok/s, TTFT {r.ttft_s * 1e3:.0f} ms", flush=True)
    return rows, [p.to_json() for p in prompts]


def summarise(rows: Dict[str, Dict[str, list]]) -> dict:
    """Per protocol: each side's mean tokens/s, TTFT and bytes per token with intervals, and the per-prompt ratios
    encrypted / plaintext (tokens/s, TTFT) with intervals; whether both sides generated the same text."""
    out = {}
    for protocol, sides in rows.items():
        c, p = sides["curve"], sides["plaintext"]
        entry = {side: {"tokens_per_s": interval([r["tokens_per_s"] for r in rs]),
                        "ttft_s": interval([r["ttft_s"] for r in rs]),
                        "up_bytes_per_token": sum(r["up_bytes"] for r in rs) / max(1, sum(r["tokens"] for r in rs)),
                        "down_bytes_per_token": sum(r["down_bytes"] for r in rs) / max(1, sum(r["tokens"] for r in rs))}
                 for side, rs in sides.items()}
        entry["tokens_per_s_ratio"] = paired_ratio([r["tokens_per_s"] for r in c], [r["tokens_per_s"] for r in p])
        entry["ttft_ratio"] = paired_ratio([r["ttft_s"] for r in c], [r["ttft_s"] for r in p])
        entry["same_text"] = f"{sum(a['text'] == b['text'] for a, b in zip(c, p))}/{len(c)}"
        out[protocol] = entry
    return out


def format_table(summary: dict) -> str:
    def ci(d: dict) -> str:
        return ci_text(d, "{:.3f}", form="interval", with_n=False)

    lines = [f"{'protocol':8s} {'tok/s curve':>12s} {'tok/s plain':>12s} {'tok/s ratio [95% CI]':>24s} "
             f"{'TTFT ms curve':>14s} {'TTFT ms plain':>14s} {'TTFT ratio [95% CI]':>24s} {'n':>3s}"]
    for protocol, e in summary.items():
        lines.append(f"{protocol:8s} {e['curve']['tokens_per_s']['mean']:12.2f} "
                     f"{e['plaintext']['tokens_per_s']['mean']:12.2f} {ci(e['tokens_per_s_ratio']):>24s} "
                     f"{e['curve']['ttft_s']['mean'] * 1e3:14.1f} {e['plaintext']['ttft_s']['mean'] * 1e3:14.1f} "
                     f"{ci(e['ttft_ratio']):>24s} {e['tokens_per_s_ratio']['n']:3d}")
    lines.append(ci_note(e[key] for e in summary.values() for key in ("tokens_per_s_ratio", "ttft_ratio")))
    return "\n".join(lines)


def run(args) -> int:
    protocols = names(args.protocols, ("sd", "hlm", "llm", "qs", "uhlm", "cuhlm", "ushape"), "protocol")
    sizes = numbers(args.sizes, int)
    if not protocols or args.prompts < 1 or args.max_new_tokens < 2 or not sizes or min(sizes) < 1 \
            or args.repeats < 2 or not args.socket_seconds > 0 or args.threads < 0:
        raise ValueError("need a protocol, --prompts >= 1, --max-new-tokens >= 2, sizes >= 1 byte, --repeats >= 2, "
                         "--socket-seconds > 0 and --threads >= 0")
    report: dict = {"settings": {k: v for k, v in vars(args).items() if k != "func"}}
    print("hat-bench curve: the socket alone (loopback TCP, echo) ...", flush=True)
    report["socket"] = socket_part(sizes, args.socket_seconds, args.repeats)
    print("hat-bench curve: requests, a CurveZMQ cloud and a plaintext cloud ...", flush=True)
    rows, prompts = request_part(args, protocols)
    report.update({"prompts": prompts, "runs": rows, "summary": summarise(rows)})
    write_report(args.out, report)
    print(format_table(report["summary"]))
    print(f"hat-bench curve: report saved to {args.out}")
    return 0
