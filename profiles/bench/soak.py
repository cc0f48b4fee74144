"""`hat-bench soak`: many devices under Poisson load for minutes while their links are cut at random (issue 9).

What runs, all real:
- one `hat-cloud serve` process with the model (CurveZMQ with an allow-list of every device's key unless
  `--plaintext`; a short `--session-timeout`, so that a device silent through a long cut has its session and KV
  memory freed while it is away);
- `--hosts` device host processes, each holding the device's parts of the model once and `--devices / --hosts`
  emulated devices: each its own `hat-edge serve` agent (edge_runtime.api.agent: OpenAI endpoint, state reports, its
  own key, its own link policy) behind its own link emulator (testbed.link_emulator; WiFi near/mid/far and
  LTE, round robin), all on a rig (profiles.bench.rig) reaching the driver's. Devices share weights, not state:
  each has its own runtime, caches, cloud connection and sessions;
- the driver: requests arrive as one Poisson process at `--rate`, each at a random device, as streamed
  `/v1/completions` over HTTP (greedy, the protocol drawn per request from `--protocols`, the prompt as token ids,
  `hatspec.tokens` asking for the generated ids); a chaos thread cuts links (reset or stall, mostly devices with a
  request in flight, a share of them longer than the cloud's session timeout) and restores them; a sampler records
  every process's RSS and the cloud's open sessions and KV positions.

Afterwards every answer is checked against a reference: for the exact protocols the model's own greedy continuation
of its prompt (hat_split.models.lm CausalLM.greedy; they must reproduce it at temperature 0), for the lossy ones
(uhlm, cuhlm) the same request replayed after the load, alone and with every link up (deterministic at temperature
0, so cuts and resumed sessions must not change a token):
- completed: the stream ended with a finish reason and `[DONE]`; lost: anything else (HTTP error, broken stream,
  timeout);
- the streamed text equals the text of the returned token ids, and usage counts them (nothing lost or repeated on
  the way to the client);
- tokens equal the reference (under `degrade`, up to the first token the device made alone); a difference is
  classified as duplicated (a run of tokens repeated), lost (a run skipped) or other, and for "other" the margin
  between the reference's top two logits there is recorded (a near tie flips with float rounding: the cloud batches,
  the reference runs alone);
- memory: RSS slope per process over the load, and open sessions / KV positions after a drain of twice the session
  timeout (they must return to 0).
With `--hostile-phases K` the load is cut into K phases of equal length and a hostile device (profiles.bench.hostile:
authenticated, opening sessions with long prompts as fast as the cloud answers, never closing them, sending junk
frames) is on in every second phase, so the well-behaved devices' latencies with and without it are measured in one
run, interleaved. The summary gives TTFT / TBT P50 / P99 and lost answers per side, the P99 TTFT ratio, and what the
hostile device was answered (sessions opened, refusals by code).
Writes JSON and a PNG beside it (profiles.bench.soak_check: the verdicts, the summary, the table and the figure).
"""
from __future__ import annotations

import http.client
import json
import multiprocessing as mp
import os
import threading
import time
import traceback
from typing import Dict, List

import numpy as np
import psutil

from cloud_runtime.quotas import parse_bytes
from edge_runtime.api.agent import AgentConfig
from edge_runtime.config import EdgeConfig, EngineConfig, LinkConfig, SplitConfig
from hat_split.prompt_sets import long_chat_prompts
from hat_split.protocols import get as get_protocol
from hat_split.models.lm import CausalLM
from hat_split.models.loading import eos_ids, load_model, load_tokenizer
from hat_split.models.partition import free_layers
from profiles.bench.bench_args import adapter_dir, names, numbers
from profiles.bench.bench_fleet import poisson_arrivals
from profiles.bench.soak_check import NEAR_TIE, check, failures, hostile_sides, plot, print_summary, summarise
from profiles.bench.rig import Rig
from testbed.link_emulator import send_control
from testbed.links import get_link_profile
from profiles.bench.provenance import write_report

LINKS = ("wifi-near", "wifi-mid", "wifi-far", "lte")
HOSTILE = "hostile"  # the hostile device's name (its key is in the allow-list like any device's)
POLICIES = ("wait", "degrade")


def add_parser(sub) -> None:
    s = sub.add_parser("soak", help="devices under Poisson load with random link cuts: lost/duplicated text, memory")
    s.add_argument("--model", default="smollm2-135m")
    s.add_argument("--m", type=int, default=2, help="layers of the device's input part (split protocols)")
    s.add_argument("--adapter", default="", help="hat-distill artifact (default runs/adapters/<model>-m<m>)")
    s.add_argument("--draft", default="adapter", choices=["adapter", "model"],
                   help="what drafts for the token protocols: HAT's w_S (the device holds only its parts) or the "
                        "whole model")
    s.add_argument("--protocols", default="hat,sd", help="drawn per request")
    s.add_argument("--policies", default="wait,degrade", help="link policies, round robin over the devices")
    s.add_argument("--links", default=",".join(LINKS), help="link profiles, round robin over the devices")
    s.add_argument("--devices", type=int, default=30)
    s.add_argument("--hosts", type=int, default=3, help="device host processes (devices share their weights)")
    s.add_argument("--duration", type=float, default=600.0, help="seconds of arrivals")
    s.add_argument("--rate", type=float, default=0.2, help="fleet request rate, requests/s")
    s.add_argument("--max-tokens", type=int, default=32)
    s.add_argument("--prompts", type=int, default=24, help="pool of held-out ShareGPT prompts")
    s.add_argument("--min-prompt-tokens", type=int, default=32)
    s.add_argument("--max-prompt-tokens", type=int, default=384)
    s.add_argument("--cut-rate", type=float, default=0.1, help="link cuts per second over the fleet")
    s.add_argument("--cut-seconds", default="0.5,8", help="a cut lasts uniformly this long (min,max)")
    s.add_argument("--long-cuts", type=float, default=0.1, help="share of cuts lasting --long-cut-seconds")
    s.add_argument("--long-cut-seconds", type=float, default=45.0)
    s.add_argument("--session-timeout", type=float, default=30.0, help="the cloud's (seconds)")
    s.add_argument("--heartbeat", type=float, default=3.0, help="the devices' ZMTP heartbeat (seconds)")
    s.add_argument("--report-interval", type=float, default=10.0, help="each agent's state report (seconds)")
    s.add_argument("--sample-every", type=float, default=5.0, help="memory samples (seconds)")
    s.add_argument("--request-timeout", type=float, default=900.0, help="a client gives up after this (seconds)")
    s.add_argument("--plaintext", action="store_true", help="no CurveZMQ (default: every link encrypted)")
    s.add_argument("--threads", type=int, default=1, help="torch threads of the cloud")
    s.add_argument("--kv-memory", default="auto", help="the cloud's KV budget (hat-cloud serve --kv-memory)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--hostile-phases", type=int, default=0,
                   help="cut the load into this many phases, a hostile device on in every second one (0: none)")
    s.add_argument("--hostile-prompt-tokens", type=int, default=1500, help="the hostile device's prompts")
    s.add_argument("--hostile-outstanding", type=int, default=8, help="its requests in flight at once")
    s.add_argument("--out", default="runs/soak.json")


# -- a device host process -------------------------------------------------------------------------------------
def _host_main(conn, spec: dict) -> None:
    """Loads the model once, starts its agents (each behind its own link emulator, all on one rig reaching the
    driver's cloud), reports their addresses, and serves until the driver sends None."""
    import torch

    torch.set_num_threads(1)
    with Rig(upstream=spec["upstream"], keys=spec["keys"]) as bed:
        try:
            loaded = load_model(spec["model"], dtype="float32", quiet=True)
            if spec["draft"] == "adapter":  # the device holds its parts only: the middle layers run in the cloud
                free_layers(loaded.model, range(spec["m"] + 1, loaded.model.config.num_hidden_layers))
            table = []
            for d in spec["devices"]:
                link = get_link_profile(d["link"])
                emu = bed.add_link(link, control=True)
                split = SplitConfig(m=spec["m"], adapter=spec["adapter"], up_bps=8 * link.rate("up"),
                                    down_bps=8 * link.rate("down"), parallel_draft=False)
                link_cfg = LinkConfig(emu.address, device_id=d["name"], security=bed.security(d["name"]),
                                      link_policy=d["policy"], heartbeat_s=spec["heartbeat"], request_timeout_s=120.0,
                                      reconnect_timeout_s=600.0)
                engine = EngineConfig(threads=1, dtype="float32", token_draft=spec["draft"])
                edge = EdgeConfig(model=spec["model"], link=link_cfg, engine=engine, split=split, draft_len=8,
                                  draft_stop_prob=0.6 if spec["draft"] == "adapter" else 0.0)
                agent = bed.agent(AgentConfig(edge, port=0, report_interval_s=spec["report_interval"]), loaded)
                table.append({**{k: d[k] for k in ("name", "link", "policy")}, "http": agent.address,
                              "control": list(emu.control_address)})
            conn.send(("ready", table))
            conn.recv()  # None: stop
        except Exception as exc:  # noqa: BLE001 - reported to the driver, which stops the run with it
            conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


# -- one client request ----------------------------------------------------------------------------------------
def stream_completion(http_address: str, body: dict, timeout_s: float) -> dict:
    """POST a streamed /v1/completions; what arrived, with client-side times (seconds since the request was sent)."""
    host, port = http_address.split("//")[1].rsplit(":", 1)
    out: dict = {"deltas": [], "times": [], "finish": None, "hatspec": None, "usage": None, "done": False,
                 "finals": 0, "error": None}
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            out["error"] = f"HTTP {resp.status}: {resp.read()[:300].decode(errors='replace')}"
            return out
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                out["done"] = True
                break
            event = json.loads(data)
            if "error" in event:
                out["error"] = str(event["error"])
                continue
            if event.get("usage"):
                out["usage"] = event["usage"]
            for choice in event.get("choices", []):
                if choice.get("text"):
                    out["deltas"].append(choice["text"])
                    out["times"].append(time.perf_counter() - t0)
                if choice.get("finish_reason"):
                    out["finish"] = choice["finish_reason"]
                    out["finals"] += 1
            if "hatspec" in event:
                out["hatspec"] = event["hatspec"]
    except (OSError, http.client.HTTPException, ValueError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
        out["wall_s"] = time.perf_counter() - t0
    return out


# -- the driver ------------------------------------------------------------------------------------------------
class _Sampler(threading.Thread):
    def __init__(self, pids: Dict[str, int], status_path: str, every_s: float, t0: float, in_flight):
        super().__init__(daemon=True)
        self.pids, self.status_path, self.every_s, self.t0, self.in_flight = pids, status_path, every_s, t0, in_flight
        self.samples: List[dict] = []
        self.stop = threading.Event()

    def run(self) -> None:
        procs = {name: psutil.Process(pid) for name, pid in self.pids.items()}
        while True:
            rss = {}
            for name, p in procs.items():
                try:
                    rss[name] = p.memory_info().rss / 2 ** 20
                except psutil.Error:
                    pass
            cloud = {}
            try:
                with open(self.status_path, encoding="utf-8") as f:
                    status = json.load(f)
                cloud = {**status.get("sessions", {}), "expired": status["server"]["sessions_expired"],
                         "errors": status["server"]["errors_by_code"]}
            except (OSError, ValueError, KeyError):
                pass
            self.samples.append({"t": time.perf_counter() - self.t0, "rss_mb": rss, "cloud": cloud,
                                 "in_flight": self.in_flight()})
            if self.stop.wait(self.every_s):
                return


def _stop_hosts(conns: list, hosts: list) -> None:
    """Ask every device host to stop (its agents and links close), then wait for it; kill one that hangs."""
    for c in conns:
        try:
            c.send(None)
        except OSError:
            pass
    for p in hosts:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()


def _start_hosts(args, bed: Rig, devices: List[str], links: List[str], policies: List[str], adapter: str):
    """The device host processes (stopped by the rig's teardown, before the cloud); (processes, every device's
    name, link, policy, HTTP address and link control address, sorted by name) once all are serving."""
    ctx = mp.get_context("spawn")
    hosts: list = []
    conns: list = []
    bed.defer(_stop_hosts, conns, hosts)
    for h in range(args.hosts):
        mine = [{"name": n, "link": links[i % len(links)], "policy": policies[i % len(policies)]}
                for i, n in enumerate(devices) if i % args.hosts == h]
        spec = {"model": args.model, "m": args.m, "adapter": adapter, "draft": args.draft,
                "upstream": bed.upstream, "keys": {d["name"]: bed.security(d["name"]) for d in mine},
                "heartbeat": args.heartbeat, "report_interval": args.report_interval, "devices": mine}
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_host_main, args=(child, spec), daemon=True)
        p.start()
        hosts.append(p)
        conns.append(parent)
    table: List[dict] = []
    for c in conns:
        if not c.poll(900):
            raise RuntimeError("a device host did not start within 900 s")
        kind, value = c.recv()
        if kind != "ready":
            raise RuntimeError(f"a device host failed:\n{value}")
        table += value
    return hosts, sorted(table, key=lambda d: d["name"])


def run(args) -> int:
    protocols = names(args.protocols, ("hat", "ushape", "sd", "hlm", "llm", "uhlm", "cuhlm", "qs"), "protocol")
    policies = names(args.policies, POLICIES, "link policy")
    links = [get_link_profile(x).name for x in args.links.split(",") if x]
    cut_lo, cut_hi = numbers(args.cut_seconds)
    if args.hostile_phases < 0 or args.hostile_phases == 1:
        raise ValueError("--hostile-phases must be 0 (none) or >= 2 (phases without and with the hostile device)")
    if not (args.devices >= 1 and 1 <= args.hosts <= args.devices and args.duration > 0 and args.rate > 0
            and args.cut_rate >= 0 and 0 < cut_lo <= cut_hi and 0 <= args.long_cuts <= 1 and links):
        raise ValueError("need devices >= hosts >= 1, duration and rate > 0, cut rate >= 0, 0 < cut min <= max, "
                         "long-cut share in [0, 1] and at least one link")
    if args.kv_memory != "auto":
        parse_bytes(args.kv_memory, "--kv-memory")  # a bad size fails here, before anything starts
    needs_adapter = "hat" in protocols or args.draft == "adapter"
    adapter = adapter_dir(args.adapter, args.model, args.m, needs_adapter)
    rng = np.random.default_rng(args.seed)

    tok = load_tokenizer(args.model)
    prompts = long_chat_prompts(tok, args.prompts, args.min_prompt_tokens, args.max_prompt_tokens)
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    names_ = [f"soak-{i:02d}" for i in range(args.devices)]
    report: dict = {"args": vars(args), "adapter": adapter, "prompt_tokens": [len(p) for p in prompts]}
    t_start = time.perf_counter()
    print(f"hat-bench soak: cloud ({args.model}), {args.devices} devices in {args.hosts} host processes, "
          f"{'plaintext' if args.plaintext else 'CurveZMQ'}", flush=True)
    cloud_args = ["--dtype", "float32", "--session-timeout", str(args.session_timeout), "--max-sessions",
                  str(2 * args.devices + 8), "--kv-memory", args.kv_memory]
    keyed = names_ + ([HOSTILE] if args.hostile_phases else [])
    with Rig(args.model, cloud_args=cloud_args, threads=args.threads, devices=keyed, secure=not args.plaintext,
                 status_interval_s=1.0) as bed:
        hosts, devices = _start_hosts(args, bed, names_, links, policies, adapter)
        report["devices"] = devices
        hostile = _start_hostile(args, bed, tok) if args.hostile_phases else None
        records = _load(args, devices, prompts, protocols, rng, bed.cloud, hosts, bed.status_path, report, hostile)
        replays = _replays(args, records, devices, prompts)
        if replays:
            print(f"hat-bench soak: {len(replays)} calm replays of the lossy protocols' requests", flush=True)
    print("hat-bench soak: checking every answer against its reference (greedy or calm replay)", flush=True)
    _verify(args, records, prompts, replays)
    report["summary"] = summarise(records, report["cuts"], report["memory"], report["load_end_s"])
    if args.hostile_phases:
        report["summary"]["hostile"] = {**hostile_sides(records), "answers": report["hostile_answers"]}
    report["requests"] = [{k: v for k, v in r.items() if k != "response"} | {"times": r["response"]["times"]}
                          for r in records]
    report["seconds"] = time.perf_counter() - t_start
    write_report(args.out, report)
    print_summary(report)
    note = plot(os.path.splitext(args.out)[0] + ".png", report)
    print(f"hat-bench soak: {report['seconds']:.0f} s; wrote {args.out}" + (f" ({note})" if note else ""))
    failed = failures(report["summary"])
    for line in failed:
        print(f"hat-bench soak: FAILED: {line}")
    return 1 if failed else 0


def _start_hostile(args, bed: Rig, tok):
    """The hostile device's process (off until the driver switches it on); the driver's end of its pipe."""
    from hat_split.models.loading import vocab_fingerprint
    from profiles.bench.hostile import hostile_main

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    spec = {"endpoint": bed.endpoint, "security": bed.security(HOSTILE), "device_id": HOSTILE, "model": args.model,
            "vocab_size": len(tok), "vocab_fingerprint": vocab_fingerprint(tok),
            "prompt_tokens": args.hostile_prompt_tokens, "outstanding": args.hostile_outstanding, "seed": args.seed}
    proc = ctx.Process(target=hostile_main, args=(child, spec), daemon=True)
    proc.start()
    bed.defer(proc.join, 10)
    return parent


def hostile_on(args, at_s: float) -> bool:
    """Whether the hostile device is on at `at_s` seconds into the load: phases of duration / K, on in the odd ones."""
    return bool(args.hostile_phases) and int(at_s // (args.duration / args.hostile_phases)) % 2 == 1


def _body(args, prompts, rec: dict) -> dict:
    """A record's request: its prompt as token ids, greedy, streamed with usage, asking for the generated ids.
    The seed follows from --seed and the prompt's index: U-HLM's uncertainty draws from the request's random stream
    even when greedy, so a lossy answer is reproducible only with its seed (a request without one gets a fresh one)."""
    return {"model": args.model, "prompt": prompts[rec["prompt"]], "max_tokens": rec["max_tokens"],
            "temperature": 0, "seed": args.seed * 1000 + rec["prompt"], "stream": True,
            "stream_options": {"include_usage": True},
            "hatspec": {"protocol": rec["protocol"], "tokens": True}}


def _replays(args, records: List[dict], devices: List[dict], prompts) -> Dict[tuple, dict]:
    """The reference of the lossy protocols (uhlm, cuhlm: the draft's own tokens where it skips): each (prompt,
    protocol, max_tokens) asked once more after the load, one request at a time, on the device of its first request,
    with every link up. At temperature 0 the protocol is deterministic, so an answer of the load, with its cuts and
    resumed sessions, must equal its calm replay."""
    by_name = {d["name"]: d for d in devices}
    out: Dict[tuple, dict] = {}
    for rec in records:
        key = (rec["prompt"], rec["protocol"], rec["max_tokens"])
        if key not in out and not get_protocol(rec["protocol"]).exact:
            out[key] = stream_completion(by_name[rec["device"]]["http"], _body(args, prompts, rec),
                                         args.request_timeout)
    return out


def _load(args, devices: List[dict], prompts, protocols, rng, cloud, hosts, status_path: str, report: dict,
          hostile=None):
    """Warm-up, then arrivals, cuts and memory samples (and the hostile device's phases); returns one record per
    request."""

    def request(rec: dict, device: dict) -> None:
        with lock:
            busy[device["name"]] += 1
        try:
            rec["response"] = stream_completion(device["http"], _body(args, prompts, rec), args.request_timeout)
        finally:
            with lock:
                busy[device["name"]] -= 1

    lock = threading.Lock()
    busy = {d["name"]: 0 for d in devices}
    # warm-up: one short request per device, all at once (every device connected, every cloud path compiled)
    warm = [{"prompt": i % len(prompts), "max_tokens": 4, "protocol": protocols[i % len(protocols)]}
            for i in range(len(devices))]
    threads = [threading.Thread(target=request, args=(w, d)) for w, d in zip(warm, devices)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bad = [(d["name"], w["response"]["error"]) for w, d in zip(warm, devices) if w["response"]["error"]
           or not w["response"]["done"]]
    if bad:
        raise RuntimeError(f"warm-up failed on {len(bad)} devices, e.g. {bad[0]}")
    print(f"hat-bench soak: {len(devices)} devices warm; load for {args.duration:.0f} s", flush=True)

    t0 = time.perf_counter()
    pids = {"cloud": cloud.proc.pid, **{f"host-{i}": p.pid for i, p in enumerate(hosts)}, "driver": os.getpid()}
    sampler = _Sampler(pids, status_path, args.sample_every, t0, lambda: sum(busy.values()))
    sampler.start()
    stop_chaos = threading.Event()
    cuts: List[dict] = []
    restores: List[threading.Timer] = []
    cut_until = {d["name"]: 0.0 for d in devices}

    def chaos() -> None:
        crng = np.random.default_rng(args.seed + 1)
        while args.cut_rate > 0 and not stop_chaos.wait(float(crng.exponential(1.0 / args.cut_rate))):
            now = time.perf_counter() - t0
            free = [d for d in devices if cut_until[d["name"]] <= now]
            with lock:
                in_flight = [d for d in free if busy[d["name"]]]
            if not free:
                continue
            pool = in_flight if in_flight and crng.random() < 0.8 else free
            d = pool[int(crng.integers(len(pool)))]
            long = bool(crng.random() < args.long_cuts)
            seconds = args.long_cut_seconds if long else float(crng.uniform(*numbers(args.cut_seconds)))
            mode = "reset" if crng.random() < 0.5 else "stall"
            address = tuple(d["control"])
            send_control(address, f"cut {mode}")
            cut_until[d["name"]] = now + seconds
            cuts.append({"t": now, "device": d["name"], "mode": mode, "seconds": seconds, "long": long,
                         "busy": d in in_flight})
            timer = threading.Timer(seconds, send_control, args=(address, "restore"))
            timer.daemon = True
            timer.start()
            restores.append(timer)

    chaos_thread = threading.Thread(target=chaos, daemon=True)
    chaos_thread.start()

    def phases() -> None:  # the hostile device on in every second phase
        for k in range(args.hostile_phases):
            at = t0 + k * args.duration / args.hostile_phases
            if stop_chaos.wait(max(0.0, at - time.perf_counter())):
                break
            hostile.send("on" if k % 2 else "off")
        stop_chaos.wait()
        hostile.send("off")

    if hostile is not None:
        threading.Thread(target=phases, daemon=True).start()
    arrivals = poisson_arrivals(args.rate, args.duration, len(devices), len(prompts), args.seed)
    records, threads = [], []
    for k, (at, device, prompt) in enumerate(arrivals):
        wait = t0 + at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        rec = {"id": k, "arrival_s": at, "device": devices[device]["name"], "policy": devices[device]["policy"],
               "link": devices[device]["link"], "prompt": prompt,
               "protocol": protocols[int(rng.integers(len(protocols)))],
               "max_tokens": args.max_tokens, "hostile_on": hostile_on(args, at)}
        records.append(rec)
        t = threading.Thread(target=request, args=(rec, devices[device]), daemon=True)
        t.start()
        threads.append(t)
    stop_chaos.set()
    chaos_thread.join()
    for timer in restores:
        timer.join()  # every link restored
    load_end = time.perf_counter() - t0
    deadline = time.monotonic() + args.request_timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    for rec in records:
        rec.setdefault("response", {"error": "no answer before the driver stopped waiting", "done": False,
                                    "finals": 0, "deltas": [], "times": [], "hatspec": None, "usage": None})
    drained = time.perf_counter() - t0
    print(f"hat-bench soak: {len(records)} requests answered or given up at {drained:.0f} s; draining "
          f"{2 * args.session_timeout:.0f} s", flush=True)
    if hostile is not None:
        hostile.send(None)
        report["hostile_answers"] = hostile.recv()[1] if hostile.poll(30) else "no answer"
    time.sleep(2 * args.session_timeout + 2)  # idle sessions expire; memory should settle
    settle = time.monotonic() + 2 * args.session_timeout  # work still queued then (a flood's) expires once done
    while sampler.samples and sampler.samples[-1]["cloud"].get("open") and time.monotonic() < settle:
        time.sleep(args.sample_every)
    sampler.stop.set()
    sampler.join()
    report.update(cuts=cuts, memory=sampler.samples, load_end_s=load_end, answered_s=drained, arrivals=len(arrivals))
    return records


def _verify(args, records: List[dict], prompts, replays: Dict[tuple, dict]) -> None:
    """Each record's verdict: an exact protocol's answer against the model's greedy continuation, a lossy one's
    against its calm replay (`_replays`; a replay that failed leaves the answer's tokens unchecked, said so)."""
    loaded = load_model(args.model, dtype="float32", quiet=True)
    lm = CausalLM(loaded.model)
    eos = eos_ids(loaded.model, loaded.tokenizer)
    refs: Dict[tuple, List[int]] = {}
    for rec in records:
        replay = replays.get((rec["prompt"], rec["protocol"], rec["max_tokens"]))
        if replay is not None:
            ref = (replay.get("hatspec") or {}).get("tokens") if replay["error"] is None and replay["done"] else None
            rec["reference_kind"] = "replay" if ref is not None else f"none (the replay failed: {replay['error']})"
        else:
            key = (rec["prompt"], rec["max_tokens"])
            if key not in refs:
                refs[key] = lm.greedy(prompts[rec["prompt"]], rec["max_tokens"], eos)
            ref, rec["reference_kind"] = refs[key], "greedy"
        rec["verdict"] = v = check(rec, ref, rec["max_tokens"], eos,
                                   lambda ids: loaded.tokenizer.decode(ids, skip_special_tokens=True))
        if v["completed"] and v["reference"]["match"] == "other" and rec["reference_kind"] == "greedy":
            # how close the reference's choice was there
            at = v["reference"]["at"]
            logits = lm.forward(lm.new_state(), list(prompts[rec["prompt"]]) + refs[key][:at])[-1]
            top = np.argsort(-logits)[:2]
            got = rec["response"]["hatspec"]["tokens"][at]
            v["reference"].update(margin=float(logits[top[0]] - logits[top[1]]),
                                  near_tie=bool(got == int(top[1]) and logits[top[0]] - logits[top[1]] < NEAR_TIE))
