"""`hat-cloud serve`: load the target model and serve devices over ZeroMQ.

The server's settings are one `CloudConfig` (cloud_runtime.config): from the flags, or from a TOML file
(`--config FILE`, keys as CloudConfig's fields, `[security]` a table) with the flags typed on the command line on top.
With `--pipeline P` the middle layers run in P pipeline stages, one process each: started without torchrun, the
command starts itself again under `torchrun --standalone --nproc-per-node P`; rank 0 serves, the others are stages
(cloud_runtime.pipeline)."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import time
from typing import Optional, Sequence

from cloud_runtime import pipeline
from cloud_runtime.cache_runner import tree_sequences
from cloud_runtime.config import CloudConfig
from cloud_runtime.runner import kv_layout
from cloud_runtime.server import CloudServer
from hat_split.extras import MissingExtra, need, require_python
from hat_split.files.config_file import add_config_argument, config_from_flags
from hat_split.files.settings import add_flags, overrides
from hat_split.models import llamacpp_rpc
from hat_split.models.llamacpp_lib import FALLBACK_NOTE, INSTALL_HINT, llama_cpp_installed
from hat_split.models.llamacpp_lm import LlamaCppLM, LlamaCppSettings, max_sequences, model_gguf
from hat_split.models.llamacpp_rpc import parse_endpoints
from hat_split.models.lm import CausalLM
from hat_split.models.loading import load_model, load_tokenizer, resolve_dtype, vocab_fingerprint
from hat_split.models.partition import holds_all_layers
from hat_split.models.placement import resolve_device
from hat_split.models.registry import MODELS, get_model_spec
from hat_split.files import strict_json

READY_LINE = "hatspec-cloud ready"  # printed (and flushed) once the socket is bound and the model loaded
RPC_READY_LINE = "hatspec-rpc starting"  # printed before the RPC server binds (a client retries until it answers)

SECTIONS = {"security.": "link security (CurveZMQ unless --plaintext)",
            "device_": "per-device quotas (0: none; an allow-list entry's NAME.quota.toml overrides them)"}
NOT_IN_THE_CLOUD = ("security.server_key",)  # the device's key: the cloud holds its own pair and the allow-list


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hat-cloud", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve the target model to devices")
    add_config_argument(s, "cloud")
    s.set_defaults(flag_keys=add_flags(s, CloudConfig, skip=NOT_IN_THE_CLOUD, sections=SECTIONS))
    s.add_argument("-v", "--verbose", action="store_true")
    r = sub.add_parser("rpc-server", help="lend this host's compute device (its GPUs, else its CPU) to a llama.cpp "
                                          "cloud (hat-cloud serve --engine llamacpp --rpc HOST:PORT,...)",
                       description="llama.cpp's RPC server (ggml's own): no authentication or encryption, so listen on "
                                   "loopback or a private network only.")
    r.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    r.add_argument("--port", type=int, default=50052, help="(default %(default)s)")
    r.add_argument("--threads", type=int, default=0, help="CPU threads (0: every core this process may use)")
    return ap


def cloud_config(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: Sequence[str]) -> CloudConfig:
    """The --config file with the flags typed on this command line on top of it, or the flags alone (ValueError,
    naming the key, for what cannot be served)."""
    typed = overrides(args, args.flag_keys)
    if not args.config and "model" not in typed:
        parser.error("serve: --model is required (or a --config file naming the model)")
    return config_from_flags(CloudConfig, args.config, typed)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "rpc-server":
        return rpc_server(args)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(message)s")
    try:
        config = cloud_config(parser, args, argv)
    except ValueError as exc:  # a ConfigError names the file and the key
        print(f"hat-cloud: {exc}", file=sys.stderr)
        return 2
    try:
        if config.pipeline > 1 and "WORLD_SIZE" not in os.environ:
            if config.engine == "torch":
                need("torch", "hat-cloud serve --pipeline")
                try:
                    pipeline.stage_device(config.device, config.pipeline)  # refused here, not in P processes
                except ValueError as exc:
                    print(f"hat-cloud: {exc}", file=sys.stderr)
                    return 2
            relaunch_under_torchrun(config, argv)
        return serve(config)
    except MissingExtra as exc:  # says what to install, in one line
        print(f"hat-cloud: {exc}", file=sys.stderr)
        return 2


def relaunch_under_torchrun(config: CloudConfig, argv: Sequence[str]) -> None:
    """Replace this process by torchrun starting `pipeline` copies of this command (never returns)."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(config.threads or max(1, (os.cpu_count() or 1) // config.pipeline)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={config.pipeline}",
           "-m", "cloud_runtime.cli", *argv]
    sys.stdout.flush()
    os.execve(sys.executable, cmd, env)


def rpc_server(args: argparse.Namespace) -> int:
    """Serve llama.cpp RPC until stopped by a signal."""
    if not 0 < args.port < 65536 or args.threads < 0:
        print("hat-cloud rpc-server: --port must be in 1..65535 and --threads >= 0", file=sys.stderr)
        return 2
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"hat-cloud rpc-server: listening on {args.host}: llama.cpp's RPC has no authentication or encryption; "
              f"keep this port on a private network", file=sys.stderr)
    try:
        print(f"{RPC_READY_LINE} endpoint={args.host}:{args.port}", flush=True)
        llamacpp_rpc.serve(args.host, args.port, args.threads)
    except (ImportError, RuntimeError) as exc:
        print(f"hat-cloud rpc-server: {exc}", file=sys.stderr)
        return 2
    return 0


def serve(config: CloudConfig) -> int:
    if config.engine == "llamacpp" and not llama_cpp_installed():
        if config.rpc:
            print(f"hat-cloud: rpc servers need llama.cpp: {INSTALL_HINT}", file=sys.stderr)
            return 2
        print(f"hat-cloud: {FALLBACK_NOTE}", file=sys.stderr)
        config = dataclasses.replace(config, engine="torch")
    if config.engine == "llamacpp":
        return serve_llamacpp(config)
    require_python("hat-cloud serve")
    torch = need("torch", "hat-cloud serve (the torch engine)")
    need("transformers", "hat-cloud serve (the torch engine)")

    if config.threads:
        torch.set_num_threads(config.threads)
    rank, back = 0, None
    try:
        device = (pipeline.stage_device(config.device, config.pipeline) if config.pipeline > 1
                  else resolve_device(config.device))
        if config.pipeline > 1:
            rank, back = pipeline.init(config.pipeline, device)
    except (RuntimeError, ValueError) as exc:
        print(f"hat-cloud: {exc}", file=sys.stderr)
        return 2
    try:  # a pipeline stage loads on the host and moves only its slice to its device
        loaded = load_model(config.model, dtype=resolve_dtype(config.dtype, device),
                            device="cpu" if config.pipeline > 1 else device)
    except (FileNotFoundError, KeyError, ValueError) as exc:
        print(f"hat-cloud: cannot load model {config.model!r}: {exc}", file=sys.stderr)
        return 2
    if config.pipeline > 1:
        try:
            pipeline.place_stage(loaded.model, rank, config.pipeline, device)
        except ValueError as exc:
            print(f"hat-cloud: --pipeline {config.pipeline}: {exc}", file=sys.stderr)
            return 2
    try:
        layout = kv_layout(config, loaded.model)
    except ValueError as exc:
        print(f"hat-cloud: {exc}", file=sys.stderr)
        return 2
    if rank > 0:
        pipeline.serve_stage(loaded.model, rank, config.pipeline, back, layout)
        return 0
    name = loaded.spec.name if loaded.spec is not None else str(config.model)
    lm = CausalLM(loaded.model)
    if holds_all_layers(loaded.model):  # a pipeline's rank 0 holds stage 0 only
        lm.warm_up()  # so the first device's TTFT is not the disk's
    executor = pipeline.PipelineExecutor(loaded.model, config.pipeline, back, layout) if config.pipeline > 1 else None
    server = CloudServer(config, lm, name, vocab_fingerprint(loaded.tokenizer), executor)
    return run_server(config, server, f"model={name} device={device} "
                                      f"dtype={str(loaded.model.dtype).removeprefix('torch.')} {layout.describe()} "
                                      f"load_s={loaded.load_seconds:.1f} pipeline={config.pipeline}")


def serve_llamacpp(config: CloudConfig) -> int:
    """The target's GGUF file on llama.cpp: token protocols, every session a sequence of one context."""
    t0 = time.perf_counter()
    try:
        n_seq = tree_sequences(config.max_sessions, config.tree_nodes, max_sequences())  # sessions + trees' paths
        lm = LlamaCppLM(model_gguf(config.model), LlamaCppSettings(
            config.n_ctx, config.n_batch, config.threads, n_seq_max=n_seq,
            n_gpu_layers=config.n_gpu_layers, rpc=parse_endpoints(config.rpc)))
        tokenizer = load_tokenizer(config.model)
    except (FileNotFoundError, KeyError, ValueError, ImportError, RuntimeError) as exc:
        print(f"hat-cloud: cannot load model {config.model!r} on llama.cpp: {exc}", file=sys.stderr)
        return 2
    lm.warm_up()
    name = get_model_spec(config.model).name if config.model in MODELS else str(config.model)
    server = CloudServer(config, lm, name, vocab_fingerprint(tokenizer))
    where = f" rpc={config.rpc}" if config.rpc else ""
    return run_server(config, server, f"model={name} engine=llamacpp n_ctx={config.n_ctx}{where} "
                                      f"load_s={time.perf_counter() - t0:.1f} pipeline=1")


def run_server(config: CloudConfig, server: CloudServer, details: str) -> int:
    """Serve until SIGTERM or Ctrl-C, after printing the ready line with `details`; the stats file at the end."""
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    try:
        with server:
            print(f"{READY_LINE} endpoint={server.endpoint} {details}", flush=True)
            server.serve_forever()
    except KeyboardInterrupt:
        pass
    except Exception as exc:  # e.g. address in use
        print(f"hat-cloud: {exc}", file=sys.stderr)
        return 1
    finally:
        server.close()  # stops the pipeline stages too
        if config.stats_json:
            with open(config.stats_json, "w", encoding="utf-8") as f:
                strict_json.dump(server.report(), f)
    return 0

if __name__ == "__main__":
    sys.exit(main())
