"""`hat-bench plan`: the cost model of `--protocol auto` (hat_split.math.costmodel) priced on hardware this project
does not have: a Jetson profile (hardware/devices), a cloud GPU (hardware/cloud_gpus.toml), a link profile (testbed)
and a model pair, with the acceptance measured here (acceptance does not depend on the hardware). Every figure is an
ESTIMATE; what each rests on is written into the JSON beside it.

The step times:
  * the cloud GPU: the GPU check's measured steps (results/gpu, `hat-bench gpu` on a lent H200: random weights with the
    real shapes, CUDA graphs) split into a weight-streaming part (weight bytes over the measured copy bandwidth) and
    the rest (kernels that do not scale with bandwidth); on another GPU the streaming part scales by the data-sheet
    bandwidth ratio, the rest is kept. A verify of x positions costs the measured decode step times the H200's
    verify/decode ratio at that x; a step of B sessions with x positions each the H200's batched steps of B sessions
    (measured with 1 position each and with 5: linear in x between and beyond), scaled the same way.
  * the device: its weights read once per step at `--device-efficiency` of the profile's peak DRAM bandwidth (a
    stated assumption: no Jetson was measured); its power the mode's budget (an upper bound).
  * devices one cloud serves at an SLA: the most devices N whose mean time between tokens stays under `--sla-tbt-ms`
    when their rounds' cloud work shares steps (N sessions' positions in one batched step, plus half a step of
    waiting), the criterion on the mean (a P99 needs the round-time distribution, which the model does not have).
    Each protocol's row serves at the knob fastest for one stream; `auto` under that SLA (a request's
    sla_tokens_per_s = 1 / TBT) spends the least cloud compute a token that keeps the pace, which for a fleet whose
    devices all choose alike is the exact protocol and knob that keeps the pace for the most devices (`auto_at_sla`).
  * the model's error: measured on this machine by `hat-bench auto` (MODEL_ERROR; a sampled plan's, SAMPLED), quoted
    beside the estimates.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from edge_runtime.auto import AUTO_TOKEN
from hat_split.math.costmodel import (CloudCosts, CostCurve, DeviceCosts, Link, Prediction, WireSizes, predict,
                                      predict_hat_tree, predict_tree)
from hat_split.math.verify import alpha_for_tokens
from profiles.bench.bench_auto import DEFAULT_AUTO_CENSUS

PROTOCOLS = ("llm", "sd", "slm", "ushape", "hat")
SAMPLED_PROTOCOLS = PROTOCOLS + ("ksqs",)  # --sampled: ksqs's lattice-coded rows beside sd's dense ones
SAMPLED_TREES = "results/speculative/trees_T1.json"  # sd's chains and trees on the Qwen pair at T = 1
SAMPLED = "results/auto/trace_T1.json"  # `hat-bench auto --temperature 1` on the pair: the fixed sd and ksqs rows'
# acceptance, and the bytes of a draft row as auto measured them (K-SQS at the config's K = 16, ℓ = 100)
GPU_BENCH = "results/gpu/gpu_bench_2026-11-26b.json"  # the GPU check with batched verify steps
SPECULATIVE = "results/speculative/bench_speculative.json"
HAT_RECORD = "results/hat/feature_drafter_qwen2.5-coder-1.5b-m2-s1200.json"
TREE_RECORDS = ("results/speculative/trees_T0_lte.json",)  # chains and trees, their tokens per round measured on the
# Qwen pair at T = 0 (hat-bench speculative --trees; 6 prompts)
HAT_TREE_RECORD = "results/hat/feature_drafter_trees_qwen2.5-coder-1.5b-m2-w400.json"  # the feature drafter's
# chain of 8 and trees, τ measured on the 1.5B cut at m = 2 (hat-distill --eval-trees; 4 ShareGPT prompts)
TREE_STEPS = {"captured": "results/gpu/gpu_bench_verify_width_2026-11-26.json",  # verify steps to 65 positions:
              "eager": "results/gpu/gpu_bench_verify_width_eager_2026-11-26.json"}  # graphs, and past 17 eager
WIRE_ROUND = 100.0  # bytes of a round's frames without payload (headers): measured frames are 60-120 B here
DRAFT_ROW = 8.0  # bytes of a greedy draft's row on the wire (one index)
HIDDEN_DTYPE_BYTES = 2  # a hidden state's element on the wire (float16)
MODEL_ERROR = "results/auto/bench_auto_eeaa100.json"  # the latest full trace: the model against the fixed rows
SPECEDGE_CAPACITY = 2.22  # SpecEdge's server throughput over the server alone (../shared/ANCHORS.md)


def add_parser(sub) -> None:
    s = sub.add_parser("plan", help="the cost model on a Jetson + cloud GPU + link (estimates), per protocol")
    s.add_argument("--device", default="agx-orin-32gb", help="a hardware/devices profile (default %(default)s)")
    s.add_argument("--mode", type=int, default=None, help="its nvpmodel mode id (default: the profile's default)")
    s.add_argument("--gpu", default="a6000", help="a hardware/cloud_gpus.toml GPU (default %(default)s)")
    s.add_argument("--link", default="wifi-near", help="a link profile (`hat-link --list`; default %(default)s)")
    s.add_argument("--draft", default="qwen2.5-coder-0.5b")
    s.add_argument("--target", default="qwen2.5-coder-1.5b")
    s.add_argument("--gpu-shape", default="qwen2.5-1.5b",
                   help="the GPU check's model whose measured steps the target's are scaled from (default %(default)s)")
    s.add_argument("--m", type=int, default=2, help="the split protocols' cut (default %(default)s)")
    s.add_argument("--alpha", type=float, default=None,
                   help=f"sd's acceptance (default: measured here, {SPECULATIVE}, γ = 4)")
    s.add_argument("--sampled", action="store_true",
                   help="price a request that samples (T = 1): sd's draft rows as measured at T = 1 (float16 over "
                        f"their support), and ksqs beside them (a lattice code per row); both α and both rows' bytes "
                        f"measured here ({SAMPLED}), --alpha and --ksqs-alpha replace the α")
    s.add_argument("--ksqs-alpha", type=float, default=None,
                   help=f"ksqs's acceptance at T = 1 (default: measured here, {SAMPLED})")
    s.add_argument("--hat-tokens-per-round", type=float, default=None,
                   help=f"hat's τ (default: measured here, {HAT_RECORD}, ShareGPT)")
    s.add_argument("--draft-vocab", type=int, default=16384, help="hat's draft head rows (default %(default)s)")
    s.add_argument("--device-bytes", type=float, default=2.0, help="bytes per device weight (2: fp16)")
    s.add_argument("--device-efficiency", type=float, default=0.5,
                   help="share of the profile's peak DRAM bandwidth a device step reaches (assumed; default "
                        "%(default)s)")
    s.add_argument("--prompt-tokens", type=int, default=128)
    s.add_argument("--sla-tbt-ms", type=float, default=100.0, help="mean time between tokens per device at most")
    s.add_argument("--auto-census", type=float, default=DEFAULT_AUTO_CENSUS,
                   help="auto's census share once its pool is full (EdgeConfig.auto_census): its reads' energy in "
                        "auto's J/token where llm runs; default %(default)s")
    s.add_argument("--out", default="runs/plan/plan.json", help="the JSON (a PNG beside it)")


@dataclass(frozen=True)
class Shape:
    """What a step reads, in parameters: the decoder layers, one layer, the head, the hidden size."""

    layers: int
    layer_params: float
    head_params: float
    hidden: int
    vocab: int

    @property
    def step_params(self) -> float:  # a decode step reads every layer and the head (embedding: one row)
        return self.layers * self.layer_params + self.head_params


def shape_of(name: str) -> Shape:
    """From the installed model's config.json, or the GPU check's shapes (profiles/bench/gpu_models)."""
    from hat_split.models import registry

    from profiles.bench.bench_gpu import MODELS_DIR

    path = registry.hf_cache_path(name) / "config.json"
    if not path.is_file():
        path = MODELS_DIR / f"{name}.json"
    if not path.is_file():
        raise ValueError(f"no config for {name!r}: install it (hat-models install {name}) or name a GPU shape")
    c = json.loads(path.read_text())
    h, heads, kv = c["hidden_size"], c["num_attention_heads"], c.get("num_key_value_heads", c["num_attention_heads"])
    hd = c.get("head_dim") or h // heads
    attn = h * heads * hd * 2 + h * kv * hd * 2
    mlp = 3 * h * c["intermediate_size"]
    return Shape(c["num_hidden_layers"], attn + mlp + 2 * h, c["vocab_size"] * h, h, c["vocab_size"])


class GpuSteps:
    """The GPU check's measured steps of one shape, moved to another GPU (module docstring)."""

    def __init__(self, bench: Dict[str, Any], shape: str, gpu_gbs: float, measured_gbs: float):
        rows = bench["models"]
        if shape not in rows:
            raise ValueError(f"the GPU check measured no {shape!r}; it has {', '.join(rows)}")
        ways = rows[shape]["ways"]
        g = ways.get("graphs") or ways["slots"]
        self.decode_s = 1.0 / g["decode_tok_s"]
        streaming = rows[shape]["weight_bytes"] / (bench["copy_GBps"] * 1e9)
        self.scale_stream = measured_gbs / gpu_gbs  # data-sheet bandwidths: the measured GPU's over the planned one's
        self.rest_s = max(0.0, self.decode_s - streaming)
        self.stream_s = streaming
        self.verify = {int(k) + 1: v / 1e3 / self.decode_s for k, v in g["verify_ms"].items()}  # x → ratio
        self.verify[1] = 1.0
        if "batched_verify_ms" not in g:
            raise ValueError(f"{shape}: the GPU check has no batched verify steps (hat-bench gpu --batch-verify 5)")
        batched = {float(b): float(b) / v for b, v in g["batched_tok_s"].items()}  # sessions → step seconds
        one = batched[1.0]
        # a batched step over one decode step, by sessions: one position each, and five (γ = 4) each
        self.batched1 = CostCurve(tuple(sorted((b, s / one) for b, s in batched.items())))
        self.batched5 = CostCurve(tuple(sorted((float(b), v / 1e3 / one) for b, v in g["batched_verify_ms"].items())))

    def step_s(self, weight_params: float, ref_params: float) -> float:
        """One decode step of a model of weight_params (bfloat16, as measured) on the planned GPU: the streaming part
        scaled by the bandwidth, the rest as measured, both by the model's share of the measured one's parameters."""
        share = weight_params / ref_params
        return share * (self.stream_s * self.scale_stream + self.rest_s)

    def curve(self, one_step_s: float) -> CostCurve:
        return CostCurve(tuple((float(x), one_step_s * r) for x, r in sorted(self.verify.items())))

    def batched_step_s(self, one_step_s: float, sessions: float, positions: int) -> float:
        """A step of `sessions` sessions with `positions` each, from the measured batched steps of 1 and 5 positions
        (linear in the sessions beyond the measured ones, and in the positions), relative to one decode step."""
        a, b = self.batched1.step_s(sessions), self.batched5.step_s(sessions)
        return one_step_s * max(0.0, a + (b - a) * (positions - 1) / 4.0)


def plan(args: argparse.Namespace) -> Dict[str, Any]:
    from hardware.device_profiles import cloud_gpus, get_profile
    from testbed.links import get_link_profile

    if not 0.0 <= args.auto_census <= 1.0:  # NaN too
        raise ValueError(f"--auto-census must be in [0, 1], got {args.auto_census}")
    device, gpus, link_profile = get_profile(args.device), cloud_gpus(), get_link_profile(args.link)
    if args.gpu not in gpus:
        raise ValueError(f"unknown GPU {args.gpu!r}; hardware/cloud_gpus.toml has {', '.join(gpus)}")
    gpu = gpus[args.gpu]
    mode = next((m for m in device.modes if m.id == (device.default_mode if args.mode is None else args.mode)), None)
    if mode is None:
        raise ValueError(f"{device.name} has no mode {args.mode}; modes {[m.id for m in device.modes]}")
    bench = json.loads(Path(GPU_BENCH).read_text())
    h200 = cloud_gpus()["h200"].memory_bandwidth_gbs
    steps = GpuSteps(bench, args.gpu_shape, gpu.memory_bandwidth_gbs, h200)
    draft, target = shape_of(args.draft), shape_of(args.target)
    ref = shape_of(args.gpu_shape).step_params
    g1 = steps.step_s(target.step_params, ref)
    # the device: its weights once per step at the assumed share of its peak bandwidth
    dev_bps = device.memory_bandwidth_gbs * 1e9 * args.device_efficiency
    per_param = args.device_bytes / dev_bps
    t_d = draft.step_params * per_param
    input_part = args.m * target.layer_params
    head = target.head_params
    feature = feature_params(target, args.draft_vocab)
    watts = float(mode.watts) if mode.watts else 0.0
    dev = DeviceCosts(draft_step_s=t_d, local_step_s=t_d, prefill_s=t_d / 8, round_s=0.0,
                      split_step_s=(input_part + head) * per_param, hat_draft_s=(input_part + feature) * per_param,
                      hat_verify_s=head * per_param, watts=watts)
    rate = lambda r: 8.0 * r if r and math.isfinite(r) else 0.0  # noqa: E731  bytes/s → bit/s
    link = Link(2 * link_profile.delay_s, rate(link_profile.up_rate_bps), rate(link_profile.down_rate_bps))
    sampled = measured_sampled(args.draft, args.target) if args.sampled else None
    row = sampled["row_bytes"]["sd"] if sampled else DRAFT_ROW
    wire = WireSizes(WIRE_ROUND, row, WIRE_ROUND, 4.0, HIDDEN_DTYPE_BYTES * target.hidden)
    middle = (target.layers - args.m) / target.layers
    alpha = args.alpha if args.alpha is not None else sampled["alpha"]["sd"] if sampled else measured_alpha()
    ksqs = None
    if sampled:
        ksqs = (args.ksqs_alpha if args.ksqs_alpha is not None else sampled["alpha"]["ksqs"],
                WireSizes(WIRE_ROUND, sampled["row_bytes"]["ksqs"], WIRE_ROUND, 4.0, wire.hidden))
    tau = args.hat_tokens_per_round if args.hat_tokens_per_round is not None else measured_hat_tau()
    hat_alpha = 1.0 - 1.0 / tau  # E(α, γ) → 1 / (1 − α) for long drafts: the α whose chains give τ
    price = Pricing(args.prompt_tokens, link, dev, wire, alpha, hat_alpha, ksqs)
    rows: List[Dict[str, Any]] = []
    for name in SAMPLED_PROTOCOLS if args.sampled else PROTOCOLS:
        pred = price.best(name, CloudCosts(steps.curve(g1), 0.0, middle))
        cap = None if name == "slm" else capacity(lambda n: price.shared(pred, steps, g1, middle, n),
                                                  args.sla_tbt_ms / 1e3)
        rows.append({**pred.as_dict(), "devices_at_sla": cap})
    fleet = auto_at_sla(price, steps, g1, middle, args.sla_tbt_ms / 1e3,
                        [r["protocol"] for r in rows if r["protocol"] in AUTO_TOKEN], args.auto_census)
    llm_cap = next(r["devices_at_sla"] for r in rows if r["protocol"] == "llm")
    fleet["over_llm"] = fleet["devices_at_sla"] / llm_cap if llm_cap else None
    trees = []
    for name, nodes, depth, shape_tau in measured_shapes(args.draft, args.target, args.sampled):
        for how in ("chain",) if name.startswith("g") else ("captured", "eager"):
            curve = steps.curve(g1) if how == "chain" else tree_curve(how, args.gpu_shape, g1)
            pred = predict_tree(nodes, depth, shape_tau, args.prompt_tokens, link, dev, CloudCosts(curve, 0.0, 1.0),
                                wire)
            trees.append({**pred.as_dict(), "shape": name, "cloud_step": how})
    hat_trees = hat_tree_rows(args, target, input_part, per_param, watts, link, wire, steps, g1, middle)
    return {"estimate": True, "device": device.name, "mode": mode.name, "watts": watts or None, "gpu": gpu.name,
            "link": link_profile.name, "draft": args.draft, "target": args.target, "m": args.m,
            "alpha_sd": alpha, "hat_tokens_per_round": tau, "sla_tbt_ms": args.sla_tbt_ms,
            "sampled": args.sampled, "alpha_ksqs": ksqs[0] if ksqs else None,
            "hat_tokens_per_round_at": "T = 0 (the feature drafter's record; not measured at T = 1)",
            "draft_row_bytes": {"sd": row, **({"ksqs": ksqs[1].up_per_draft} if ksqs else {})},
            "assumptions": {"device_efficiency": args.device_efficiency, "device_bytes_per_weight": args.device_bytes,
                            "cloud_dtype": "bfloat16", "gpu_check": GPU_BENCH, "gpu_shape": args.gpu_shape,
                            "cloud_step_s": g1, "device_draft_step_s": t_d,
                            "model_error_here": measured_error(SAMPLED if args.sampled else MODEL_ERROR)},
            "protocols": rows, "auto_at_sla": fleet, "specedge_capacity": SPECEDGE_CAPACITY, "trees": trees,
            "hat_trees": hat_trees}


@dataclass(frozen=True)
class Pricing:
    """The cost model's inputs that stay fixed while the cloud's load varies."""

    prompt_tokens: int
    link: Link
    device: DeviceCosts
    wire: WireSizes
    alpha: float  # sd's
    hat_alpha: float
    ksqs: Optional[Tuple[float, WireSizes]] = None  # ksqs's α and wire sizes (a sampled request)

    def at(self, name: str, knob: int, cloud: CloudCosts) -> Prediction:
        a, wire = {"hat": (self.hat_alpha, self.wire), "ksqs": self.ksqs}.get(name, (self.alpha, self.wire))
        return predict(name, knob, self.prompt_tokens, self.link, self.device, None if name == "slm" else cloud,
                       wire, a)

    def best(self, name: str, cloud: CloudCosts) -> Prediction:
        """sd, ksqs and hat at their best γ in 1..8; llm in chunks of 8."""
        if name in ("sd", "ksqs", "hat"):
            return max((self.at(name, g, cloud) for g in range(1, 9)), key=lambda p: (p.tokens_per_s, -p.knob))
        return self.at(name, 8 if name == "llm" else 0, cloud)

    def shared(self, pred: Prediction, steps: "GpuSteps", g1: float, middle: float, n: int) -> float:
        """Mean seconds between tokens of one of n devices running `pred`'s protocol and knob, their rounds' cloud
        work in shared steps (n devices' sessions in one batched step, half a step of waiting)."""
        positions = pred.knob + 1 if pred.protocol in ("sd", "ksqs", "hat") else 1
        share = middle if pred.protocol in ("ushape", "hat") else 1.0
        step = share * steps.batched_step_s(g1, n, positions)
        # the shared step, whatever this device's positions; llm's round is c such steps (one point: proportional)
        curve = CostCurve(((1.0, step),) if pred.protocol == "llm" else ((1.0, step), (64.0, step)))
        return 1.0 / self.at(pred.protocol, pred.knob, CloudCosts(curve, 0.5 * step, 1.0)).tokens_per_s


def auto_at_sla(price: Pricing, steps: "GpuSteps", g1: float, middle: float, sla_s: float,
                names: List[str], census: float = 0.0) -> Dict[str, Any]:
    """`auto` on every device of a fleet under one SLA (a request's pace 1 / sla_s): each device runs the exact
    protocol and knob whose token adds the least cloud compute while it keeps the pace, and the fleet that chooses
    alike is served longest by the candidate (any of `names` — the token protocols auto runs for a request that is
    not private — at any knob: sd and ksqs at γ 1..8, llm in chunks of 8) that keeps the pace for the most devices.
    Its choice, the devices it serves, and its cloud compute a token for one device (ties: the less cloud
    compute); its device energy a token where the device's watts are known, with its census's (`census`: the share
    of requests whose draft model reads llm's tokens, EdgeConfig.auto_census once the census's pool is full): where
    llm runs, a census request's draft model reads each token as a prefill position (the device's `prefill_s`),
    where a drafting protocol runs its drafts are its reads."""
    best: Optional[Tuple[int, float, Prediction]] = None
    for name in names:
        knobs = range(1, 9) if name in ("sd", "ksqs", "hat") else (8 if name == "llm" else 0,)
        for knob in knobs:
            pred = price.at(name, knob, CloudCosts(steps.curve(g1), 0.0, middle))
            cap = capacity(lambda n: price.shared(pred, steps, g1, middle, n), sla_s)
            if best is None or (cap, -pred.cloud_s_per_token) > (best[0], -best[1]):
                best = (cap, pred.cloud_s_per_token, pred)
    if best is None:
        raise ValueError("no exact protocol to choose among")
    cap, _, pred = best
    reads = census * price.device.prefill_s * price.device.watts if pred.protocol == "llm" else 0.0
    joules = None if pred.joules_per_token is None else pred.joules_per_token + reads
    return {"protocol": pred.protocol, "knob": pred.knob, "devices_at_sla": cap,
            "cloud_s_per_token": pred.cloud_s_per_token, "tokens_per_s_alone": pred.tokens_per_s,
            "joules_per_token": joules, "census_joules_per_token": reads if joules is not None else None,
            "census": census}


def measured_error(path: str = MODEL_ERROR) -> Dict[str, Any]:
    """The cost model's error on this machine (`hat-bench auto`'s trace): per protocol, the least and the most over
    the trace's phases of the median |predicted − measured| / measured steady tokens/s against the fixed rows, n
    requests a phase. sd at the request's own α (what the model says given the acceptance) and at auto's α (its
    estimate before the request showed its own) — there also the phase's mean prediction over its mean measurement
    − 1, signed (a bias; where recorded); ksqs (a sampled trace) at auto's; the draft-tree and η-chain rows at auto's
    estimates (`rows`: both figures' least and most, where the trace priced them). The summary `hat-bench resummarise`
    recomputed from the trace's records when it holds one, else its own."""
    doc = json.loads(Path(path).read_text())
    summary = (doc.get("resummarised") or doc)["summary"]  # recomputed from its records by the current summariser
    phases = [e["model_error"] for p, e in summary.items() if p != "overall"]
    out: Dict[str, Any] = {"record": path, "ran_on": doc["provenance"]["git_commit"], "phases": len(phases)}
    for key, name, field in (("llm", "llm", "median_abs_error"), ("sd", "sd", "median_abs_error_own_alpha"),
                             ("sd_at_autos_alpha", "sd", "median_abs_error"),
                             ("sd_phase_mean_at_autos_alpha", "sd", "phase_mean_error"),
                             ("ksqs_at_autos_alpha", "ksqs", "median_abs_error")):
        seen = [e[name] for e in phases if field in e.get(name, {})]
        if seen:
            out[key] = {"min": min(e[field] for e in seen), "max": max(e[field] for e in seen),
                        "n_per_phase": min(e["n"] for e in seen), "phases": len(seen)}
    rows = {}  # the chain and draft-tree rows (hat-bench auto's `priced`), at auto's estimates
    for name in sorted({n for e in phases for n in e if n.startswith(("sd_g", "sd_t"))}):
        seen = [e[name] for e in phases if name in e]
        rows[name] = {f: {"min": min(e[f] for e in seen), "max": max(e[f] for e in seen)}
                      for f in ("median_abs_error", "phase_mean_error")}
        rows[name].update(n_per_phase=min(e["n"] for e in seen), phases=len(seen))
    if rows:
        out["rows"] = rows
    return out


def error_text(err: Dict[str, Any]) -> str:
    """measured_error in one line."""
    span = lambda e: f"{100 * e['min']:.0f}–{100 * e['max']:.0f} %"  # noqa: E731
    signed = lambda e: f"{round(100 * e['min']):+d} to {round(100 * e['max']):+d} %"  # noqa: E731 (no "-0")
    parts = [f"llm {span(err['llm'])}"] if "llm" in err else []
    if "sd" in err:
        autos = ""  # sd at auto's α, and its phases' bias where recorded (a phase that has one has the other)
        if "sd_at_autos_alpha" in err:
            bias = err.get("sd_phase_mean_at_autos_alpha")
            autos = f" ({span(err['sd_at_autos_alpha'])} at auto's" + \
                (f", its phase means {signed(bias)})" if bias else ")")
        parts.append(f"sd {span(err['sd'])} at the request's α{autos}")
    if "ksqs_at_autos_alpha" in err:
        parts.append(f"ksqs {span(err['ksqs_at_autos_alpha'])} at auto's α")
    parts += [f"{name} {span(e['median_abs_error'])} at auto's (phase means {signed(e['phase_mean_error'])})"
              for name, e in err.get("rows", {}).items()]
    n = min(e["n_per_phase"] for k, e in err.items() if isinstance(e, dict) and "n_per_phase" in e)
    return (f"{', '.join(parts)} (median |predicted − measured| / measured tokens/s per phase, {err['phases']} "
            f"phases, n = {n} requests each; {err['record']}, ran on {err['ran_on'][:7]})")


def capacity(tbt, sla_s: float, most: int = 4096) -> int:
    """The most devices n (up to `most`) with tbt(n) <= sla_s (tbt grows with n); 0 when one device misses it."""
    if tbt(1) > sla_s:
        return 0
    if tbt(most) <= sla_s:
        return most
    lo, hi = 1, most
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if tbt(mid) <= sla_s else (lo, mid)
    return lo


def measured_alpha() -> float:
    """sd's acceptance at γ = 4 measured here on the Qwen pair, greedy."""
    return float(json.loads(Path(SPECULATIVE).read_text())["summary"]["hatspec_sd_g4"]["alpha"])


def measured_sampled(draft: str, target: str) -> Dict[str, Dict[str, float]]:
    """At T = 1 on this model pair (SAMPLED): sd's and ksqs's acceptance (their fixed rows' accepted over drafted
    positions) and the bytes of one draft row (the median over auto's requests of its estimate: a round's request
    less its frame, per draft; the fixed rows' totals would carry the prompt's upload)."""
    doc = json.loads(Path(SAMPLED).read_text())
    if (doc["args"]["draft"], doc["args"]["target"], doc["args"]["temperature"]) != (draft, target, 1.0):
        raise ValueError(f"{SAMPLED} was measured on {doc['args']['draft']} → {doc['args']['target']} at T = "
                         f"{doc['args']['temperature']}, not {draft} → {target} at T = 1: give --alpha and "
                         "--ksqs-alpha, and measure the rows")
    alpha, row_bytes = {}, {}
    for name in ("sd", "ksqs"):
        rows = [r for r in doc["rows"] if r["protocol"] == name]
        alpha[name] = sum(r["accepted"] for r in rows) / sum(r["drafted"] for r in rows)
        row_bytes[name] = statistics.median(r["predicted"]["estimates"]["up_per_draft"][name]
                                            for r in doc["rows"] if r["protocol"] == "auto")
    return {"alpha": alpha, "row_bytes": row_bytes}


def measured_shapes(draft: str, target: str, sampled: bool = False) -> List[tuple]:
    """(name, nodes, depth, tokens per round) of the chains and trees measured here on this model pair (TREE_RECORDS,
    or at T = 1 SAMPLED_TREES; none for another pair): g4 is a chain of 4, t32d8w4 a tree of 32 nodes, 8 levels, 4
    wide."""
    out = []
    for path in (SAMPLED_TREES,) if sampled else TREE_RECORDS:
        record = json.loads(Path(path).read_text())
        if (record["settings"]["draft"], record["settings"]["target"]) != (draft, target):
            continue
        summary = record["summary"]
        for key, entry in summary.items():
            if not key.startswith("hatspec_sd_") or not isinstance(entry, dict) or "_eta" in key:
                continue
            name = key[len("hatspec_sd_"):]
            nums = [int(x) for x in name[1:].replace("d", " ").replace("w", " ").split()]
            nodes, depth = (nums[0], nums[0]) if name.startswith("g") else (nums[0], nums[1])
            out.append((name, nodes, depth, float(entry["tokens_per_round"])))
    return out


def tree_curve(how: str, shape: str, g1: float) -> CostCurve:
    """A verify step of x positions over one decode step, as the GPU check measured them to 65 positions (`captured`:
    CUDA graphs reaching them, as the slot layout now captures a tree's verify up to max_tree_nodes + 1 positions;
    `eager`: every size at the cost of a step past the graphs' reach, as with graphs off), times the planned GPU's
    decode step g1."""
    ways = json.loads(Path(TREE_STEPS[how]).read_text())["models"][shape]["ways"]["graphs"]
    decode_ms = 1e3 / ways["decode_tok_s"]
    points = [(1.0, 1.0)] + [(float(k) + 1, v / decode_ms) for k, v in sorted(ways["verify_ms"].items(),
                                                                            key=lambda kv: int(kv[0]))]
    if how == "eager":  # a tree step is never captured: every size costs what past the graphs' reach cost
        eager = max(r for _, r in points)
        points = [(x, max(r, eager)) for x, r in points]
    return CostCurve(tuple((x, g1 * r) for x, r in points))


def hat_tree_rows(args, target: "Shape", input_part: float, per_param: float, watts: float, link: Link,
                  wire: WireSizes, steps: "GpuSteps", g1: float, middle: float) -> List[Dict[str, Any]]:
    """The feature drafter's chain of 8 and its trees (HAT_TREE_RECORD: τ measured here, ShareGPT), priced as
    predict_hat_tree and predict('hat', 8) say, the device drafting over the record's draft vocabulary, the cloud's
    tree verify captured or eager (tree_curve); none for another target or cut."""
    rec = json.loads(Path(HAT_TREE_RECORD).read_text())
    if rec["base_model"] != args.target or int(rec["m"]) != args.m:
        return []
    r = rec["record"]
    key = next(k for k in r if k.startswith("acceptance_draft_vocab_"))
    vocab = int(key.rsplit("_", 1)[1])
    feature = feature_params(target, vocab)
    dev = DeviceCosts(hat_draft_s=(input_part + feature) * per_param, hat_verify_s=target.head_params * per_param,
                      prefill_s=input_part * per_param, watts=watts)
    out = []
    chain = r[key]["sharegpt"]
    gamma = int(chain["max_draft"])
    cloud = CloudCosts(steps.curve(g1), 0.0, middle)
    pred = predict("hat", gamma, args.prompt_tokens, link, dev, cloud, wire,
                   alpha_for_tokens(chain["tokens_per_round"], gamma))
    out.append({**pred.as_dict(), "shape": f"g{gamma}", "cloud_step": "chain", "draft_vocab": vocab})
    for name, entry in r[f"trees_draft_vocab_{vocab}"].items():
        nodes, depth, _ = entry["sharegpt"]["tree"]
        for how in ("captured", "eager"):
            cloud = CloudCosts(tree_curve(how, args.gpu_shape, g1), 0.0, middle)
            pred = predict_hat_tree(nodes, depth, entry["sharegpt"]["tokens_per_round"], args.prompt_tokens, link,
                                    dev, cloud, wire)
            out.append({**pred.as_dict(), "shape": name, "cloud_step": how, "draft_vocab": vocab})
    return out


def feature_params(target: "Shape", draft_vocab: int) -> float:
    """Parameters a feature-drafter step reads: one decoder layer, the fusion (2 h²) and the draft head over
    draft_vocab rows (0: the whole head)."""
    return target.layer_params + 2 * target.hidden ** 2 + min(draft_vocab or target.vocab, target.vocab) * target.hidden


def measured_hat_tau() -> float:
    rec = json.loads(Path(HAT_RECORD).read_text())["record"]
    return float(rec["acceptance_draft_vocab_16384"]["sharegpt"]["tokens_per_round"])


def defaults(**given: Any) -> argparse.Namespace:
    """The plan's arguments: its parser's defaults, `given` replacing some (another command's plan)."""
    ap = argparse.ArgumentParser()
    add_parser(ap.add_subparsers())
    args = ap.parse_args(["plan"])
    for k, v in given.items():
        if not hasattr(args, k):
            raise ValueError(f"the plan has no argument {k!r}")
        setattr(args, k, v)
    return args


GRID_DEVICES = ("agx-orin-32gb", "orin-nano-8gb")  # HAT's device, and the smallest common one
GRID_LINKS = ("wifi-near", "wifi-far", "lte")


def wins(**given: Any) -> Dict[str, str]:
    """Per protocol, one line: where on the grid of GRID_DEVICES × GRID_LINKS (A6000 cloud) it is the fastest exact
    protocol for one device (slm, lossy: where the device alone beats them all), and where one cloud serves the most
    devices with it (ESTIMATES)."""
    fastest: Dict[str, List[str]] = {p: [] for p in PROTOCOLS}
    most: Dict[str, List[str]] = {p: [] for p in PROTOCOLS}
    for device in GRID_DEVICES:
        for link in GRID_LINKS:
            rows = plan(defaults(**{**given, "device": device, "link": link}))["protocols"]
            where = f"{device}/{link}"
            served = [r for r in rows if r["devices_at_sla"] is not None]  # the exact ones: all but slm
            best = max(served, key=lambda r: r["tokens_per_s"])
            fastest[best["protocol"]].append(where)
            if next(r for r in rows if r["protocol"] == "slm")["tokens_per_s"] > best["tokens_per_s"]:
                fastest["slm"].append(where)
            most[max(served, key=lambda r: r["devices_at_sla"])["protocol"]].append(where)
    out = {}
    for p in PROTOCOLS:
        f = ", ".join(fastest[p]) or "nowhere"
        if p == "slm":
            out[p] = f"slm (lossy): faster than every exact protocol on {f}"
        else:
            out[p] = f"{p}: fastest exact on {f}; most devices per cloud on {', '.join(most[p]) or 'nowhere'}"
    return out


def format_rows(doc: Dict[str, Any]) -> str:
    head = ["protocol", "knob", "tok/s", "TTFT s", "J/tok", "up B/tok", "down B/tok", "cloud ms/tok",
            f"devices at TBT≤{doc['sla_tbt_ms']:.0f} ms"]
    lines = [head]
    for r in doc["protocols"]:
        j = "-" if r["joules_per_token"] is None else f"{r['joules_per_token']:.3f}"
        cap = "-" if r["devices_at_sla"] is None else str(r["devices_at_sla"])
        lines.append([r["protocol"], str(r["knob"]), f"{r['tokens_per_s']:.1f}", f"{r['ttft_s']:.3f}", j,
                      f"{r['up_bytes_per_token']:.0f}", f"{r['down_bytes_per_token']:.0f}",
                      f"{1e3 * r['cloud_s_per_token']:.2f}", cap])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in lines)
    trees = [["sd shape", "cloud step", "tok/round", "tok/s", "up B/tok", "cloud ms/tok"]]
    trees += [[r["shape"], r["cloud_step"], f"{r['tokens_per_round']:.2f}", f"{r['tokens_per_s']:.1f}",
               f"{r['up_bytes_per_token']:.0f}", f"{1e3 * r['cloud_s_per_token']:.2f}"] for r in doc.get("trees", [])]
    hat = [["hat shape", "cloud step", "tok/round", "tok/s", "TTFT s", "up B/tok", "cloud ms/tok"]]
    hat += [[r["shape"], r["cloud_step"], f"{r['tokens_per_round']:.2f}", f"{r['tokens_per_s']:.1f}",
             f"{r['ttft_s']:.3f}", f"{r['up_bytes_per_token']:.0f}", f"{1e3 * r['cloud_s_per_token']:.2f}"]
            for r in doc.get("hat_trees", [])]
    return "\n\n".join([out] + [_table(t) for t in (trees, hat) if len(t) > 1])


def _table(lines: List[List[str]]) -> str:
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in lines)


def run(args: argparse.Namespace) -> int:
    from profiles.bench.provenance import write_report

    doc = plan(args)
    write_report(args.out, doc)
    note = plot(doc, Path(args.out).with_suffix(".png"))
    sampled = (f", sampled (T = 1): ksqs α {doc['alpha_ksqs']:.2f}, a draft row {doc['draft_row_bytes']['sd']:.0f} B "
               f"(sd) / {doc['draft_row_bytes']['ksqs']:.0f} B (ksqs)" if doc["sampled"] else "")
    print(f"ESTIMATES: {doc['device']} ({doc['mode']}) + {doc['gpu']} over {doc['link']}, {doc['draft']} → "
          f"{doc['target']}; sd α {doc['alpha_sd']:.2f}, hat τ {doc['hat_tokens_per_round']:.2f} (measured here)"
          + sampled)
    print(format_rows(doc))
    a = doc["assumptions"]
    print(f"assumed: device steps at {a['device_efficiency']:.0%} of peak DRAM bandwidth, "
          f"{a['device_bytes_per_weight']:g} bytes a weight; cloud steps scaled from {a['gpu_check']} "
          f"({a['gpu_shape']})")
    print(f"model error here: {error_text(a['model_error_here'])}")
    f = doc["auto_at_sla"]
    over = "" if f["over_llm"] is None else f" ({f['over_llm']:.2f}× llm's; SpecEdge reports {SPECEDGE_CAPACITY}× " \
                                            "server throughput)"
    knob = f" γ={f['knob']}" if f["protocol"] in ("sd", "ksqs", "hat") else ""
    joules = "" if f["joules_per_token"] is None else \
        f", {f['joules_per_token']:.3f} J a token ({f['census_joules_per_token']:.3f} of it its census's reads)"
    print(f"auto at TBT ≤ {doc['sla_tbt_ms']:.0f} ms: every device runs {f['protocol']}{knob}"
          f", {1e3 * f['cloud_s_per_token']:.2f} ms of cloud a token{joules}; one {doc['gpu']} serves "
          f"{f['devices_at_sla']} devices{over}")
    print(f"wrote {args.out}{'; ' + note if note else ' and its PNG'}")
    return 0


def plot(doc: Dict[str, Any], path: Path) -> str:
    from hat_split.files.figures import NO_MATPLOTLIB, pyplot, save_figure

    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    rows = doc["protocols"]
    names = [r["protocol"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    axes[0].bar(names, [r["tokens_per_s"] for r in rows])
    axes[0].set(title="tokens/s per device (ESTIMATE)", ylabel="tokens/s")
    caps = [r["devices_at_sla"] or 0 for r in rows]
    axes[1].bar(names + ["auto@SLA"], caps + [doc["auto_at_sla"]["devices_at_sla"]])
    axes[1].set(title=f"devices one cloud serves at TBT ≤ {doc['sla_tbt_ms']:.0f} ms (ESTIMATE)", yscale="log")
    fig.suptitle(f"{doc['device']} ({doc['mode']}) + {doc['gpu']}, {doc['link']}: {doc['draft']} → {doc['target']}",
                 fontsize=9)
    return save_figure(fig, axes, str(path))
