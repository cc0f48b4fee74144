"""`hat-bench auto`: protocol auto against every fixed protocol through one scripted trace, on real models.

A cloud process pinned to its own core(s), a link emulator in front of it, and this process as the device on the
other core(s) (every protocol's draft prefill overlapping the cloud's, as on a device with cores of its own); auto
on an edge runtime of its own, so what it knows comes from its own requests only. The trace is a list of phases,
each a link profile (the emulator's profile changes between phases), a cloud load (N other devices, threads here
with a connection each, asking the cloud to decode alone without pause: no model on their side) and, for `cut`, a
cut of the link for --cut-s seconds during each request. In every phase each protocol of --protocols (auto among
them) runs one request on the same prompt, in a rotating order; the whole trace is repeated --repetitions times. Per
phase and overall: tokens/s, decode tokens/s, TTFT, the cloud's step seconds per token, bytes per token, and the
cost model's predicted decode tokens/s for sd, ksqs and llm (auto's estimates as they stand after its request in that
phase) against the measured ones, sd's also at the α the fixed sd request realised (the model apart from the α
estimate); what auto ran in each phase.

A `power` phase puts the board in a low-power mode the way a Jetson's would show it (profiles.bench.board): the
device's model runs --power-slowdown times slower and `nvpmodel -q` (a stand-in first on PATH) names MODE_15W, so
the device's monitor reads the change as on a Jetson; the other phases are MAXN at full speed.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
from contextlib import contextmanager, nullcontext
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

from edge_runtime.auto import AUTO_MAX_DRAFT
from edge_runtime.config import EdgeConfig
from profiles.bench.board import Board, SlowedLM
from profiles.bench.decisions import recorded
from profiles.bench.load import Load
from profiles.bench import resumed
from profiles.bench.provenance import REPO, provenance, write_report
from profiles.bench.stats import MIN_BOOTSTRAP_N, ci_text, interval

DEFAULT_TRACE = "loopback,wifi-far,lte,cut:lte,wifi-near,load:wifi-near,load+power:wifi-near"
DEFAULT_AUTO_ETA = EdgeConfig.__dataclass_fields__["auto_eta"].default
DEFAULT_AUTO_CENSUS = EdgeConfig.__dataclass_fields__["auto_census"].default
DEFAULT_CHAINS = f"{AUTO_MAX_DRAFT}e{DEFAULT_AUTO_ETA:g}"  # auto's η-chain as a fixed row of its own


def add_parser(sub) -> None:
    s = sub.add_parser("auto", help="protocol auto against the fixed protocols through a scripted trace")
    s.add_argument("--draft", default="qwen2.5-coder-0.5b")
    s.add_argument("--target", default="qwen2.5-coder-1.5b")
    s.add_argument("--engine", default="llamacpp", choices=["llamacpp", "torch"], help="both sides' engine")
    s.add_argument("--protocols", default="llm,sd,hlm,auto", help="comma-separated (default %(default)s)")
    s.add_argument("--trace", default=DEFAULT_TRACE,
                   help="phases: a link profile, or KINDS:PROFILE with KINDS one or more of cut (the link cut during "
                        "each request), load (--load-devices others decoding), power (the board in a low-power "
                        "mode: --power-slowdown) joined by +; default %(default)s")
    s.add_argument("--repetitions", type=int, default=5)
    s.add_argument("--max-new-tokens", type=int, default=32)
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--draft-len", type=int, default=4, help="sd's fixed γ")
    s.add_argument("--trees", default="",
                   help="draft-tree shapes NODESxDEPTHxWIDTH, comma separated (e.g. 16x4x4,32x6x4): each a fixed row "
                        "of its own (sd_tNdDwW, among the fixed exact protocols auto is compared with), and all of "
                        "them auto's candidates beside the chains (its --auto-trees)")
    s.add_argument("--eta", type=float, default=0.0,
                   help="η (draft_stop_prob) of the --trees rows and of auto's trees: a tree ends after the level "
                        "whose main-line draft has probability below η; NxNx1 is a chain of at most N that ends on "
                        "its draft's confidence (default 0: the whole shape)")
    s.add_argument("--chains", default=DEFAULT_CHAINS,
                   help="more chains for sd, comma separated: a draft length γ (e.g. 6) or one ended by η (8e0.4: up "
                        "to 8, ended after a draft token of probability below 0.4, HAT eq. 5), each a fixed row of its "
                        "own (sd_gN, sd_gN_eη; among the fixed exact protocols auto is compared with); default "
                        "%(default)s: auto's η-chain at the default --auto-eta ('' for none)")
    s.add_argument("--auto-eta", type=float, default=DEFAULT_AUTO_ETA,
                   help="auto's η-chain (EdgeConfig.auto_eta; 0: none); default %(default)s")
    s.add_argument("--auto-census", type=float, default=DEFAULT_AUTO_CENSUS,
                   help="auto's census (EdgeConfig.auto_census): the share of its requests, drawn at random, whose "
                        "reads of llm's tokens measure the prompts' acceptance (each row says whether it was one), "
                        "more at temperature 0 while its pool of answers is not full; default %(default)s")
    s.add_argument("--load-devices", type=int, default=8)
    s.add_argument("--cut-s", type=float, default=10.0,
                   help="seconds a cut phase stalls the link for, from 0.5 s into each request (default %(default)s: "
                        "past the device's ZMTP heartbeat, 3 s, and its ping, so every request's link drops and it "
                        "resumes; a cut near the heartbeat drops some requests at random, one shorter rides out)")
    s.add_argument("--power-slowdown", type=float, default=3.0,
                   help="a power phase's device compute, times the full-power board's (its mode MODE_15W)")
    s.add_argument("--cloud-cores", type=int, default=1, help="cores for the cloud; the device gets the rest")
    s.add_argument("--decisions", action="store_true",
                   help="record each of auto's choices in its row (`decisions`): every candidate's price, the "
                        "estimates it read and the tokens its round committed (profiles.bench.decisions)")
    s.add_argument("--auto-record", default="",
                   help="auto's record (EdgeConfig.auto_record): a device that ran before starts from what it "
                        "measured then, and the record is written after each of auto's requests; default: none "
                        "(auto's runtime measures afresh, as a device's first run)")
    s.add_argument("--prompt-set", default="demo", choices=["demo", "calibration"],
                   help="the trace's four prompts: the demo's (half HumanEval, half ShareGPT), or as many from the "
                        "calibration split, disjoint from them (a run that writes an --auto-record for another)")
    s.add_argument("--out", default="runs/auto/bench_auto.json",
                   help="the report, written after every cell (a phase of a repetition) until complete")
    s.add_argument("--resume", action="store_true",
                   help="continue the report at --out: its complete cells are kept and not run again (a larger "
                        "--repetitions extends it); refused, the file untouched, unless it ran on this commit and "
                        "machine with these arguments (profiles.bench.resumed); no file: start afresh")


@dataclass(frozen=True)
class Phase:
    name: str
    link: str
    cut: bool = False
    load: bool = False
    power: bool = False


KINDS = ("cut", "load", "power")


def parse_trace(text: str) -> List[Phase]:
    from testbed.links import get_link_profile

    phases = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        kinds, _, link = item.rpartition(":")
        named = [k for k in kinds.split("+") if k] if kinds else []
        if any(k not in KINDS for k in named) or (kinds and not named):
            raise ValueError(f"trace phase {item!r}: PROFILE or KINDS:PROFILE, KINDS one or more of "
                             f"{', '.join(KINDS)} joined by +")
        get_link_profile(link)  # a ValueError naming the known ones
        phases.append(Phase(item, link, "cut" in named, "load" in named, "power" in named))
    if not phases:
        raise ValueError("the trace has no phase")
    return phases


def run(args: argparse.Namespace) -> int:
    from edge_runtime.config import EngineConfig
    from hat_split.math.costmodel import Link
    from hat_split.math.sampling import SamplingParams
    from hat_split.prompt_sets import calibration_prompts, demo_prompts
    from profiles.bench.rig import Rig

    phases = parse_trace(args.trace)
    trees = {**chain_rows(args.chains), **tree_rows(args.trees, args.eta)}  # the fixed sd rows beside sd: their
    # config fields
    protocols = [p for p in args.protocols.split(",") if p] + list(trees)
    if args.trees and args.engine == "torch" and any(p.power for p in phases):
        raise ValueError("--trees with a power phase needs --engine llamacpp: the torch engine drafts trees with a "
                         "model of its own that the board's slowdown does not reach")
    if not 0.0 <= args.auto_eta < 1.0:
        raise ValueError(f"--auto-eta must be in [0, 1), got {args.auto_eta}")
    if not 0.0 <= args.auto_census <= 1.0:
        raise ValueError(f"--auto-census must be in [0, 1], got {args.auto_census}")
    if not 1.0 <= args.power_slowdown <= 100.0:
        raise ValueError(f"--power-slowdown must be in [1, 100], got {args.power_slowdown}")
    cores = sorted(os.sched_getaffinity(0))
    if not 0 < args.cloud_cores < len(cores):
        raise ValueError(f"--cloud-cores: 1..{len(cores) - 1} (the device needs a core of its own)")
    cloud_cores, device_cores = cores[:args.cloud_cores], cores[args.cloud_cores:]
    prompts = demo_prompts(4) if args.prompt_set == "demo" else calibration_prompts(4)
    earlier = (resumed.load(args.out, vars(args), provenance(), REPO) if args.resume else None) or {}  # before
    # any model loads; {}: a run from nothing
    done = resumed.cells_done(earlier.get("rows", []), protocols)
    rows: List[dict] = resumed.kept_rows(earlier.get("rows", []), done)
    runs = earlier.get("runs") or ([earlier["provenance"]] if earlier else [])
    if earlier:
        print(f"resuming {args.out}: {len(done)} of {args.repetitions * len(phases)} cells kept", flush=True)
    t0 = time.perf_counter() - earlier.get("wall_s", 0.0)

    def write(complete: bool) -> dict:
        """The report of the rows so far, at --out (after every cell, and at the end)."""
        stamp = provenance()
        report = {"args": vars(args), "cores": {"cloud": cloud_cores, "device": device_cores},
                  "phases": [p.__dict__ for p in phases], "rows": rows, "summary": summarise(rows, phases, protocols),
                  "wall_s": time.perf_counter() - t0, "complete": complete, "runs": runs + [stamp],
                  "provenance": stamp}
        write_report(args.out, report)
        return report

    if len(done) == args.repetitions * len(phases):  # a finished report resumed: nothing to run
        print_summary(write(complete=True))
        return 0
    board = Board() if any(p.power for p in phases) else None
    # this process on the device's cores before the engines start their threads, and back on all of them after
    with pinned(device_cores), recorded(args.decisions) as decisions, board or nullcontext(), \
            Rig(args.target, cloud_args=["--engine", args.engine], threads=len(cloud_cores), cloud_cpus=cloud_cores,
                link="loopback") as bed:
        # the device on cores of its own, as on a real device: its prefill and catch-up run while the cloud works
        config = EdgeConfig(model=args.draft, link=bed.link_config(link_policy="wait", reconnect_timeout_s=120.0),
                            draft_len=args.draft_len, overlap_prefill="on",
                            engine=EngineConfig(backend=args.engine, threads=len(device_cores),
                                                weight_quant="int8" if args.engine == "torch" else "none"))
        rt = bed.runtime(config)
        # auto on a runtime of its own: what it knows comes from its own requests, not from the fixed protocols'
        # (a runtime's sd and llm requests teach its auto: edge_runtime.runtime); the tree shapes are its candidates
        rt_auto = (bed.runtime(dataclasses.replace(config, auto_trees=args.trees, draft_stop_prob=args.eta,
                                                   auto_eta=args.auto_eta, auto_census=args.auto_census,
                                                   auto_record=args.auto_record))
                   if "auto" in protocols else rt)  # auto's chains draft γ whatever η (edge_runtime.sessions.auto)
        if board is not None:
            for r in {id(rt): rt, id(rt_auto): rt_auto}.values():
                r.engine.lm = SlowedLM(r.engine.lm, board)
        load_prompt = rt.encode_prompt(prompts[0].text)[:64]
        # the other devices reach the cloud itself, not through this device's emulated link (its proxy is a thread
        # of this process, on the device's core), from a process of their own on the cloud's cores (bench.load)
        direct = bed.link_config(server="tcp://{}:{}".format(*bed.upstream))
        for rep in range(args.repetitions):
            for k, phase in enumerate(phases):
                if (rep, phase.name) in done:
                    continue
                bed.link.set_profile(phase.link)
                if board is not None and phase.power:
                    board.set("MODE_15W", args.power_slowdown)
                elif board is not None:
                    board.set("MAXN", 1.0)
                prompt = prompts[(rep + k) % len(prompts)]
                order = protocols[rep % len(protocols):] + protocols[:rep % len(protocols)]
                load = (Load(direct, args.load_devices, load_prompt, cloud_cores) if phase.load else nullcontext())
                with load:
                    for name in order:
                        timer = threading.Timer(0.5, _cut, (bed.link, args.cut_s)) if phase.cut else None
                        if timer:
                            timer.start()
                        commits: List[tuple] = []
                        runner = rt_auto if name == "auto" else rt
                        if runner is rt:  # a fixed row: the base config, a tree row's shape on it
                            rt.config = dataclasses.replace(config, **trees.get(name, {}))
                        if decisions is not None:
                            decisions.take()  # only this request's choices go into its row
                        started = time.monotonic()  # the clock of the commits and of the decisions' `at`
                        res = runner.run(_request(prompt, "sd" if name in trees else name, args,
                                                  SamplingParams(args.temperature), commits))
                        if timer:
                            timer.join()
                            time.sleep(0.2)
                        rows.append(_row(rep, phase, name, res, commits))
                        if name == "auto":
                            rtt = rt_auto.client.base_rtt_s
                            link = Link(rtt, rt_auto.auto_estimates.uplink_at(rtt))
                            rows[-1]["predicted"] = _predictions(rt_auto, link, res.prompt_tokens, args.draft_len)
                            rows[-1]["census"] = rt_auto.auto_estimates.census  # its reads measured the prompts'
                            if decisions is not None:  # each one's `at` from the request's start, as its commits'
                                rows[-1]["decisions"] = decisions.take()
                                rows[-1]["first_commit_after_s"] = commits[0][0] - started if commits else None
                                for made in rows[-1]["decisions"]:
                                    made["at"] = None if made["at"] is None else round(made["at"] - started, 4)
                        print(f"rep {rep} {phase.name:>16} {name:>5}: {rows[-1]['steady_tokens_per_s']:.2f} tok/s "
                              f"after the first reply, ttft {res.ttft_s:.2f} s"
                              + (f"; ran {_ran(res)}" if res.auto else "")
                              + (f"; the link dropped {res.interruptions}×" if res.interruptions else ""), flush=True)
                write(complete=False)  # a cell at a time: a run that dies keeps what it measured (--resume)
        report = write(complete=True)
    print_summary(report)
    print(f"wrote {args.out}")
    return 0


@contextmanager
def pinned(cpus: List[int]) -> Iterator[None]:
    """This process on `cpus` for the block, then on the cores it had before (a caller that runs the bench twice in
    one process, a test, keeps its cores)."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def chain_rows(text: str) -> Dict[str, dict]:
    """The fixed chain rows of --chains: each chain's name (sd_gN, sd_gN_eη) and the EdgeConfig fields it sets."""
    out: Dict[str, dict] = {}
    for item in (x.strip() for x in text.split(",") if x.strip()):
        gamma, _, eta = item.partition("e")
        try:
            g, e = int(gamma), float(eta) if eta else 0.0
        except ValueError:
            g, e = 0, 0.0
        if not 1 <= g <= 16 or not 0.0 <= e < 1.0 or (eta and e == 0.0):
            raise ValueError(f"--chains: a draft length 1..16, or one ended by η in (0, 1) as 8e0.4, comma "
                             f"separated; got {item!r}")
        out[f"sd_g{g}" + (f"_e{e:g}" if e else "")] = {"draft_len": g, "draft_stop_prob": e}
    return out


def tree_rows(text: str, eta: float = 0.0) -> Dict[str, dict]:
    """The fixed tree rows of --trees: each shape's name (sd_tNdDwW, and _eη when η ends it early) and the EdgeConfig
    fields it sets."""
    from hat_split.math.tree import parse_shapes, shape_name

    if not 0.0 <= eta < 1.0:
        raise ValueError(f"--eta must be in [0, 1), got {eta}")
    return {f"sd_{shape_name(*t)}" + (f"_e{eta:g}" if eta else ""): {
        **dict(zip(("tree_nodes", "tree_depth", "tree_width"), t)), "draft_stop_prob": eta}
        for t in parse_shapes(text)}


def _cut(link, seconds: float) -> None:
    link.cut("stall")
    time.sleep(seconds)
    link.restore()


def _request(prompt, protocol: str, args, sampling, commits: List[tuple]):
    """The phase's request; each commit's time and size go to `commits`."""
    from edge_runtime.request import GenerationRequest

    return GenerationRequest(prompt.text, protocol, sampling, args.max_new_tokens, seed=0, chat=prompt.chat,
                             on_tokens=lambda toks, _lp: commits.append((time.monotonic(), len(toks))))


def _ran(res) -> str:
    return ", ".join(f"{s['protocol']}×{s['tokens']}" for s in res.auto)


def steady_rate(commits: List[tuple]) -> float:
    """Tokens per second after the first reply: the tokens committed after the first commit over the time from it to
    the last (a protocol committing c tokens a round has its first c at the first token's time: counting them, as a
    rate from the first token does, overstates a chunked protocol's pace)."""
    if len(commits) < 2 or commits[-1][0] <= commits[0][0]:
        return 0.0
    return sum(n for _, n in commits[1:]) / (commits[-1][0] - commits[0][0])


def _row(rep: int, phase: Phase, name: str, res, commits: List[tuple]) -> dict:
    s = res.summary()
    n = max(res.n, 1)
    return {"rep": rep, "phase": phase.name, "protocol": name, "tokens": res.n, "total_s": res.total_s,
            "ttft_s": res.ttft_s, "tokens_per_s": s["tokens_per_s"], "steady_tokens_per_s": steady_rate(commits),
            "alpha": s.get("alpha"), "accepted": res.accepted, "drafted": res.drafted, "rounds": res.rounds,
            "cloud_s_per_token": (res.cloud_compute_s - res.cloud_prefill_s) / n,
            "up_bytes_per_token":
            s["up_bytes_per_token"], "down_bytes_per_token": s["down_bytes_per_token"], "degraded": len(res.degraded),
            "drops": res.interruptions, "auto": res.auto,
            "commits": [[round(t - commits[0][0], 4), k] for t, k in commits],  # each commit's time from the first
            "token_ids": list(res.tokens)}  # what it generated: rows of a repetition that ran alike, yet committed
    # unlike rounds, tell here whether the target's answer itself differed (a loaded cloud's batched near ties)


def _predictions(rt, link, prompt_tokens: int, draft_len: int) -> Dict[str, object]:
    """sd's and ksqs's (at the fixed protocol's γ) and llm's (at its chunk) tokens/s after the first reply, as auto's
    estimates predict them now for the request's kind of sampling (None for one not measured yet); sd's at every α
    of ALPHA_GRID (the model given a request's own acceptance: the summary's second error); its draft trees
    (sd_trees, by shape); the estimates themselves."""
    from edge_runtime.auto import AUTO_TOKEN, AutoController, auto_max_draft
    from edge_runtime.runtime import tree_shapes
    from hat_split.math.costmodel import predict
    from hat_split.math.tree import shape_name

    c = AutoController(rt.auto_estimates, list(AUTO_TOKEN), draft_len, rt.config.llm_chunk, prompt_tokens,
                       shares_host=not rt.config.overlaps_prefill,
                       trees=tree_shapes(rt.config, rt.client.welcome), tree_eta=rt.config.draft_stop_prob)
    now = time.monotonic()
    preds = {"sd": c.at("sd", draft_len, link, now), "ksqs": c.at("ksqs", draft_len, link, now),
             "llm": c.at("llm", rt.config.llm_chunk, link, now)}
    out: Dict[str, object] = {name: (p.tokens_per_s if p is not None else None) for name, p in preds.items()}
    # the model's ranking of the draft lengths auto chooses among (runtime: within the cloud's max_draft_len)
    longest = auto_max_draft(rt.client.welcome.max_draft_len)
    by_gamma = [c.at("sd", g, link, now) for g in range(1, longest + 1)]
    out["sd_by_gamma"] = [p.tokens_per_s if p is not None else None for p in by_gamma]
    shapes = {shape_name(*t): t for t in c.trees}  # auto's tree candidates
    if rt.config.auto_eta and (longest, longest, 1) not in c.trees:  # and its η-chain (once measured)
        shapes[f"g{longest}_e{rt.config.auto_eta:g}"] = (longest, longest, 1)
    trees = {name: c.at_tree(t, link, now) for name, t in shapes.items()}  # as priced now
    out["sd_trees"] = {name: p.tokens_per_s if p is not None else None for name, p in trees.items()}
    est, curve = rt.auto_estimates, rt.auto_estimates.curve(now)
    out["sd_tree_parts"] = {name: _tree_parts(est, shapes[name], c.stop_eta(shapes[name]), p)
                            for name, p in trees.items() if p is not None}
    if preds["sd"] is not None and curve is not None:
        out["sd_by_alpha"] = [predict("sd", draft_len, prompt_tokens, link, est.device(c.shares_host, "sd"),
                                      est.cloud(curve, "sd"), est.wire(), a).tokens_per_s
                              for a in ALPHA_GRID]
    out["estimates"] = {"kind": est.kind, "alpha": est.alpha, "alpha_ksqs": est.alpha_of("ksqs"),
                        "belief": est.belief("sd"),
                        "up_per_draft": {p: est.up_per_draft(p) for p in ("sd", "ksqs")},
                        "uplink_bps": est.uplink_bps, "draft_step_s": est.draft_step_s,
                        "draft_step_busy_s": est.draft_step_busy_s, "draft_step_priced": est.draft_step(),
                        "catch_up": est.catch_up.points(),
                        "overhead_s": dict(est.overhead_s), "overhead_rounds": dict(est.overhead_rounds),
                        "overhead_priced": {p: est.overhead(p) for p in ("sd", "llm")},
                        "cloud_busy": est.cloud_busy, "power_mode": est.power_mode,
                        "reported_wait_s": est.reported_wait_s, "reported_step_s": est.reported_step_s,
                        "reported_duty": est.reported_duty, "curve": list(curve.points) if curve else [],
                        "rtt_s": link.rtt_s, "wire": est.wire().__dict__}
    return out


def _tree_parts(est, shape, eta: float, pred) -> dict:
    """What a draft tree's price (`AutoController.at_tree`) was made of: the prediction's round (tokens, seconds,
    bytes, cloud seconds) and the estimates behind it — what the census's reads say an η-chain of its depth commits
    and sends a round (`eta_chain_read`; None where they do not price it), else its chain's expected tokens at the
    request's acceptance and the ratio an η-ended chain's rounds bore to that, its draft steps and nodes sent a round
    as measured; its round overhead — so a trace tells which of them a wrong price came from."""
    from edge_runtime.auto_estimates import tree_key

    read = est.eta_chain_read(shape[1], eta) if shape[2] == 1 and eta > 0 else None
    alike = est.eta_chain_read(shape[1], eta, weigh=False) if read else None  # the census's texts alike (before
    # stop 95), to set beside what they price weighed by the request's evidence
    return {**pred.as_dict(), "census_read": list(read) if read else None,
            "census_read_alike": list(alike) if alike else None,
            "chain_tokens": est.chain_tokens("sd", shape[1]),
            "eta_ratio": est.eta_ratio(shape), "rounds": est.tree_rounds_of(shape),
            "steps": est.tree_steps_at(shape, pred.tokens_per_round), "sent": est.tree_sent_of(shape),
            "overhead_s": est.overhead(tree_key(shape)), "draft_step_s": est.draft_step()}


ALPHA_GRID = [i / 20 for i in range(21)]


def at_alpha(grid_values: List[float], alpha: float) -> float:
    """A prediction on ALPHA_GRID read at `alpha` (linear between the grid's points)."""
    x = min(max(alpha, 0.0), 1.0) * (len(ALPHA_GRID) - 1)
    i = min(int(x), len(ALPHA_GRID) - 2)
    return grid_values[i] + (x - i) * (grid_values[i + 1] - grid_values[i])


def summarise(rows: List[dict], phases: List[Phase], protocols: List[str]) -> dict:
    """Per phase and protocol: totals and medians over repetitions (n beside them); auto against the best fixed exact
    protocol; the cost model's error per phase for sd, ksqs, llm and the chain and draft-tree rows (`priced`): its
    prediction after that phase's auto request against the fixed protocol's measured tokens/s after the first reply
    in the same repetition, each at the fixed protocol's knob: the median of the requests' absolute errors, and the
    phase's mean prediction over its mean measurement − 1, signed — a bias, where a prompt's own acceptance, unknown
    to a protocol auto did not run on it, spreads the former), and at the same request (`same_request_errors`)."""
    out: Dict[str, dict] = {}
    for phase in [p.name for p in phases] + ["overall"]:
        sel = [r for r in rows if phase == "overall" or r["phase"] == phase]
        per = {}
        for name in protocols:
            mine = [r for r in sel if r["protocol"] == name]
            if not mine:
                continue
            per[name] = {"n": len(mine),
                         "tokens_per_s": sum(r["tokens"] for r in mine) / sum(r["total_s"] for r in mine),
                         "steady_tokens_per_s_median": statistics.median(r["steady_tokens_per_s"] for r in mine),
                         "ttft_s_median": statistics.median(r["ttft_s"] for r in mine),
                         "cloud_ms_per_token": 1e3 * statistics.mean(r["cloud_s_per_token"] for r in mine),
                         "up_bytes_per_token": statistics.mean(r["up_bytes_per_token"] for r in mine),
                         "degraded_tokens": sum(r["degraded"] for r in mine),
                         "drops": sum(r.get("drops", 0) for r in mine)}  # (a report before drops were kept: 0)
        fixed = {k: v["tokens_per_s"] for k, v in per.items() if k not in ("auto", "slm")}
        entry: dict = {"protocols": per}
        if "auto" in per and fixed:
            best = max(fixed, key=fixed.get)
            entry["auto_over_best_fixed"] = per["auto"]["tokens_per_s"] / fixed[best]
            entry["best_fixed"] = best
            entry["auto_over_best_fixed_per_request"] = paired(sel, "auto", best)
            entry["auto_over_best_fixed_interval"] = interval(entry["auto_over_best_fixed_per_request"])
            entry["auto_over_held_out_best"] = held_out_best(sel, sorted(fixed))
        errors = {}
        for name in ["sd", "ksqs", "llm"] + [p for p in protocols if priced_as(p, protocols)]:
            pairs = [(a["predicted"], f) for a in sel if a["protocol"] == "auto"
                     and priced(a.get("predicted", {}), name, protocols)
                     for f in sel if f["protocol"] == name and f["rep"] == a["rep"] and f["phase"] == a["phase"]
                     and f["steady_tokens_per_s"] > 0]
            if not pairs:
                continue
            guess = [priced(p, name, protocols) for p, _ in pairs]
            errors[name] = {"n": len(pairs), "median_abs_error": statistics.median(
                abs(g - f["steady_tokens_per_s"]) / f["steady_tokens_per_s"] for g, (_, f) in zip(guess, pairs)),
                "phase_mean_error": statistics.mean(guess)
                / statistics.mean(f["steady_tokens_per_s"] for _, f in pairs) - 1.0}
            own = [abs(at_alpha(p["sd_by_alpha"], f["alpha"]) - f["steady_tokens_per_s"]) / f["steady_tokens_per_s"]
                   for p, f in pairs if name == "sd" and p.get("sd_by_alpha") and f.get("alpha") is not None]
            if own:
                errors[name]["median_abs_error_own_alpha"] = statistics.median(own)
        entry["model_error"] = errors
        entry["model_error_same_request"] = same_request_errors(sel)
        entry["cloud_model_error"] = cloud_model_error(sel)
        out[phase] = entry
    return out


def priced_as(row: str, protocols: List[str]) -> Optional[Tuple[str, object]]:
    """Where auto's `predicted` prices the fixed chain or draft-tree row `row` (None for any other row): a tree row
    sd_tNdDwW[_eη] at ("sd_trees", its shape's name) (auto's candidates are the configured --trees, at the same η);
    an η-chain row sd_gG_eη at the chain-shaped tree GxGx1's where that is a configured tree at that η (a tree row
    sd_tGdGw1_eη beside it: the same drafts), else at auto's η-chain's (gG_eη); a chain row sd_gG at
    ("sd_by_gamma", G − 1)."""
    tree = re.fullmatch(r"sd_(t\d+d\d+w\d+)(_e[0-9.]+)?", row)
    if tree:
        return "sd_trees", tree.group(1)
    chain = re.fullmatch(r"sd_g(\d+)(?:_e([0-9.]+))?", row)
    if not chain:
        return None
    g, eta = chain.groups()
    if eta is None:
        return "sd_by_gamma", int(g) - 1
    return "sd_trees", f"t{g}d{g}w1" if f"sd_t{g}d{g}w1_e{eta}" in protocols else f"g{g}_e{eta}"


def priced(predicted: dict, name: str, protocols: List[str]) -> Optional[float]:
    """auto's prediction of the fixed row `name`'s tokens/s after the first reply (its `predicted`; None where it
    priced none): sd, ksqs and llm at the fixed rows' knobs, a chain or draft-tree row where `priced_as` says."""
    if name in ("sd", "ksqs", "llm"):
        return predicted.get(name)
    where = priced_as(name, protocols)
    if where is None:
        return None
    table, key = where
    values = predicted.get(table) or ({} if table == "sd_trees" else [])
    return values.get(key) if table == "sd_trees" else (values[key] if key < len(values) else None)


def cloud_model_error(rows: List[dict]) -> Dict[str, dict]:
    """The cloud's compute a token as the cost model prices it against the cloud's own count, per fixed protocol:
    the curve auto held after its request of the same phase and repetition (the cloud's report, as every device
    prices it), at the row's own rounds — llm's tokens after the first, one position each; a drafting row's rounds
    of drafted / rounds + 1 positions (the rounds a row recorded; before rows did, tokens − 1 − accepted, a round
    committing its accepted drafts and one more) — over the row's tokens, against its cloud seconds a token
    (prefill left out on both sides). So the curve is checked apart from α: {name: {"n", "median_error" (signed:
    predicted over measured − 1), "median_abs_error", "max_abs_error"}}."""
    from hat_split.math.costmodel import CostCurve

    errors: Dict[str, List[float]] = {}
    fixed: Dict[tuple, List[dict]] = {}  # the fixed rows by (repetition, phase)
    for f in rows:
        if f["protocol"] not in ("auto", "slm") and f["cloud_s_per_token"] > 0 and f["tokens"] >= 2:
            fixed.setdefault((f["rep"], f["phase"]), []).append(f)
    for a in rows:
        curve = (a.get("predicted") or {}).get("estimates", {}).get("curve") if a["protocol"] == "auto" else None
        if not curve:
            continue
        g = CostCurve(tuple(tuple(p) for p in curve)).step_s
        for f in fixed.get((a["rep"], a["phase"]), ()):
            if f["drafted"]:
                rounds = f.get("rounds") or f["tokens"] - 1 - f["accepted"]
                if rounds < 1:
                    continue
                predicted = rounds * g(f["drafted"] / rounds + 1) / f["tokens"]
            else:
                predicted = (f["tokens"] - 1) * g(1) / f["tokens"]
            errors.setdefault(f["protocol"], []).append(predicted / f["cloud_s_per_token"] - 1)
    return {name: {"n": len(v), "median_error": statistics.median(v),
                   "median_abs_error": statistics.median(abs(x) for x in v), "max_abs_error": max(abs(x) for x in v)}
            for name, v in sorted(errors.items())}


def same_request_errors(rows: List[dict]) -> Dict[str, dict]:
    """The cost model at the moment it priced, per protocol: auto's prediction at its request's end for the protocol
    it ran throughout (llm, or sd's chains and trees) against that request's own pace after the first reply. The
    fixed row of the same repetition (`model_error`) runs minutes apart, and a machine whose speed drifts moves
    between the two; this does not. Requests that ran more than one protocol, or kept no pace, are left out."""
    errors: Dict[str, List[float]] = {}
    for a in rows:
        if a["protocol"] != "auto" or not a.get("auto") or not a["steady_tokens_per_s"] > 0:
            continue
        ran = {seg["protocol"] for seg in a["auto"]}
        if len(ran) != 1:
            continue
        name = ran.pop()
        predicted = a.get("predicted", {}).get(name)
        if predicted:
            errors.setdefault(name, []).append(abs(predicted - a["steady_tokens_per_s"]) / a["steady_tokens_per_s"])
    return {name: {"n": len(v), "median_abs_error": statistics.median(v), "max_abs_error": max(v)}
            for name, v in sorted(errors.items())}


def held_out_best(rows: List[dict], fixed: List[str]) -> dict:
    """auto against the fixed protocol a user would have picked for the phase from the trace's other repetitions:
    in each phase and repetition, the fixed protocol fastest over that phase's other repetitions (tokens over
    seconds), and auto's request against that protocol's in this repetition. The best fixed row picked on the very
    requests it is judged on (`auto_over_best_fixed`) is the largest of several noisy means, so it is biased upward
    where the rows are close; picked on the others, it is not. {"ratio": auto's tokens/s over the picks' (tokens
    and seconds summed over the requests compared), "per_request", "interval" (its mean's, n beside it), "picks":
    [[phase, rep, protocol], ...]}; {} where no phase has two repetitions."""
    picks, ratios = [], []
    compared: Dict[str, List[dict]] = {"auto": [], "pick": []}
    for phase in sorted({r["phase"] for r in rows}):
        mine = [r for r in rows if r["phase"] == phase]
        for rep in sorted({r["rep"] for r in mine}):
            pace = {}
            for name in fixed:
                other = [r for r in mine if r["protocol"] == name and r["rep"] != rep]
                seconds = sum(r["total_s"] for r in other)
                if seconds > 0:
                    pace[name] = sum(r["tokens"] for r in other) / seconds
            a = [r for r in mine if r["protocol"] == "auto" and r["rep"] == rep and r["total_s"] > 0]
            if not pace or not a:
                continue
            pick = max(pace, key=pace.get)
            b = [r for r in mine if r["protocol"] == pick and r["rep"] == rep and r["total_s"] > 0 and r["tokens"]]
            if not b:
                continue
            picks.append([phase, rep, pick])
            ratios.append(_rate(a[0]) / _rate(b[0]))
            compared["auto"].append(a[0])
            compared["pick"].append(b[0])
    if not ratios:
        return {}
    pace = {k: sum(r["tokens"] for r in v) / sum(r["total_s"] for r in v) for k, v in compared.items()}
    return {"ratio": pace["auto"] / pace["pick"], "per_request": ratios, "interval": interval(ratios),
            "picks": picks}


def paired(rows: List[dict], a: str, b: str) -> List[float]:
    """Protocol a's tokens/s over b's, request by request (the same phase, repetition and prompt), in row order:
    the spread of the phase's ratio."""
    of = {(r["phase"], r["rep"]): _rate(r) for r in rows if r["protocol"] == b}
    return [_rate(r) / of[(r["phase"], r["rep"])] for r in rows
            if r["protocol"] == a and of.get((r["phase"], r["rep"]), 0) > 0]


def _rate(row: dict) -> float:
    """A request's tokens/s over its whole time (0 for one that took none)."""
    return row["tokens"] / row["total_s"] if row["total_s"] > 0 else 0.0


def _spread(values: List[float], ci: dict) -> str:
    """Per-request ratios as text: min–max and n below MIN_BOOTSTRAP_N values, the mean's interval from there."""
    if len(values) < MIN_BOOTSTRAP_N:
        return f"{min(values):.2f}–{max(values):.2f}, n={len(values)}"
    return ci_text(ci, form="interval")


def print_summary(report: dict) -> None:
    for phase, e in report["summary"].items():
        cells = ", ".join(f"{k} {v['tokens_per_s']:.2f}" for k, v in e["protocols"].items())
        each = e.get("auto_over_best_fixed_per_request") or []
        spread = f" (per request {min(each):.2f}–{max(each):.2f}, n={len(each)})" if each else ""
        ratio = (f"; auto {e['auto_over_best_fixed']:.2f}x {e['best_fixed']}{spread}" if "auto_over_best_fixed" in e
                 else "")
        held = e.get("auto_over_held_out_best") or {}
        ratio += (f"; {held['ratio']:.2f}x the best fixed picked on the other repetitions (per request "
                  f"{_spread(held['per_request'], held['interval'])})" if held else "")
        err = "; model error " + ", ".join(
            f"{k} {100 * v['median_abs_error']:.0f} %" + (f" ({100 * v['median_abs_error_own_alpha']:.0f} % at the "
                                                          "request's own α)" if "median_abs_error_own_alpha" in v
                                                          else "")
            + (f", phase mean {100 * v['phase_mean_error']:+.0f} %" if "phase_mean_error" in v else "")
            + f" (n={v['n']})"
            for k, v in e["model_error"].items()) if e["model_error"] else ""
        same = e.get("model_error_same_request") or {}
        err += ("; at the same request " + ", ".join(
            f"{k} {100 * v['median_abs_error']:.0f} % (at most {100 * v['max_abs_error']:.0f} %, n={v['n']})"
            for k, v in same.items())) if same else ""
        cloud = e.get("cloud_model_error") or {}
        err += ("; the cloud's compute a token as priced " + ", ".join(
            f"{k} {100 * v['median_error']:+.0f} % (n={v['n']})" for k, v in cloud.items())) if cloud else ""
        drops = ", ".join(f"{k} {v['drops']}" for k, v in e["protocols"].items() if v.get("drops"))
        err += f"; requests' link drops (reconnected, resumed) {drops}" if drops else ""
        print(f"{phase:>16}: tok/s {cells}{ratio}{err}")
