"""`hat-bench qs`: QS-SD and SQS-SD on the real pair over the link emulator with a two-state Markov uplink, one run.

  1. tokens/s vs sampling temperature for LLM, SLM, S-Q (sample then quantize), `qs` static, `qs` heuristic and
     `qs` DQN (a hat-train-policy file), in a low-rate and a high-rate regime (QS-SD Fig. 4);
  2. latency per token, per round and resampling rate vs temperature for `ksqs` and `csqs` with the per-round bit
     budget B (SQS Fig. 2), and csqs's long-run dropped mass against the conformal bound (SQS eq. 9);
  3. bits per draft token actually sent (payload bits, and the whole Verify frame) vs the papers' formula;
  4. encode + decode time of one 151,936-token distribution per support (K = V, top-K, conformal).
The emulated uplink switches between its two rates on a discrete-time Markov chain (`--markov-step-s`); the cloud
measures the rate each Verify saw and reports it back, which is what the adaptive policies read.
Per temperature every method runs on every prompt, the methods in turn per prompt, the order rotating by one per prompt
(stats.rotated), so the Markov link's state and a drift of the machine fall on every method alike. Beside each
pooled figure, `<key>_ci`: the mean of its per-request values with a 95 % interval, n and method (stats.mean_ci);
`tokens_per_s_vs_llm_ci` is the per-prompt speedup over `llm` on the same prompt (stats.interval, paired_ratio).
"""
from __future__ import annotations

import dataclasses
import os
import threading
import time
from typing import Dict, List, Optional

import numpy as np

from edge_runtime.config import EdgeConfig, EngineConfig, LinkConfig, QSConfig
from hat_split.files.figures import NO_MATPLOTLIB, pyplot
from hat_split.math.sampling import SamplingParams
from hat_split.prompt_sets import evaluation_prompts
from hat_split.wire import dist_codec
from hat_split.wire.sqs import ConformalThreshold, LatticeWire
from profiles.bench.stats import ci_text, interval, paired_ratio, rotated
from profiles.bench.rig import Rig
from testbed.links import LinkProfile
from profiles.bench.provenance import write_report
from hat_split.files import strict_json

METHODS = ("llm", "slm", "sq", "qs_static", "qs_heuristic", "qs_dqn")
SPARSE = ("ksqs", "csqs")


def add_parser(sub) -> None:
    s = sub.add_parser("qs", help="QS-SD / K-SQS / C-SQS vs LLM, SLM, S-Q over a two-state Markov uplink")
    s.add_argument("--draft", default="qwen2.5-coder-0.5b")
    s.add_argument("--target", default="qwen2.5-coder-1.5b")
    s.add_argument("--prompts", type=int, default=2)
    s.add_argument("--max-new-tokens", type=int, default=32)
    s.add_argument("--temperatures", default="0.25,0.5,1.0")
    s.add_argument("--regimes", default="low:175e3:525e3,high:2e6:6e6",
                   help="name:rate1:rate2 (bit/s) per regime; QS-SD: 350 kbit/s and 4 Mbit/s on average")
    s.add_argument("--p-switch", type=float, default=0.3, help="Markov switching probability per step")
    s.add_argument("--markov-step-s", type=float, default=1.0)
    s.add_argument("--delay-ms", type=float, default=10.0, help="one-way propagation delay")
    s.add_argument("--draft-len", type=int, default=4, help="L of the static policies and the heuristic's start")
    s.add_argument("--ell", type=int, default=100, help="ℓ of the static policies (SQS: 100)")
    s.add_argument("--policy-file", default="runs/policy.npz", help="hat-train-policy network ('' = skip qs_dqn)")
    s.add_argument("--k", type=int, default=16, help="ksqs K")
    s.add_argument("--budget-bits", type=int, default=5000, help="ksqs / csqs per-round bit budget B (SQS: 5000)")
    s.add_argument("--max-len", type=int, default=16, help="longest draft under the bit budget")
    s.add_argument("--methods", default=",".join(METHODS))
    s.add_argument("--weight-quant", default="int8", choices=["none", "int8"])
    s.add_argument("--target-dtype", default="auto")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--out", default="runs/bench_qs.json")


class MarkovLink(threading.Thread):
    """Drives a LinkEmulator's uplink between two rates on a discrete-time Markov chain; logs the switches."""

    def __init__(self, link, rates, p_switch, step_s, delay_s, seed):
        super().__init__(daemon=True)
        self.link, self.rates, self.p, self.step_s, self.delay_s = link, rates, p_switch, step_s, delay_s
        self.rng = np.random.default_rng(seed)
        self.state = 0
        self.log: List[tuple] = []
        self.stop = threading.Event()
        self._apply()

    def _apply(self) -> None:
        rate = self.rates[self.state] / 8
        self.link.set_profile(LinkProfile(f"markov-{self.state}", rate, 20e6 / 8, self.delay_s))
        self.log.append((time.monotonic(), self.rates[self.state]))

    def run(self) -> None:
        while not self.stop.wait(self.step_s):
            if self.rng.random() < self.p:
                self.state = 1 - self.state
                try:
                    self._apply()
                except RuntimeError:  # the emulator closed under us (the run ended or failed)
                    return


def _regimes(text: str) -> Dict[str, tuple]:
    out = {}
    for part in text.split(","):
        name, a, b = part.split(":")
        out[name] = (float(a), float(b))
    return out


def _configure(rt, method, args, base) -> str:
    """Set `rt`'s config for `method`; its protocol."""
    protocol = {"llm": "llm", "slm": "slm", "sq": "sq", "ksqs": "ksqs", "csqs": "csqs"}.get(method, "qs")
    qs = {"qs_heuristic": dataclasses.replace(base, policy="heuristic"),
          "qs_dqn": dataclasses.replace(base, policy="dqn", policy_file=args.policy_file),
          "ksqs": dataclasses.replace(base, budget_bits=args.budget_bits),
          "csqs": dataclasses.replace(base, budget_bits=args.budget_bits)}.get(method, base)
    draft_len = args.max_len if method in SPARSE else args.draft_len
    rt.config = dataclasses.replace(rt.config, qs=qs, draft_len=draft_len)
    return protocol


def _run_methods(rt, methods, ids, params, args, base) -> Dict[str, list]:
    """Every method on every prompt, the methods in turn per prompt in `rotated` order; rows in prompt order."""
    runs: Dict[str, list] = {m: [None] * len(ids) for m in methods}
    for i, x in enumerate(ids):
        for method in rotated(methods, i):
            protocol = _configure(rt, method, args, base)
            runs[method][i] = rt.generate(x, protocol, params, args.max_new_tokens, seed=args.seed * 1000 + i).to_json()
    for method, rows in runs.items():
        s = _summary(rows)
        print(f"  {method:13s} T={params.temperature:g}: {ci_text(s['tokens_per_s_ci'])} tok/s, "
              f"resampling {s['resampling_rate']:.2f}"
              f", {s.get('payload_bits_per_draft', 0):.0f} bits/draft", flush=True)
    return runs


def _per(rows: list, num, den) -> list:
    """Per request: num(row) / den(row), None where den(row) is 0."""
    return [num(r) / den(r) if den(r) else None for r in rows]


def _rates(rows: list) -> list:
    """Per request: tokens/s."""
    return _per(rows, lambda r: r["n_tokens"], lambda r: r["total_s"])


def _drafts(row: dict) -> int:
    """Draft tokens sent in one request's rounds."""
    return sum(g["L"] for g in row["round_log"])


def _summary(rows: list) -> dict:
    n = sum(r["n_tokens"] for r in rows)
    secs = sum(r["total_s"] for r in rows)
    rounds = sum(r["rounds"] for r in rows)
    logs = [g for r in rows for g in r["round_log"]]
    out = {"tokens_per_s": n / secs if secs else 0.0, "latency_per_token_s": secs / max(n, 1),
           "latency_per_round_s": secs / max(rounds, 1), "rounds": rounds,
           "resampling_rate": sum(r["rejected"] for r in rows) / max(rounds, 1),
           "accepted_per_round": sum(r["accepted"] for r in rows) / max(rounds, 1),
           "tokens_per_s_ci": interval(_rates(rows)),
           "latency_per_token_s_ci": interval(_per(rows, lambda r: r["total_s"], lambda r: r["n_tokens"])),
           "latency_per_round_s_ci": interval(_per(rows, lambda r: r["total_s"], lambda r: r["rounds"])),
           "resampling_rate_ci": interval(_per(rows, lambda r: r["rejected"], lambda r: r["rounds"])),
           "accepted_per_round_ci": interval(_per(rows, lambda r: r["accepted"], lambda r: r["rounds"]))}
    if logs:
        drafts = sum(g["L"] for g in logs)
        out.update(
            formula_bits_per_draft=sum(sum(g["bits"]) for g in logs) / drafts,
            payload_bits_per_draft=sum(g["payload_bits"] for g in logs) / drafts,
            frame_bits_per_draft=8 * sum(b for r in rows for b in r["round_up_bytes"]) / drafts,
            mean_L=drafts / len(logs), mean_ell=float(np.mean([g["ell"] for g in logs])),
            mean_k=float(np.mean([k for g in logs for k in g["k"]])),
            measured_uplink_bps=float(np.median([g["uplink_bps"] for g in logs if g["uplink_bps"] > 0] or [0])))
        kept = [d for g in logs for d in g["dropped"][: min(g["accepted"] + 1, g["L"])]]
        out["mean_dropped_mass"] = float(np.mean(kept)) if kept else 0.0
        out["settled_rows"] = len(kept)
        out["payload_bits_per_draft_ci"] = interval(
            _per(rows, lambda r: sum(g["payload_bits"] for g in r["round_log"]), _drafts))
        out["frame_bits_per_draft_ci"] = interval(_per(rows, lambda r: 8 * sum(r["round_up_bytes"]), _drafts))
    return out


def summarise(runs: Dict[str, list], llm: Optional[list] = None) -> Dict[str, dict]:
    """Per method: `_summary`, and `tokens_per_s_vs_llm_ci` (per-prompt tokens/s over `llm`'s on the same prompt)
    where `llm` ran: runs["llm"] unless given."""
    base = llm if llm is not None else runs.get("llm")
    out = {m: _summary(rows) for m, rows in runs.items()}
    if base is not None:
        for m, rows in runs.items():
            out[m]["tokens_per_s_vs_llm_ci"] = paired_ratio(_rates(rows), _rates(base))
    return out


def codec_timing(vocab: int = 151_936, repeats: int = 20) -> dict:
    """Encode (quantize + rank) and decode (unrank + dense row) of one distribution, best of `repeats`."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(vocab) * 4
    q = np.exp(logits - logits.max())
    q /= q.sum()
    out = {}
    for name, wire in (("qs K=V ℓ=100", LatticeWire(vocab, 100, "full")),
                       ("ksqs K=16 ℓ=100", LatticeWire(vocab, 100, "topk", 16)),
                       ("ksqs K=64 ℓ=100", LatticeWire(vocab, 100, "topk", 64)),
                       ("csqs β=0.001 ℓ=100", LatticeWire(vocab, 100, "conformal", 16,
                                                          ConformalThreshold(beta=0.001)))):
        enc, dec = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            row = wire.quantize(q)
            payload = wire.pack([row])
            t1 = time.perf_counter()
            dist_codec.decode_dist(payload, 1, vocab)
            dec.append(time.perf_counter() - t1)
            enc.append(t1 - t0)
            if wire.conformal is not None:
                wire.conformal.observe(row.dropped)
                wire.conformal.settle(1, 1)
        out[name] = {"k": row.k, "bits": int(payload.bits), "encode_ms": 1e3 * min(enc), "decode_ms": 1e3 * min(dec)}
    return out


def run(args) -> int:
    methods = [m for m in args.methods.split(",") if m]
    bad = [m for m in methods if m not in METHODS + SPARSE]
    if bad:
        raise ValueError(f"unknown method(s) {bad}; choose from {', '.join(METHODS + SPARSE)}")
    if "qs_dqn" in methods and not (args.policy_file and os.path.exists(args.policy_file)):
        print(f"hat-bench qs: no policy file {args.policy_file!r} (run hat-train-policy): qs_dqn skipped", flush=True)
        methods.remove("qs_dqn")
    temps = [float(t) for t in args.temperatures.split(",")]
    regimes = _regimes(args.regimes)
    prompts = evaluation_prompts(args.prompts)
    base = QSConfig(ell=args.ell, k=args.k)
    report: dict = {"args": vars(args), "codec": codec_timing(), "fig4": {}, "sqs": {}}
    print(strict_json.dumps(report["codec"], indent=1, ensure_ascii=False), flush=True)
    t_start = time.perf_counter()
    with Rig(args.target, cloud_args=["--dtype", args.target_dtype]) as bed:
        for r_i, (regime, rates) in enumerate(regimes.items()):
            with bed.add_link("loopback") as link:
                markov = MarkovLink(link, rates, args.p_switch, args.markov_step_s, args.delay_ms / 1e3,
                                    args.seed + r_i)
                markov.start()
                cfg = EdgeConfig(model=args.draft, link=LinkConfig(link.address, security=bed.security()),
                                 engine=EngineConfig(weight_quant=args.weight_quant), qs=base)
                with bed.runtime(cfg) as rt:
                    ids = [rt.encode_prompt(p.text, p.chat) for p in prompts]
                    rt.generate(ids[0], "qs", SamplingParams(1.0), 2, seed=0)  # warm-up
                    fig4: dict = {}
                    dense = [m for m in methods if m not in SPARSE]
                    sparse = list(SPARSE) if r_i == 0 else []  # SQS Fig. 2: the first (low-rate) regime
                    for temp in temps:
                        runs = _run_methods(rt, dense + sparse, ids, SamplingParams(temp), args, base)
                        fig4[f"{temp:g}"] = {m: runs[m] for m in dense}
                        if sparse:
                            report["sqs"][f"{temp:g}"] = {m: runs[m] for m in sparse}
                markov.stop.set()
                markov.join()
            report["fig4"][regime] = {"rates_bps": rates, "switches": len(markov.log) - 1, "runs": fig4}
    report["seconds"] = time.perf_counter() - t_start
    th = ConformalThreshold(base.alpha, base.eta, base.beta)
    report["tables"] = tables = {"fig4": {}, "sqs": {}}
    for regime, block in report["fig4"].items():
        tables["fig4"][regime] = {t: summarise(runs) for t, runs in block["runs"].items()}
    first = next(iter(report["fig4"].values()), {"runs": {}})["runs"]  # the regime the sparse schemes ran in
    for t, runs in report["sqs"].items():
        tables["sqs"][t] = summarise(runs, first.get(t, {}).get("llm"))
        cs = tables["sqs"][t].get("csqs")
        if cs:
            cs["eq9_bound"] = th.mean_dropped_bound(cs["settled_rows"])
    write_report(args.out, report)
    _print_tables(tables)
    note = plot(os.path.splitext(args.out)[0] + ".png", tables)
    print(f"hat-bench qs: {report['seconds']:.0f} s; wrote {args.out}" + (f" ({note})" if note else ""))
    return 0


def _print_tables(tables: dict) -> None:
    for regime, by_t in tables["fig4"].items():
        print(f"\n[{regime} rate] tokens/s, mean over requests ± 95 % interval (n, method); per-prompt speedup over "
              "llm (mean L, ℓ; measured uplink kbit/s)")
        for t, by_m in by_t.items():
            cells = [f"{m} {ci_text(s['tokens_per_s_ci'])}"
                     + (f"; {ci_text(s['tokens_per_s_vs_llm_ci'])}x" if m != "llm"
                        and s.get("tokens_per_s_vs_llm_ci") else "")
                     + (f" (L {s['mean_L']:.1f}, ℓ {s['mean_ell']:.0f}; {s['measured_uplink_bps'] / 1e3:.0f})"
                        if "mean_L" in s else "")
                     for m, s in by_m.items()]
            print(f"  T={t}: " + " | ".join(cells))
    print("\n[ksqs / csqs] latency/token s (mean over requests ± 95 % interval (n, method)), latency/round s, "
          "resampling rate, bits/draft (formula, payload, frame)")
    for t, by_m in tables["sqs"].items():
        for m, s in by_m.items():
            extra = (f", dropped {s['mean_dropped_mass']:.5f} <= eq.9 {s['eq9_bound']:.4f}" if "eq9_bound" in s else "")
            print(f"  T={t} {m}: {ci_text(s['latency_per_token_s_ci'], '{:.3f}')}, {s['latency_per_round_s']:.3f}, "
                  f"{s['resampling_rate']:.2f}, ({s['formula_bits_per_draft']:.0f}, {s['payload_bits_per_draft']:.0f}, "
                  f"{s['frame_bits_per_draft']:.0f}), K {s['mean_k']:.1f}, L {s['mean_L']:.1f}" + extra)


def plot(path: str, tables: dict) -> str:
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    regimes = list(tables["fig4"])
    fig, axes = plt.subplots(1, len(regimes) + 2, figsize=(5 * (len(regimes) + 2), 4))
    for ax, regime in zip(axes, regimes):
        by_t = tables["fig4"][regime]
        temps = [float(t) for t in by_t]
        for m in next(iter(by_t.values())):
            ax.plot(temps, [by_t[t][m]["tokens_per_s"] for t in by_t], "o-", label=m)
        ax.set_title(f"{regime} rate (QS-SD Fig. 4)")
        ax.set_xlabel("temperature")
        ax.set_ylabel("tokens/s")
        ax.legend(fontsize=7)
    temps = [float(t) for t in tables["sqs"]]
    for m in SPARSE:
        if all(m in v for v in tables["sqs"].values()):
            axes[-2].plot(temps, [v[m]["latency_per_token_s"] for v in tables["sqs"].values()], "o-", label=m)
            axes[-1].plot(temps, [v[m]["resampling_rate"] for v in tables["sqs"].values()], "o-", label=m)
    axes[-2].set_title("latency per token (SQS Fig. 2a)")
    axes[-1].set_title("resampling rate (SQS Fig. 2b)")
    for ax in axes[-2:]:
        ax.set_xlabel("temperature")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return ""
