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
from edge_runtime.config import EdgeConfig, UncertaintyConfig
from edge_runtime.request import RequestDefaults
from edge_runtime.runtime import EdgeRuntime
from hat_split.files import strict_json
from hat_split.files.config_file import add_config_argument, config_from_flags, with_overrides
from hat_split.files.settings import add_flags, overrides
from hat_split.math.calibration import THRESHOLD_RULES, load
from hat_split.models.llamacpp_lib import FALLBACK_NOTE, llama_cpp_installed
from hat_split.models.lm import wait_passively
from hat_split.protocols import REQUESTABLE as NAMES
from hat_split.version import describe

SECTIONS = {  # the help's sections, by the table a flag's key is in
    "link.": "the link to the cloud", "engine.": "what runs the draft",
    "uncertainty.": "uhlm / randhlm / cuhlm (U-HLM, CU-HLM); unset flags come from --calibration, else the papers' "
                    "values",
    "qs.": "qs / ksqs / csqs / sq (QS-SD, SQS-SD)",
    "split.": "ushape / hat (HAT: the model is cut; --model is the large model, the cloud runs its middle)",
    "request.": "each request (serve: what a request that names none gets)",
}
NOT_ON_THE_DEVICE = ("link.security.allow_dir",)  # the cloud's key: a device has no allow-list


def build_parser() -> argparse.ArgumentParser:
    """Every setting's flag comes from its config field (hat_split.files.settings): EdgeConfig's for both commands,
    RequestDefaults' for generate's requests, AgentConfig's (its [edge] and [request] tables) for serve."""
    ap = argparse.ArgumentParser(prog="hat-edge", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text for one or more prompts")
    g.add_argument("prompt", nargs="*", help="prompt text (or use --prompts-file)")
    g.add_argument("--prompts-file", help='a JSON list of prompts (strings or {"text": ..., "chat": bool}), or a '
                   "text file with one prompt per line")
    g.add_argument("--protocol", default="sd",
                   help=f"one of {', '.join(NAMES)} (auto: the device chooses among the exact protocols and switches "
                   "at round boundaries, and says what ran and why); several separated by commas run one after "
                   "another")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    g.add_argument("--json", metavar="PATH",
                   help="write a machine-readable result ('-' for stdout, text then on stderr; strict JSON: a ratio "
                        "with nothing to divide, such as the acceptance of slm, is null)")
    g.add_argument("--quiet", action="store_true", help="do not stream text")
    _add_common(g, "device (an EdgeConfig)")
    keys = add_flags(g, EdgeConfig, skip=NOT_ON_THE_DEVICE, sections=SECTIONS)
    keys += add_flags(g, RequestDefaults, prefix="request.", skip=("protocol",), sections={"": SECTIONS["request."]})
    g.set_defaults(flag_keys=keys)
    w = sub.add_parser("version", help="this installation: hatspec and protocol version, Python, build, engines")
    w.add_argument("--json", action="store_true", help="one JSON line")
    v = sub.add_parser("serve", help="the long-running agent: state reports to the cloud, HTTP on the device")
    v.add_argument("--chat", action="store_true", help=argparse.SUPPRESS)  # refused with the reason
    _add_common(v, "agent (an AgentConfig: the device's EdgeConfig is its [edge] table)")
    keys = add_flags(v, AgentConfig, skip=tuple("edge." + k for k in NOT_ON_THE_DEVICE),
                     sections={**{"edge." + t: title for t, title in SECTIONS.items() if t != "request."},
                               "request.": SECTIONS["request."]})
    v.set_defaults(flag_keys=keys)
    return ap


class _BetaLine(argparse.Action):
    """--beta-line A B, the old spelling of --beta-a A --beta-b B."""

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{parser.prog}: --beta-line is deprecated: use --beta-a A --beta-b B", file=sys.stderr)
        prefix = "edge." if parser.prog.endswith("serve") else ""
        setattr(namespace, f"{prefix}uncertainty.beta_a", values[0])
        setattr(namespace, f"{prefix}uncertainty.beta_b", values[1])


def _add_common(p: argparse.ArgumentParser, role: str) -> None:
    """What both commands take besides their configs' flags."""
    add_config_argument(p, role)
    p.add_argument("--calibration", metavar="PATH", help="uhlm / cuhlm: a hat-calibrate file (rejection line, "
                   "threshold, k*, M, θmax); the uncertainty flags typed win over it")
    p.add_argument("--threshold-rule", choices=THRESHOLD_RULES, default="risk-prone",
                   help="which calibrated threshold --calibration sets (default %(default)s, U-HLM Theorem 1)")
    p.add_argument("--beta-line", type=float, nargs=2, metavar=("A", "B"), action=_BetaLine,
                   default=argparse.SUPPRESS, help=argparse.SUPPRESS)


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


def _typed(args) -> Dict[str, Any]:
    """The config keys the user typed flags for: dotted key → value."""
    return overrides(args, args.flag_keys)


def _uncertainty_config(args, base=None):
    """`base` (the papers' defaults, or the config file's), then the calibration file, then the typed flags."""
    base = UncertaintyConfig() if base is None else base
    if args.calibration:
        base = base.calibrated(load(args.calibration), args.threshold_rule)
    typed = {k.rsplit("uncertainty.", 1)[1]: v for k, v in _typed(args).items() if "uncertainty." in k}
    return dataclasses.replace(base, **typed)


def _configs(parser: argparse.ArgumentParser, args, argv: List[str]):
    """generate: the EdgeConfig; serve: the AgentConfig. From --config with the typed flags on top, else the flags;
    then the uncertainty settings a calibration file gives. A bundle names its model when --model is not given."""
    serve = args.command == "serve"
    edge = "edge." if serve else ""
    typed = {k: v for k, v in _typed(args).items() if serve or not k.startswith("request.")}
    if f"{edge}model" not in typed and f"{edge}engine.bundle" in typed:
        typed[f"{edge}model"] = typed[f"{edge}engine.bundle"]
    if not (args.config or f"{edge}model" in typed):
        raise ValueError("give --model (torch backend) or --bundle (onnxruntime / tensorrt), or --config FILE")
    config = config_from_flags(AgentConfig if serve else EdgeConfig, args.config, typed)
    if serve:
        return dataclasses.replace(config, edge=_finish_edge_config(args, config.edge))
    return _finish_edge_config(args, config)


def _finish_edge_config(args, config: EdgeConfig) -> EdgeConfig:
    """The uncertainty settings a calibration file gives; the torch engine, said on stderr, when llamacpp is asked
    for and not installed."""
    config = dataclasses.replace(config, uncertainty=_uncertainty_config(args, config.uncertainty))
    if config.engine.backend == "llamacpp" and not llama_cpp_installed():
        print(f"hat-edge: {FALLBACK_NOTE}", file=sys.stderr)
        config = with_overrides(config, {"engine.backend": "torch"})
    return config


def _request_defaults(args, protocol: str) -> RequestDefaults:
    """generate: what its requests get, from the flags (flag names in the messages)."""
    typed = {k[len("request."):]: v for k, v in _typed(args).items() if k.startswith("request.")}
    try:
        return RequestDefaults(protocol, **typed)
    except ValueError as exc:
        message = str(exc)
        for name in ("temperature", "top_p", "top_k", "max_new_tokens", "seed"):
            flag = "--" + name.replace("_", "-")
            message = message.replace(f"SamplingParams.{name}", flag).replace(name, flag)
        raise ValueError(message) from None


def _version(as_json: bool) -> int:
    info = describe()
    if as_json:
        print(strict_json.dumps(info))
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
        if args.command == "serve" and args.chat:
            raise ValueError("--chat is hat-edge generate's: a request to the agent says whether it is a chat "
                             "(/v1/chat/completions, or \"chat\": true in /hatspec/generate)")
        if args.command == "generate":
            protocols = [p.strip() for p in args.protocol.split(",") if p.strip()]
            unknown = [p for p in protocols if p not in NAMES]
            if unknown or not protocols:
                raise ValueError(f"unknown protocol(s) {unknown}; choose from {', '.join(NAMES)}")
            defaults = _request_defaults(args, protocols[0])
            if (defaults.allow_lossy or defaults.sla_tokens_per_s) and "auto" not in protocols:
                raise ValueError("--allow-lossy and --sla-tokens-per-s are protocol auto's: add auto to --protocol")
        configured = _configs(parser, args, argv)
        slowdown = (configured.edge if args.command == "serve" else configured).split.slowdown
        how = wait_passively(slowdown)  # before torch loads: a slowed board's sleeps leave the cores free
        if how not in ("passive", "not slowed"):
            print(f"hat-edge: board slowdown {slowdown}: {how}", file=sys.stderr)
        if args.command == "generate":
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
                    res = rt.run(defaults.request(prompt, protocol=protocol, chat=chat, on_text=on_text))
                    s = res.summary()
                    accepted = "-" if s["accepted_per_round"] is None else f"{s['accepted_per_round']:.2f}"
                    print(f"\n--- {res.n} tokens, {s['tokens_per_s']:.2f} tok/s, ttft {s['ttft_s']:.2f} s, "
                          f"accepted/round {accepted}, up {s['up_bytes_per_token']:.0f} B/tok, "
                          f"down {s['down_bytes_per_token']:.0f} B/tok, rt/tok {s['round_trips_per_token']:.2f}",
                          file=text_out, flush=True)
                    for seg in res.auto:  # protocol auto: what ran and why
                        print(f"    auto: {seg['protocol']} (knob {seg['knob']}) {seg['tokens']} tokens in "
                              f"{seg['rounds']} rounds: {seg['reason']}", file=text_out, flush=True)
                    results.append({"prompt_index": i, **res.to_json()})
    except (CloudUnavailable, CloudError) as exc:
        print(f"hat-edge: {exc}", file=sys.stderr)
        return 3
    except (ValueError, FileNotFoundError, ImportError) as exc:  # ImportError: says which package to install
        print(f"hat-edge: {exc}", file=sys.stderr)
        return 2
    if args.json:
        doc = strict_json.dumps({"model": config.model, "server": config.link.server, "results": results}, indent=1)
        if args.json == "-":
            print(doc)
        else:
            with open(args.json, "w", encoding="utf-8") as f:
                f.write(doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
