"""`hat-bench soak`'s verdicts: every answer against the model's greedy continuation, the summary of a run, its
printed table and its figure (pure: no processes, no models; profiles.bench.soak runs the soak).

Latencies are summarised over requests: P50 / P90 / P99, and the mean with its 95 % interval, n and method (the rule of
profiles.bench.stats: a bootstrap from 8 requests, a t interval below; each
"<key>_ci" beside its "<key>": {"mean", "lo", "hi", "n"}, lo and hi None below two requests)."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from hat_split.files.figures import NO_MATPLOTLIB, pyplot, save_figure
from profiles.bench.stats import ci_text, interval, percentiles

NEAR_TIE = 0.01  # logits: a reference whose top two are this close may flip with float rounding (batched vs alone)


# -- checking an answer (pure) ---------------------------------------------------------------------------------
def compare(got: Sequence[int], ref: Sequence[int], upto: Optional[int] = None) -> dict:
    """Tokens against the reference (up to index `upto` when the rest is not the reference's to decide): "exact", or
    where they part and how: "duplicated" (a run of earlier tokens repeated), "lost" (a run of the reference
    skipped), "other" (a different token)."""
    n = len(got) if upto is None else min(upto, len(got))
    ref_n = len(ref) if upto is None else min(upto, len(ref))
    d = next((i for i in range(min(n, ref_n)) if got[i] != ref[i]), min(n, ref_n))
    if d == n == ref_n:
        return {"match": "exact"}
    if upto is None and d == len(got) < len(ref):
        return {"match": "lost", "at": d, "run": len(ref) - d}  # ended early
    if upto is None and d == len(ref) < len(got):
        return {"match": "duplicated", "at": d, "run": len(got) - d}  # went on past the reference's end
    for k in range(1, 9):
        if d >= k and list(got[d:d + k]) == list(got[d - k:d]) and list(got[d + k:n]) == list(ref[d:n - k]):
            return {"match": "duplicated", "at": d, "run": k}
        if list(got[d:n]) == list(ref[d + k:n + k]):
            return {"match": "lost", "at": d, "run": k}
    return {"match": "other", "at": d}


def check(rec: dict, ref: Optional[List[int]], max_tokens: int, eos: Sequence[int], decode) -> dict:
    """One request's verdict: completed or lost, delivery consistent, tokens against the reference."""
    r = rec["response"]
    completed = r["error"] is None and r["done"] and r["finals"] == 1 and r["hatspec"] is not None
    out = {"completed": completed, "error": r["error"], "finals": r["finals"]}
    if not completed:
        return out
    tokens = r["hatspec"].get("tokens", [])
    degraded = r["hatspec"].get("degraded", [])
    full = len(tokens) == max_tokens or (tokens and tokens[-1] in eos)
    out.update(
        tokens=len(tokens), interruptions=r["hatspec"].get("interruptions", 0), degraded=len(degraded),
        queue_s=r["hatspec"].get("queue_s", 0.0),
        delivered=("".join(r["deltas"]) == decode(tokens)) and (r["usage"] or {}).get("completion_tokens") ==
        len(tokens) and full,
        reference=compare(tokens, ref, degraded[0] if degraded else None) if ref is not None
        else {"match": "unchecked"})
    return out


def slope_mb_per_min(samples: List[tuple]) -> Optional[float]:
    """Least-squares slope of (seconds, MB) samples, in MB per minute."""
    if len(samples) < 3:
        return None
    t, mb = np.array(samples, dtype=float).T
    return float(np.polyfit(t / 60.0, mb, 1)[0])


def latencies(done: List[dict]) -> tuple:
    """(TTFT of each completed answer, its mean time between tokens), seconds."""
    ttft = [r["response"]["times"][0] for r in done if r["response"]["times"]]
    tbt = [(r["response"]["times"][-1] - r["response"]["times"][0]) / (r["verdict"]["tokens"] - 1)
           for r in done if r["verdict"]["tokens"] > 1 and r["response"]["times"]]
    return ttft, tbt


def latency_entries(key: str, values: Sequence[float]) -> dict:
    """{key: percentiles, key + "_ci": the mean's interval} of one latency over requests."""
    return {key: percentiles(values), f"{key}_ci": interval(values)}


def hostile_sides(records: List[dict]) -> dict:
    """The well-behaved devices' answers without and with the hostile device on (by arrival): completed, lost, TTFT
    and TBT percentiles and mean intervals; and the P99 TTFT ratio (with / without)."""
    out: Dict[str, Any] = {}
    for side, on in (("without", False), ("with", True)):
        mine = [r for r in records if r.get("hostile_on") == on]
        done = [r for r in mine if r["verdict"]["completed"]]
        ttft, tbt = latencies(done)
        out[side] = {"requests": len(mine), "completed": len(done), "lost": len(mine) - len(done),
                     **latency_entries("ttft_s", ttft), **latency_entries("tbt_s", tbt)}
    p99 = [out[s]["ttft_s"]["p99"] for s in ("without", "with")]
    out["p99_ttft_ratio"] = p99[1] / p99[0] if None not in p99 and p99[0] else None
    return out


def summarise(records: List[dict], cuts: List[dict], memory: List[dict], load_end_s: float) -> dict:
    done = [r for r in records if r["verdict"]["completed"]]
    matches = [r["verdict"]["reference"]["match"] for r in done]
    ttft, tbt = latencies(done)
    hit = [r for r in done if r["verdict"]["interruptions"]]
    calm = [r for r in done if not r["verdict"]["interruptions"]]
    mem: Dict[str, dict] = {}
    for name in sorted({k for m in memory for k in m["rss_mb"]}):
        series = [(m["t"], m["rss_mb"][name]) for m in memory if name in m["rss_mb"]]
        under_load = [(t, v) for t, v in series if t <= load_end_s]
        mem[name] = {"first_mb": series[0][1], "last_mb": series[-1][1], "max_mb": max(v for _, v in series),
                     "slope_mb_per_min": slope_mb_per_min(under_load),
                     "slope_second_half_mb_per_min": slope_mb_per_min(under_load[len(under_load) // 2:])}
    return {
        "requests": len(records), "completed": len(done), "lost": len(records) - len(done),
        "lost_errors": [r["verdict"]["error"] for r in records if not r["verdict"]["completed"]][:20],
        "duplicated": sum(m == "duplicated" for m in matches) + sum(r["verdict"]["finals"] > 1 for r in records),
        "lost_tokens": sum(m == "lost" for m in matches),
        "delivery_inconsistent": sum(not r["verdict"]["delivered"] for r in done),
        "reference_exact": sum(m == "exact" for m in matches), "reference_other": sum(m == "other" for m in matches),
        "reference_other_near_tie": sum(r["verdict"]["reference"].get("near_tie", False) for r in done),
        # an answer that differs from its reference where the reference had no near tie: a wrong answer
        "reference_wrong": sum(m == "other" and not r["verdict"]["reference"].get("near_tie", False)
                               for m, r in zip(matches, done)),
        "interrupted_requests": len(hit), "interruptions": sum(r["verdict"]["interruptions"] for r in done),
        "degraded_requests": sum(bool(r["verdict"]["degraded"]) for r in done),
        "degraded_tokens": sum(r["verdict"]["degraded"] for r in done),
        "tokens": sum(r["verdict"]["tokens"] for r in done),
        "cuts": len(cuts), "cuts_long": sum(c["long"] for c in cuts),
        "cuts_by_mode": {m: sum(c["mode"] == m for c in cuts) for m in ("reset", "stall")},
        "cuts_during_a_request": sum(c["busy"] for c in cuts),
        **latency_entries("ttft_s", ttft), **latency_entries("tbt_s", tbt),
        # waiting behind the device's earlier request
        **latency_entries("queue_s", [r["verdict"]["queue_s"] for r in done]),
        **latency_entries("ttft_after_queue_s", [r["response"]["times"][0] - r["verdict"]["queue_s"] for r in done
                                                 if r["response"]["times"]]),
        **latency_entries("ttft_s_interrupted", [r["response"]["times"][0] for r in hit if r["response"]["times"]]),
        **latency_entries("ttft_s_uninterrupted", [r["response"]["times"][0] for r in calm
                                                   if r["response"]["times"]]),
        "by_protocol": {p: {"completed": sum(r["protocol"] == p for r in done),
                            "exact": sum(r["protocol"] == p and r["verdict"]["reference"]["match"] == "exact"
                                         for r in done),
                            "reference": sorted({r.get("reference_kind", "greedy") for r in records
                                                 if r["protocol"] == p})}
                        for p in sorted({r["protocol"] for r in records})},
        "reference_unchecked": sum(m == "unchecked" for m in matches),
        "by_policy": {p: {"completed": sum(r["policy"] == p for r in done),
                          "exact": sum(r["policy"] == p and r["verdict"]["reference"]["match"] == "exact"
                                       for r in done)} for p in sorted({r["policy"] for r in records})},
        "memory": mem, "cloud_kv": cloud_kv(memory),
    }


def failures(summary: dict) -> List[str]:
    """What makes a soak fail, one line each (empty: it passed): an answer lost, repeated, with a run of tokens lost
    or repeated, delivered inconsistently, wrong (other than its reference where the reference had no near tie), or
    left unchecked (its reference could not be made)."""
    s = summary
    checks = (("lost", "answers lost"), ("duplicated", "answers repeated"), ("lost_tokens", "answers with a run of "
              "tokens lost"), ("delivery_inconsistent", "answers delivered inconsistently"), ("reference_wrong",
              "answers other than their reference without a near tie there"), ("reference_unchecked",
              "answers left unchecked (their reference failed)"))
    return [f"{s.get(key, 0)} {what}" for key, what in checks if s.get(key, 0)]


def cloud_kv(memory: List[dict]) -> dict:
    """The cloud's KV cache over the run (its status files): the byte budget, the most bytes and sessions held at a
    sample, and its error replies by code at the end (refusals: quota, busy, memory_full, ...)."""
    clouds = [m["cloud"] for m in memory if m.get("cloud")]
    if not clouds:
        return {}
    return {"budget_bytes": clouds[-1].get("kv_budget_bytes"),
            "max_bytes": max(c.get("kv_bytes", 0) for c in clouds),
            "max_sessions": max(c.get("open", 0) for c in clouds),
            "evicted": clouds[-1].get("evicted"), "errors": clouds[-1].get("errors", {})}


def _f(x: Optional[float], scale: float = 1e3, fmt: str = "{:.0f}") -> str:
    return "-" if x is None else fmt.format(x * scale)


def _interval(ci: Optional[dict], scale: float = 1e3) -> str:
    """The mean and its interval in ms with n and the method (stats.ci_text): "123 ± 4 (n=40, bootstrap)"."""
    return ci_text(ci, "{:.0f}", scale)


def print_summary(report: dict) -> None:
    s = report["summary"]
    print(f"\n requests {s['requests']}: completed {s['completed']}, lost {s['lost']}, duplicated {s['duplicated']}, "
          f"lost-token runs {s['lost_tokens']}, delivery inconsistent {s['delivery_inconsistent']}")
    for error in s["lost_errors"]:
        print(f" lost: {error}")
    print(f" equal to the reference (exact protocols: the model's greedy answer; lossy ones: their calm replay): "
          f"{s['reference_exact']} (other: {s['reference_other']}, of which {s['reference_other_near_tie']} where the "
          f"greedy reference's top two logits differ by < {NEAR_TIE} and the answer took the second, "
          f"{s.get('reference_wrong', 0)} wrong; unchecked: {s.get('reference_unchecked', 0)}); by policy "
          f"{s['by_policy']}")
    for p, b in s["by_protocol"].items():
        print(f"   {p:7s} completed {b['completed']:4d}, equal to its reference {b['exact']:4d} "
              f"({', '.join(b['reference'])})")
    print(f" cuts {s['cuts']} ({s['cuts_by_mode']}, long {s['cuts_long']}, during a request "
          f"{s['cuts_during_a_request']}); requests interrupted {s['interrupted_requests']} "
          f"({s['interruptions']} drops), degraded {s['degraded_requests']} ({s['degraded_tokens']} tokens)")
    for key in ("ttft_s", "queue_s", "ttft_after_queue_s", "ttft_s_uninterrupted", "ttft_s_interrupted", "tbt_s"):
        v = s[key]
        print(f" {key:22s} mean {_interval(s.get(f'{key}_ci')):>28s} (95 %) P50 {_f(v['p50'])} P90 {_f(v['p90'])} "
              f"P99 {_f(v['p99'])} ms (n={v['n']})")
    for name, m in s["memory"].items():
        print(f" RSS {name:8s} first {m['first_mb']:.0f} MB, last {m['last_mb']:.0f}, max {m['max_mb']:.0f}; slope "
              f"{_f(m['slope_mb_per_min'], 1, '{:+.2f}')} MB/min (second half "
              f"{_f(m['slope_second_half_mb_per_min'], 1, '{:+.2f}')})")
    hostile = s.get("hostile")
    if hostile:
        for side in ("without", "with"):
            h = hostile[side]
            print(f" {side} the hostile device: {h['completed']} of {h['requests']} answered (lost {h['lost']}); "
                  f"TTFT mean {_interval(h.get('ttft_s_ci'))} P50 {_f(h['ttft_s']['p50'])} P99 "
                  f"{_f(h['ttft_s']['p99'])} ms, TBT mean {_interval(h.get('tbt_s_ci'))} P50 {_f(h['tbt_s']['p50'])} "
                  f"P99 {_f(h['tbt_s']['p99'])} ms (n={h['ttft_s']['n']}, {h['tbt_s']['n']})")
        ratio = hostile["p99_ttft_ratio"]
        print(f" P99 TTFT with / without: {'-' if ratio is None else f'{ratio:.2f}'}; the hostile device was "
              f"answered {hostile['answers']}")
    kv = s.get("cloud_kv")
    if kv and kv.get("budget_bytes"):
        print(f" cloud KV: at most {kv['max_bytes'] / 2 ** 20:.0f} MiB held ({kv['max_sessions']} sessions) of its "
              f"{kv['budget_bytes'] / 2 ** 20:.0f} MiB budget; evicted {kv['evicted']}; its errors by code "
              f"{kv['errors']}")
    last = report["memory"][-1]["cloud"] if report["memory"] else {}
    print(f" cloud after the drain: {last.get('open', '-')} sessions open, {last.get('kv_positions', '-')} KV "
          f"positions, {last.get('expired', '-')} sessions expired in all")


def plot(path: str, report: dict) -> str:
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    mem = report["memory"]
    fig, axes = plt.subplots(2, 2, figsize=(14, 9))
    for name in report["summary"]["memory"]:
        pts = [(m["t"], m["rss_mb"][name]) for m in mem if name in m["rss_mb"]]
        axes[0, 0].plot([t for t, _ in pts], [v for _, v in pts], label=name)
    for c in report["cuts"]:
        axes[0, 0].axvline(c["t"], color="red" if c["long"] else "grey", alpha=0.25, lw=0.8)
    axes[0, 0].set(title="RSS over time (grey: link cuts, red: long cuts)", xlabel="s", ylabel="MB")
    ts = [m["t"] for m in mem]
    axes[0, 1].plot(ts, [m["cloud"].get("open", np.nan) for m in mem], label="cloud sessions open")
    axes[0, 1].plot(ts, [m["in_flight"] for m in mem], label="requests in flight")
    ax2 = axes[0, 1].twinx()
    ax2.plot(ts, [m["cloud"].get("kv_positions", np.nan) for m in mem], color="green", alpha=0.6)
    ax2.set_ylabel("KV positions held (green)")
    axes[0, 1].axvline(report["load_end_s"], color="black", ls="--", lw=0.8)
    axes[0, 1].set(title="sessions and KV over time (dashed: arrivals end)", xlabel="s")
    reqs = [r for r in report["requests"] if r["verdict"]["completed"] and r["times"]]
    for label, sel in (("uninterrupted", lambda r: not r["verdict"]["interruptions"]),
                       ("interrupted", lambda r: r["verdict"]["interruptions"])):
        v = sorted(r["times"][0] for r in reqs if sel(r))
        if v:
            axes[1, 0].step(v, np.arange(1, len(v) + 1) / len(v), where="post", label=label)
        v = sorted((r["times"][-1] - r["times"][0]) / (r["verdict"]["tokens"] - 1) for r in reqs
                   if sel(r) and r["verdict"]["tokens"] > 1)
        if v:
            axes[1, 1].step(v, np.arange(1, len(v) + 1) / len(v), where="post", label=label)
    axes[1, 0].set(title="TTFT at the client (CDF)", xlabel="s", ylabel="fraction", xscale="log")
    axes[1, 1].set(title="TBT at the client (CDF, per request)", xlabel="s/token", ylabel="fraction", xscale="log")
    return save_figure(fig, axes, path, 8)
