"""`hat-bench fleet`: HAT's fleet evaluation (paper 004, §4.2-4.5, Fig. 6-12) on this machine, in one run.

A real cloud process serves the middle layers of a real model to N device processes, each a separate OS process with
its own link emulator (WiFi near / mid / far, HAT §4.1, round robin) and its own board speed (device compute
stretched ×1, ×1.5 or ×2: an Orin beside slower Xaviers), holding only its own parts of the model (the middle
layers are freed). Requests arrive as one Poisson process at the fleet's rate, each at a random device (a device
busy with an earlier request queues it); prompts are held-out ShareGPT conversation histories. TTFT is measured from
the request's arrival, so it includes a device's own queue.

Systems (HAT's baselines, §4.1), each against its own freshly started cloud:
  U-shape    ushape; the cloud computes each prompt in one step (iteration batching without chunked prefill)
  U-Sarathi  ushape; the cloud splits prompts into chunks inside its token budget beside decodes (Sarathi-style)
  HAT        hat: device-side prompt chunking, speculative decoding with the adapter, parallel drafting; the
             cloud batches as U-Sarathi
  HAT-noPD   HAT without parallel drafting (not in the default list): on one shared host the devices' extra draft
             steps take cores from the cloud, which separate boards would not
  SD         the token protocol sd with the same draft as HAT (output ∘ Λ ∘ input on the device, η = 0.6, at most 8
             drafts): tokens and draft distributions cross the link and the cloud verifies with the whole model,
             batched with the other devices' work; the device's draft prefill overlaps the cloud's

Three experiments share the systems and the arrival sequences (one sequence per (N, rate), the same for every system):
  sweep     N = --sweep-n, every rate in --rates: TTFT and TBT mean / P50 / P90 vs rate (Fig. 6-7), SLA compliance
            CDFs (Fig. 9-10), per-step cloud compute mean and standard deviation (Fig. 8)
  scale     N in --fleet-sizes at --scale-rate: the same figures per fleet size, and the server's own overhead per
            step (loop time outside model forwards) at the largest N
  pipeline  HAT at N = --sweep-n and --scale-rate on P = 1 and --pipeline-stages P (one gloo process per stage;
            Fig. 11-12), and the control: P = 1 with the P stages' threads
Writes JSON and a PNG beside it.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
import traceback
from typing import Dict, List, Optional

import numpy as np
import psutil

from edge_runtime.config import EdgeConfig, EngineConfig, LinkConfig, SplitConfig
from hat_split.files.figures import NO_MATPLOTLIB, pyplot, save_figure
from hat_split.math.sampling import SamplingParams
from hat_split.models.loading import load_model, load_tokenizer
from hat_split.models.partition import free_layers
from hat_split.prompt_sets import long_chat_prompts
from profiles.bench.bench_args import adapter_dir, names, numbers
from profiles.bench.stats import ci_text, interval, mean, percentile
from profiles.bench.rig import Rig
from testbed.links import get_link_profile
from profiles.bench.provenance import write_report

SYSTEMS = {  # name: (protocol, EdgeConfig fields with "split" / "engine" the SplitConfig / EngineConfig fields, cloud
    # arguments)
    "U-shape": ("ushape", {"split": {"chunking": "off"}}, ["--token-budget", "65536", "--prefill-floor", "0"]),
    "U-Sarathi": ("ushape", {"split": {"chunking": "off"}}, []),
    "HAT": ("hat", {"split": {"chunking": "auto", "parallel_draft": True}}, []),
    "HAT-noPD": ("hat", {"split": {"chunking": "auto", "parallel_draft": False}}, []),
    # the same draft w_S as HAT, the same η = 0.6 and at most 8 drafts, but tokens (and their draft distributions) on
    # the wire and the whole model in the cloud; prompts are prefilled by the cloud in Sarathi chunks
    "SD": ("sd", {"split": {}, "engine": {"token_draft": "adapter"}, "draft_len": 8, "draft_stop_prob": 0.6,
                  "overlap_prefill": "on"}, []),
}
LINKS = ("wifi-near", "wifi-mid", "wifi-far")
BOARDS = (("orin", 1.0), ("xavier-fast", 1.5), ("xavier", 2.0))  # (name, compute slowdown)


def add_parser(sub) -> None:
    s = sub.add_parser("fleet", help="HAT fleet evaluation: many device processes, Poisson arrivals, one cloud")
    s.add_argument("--model", default="smollm2-135m")
    s.add_argument("--m", type=int, default=2, help="layers of the device's input part")
    s.add_argument("--adapter", default="", help="hat-distill artifact (default runs/adapters/<model>-m<m>)")
    s.add_argument("--systems", default="U-shape,U-Sarathi,HAT,SD", help=f"of {', '.join(SYSTEMS)}")
    s.add_argument("--sweep-n", type=int, default=16, help="fleet size of the rate sweep and the pipeline runs")
    s.add_argument("--rates", default="0.1,0.2,0.4", help="fleet request rates of the sweep, requests/s")
    s.add_argument("--fleet-sizes", default="8,16,30")
    s.add_argument("--scale-rate", type=float, default=0.2, help="request rate of the scale and pipeline runs")
    s.add_argument("--pipeline-stages", default="2,4", help="HAT pipeline lengths beside P = 1, each with its control")
    s.add_argument("--experiments", default="sweep,scale,pipeline")
    s.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per run")
    s.add_argument("--max-new-tokens", type=int, default=32)
    s.add_argument("--prompts", type=int, default=24, help="pool of held-out ShareGPT prompts")
    s.add_argument("--min-prompt-tokens", type=int, default=64)
    s.add_argument("--max-prompt-tokens", type=int, default=512)
    s.add_argument("--ttft-sla", type=float, default=5.0, help="seconds; reported compliance (CDFs cover a range)")
    s.add_argument("--tbt-sla", type=float, default=1.0, help="seconds per token")
    s.add_argument("--threads", type=int, default=1, help="torch threads per cloud stage")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--out", default="runs/bench_fleet.json")


# -- one device process ------------------------------------------------------------------------------------------
def _device_main(index: int, conn, model: str, m: int, adapter: str) -> None:
    """A device: its parts of the model (middle layers freed), then runs of requests as the driver commands."""
    import torch

    torch.set_num_threads(1)
    loaded = load_model(model, dtype="float32", quiet=True)
    # the middle part runs in the cloud; layer m stays as the shape Λ (hat_split.models.adapter) is built on
    free_layers(loaded.model, range(m + 1, loaded.model.config.num_hidden_layers))
    conn.send(("ready", _rss_mb()))
    while True:
        cmd = conn.recv()
        if cmd is None:
            return
        try:
            conn.send(("done", _serve(index, conn, loaded, model, m, adapter, cmd)))
        except Exception as exc:  # reported to the driver, which stops the run with it
            conn.send(("error", f"device {index}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _serve(index: int, conn, loaded, model: str, m: int, adapter: str, cmd: dict) -> List[dict]:
    link = get_link_profile(LINKS[index % len(LINKS)])
    board, slowdown = BOARDS[(index // len(LINKS)) % len(BOARDS)]
    params = SamplingParams(0.0)
    rows = []
    with Rig(upstream=("127.0.0.1", cmd["port"]), link=link) as bed:  # the cloud is the driver's
        edge = dict(cmd["edge"])
        split = SplitConfig(m=m, adapter=adapter, up_bps=8 * link.rate("up"), down_bps=8 * link.rate("down"),
                            slowdown=slowdown, **edge.pop("split"))
        link_cfg = LinkConfig(bed.endpoint, device_id=f"device-{index}", security=bed.security(),
                              request_timeout_s=600.0)
        engine = EngineConfig(threads=1, dtype="float32", **edge.pop("engine", {}))
        cfg = EdgeConfig(model=model, link=link_cfg, engine=engine, split=split, **edge)
        rt = bed.runtime(cfg, loaded)
        rt.generate(cmd["warm_up"], cmd["protocol"], params, 4, seed=index)  # connect; the cloud's g() learns
        conn.send(("warm", None))
        t0 = conn.recv()  # the fleet's common clock start (time.time())
        for arrival, prompt_index in cmd["arrivals"]:
            at = t0 + arrival
            wait = at - time.time()
            if wait > 0:
                time.sleep(wait)
            started = time.time()
            r = rt.generate(cmd["prompts"][prompt_index], cmd["protocol"], params, cmd["max_new_tokens"],
                            seed=index)
            queue_s = started - at
            rows.append({"device": index, "link": link.name, "board": board, "arrival_s": arrival,
                         "queue_s": queue_s, "ttft_s": queue_s + r.ttft_s,
                         "tbt_s": (r.total_s - r.ttft_s) / (r.n - 1) if r.n > 1 else None,
                         "prompt_tokens": r.prompt_tokens, "tokens": r.n, "rounds": r.rounds,
                         "accepted": r.accepted, "drafted": r.drafted, "chunks": r.prefill_chunks,
                         "cloud_compute_s": r.cloud_compute_s, "device_compute_s": r.device_compute_s,
                         "finished_s": time.time() - t0})
    return rows


def _rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2 ** 20


# -- the driver --------------------------------------------------------------------------------------------------
class Fleet:
    """N device processes, started once and reused by every run."""

    def __init__(self, n: int, model: str, m: int, adapter: str):
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for i in range(n):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_device_main, args=(i, child, model, m, adapter), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        self.rss_mb = [self._expect(c, "ready", 900) for c in self.conns]

    @staticmethod
    def _expect(conn, kind: str, timeout: float):
        if not conn.poll(timeout):
            raise RuntimeError(f"a device did not answer {kind!r} within {timeout:.0f} s")
        got, value = conn.recv()
        if got == "error":
            raise RuntimeError(value)
        if got != kind:
            raise RuntimeError(f"a device answered {got!r} where {kind!r} was expected")
        return value

    def run(self, n: int, cmd: dict, arrivals: List[tuple], timeout: float) -> List[dict]:
        """Requests `arrivals` [(time, device, prompt)] on the first n devices; every request's row."""
        for i in range(n):
            mine = [(t, p) for t, d, p in arrivals if d == i]
            self.conns[i].send(dict(cmd, arrivals=mine))
        for i in range(n):
            self._expect(self.conns[i], "warm", 600)
        t0 = time.time() + 0.5
        for i in range(n):
            self.conns[i].send(t0)
        rows: List[dict] = []
        for i in range(n):
            rows += self._expect(self.conns[i], "done", timeout)
        return rows

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(None)
            except OSError:
                pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def poisson_arrivals(rate: float, duration: float, n_devices: int, n_prompts: int, seed: int) -> List[tuple]:
    """(arrival time s, device, prompt index) of a Poisson process at `rate` over `duration` seconds."""
    rng = np.random.default_rng(seed)
    out, t = [], float(rng.exponential(1.0 / rate))
    while t < duration:
        out.append((t, int(rng.integers(n_devices)), int(rng.integers(n_prompts))))
        t += float(rng.exponential(1.0 / rate))
    return out


def summarise(rows: List[dict], cloud: dict, ttft_sla: float, tbt_sla: float) -> dict:
    ttft = [r["ttft_s"] for r in rows]
    tbt = [r["tbt_s"] for r in rows if r["tbt_s"] is not None]
    log = cloud.get("steps", {}).get("step_log", [])
    compute = [c for _, _, c in log]
    out = {"requests": len(rows), "tokens": sum(r["tokens"] for r in rows),
           "makespan_s": max((r["finished_s"] for r in rows), default=0.0),
           "ttft_mean_s": mean(ttft), "ttft_p50_s": percentile(ttft, 50),
           "ttft_p90_s": percentile(ttft, 90), "tbt_mean_s": mean(tbt),
           "tbt_p50_s": percentile(tbt, 50), "tbt_p90_s": percentile(tbt, 90),
           "queue_mean_s": mean([r["queue_s"] for r in rows]),
           "ttft_sla_met": mean([t <= ttft_sla for t in ttft]),
           "tbt_sla_met": mean([t <= tbt_sla for t in tbt]),
           "step_compute_mean_s": mean(compute),
           "step_compute_std_s": float(np.std(compute)) if compute else None,
           "step_tokens_mean": mean([t for t, _, _ in log]),
           "steps": cloud.get("steps", {}).get("steps"), "server_overhead": cloud.get("overhead"),
           "stage_compute_s": cloud.get("steps", {}).get("stage_s"),
           "ttft_sorted_s": sorted(ttft), "tbt_sorted_s": sorted(tbt)}
    drafted = sum(r["rounds"] for r in rows) - len(rows)
    if drafted > 0:
        out["tokens_per_round"] = (out["tokens"] - len(rows)) / drafted
    out["throughput_tok_s"] = out["tokens"] / out["makespan_s"] if out["makespan_s"] else None
    out["ttft_mean_ci"], out["tbt_mean_ci"] = interval(ttft), interval(tbt)  # 95 % over requests (stats.mean_ci)
    return out


def plan_runs(args, systems, experiments, rates, sizes, stages) -> List[tuple]:
    """(experiment, system, N, rate, pipeline P, threads per stage) per run. The pipeline experiment runs HAT at P = 1
    and at each P, and its control: for each P, HAT on one stage with P times the threads, so a gain from stages is
    not a gain from more threads. A configuration another experiment already ran is not run again (`run`)."""
    one = args.threads
    runs = []
    if "sweep" in experiments:
        runs += [("sweep", s, args.sweep_n, r, 1, one) for r in rates for s in systems]
    if "scale" in experiments:
        runs += [("scale", s, n, args.scale_rate, 1, one) for n in sizes for s in systems]
    if "pipeline" in experiments and "HAT" in systems:
        runs.append(("pipeline", "HAT", args.sweep_n, args.scale_rate, 1, one))  # the baseline the stages divide
        for p in stages:
            runs += [("pipeline", "HAT", args.sweep_n, args.scale_rate, p, one),
                     ("pipeline-control", "HAT", args.sweep_n, args.scale_rate, 1, p * one)]
    return runs


def run(args) -> int:
    systems = names(args.systems, SYSTEMS, "system")
    experiments = names(args.experiments, ("sweep", "scale", "pipeline"), "experiment")
    rates = numbers(args.rates)
    sizes = numbers(args.fleet_sizes, int)
    stages = numbers(args.pipeline_stages, int)
    if min(rates + [args.scale_rate]) <= 0 or min(sizes + [args.sweep_n]) < 1 or (stages and min(stages) < 2):
        raise ValueError("rates must be > 0, fleet sizes >= 1 and pipeline lengths >= 2")
    adapter = adapter_dir(args.adapter, args.model, args.m,
                          any(SYSTEMS[x][0] == "hat" or "token_draft" in SYSTEMS[x][1] for x in systems))

    runs = plan_runs(args, systems, experiments, rates, sizes, stages)
    n_max = max(r[2] for r in runs)

    tok = load_tokenizer(args.model)
    prompts = long_chat_prompts(tok, args.prompts + 1, args.min_prompt_tokens, args.max_prompt_tokens)
    warm_up, prompts = prompts[0][:48], prompts[1:]
    report: dict = {"args": vars(args), "adapter": adapter, "prompt_tokens": [len(p) for p in prompts],
                    "runs": [], "links": LINKS, "boards": BOARDS}
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    t_start = time.perf_counter()
    print(f"hat-bench fleet: starting {n_max} device processes", flush=True)
    fleet = Fleet(n_max, args.model, args.m, adapter)
    report["device_rss_mb"] = fleet.rss_mb
    done: Dict[tuple, dict] = {}
    try:
        for k, (exp, system, n, rate, pipeline, threads) in enumerate(runs):
            key = (system, n, rate, pipeline, threads)
            if key in done:  # the same configuration already ran in another experiment
                report["runs"].append(dict(done[key], experiment=exp))
                continue
            protocol, fields, cloud_args = SYSTEMS[system]
            arrivals = poisson_arrivals(rate, args.duration, n, len(prompts), args.seed + 1000 * n + int(rate * 1e4))
            stats_path = os.path.join(out_dir, f".fleet_cloud_{k}.json")
            extra = ["--dtype", "float32", "--stats-json", stats_path, "--max-sessions", str(max(64, 2 * n)),
                     *cloud_args] + (["--pipeline", str(pipeline)] if pipeline > 1 else [])
            cmd = {"protocol": protocol, "edge": fields, "warm_up": warm_up, "prompts": prompts,
                   "max_new_tokens": args.max_new_tokens}
            t0 = time.perf_counter()
            with Rig(args.model, cloud_args=extra, threads=threads) as bed:
                rows = fleet.run(n, dict(cmd, port=bed.cloud.port), arrivals, timeout=args.duration * 20 + 600)
            cloud_stats = {}
            if os.path.exists(stats_path):
                with open(stats_path, encoding="utf-8") as f:
                    cloud_stats = json.load(f)
                os.remove(stats_path)
            summary = summarise(rows, cloud_stats, args.ttft_sla, args.tbt_sla)
            entry = {"experiment": exp, "system": system, "devices": n, "rate": rate, "pipeline": pipeline,
                     "threads_per_stage": threads, "total_threads": threads * pipeline,
                     "arrivals": len(arrivals), "wall_s": time.perf_counter() - t0, "summary": summary,
                     "requests": rows, "cloud": {k2: v for k2, v in cloud_stats.items() if k2 != "steps"},
                     "cloud_steps": {k2: v for k2, v in cloud_stats.get("steps", {}).items() if k2 != "step_log"}}
            done[key] = entry
            report["runs"].append(entry)
            print(_line(entry), flush=True)
            _write(args.out, report, t_start)
    finally:
        fleet.close()
    _write(args.out, report, t_start)
    print_tables(report)
    note = plot(os.path.splitext(args.out)[0] + ".png", report)
    print(f"hat-bench fleet: {report['seconds']:.0f} s; wrote {args.out}" + (f" ({note})" if note else ""))
    return 0


def _write(path: str, report: dict, t_start: float) -> None:
    report["seconds"] = time.perf_counter() - t_start
    write_report(path, report)


def _ms(x: Optional[float]) -> str:
    return "   -   " if x is None else f"{x * 1e3:7.0f}"


def _mean_ms(mean_s: Optional[float], ci: Optional[dict]) -> str:
    """A mean in ms with its interval's larger half-width, n and method (stats.ci_text); the mean alone without one."""
    return f" {ci_text(ci, '{:.0f}', 1e3):>6s}" if ci and ci["mean"] is not None else _ms(mean_s)


def _line(e: dict) -> str:
    s = e["summary"]
    over = s["server_overhead"]
    return (f"  {e['experiment']:8s} {e['system']:9s} N={e['devices']:2d} rate={e['rate']:.2f}/s P={e['pipeline']} "
            f"threads={e.get('total_threads', e['pipeline'])} "
            f"{s['requests']:3d}/{e['arrivals']:3d} req  "
            f"TTFT mean/P50/P90 {_mean_ms(s['ttft_mean_s'], s.get('ttft_mean_ci'))}{_ms(s['ttft_p50_s'])}"
            f"{_ms(s['ttft_p90_s'])} ms  TBT {_mean_ms(s['tbt_mean_s'], s.get('tbt_mean_ci'))}{_ms(s['tbt_p50_s'])}"
            f"{_ms(s['tbt_p90_s'])} ms  "
            f"step {_ms(s['step_compute_mean_s'])}±{_ms(s['step_compute_std_s']).strip()} ms "
            f"({s['step_tokens_mean'] or 0:.0f} tok)  overhead "
            f"{'-' if over is None else f'{100 * over:.1f}%'}  [{e['wall_s']:.0f} s]")


def print_tables(report: dict) -> None:
    print("\n experiment system    N  rate  P  threads  req  TTFT mean/P50/P90 ms        TBT mean/P50/P90 ms         "
          "step compute mean±std ms  overhead")
    for e in report["runs"]:
        print(_line(e))


def plot(path: str, report: dict) -> str:
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    runs = report["runs"]
    fig, axes = plt.subplots(2, 3, figsize=(16, 9))
    sweep = [e for e in runs if e["experiment"] == "sweep"]
    systems = list(dict.fromkeys(e["system"] for e in runs))
    for system in systems:
        pts = sorted((e["rate"], e["summary"]) for e in sweep if e["system"] == system)
        if pts:
            for ax, key in ((axes[0, 0], "ttft"), (axes[0, 1], "tbt")):
                ax.errorbar([r for r, _ in pts], [s[f"{key}_p50_s"] for _, s in pts],
                            yerr=[[0.0] * len(pts), [s[f"{key}_p90_s"] - s[f"{key}_p50_s"] for _, s in pts]],
                            marker="o", capsize=3, label=system)
    axes[0, 0].set(title="TTFT P50 (bar to P90) vs request rate (Fig. 6)", xlabel="requests/s", ylabel="s")
    axes[0, 1].set(title="TBT P50 (bar to P90) vs request rate (Fig. 7)", xlabel="requests/s", ylabel="s/token")
    scale = [e for e in runs if e["experiment"] == "scale"]
    sizes = sorted({e["devices"] for e in scale})
    width = 0.8 / max(len(systems), 1)
    for j, system in enumerate(systems):
        by_n = {e["devices"]: e["summary"] for e in scale if e["system"] == system}
        xs = [i + j * width for i, n in enumerate(sizes) if n in by_n]
        if xs:
            axes[0, 2].bar(xs, [by_n[n]["step_compute_mean_s"] or 0 for n in sizes if n in by_n], width,
                           yerr=[[min(by_n[n]["step_compute_mean_s"] or 0, by_n[n]["step_compute_std_s"] or 0)
                                  for n in sizes if n in by_n],  # a time is never below 0: clip the lower bar
                                 [by_n[n]["step_compute_std_s"] or 0 for n in sizes if n in by_n]], capsize=3,
                           label=system)
    axes[0, 2].set_xticks(np.arange(len(sizes)) + 0.4 - width / 2)
    axes[0, 2].set_xticklabels([f"N={n}" for n in sizes])
    axes[0, 2].set(title="cloud compute per step, mean ± std (Fig. 8)", ylabel="s")
    mid = sorted({e["rate"] for e in sweep})
    at = mid[len(mid) // 2] if mid else None
    for system in systems:
        for e in sweep:
            if e["system"] == system and e["rate"] == at:
                for ax, key in ((axes[1, 0], "ttft_sorted_s"), (axes[1, 1], "tbt_sorted_s")):
                    v = e["summary"][key]
                    if v:
                        ax.step(v, np.arange(1, len(v) + 1) / len(v), where="post", label=system)
    axes[1, 0].set(title=f"SLA compliance, prefill (Fig. 9): CDF of TTFT at {at}/s", xlabel="TTFT SLA (s)",
                   ylabel="fraction of requests met")
    axes[1, 1].set(title=f"SLA compliance, decode (Fig. 10): CDF of TBT at {at}/s", xlabel="TBT SLA (s/token)",
                   ylabel="fraction of requests met")
    pipe = sorted((e["pipeline"], e["summary"]) for e in runs
                  if e["system"] == "HAT" and e["devices"] == report["args"]["sweep_n"]
                  and e["rate"] == report["args"]["scale_rate"] and e["experiment"] != "pipeline-control")
    control = sorted((e["total_threads"] // max(1, report["args"]["threads"]), e["summary"]) for e in runs
                     if e["experiment"] == "pipeline-control")
    if control:  # P = 1 with the threads of P stages, drawn at that P
        axes[1, 2].plot([p for p, _ in control], [s["ttft_mean_s"] for _, s in control], "x", ms=9,
                        label="TTFT mean, P = 1 with the same threads")
        axes[1, 2].plot([p for p, _ in control], [s["tbt_mean_s"] for _, s in control], "+", ms=9,
                        label="TBT mean, P = 1 with the same threads")
    pipe = list({p: s for p, s in pipe}.items())
    if pipe:
        axes[1, 2].plot([p for p, _ in pipe], [s["ttft_mean_s"] for _, s in pipe], "o-", label="TTFT mean")
        axes[1, 2].plot([p for p, _ in pipe], [s["tbt_mean_s"] for _, s in pipe], "s-", label="TBT mean")
    axes[1, 2].set(title="HAT vs pipeline length (Fig. 11-12)", xlabel="stages P", ylabel="s")
    return save_figure(fig, axes, path, 8)
