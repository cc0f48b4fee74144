"""`hat-edge generate`: generate on the device together with the cloud, streaming accepted text.
`hat-edge serve`: the long-running agent (edge_runtime.api.agent) a fleet starts on every device.

Both take `--config FILE` (TOML): `generate` an EdgeConfig, `serve` an AgentConfig (the EdgeConfig is its [edge]
table). Flags typed on the command line override the file's keys."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any, Dict, List

from edge_runtime.api.agent import AgentConfig, run_agent
from edge_runtime.client import CloudError, CloudUnavailable
from edge_runtime.config import (
    BACKENDS,
    CHUNKING_MODES,
    LINK_POLICIES,
    OVERLAP_MODES,
    PRECISIONS,
    TOKEN_DRAFTS,
    EdgeConfig,
    EngineConfig,
    LinkConfig,
    QSConfig,
    SplitConfig,
    UncertaintyConfig,
)
from edge_runtime.policy.policies import POLICIES
from edge_runtime.runtime import EdgeRuntime
from hat_split.files.config_file import add_config_argument, config_from_command_line, with_overrides
from hat_split.math.calibration import THRESHOLD_RULES, load
from hat_split.math.sampling import SamplingParams
from hat_split.models.llamacpp_lib import FALLBACK_NOTE, llama_cpp_installed
from hat_split.models.lm import wait_passively
from hat_split.models.registry import MODEL_DTYPES, WEIGHT_QUANTS
from hat_split.protocols import NAMES
from hat_split.version import describe
from hat_split.wire.hidden_codec import HIDDEN_FORMATS

FLAG_KEYS = {  # argparse dest → the EdgeConfig key (dotted: nested table) it sets
    "server": "link.server", "device_id": "link.device_id", "connect_timeout": "link.connect_timeout_s",
    "retries": "link.connect_retries", "heartbeat": "link.heartbeat_s", "reconnect_timeout": "link.reconnect_timeout_s",
    "link_policy": "link.link_policy", "curve_secret": "link.security.secret_key",
    "curve_server_key": "link.security.server_key",
    "backend": "engine.backend", "bundle": "engine.bundle", "precision": "engine.precision",
    "threads": "engine.threads", "dtype": "engine.dtype", "device": "engine.device",
    "weight_quant": "engine.weight_quant",
    "token_draft": "engine.token_draft", "n_ctx": "engine.n_ctx", "n_batch": "engine.n_batch",
    "n_gpu_layers": "engine.n_gpu_layers",
    "device_profile": "device_profile", "draft_len": "draft_len", "draft_stop_prob": "draft_stop_prob",
    "dist_dtype": "dist_dtype", "overlap_prefill": "overlap_prefill",
    "ell": "qs.ell", "k": "qs.k", "alpha": "qs.alpha", "eta": "qs.eta", "beta": "qs.beta",
    "budget_bits": "qs.budget_bits", "policy": "qs.policy", "policy_file": "qs.policy_file",
    "m": "split.m", "tail": "split.tail", "adapter": "split.adapter", "hidden_format": "split.hidden_format",
    "hat_eta": "split.eta", "max_draft": "split.max_draft", "chunking": "split.chunking",
    "chunk_tokens": "split.chunk_tokens", "pd_topk": "split.pd_topk", "up_bps": "split.up_bps",
    "down_bps": "split.down_bps", "draft_vocab": "split.draft_vocab",
}
AGENT_KEYS = {"host": "host", "port": "port", "report_interval": "report_interval_s", "status_file": "status_file",
              "mode_every": "mode_every"}  # argparse dest → the AgentConfig key it sets


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hat-edge", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text for one or more prompts")
    g.add_argument("prompt", nargs="*", help="prompt text (or use --prompts-file)")
    g.add_argument("--prompts-file", help='a JSON list of prompts (strings or {"text": ..., "chat": bool}), or a '
                   "text file with one prompt per line")
    _add_edge_args(g)
    g.add_argument("--json", metavar="PATH",
                   help="write a machine-readable result ('-' for stdout, text then on stderr)")
    g.add_argument("--quiet", action="store_true", help="do not stream text")
    w = sub.add_parser("version", help="this installation: hatspec and protocol version, Python, build, engines")
    w.add_argument("--json", action="store_true", help="one JSON line")
    v = sub.add_parser("serve", help="the long-running agent: state reports to the cloud, HTTP on the device")
    _add_edge_args(v)
    v.add_argument("--host", default="127.0.0.1", help="HTTP address (default: this device only)")
    v.add_argument("--port", type=int, default=8642)
    v.add_argument("--report-interval", type=float, default=10.0, metavar="S",
                   help="seconds between state reports to the cloud (power mode, drafting delay)")
    v.add_argument("--status-file", default="", metavar="PATH", help="rewrite the agent's status JSON here")
    v.add_argument("--mode-cycle", default="", metavar="MODES",
                   help="nvpmodel modes of --device-profile to switch among, comma separated (HAT's testbed; root)")
    v.add_argument("--mode-every", type=int, default=0, metavar="N", help="requests between mode switches")
    return ap


def _add_edge_args(g) -> None:
    """The draft, the link and the protocols' settings: shared by generate and serve."""
    d = {**EdgeConfig.__dataclass_fields__, **LinkConfig.__dataclass_fields__, **EngineConfig.__dataclass_fields__}
    add_config_argument(g, "device (generate: EdgeConfig; serve: AgentConfig with an [edge] table)")
    g.add_argument("--model", default="", help="draft model: registry name, HF directory or .gguf file (the torch "
                                                "backend; a --bundle names its own)")
    g.add_argument("--server", default=d["server"].default, help="cloud endpoint (default %(default)s)")
    g.add_argument("--protocol", default="sd",
                   help=f"one of {', '.join(NAMES)}; several separated by commas run one after another (serve: "
                        "the default of requests that name none)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--draft-len", type=int, default=d["draft_len"].default, help="γ for sd")
    g.add_argument("--dist-dtype", default=d["dist_dtype"].default, choices=["float16", "float32"])
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    g.add_argument("--connect-timeout", type=float, default=d["connect_timeout_s"].default)
    g.add_argument("--curve-secret", default="", metavar="FILE", help="this device's secret key (hat-keys generate)")
    g.add_argument("--curve-server-key", default="", metavar="FILE", help="the cloud's public key (NAME.key)")
    g.add_argument("--plaintext", action="store_true", help="no encryption or authentication of the link (a lab)")
    g.add_argument("--link-policy", default=d["link_policy"].default, choices=LINK_POLICIES,
                   help="when the link drops mid-answer: wait (pause, reconnect, resume), degrade (the device goes on "
                        "alone meanwhile, tokens marked), fail")
    g.add_argument("--heartbeat", type=float, default=d["heartbeat_s"].default, metavar="S",
                   help="a link silent this long counts as dropped (ZMTP heartbeats)")
    g.add_argument("--reconnect-timeout", type=float, default=d["reconnect_timeout_s"].default, metavar="S")
    g.add_argument("--device-id", default=d["device_id"].default, help="this device's name in the cloud's logs")
    g.add_argument("--device-profile", default="", help="this board's profile (hat-profile list), reported to the "
                                                      "cloud with its power mode and drafting delay")
    g.add_argument("--retries", type=int, default=d["connect_retries"].default)
    g.add_argument("--threads", type=int, default=0, help="torch or llama.cpp threads (0: their default)")
    g.add_argument("--dtype", default=d["dtype"].default, choices=MODEL_DTYPES, help="draft model dtype")
    g.add_argument("--device", default=d["device"].default, metavar="auto|cpu|cuda|cuda:N",
                   help="torch backend: where the draft runs (default %(default)s: a CUDA GPU when present, as a "
                        "Jetson's; else the CPU)")
    g.add_argument("--weight-quant", default=d["weight_quant"].default, choices=WEIGHT_QUANTS,
                   help="int8: dynamic int8 linear layers for the draft (CPU, ~2x faster drafting)")
    g.add_argument("--draft-stop-prob", type=float, default=d["draft_stop_prob"].default,
                   help="η: end a draft after a token whose draft probability is below η (0: always --draft-len)")
    g.add_argument("--backend", "--engine", dest="backend", default=d["backend"].default, choices=BACKENDS,
                   help="what runs the draft: torch (--model), onnxruntime / tensorrt (a hat-export --bundle), or "
                        "llamacpp (--model's GGUF file on llama.cpp; token protocols)")
    g.add_argument("--n-ctx", type=int, default=d["n_ctx"].default,
                   help="llamacpp: KV positions of the draft's context (default %(default)s)")
    g.add_argument("--n-batch", type=int, default=d["n_batch"].default,
                   help="llamacpp: tokens per llama_decode (default %(default)s)")
    g.add_argument("--n-gpu-layers", type=int, default=d["n_gpu_layers"].default,
                   help="llamacpp: layers on the GPU of a CUDA build, -1 all (default %(default)s)")
    g.add_argument("--bundle", default="", help="hat-export bundle directory for --backend onnxruntime / tensorrt")
    g.add_argument("--precision", default=d["precision"].default, choices=PRECISIONS,
                   help="which of the bundle's artifacts (default %(default)s)")
    g.add_argument("--providers", default="", help="onnxruntime execution providers, comma separated (default: the "
                                                   "available ones, TensorRT → CUDA → CPU)")
    g.add_argument("--token-draft", default=d["token_draft"].default, choices=TOKEN_DRAFTS,
                   help="what drafts for token protocols: the whole model, or the split draft of --adapter (a device "
                        "holding only its parts of a large model)")
    g.add_argument("--overlap-prefill", default=d["overlap_prefill"].default, choices=OVERLAP_MODES,
                   help="run the draft's prompt prefill while the cloud prefills (auto: unless the server is local)")
    u = g.add_argument_group("uhlm / randhlm / cuhlm (U-HLM, CU-HLM); unset flags come from --calibration, "
                             "else the papers' values")
    ud = UncertaintyConfig.__dataclass_fields__
    u.add_argument("--calibration", metavar="PATH", help="a hat-calibrate file: rejection line, threshold, k*, M, θmax")
    u.add_argument("--threshold-rule", choices=THRESHOLD_RULES, default="risk-prone",
                   help="which calibrated threshold --calibration sets (default %(default)s, U-HLM Theorem 1)")
    u.add_argument("--u-threshold", type=float, help=f"skip the upload when uncertainty u <= this (-1: never skip; "
                                                     f"default {ud['u_threshold'].default})")
    u.add_argument("--perturb-samples", type=int, help=f"M temperatures (default {ud['samples'].default})")
    u.add_argument("--theta-max", type=float, help=f"temperatures ~ U[0, θmax] (default {ud['theta_max'].default})")
    u.add_argument("--skip-prob", type=float,
                   help=f"randhlm skip probability (default {ud['random_skip_prob'].default})")
    u.add_argument("--beta-line", type=float, nargs=2, metavar=("A", "B"),
                   help=f"rejection model β = A·u + B (default {ud['beta_a'].default} {ud['beta_b'].default})")
    u.add_argument("--k-mode", choices=["online", "offline"], help=f"default {ud['k_mode'].default}")
    u.add_argument("--k-offline", type=int, help=f"cuhlm offline k* (default {ud['k_offline'].default})")
    u.add_argument("--k-theta", type=float, help=f"tolerance θ for k (default {ud['k_theta'].default})")
    u.add_argument("--prob-bits", type=int, help=f"bits per uploaded probability (default {ud['prob_bits'].default})")
    u.add_argument("--exact", action="store_true", default=None,
                   help="cuhlm: sample the draft from the distribution it sends")
    q = g.add_argument_group("qs / ksqs / csqs / sq (QS-SD, SQS-SD)")
    qd = QSConfig.__dataclass_fields__
    q.add_argument("--ell", type=int, default=qd["ell"].default, help="lattice resolution ℓ (default %(default)s)")
    q.add_argument("--k", type=int, default=qd["k"].default, help="ksqs support size K (default %(default)s)")
    q.add_argument("--alpha", type=float, default=qd["alpha"].default, help="csqs target dropped mass α")
    q.add_argument("--eta", type=float, default=qd["eta"].default, help="csqs threshold learning rate η")
    q.add_argument("--beta", type=float, default=qd["beta"].default, help="csqs initial threshold β1")
    q.add_argument("--budget-bits", type=int, default=0,
                   help="B > 0: draft the longest L whose distributions fit in B bits per round (SQS: 5000)")
    q.add_argument("--policy", choices=POLICIES, default="static",
                   help="(L, ℓ) per round: static (--draft-len, --ell), heuristic (QS-SD §V) or dqn")
    q.add_argument("--policy-file", default="", help="dqn: a hat-train-policy network (.npz)")
    h = g.add_argument_group("ushape / hat (HAT: the model is cut; --model is the large model, "
                             "the cloud runs its middle)")
    hd = SplitConfig.__dataclass_fields__
    h.add_argument("--m", type=int, default=hd["m"].default,
                   help="layers of the device's input part (default %(default)s; a --bundle brings its own cut)")
    h.add_argument("--tail", type=int, default=0, help="last layers kept on the device with the head")
    h.add_argument("--adapter", default="", help="hat: a hat-distill adapter directory")
    h.add_argument("--hidden-format", default=hd["hidden_format"].default, choices=HIDDEN_FORMATS)
    h.add_argument("--hat-eta", type=float, default=hd["eta"].default, help="drafting threshold η (eq. 5)")
    h.add_argument("--max-draft", type=int, default=hd["max_draft"].default)
    h.add_argument("--chunking", default=hd["chunking"].default, choices=CHUNKING_MODES,
                   help="prompt chunking: auto = the cloud's eq. 3 chunk size, off = one chunk")
    h.add_argument("--chunk-tokens", type=int, default=0, help="fixed prompt chunk size (overrides --chunking)")
    h.add_argument("--no-parallel-draft", action="store_true", help="hat: no drafting while the cloud verifies")
    h.add_argument("--pd-topk", type=int, default=hd["pd_topk"].default, help="candidates of parallel drafting")
    h.add_argument("--draft-vocab", type=int, default=0, metavar="N",
                   help="hat: draft over the adapter's N most frequent tokens (a smaller head; exact output)")
    h.add_argument("--up-bps", type=float, default=0.0, help="initial uplink estimate, bit/s (a link profile's)")
    h.add_argument("--down-bps", type=float, default=0.0, help="initial downlink estimate, bit/s")


def _load_prompts(args) -> list:
    """[(text, chat)] from the positional prompts and --prompts-file."""
    prompts = [(p, args.chat) for p in args.prompt]
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            raw = f.read()
        try:
            loaded = json.loads(raw)
        except json.JSONDecodeError:
            loaded = [line for line in raw.splitlines() if line.strip()]
        if not isinstance(loaded, list):
            raise ValueError(f"{args.prompts_file}: expected a JSON list or one prompt per line")
        for item in loaded:
            if isinstance(item, str):
                prompts.append((item, args.chat))
            elif isinstance(item, dict) and isinstance(item.get("text"), str):
                prompts.append((item["text"], bool(item.get("chat", args.chat))))
            else:
                raise ValueError(f"{args.prompts_file}: each prompt must be a string or an object with a 'text'")
    if not prompts:
        raise ValueError("no prompt given")
    return prompts


def _uncertainty_config(args, base: UncertaintyConfig = UncertaintyConfig()) -> UncertaintyConfig:
    """`base` (the papers' defaults, or the config file's), then the calibration file, then explicit flags."""
    if args.calibration:
        base = base.calibrated(load(args.calibration), args.threshold_rule)
    flags = {"u_threshold": args.u_threshold, "samples": args.perturb_samples, "theta_max": args.theta_max,
             "random_skip_prob": args.skip_prob, "k_mode": args.k_mode, "k_offline": args.k_offline,
             "k_theta": args.k_theta, "prob_bits": args.prob_bits, "exact": args.exact}
    if args.beta_line is not None:
        flags.update(beta_a=args.beta_line[0], beta_b=args.beta_line[1])
    return dataclasses.replace(base, **{k: v for k, v in flags.items() if v is not None})


def _flag_values(args) -> Dict[str, Dict[str, Any]]:
    """What each EdgeConfig flag sets: argparse dest → {dotted key: value}."""
    out = {dest: {key: getattr(args, dest)} for dest, key in FLAG_KEYS.items()}
    out["model"] = {"model": args.model or args.bundle}
    out["plaintext"] = {"link.security.mode": "plaintext" if args.plaintext else "curve"}
    out["providers"] = {"engine.providers": tuple(p for p in args.providers.split(",") if p)}
    out["no_parallel_draft"] = {"split.parallel_draft": not args.no_parallel_draft}
    return out


def _require_model(args) -> None:
    if not (args.config or args.model or args.bundle):
        raise ValueError("give --model (torch backend) or --bundle (onnxruntime / tensorrt), or --config FILE")


def _agent_values(args, protocols: List[str]) -> Dict[str, Dict[str, Any]]:
    """What each AgentConfig flag sets: argparse dest → {key: value}; the EdgeConfig flags set its [edge] table."""
    out = {dest: {f"edge.{key}": value for key, value in keys.items()} for dest, keys in _flag_values(args).items()}
    out.update({dest: {key: getattr(args, dest)} for dest, key in AGENT_KEYS.items()})
    out["protocol"] = {"default_protocol": protocols[0]}
    out["mode_cycle"] = {"mode_cycle": tuple(m.strip() for m in args.mode_cycle.split(",") if m.strip())}
    return out


def _configs(parser: argparse.ArgumentParser, args, argv: List[str], protocols: List[str]):
    """generate: the EdgeConfig; serve: the AgentConfig. From --config with the typed flags on top, else the flags;
    then the uncertainty settings a calibration file gives."""
    _require_model(args)
    if args.command == "serve":
        agent = config_from_command_line(AgentConfig, parser, args, argv, _agent_values(args, protocols))
        return dataclasses.replace(agent, edge=_finish_edge_config(args, agent.edge))
    return _finish_edge_config(args, config_from_command_line(EdgeConfig, parser, args, argv, _flag_values(args)))


def _finish_edge_config(args, config: EdgeConfig) -> EdgeConfig:
    """The uncertainty settings a calibration file gives; the torch engine, said on stderr, when llamacpp is asked
    for and not installed."""
    config = dataclasses.replace(config, uncertainty=_uncertainty_config(args, config.uncertainty))
    if config.engine.backend == "llamacpp" and not llama_cpp_installed():
        print(f"hat-edge: {FALLBACK_NOTE}", file=sys.stderr)
        config = with_overrides(config, {"engine.backend": "torch"})
    return config


def _version(as_json: bool) -> int:
    info = describe()
    if as_json:
        print(json.dumps(info))
    else:
        engines = ", ".join(f"{k} {v}" for k, v in info["engines"].items() if v) or "none"
        print(f"hatspec {info['hatspec']} (protocol {info['protocol']}, build {info['build'] or 'this checkout'}) "
              f"on Python {info['python']} {info['machine']}; engines: {engines}")
    return 0


def main(argv=None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if args.command == "version":
        return _version(args.json)
    try:
        protocols = [p.strip() for p in args.protocol.split(",") if p.strip()]
        unknown = [p for p in protocols if p not in NAMES]
        if unknown or not protocols:
            raise ValueError(f"unknown protocol(s) {unknown}; choose from {', '.join(NAMES)}")
        configured = _configs(parser, args, argv, protocols)
        slowdown = (configured.edge if args.command == "serve" else configured).split.slowdown
        how = wait_passively(slowdown)  # before torch loads: a slowed board's sleeps leave the cores free
        if how not in ("passive", "not slowed"):
            print(f"hat-edge: board slowdown {slowdown}: {how}", file=sys.stderr)
        params = SamplingParams(args.temperature, args.top_k, args.top_p)
        if args.max_new_tokens < 1:
            raise ValueError("--max-new-tokens must be >= 1")
        if args.command != "serve":
            prompts = _load_prompts(args)
    except (ValueError, OSError) as exc:
        print(f"hat-edge: {exc}", file=sys.stderr)
        return 2
    if args.command == "serve":
        try:
            return run_agent(configured)
        except (ValueError, OSError, ImportError) as exc:  # ImportError: an engine's optional package is missing
            print(f"hat-edge serve: {exc}", file=sys.stderr)
            return 2
    config = configured
    text_out = sys.stderr if args.json == "-" else sys.stdout
    results = []
    try:
        with EdgeRuntime(config) as rt:
            for protocol in protocols:
                for i, (prompt, chat) in enumerate(prompts):
                    if not args.quiet:
                        print(f"\n=== [{protocol}] prompt {i + 1}/{len(prompts)} ===", file=text_out, flush=True)
                    on_text = None if args.quiet else (lambda t: print(t, end="", file=text_out, flush=True))
                    res = rt.generate(prompt, protocol, params, args.max_new_tokens, args.seed, chat, on_text)
                    s = res.summary()
                    print(f"\n--- {res.n} tokens, {s['tokens_per_s']:.2f} tok/s, ttft {s['ttft_s']:.2f} s, "
                          f"accepted/round {s['accepted_per_round']:.2f}, up {s['up_bytes_per_token']:.0f} B/tok, "
                          f"down {s['down_bytes_per_token']:.0f} B/tok, rt/tok {s['round_trips_per_token']:.2f}",
                          file=text_out, flush=True)
                    results.append({"prompt_index": i, **res.to_json()})
    except (CloudUnavailable, CloudError) as exc:
        print(f"hat-edge: {exc}", file=sys.stderr)
        return 3
    except (ValueError, FileNotFoundError, ImportError) as exc:  # ImportError: says which package to install
        print(f"hat-edge: {exc}", file=sys.stderr)
        return 2
    if args.json:
        doc = json.dumps({"model": config.model, "server": config.link.server, "results": results}, indent=1)
        if args.json == "-":
            print(doc)
        else:
            with open(args.json, "w", encoding="utf-8") as f:
                f.write(doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
