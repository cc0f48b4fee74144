"""`hat-cloud serve`: load the target model and serve devices over ZeroMQ.

With `--pipeline P` the middle layers run in P pipeline stages, one process each: started without torchrun, the
command starts itself again under `torchrun --standalone --nproc-per-node P`; rank 0 serves, the others are stages
(cloud_runtime.pipeline)."""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys

from cloud_runtime.config import CloudConfig
from hat_split.models.registry import MODEL_DTYPES
from hat_split.net.security import LinkSecurity

READY_LINE = "hatspec-cloud ready"  # printed (and flushed) once the socket is bound and the model loaded


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hat-cloud", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve the target model to devices")
    d = CloudConfig.__dataclass_fields__
    s.add_argument("--model", required=True, help="registry name (see `hat-models list`), HF directory or .gguf file")
    s.add_argument("--bind", default=d["bind"].default, help="ZeroMQ endpoint to bind (default %(default)s)")
    s.add_argument("--session-timeout", type=float, default=d["session_timeout_s"].default, help="seconds")
    s.add_argument("--max-sessions", type=int, default=d["max_sessions"].default)
    s.add_argument("--max-draft-len", type=int, default=d["max_draft_len"].default)
    s.add_argument("--max-context", type=int, default=d["max_context"].default)
    s.add_argument("--token-budget", type=int, default=d["token_budget"].default,
                   help="positions per batched middle-part step, all devices (default %(default)s)")
    s.add_argument("--prefill-floor", type=int, default=d["prefill_floor"].default,
                   help="positions of each step kept for waiting prompts (default %(default)s)")
    s.add_argument("--kv-positions", type=int, default=d["kv_positions"].default,
                   help="middle-part KV cache positions, all sessions (default %(default)s)")
    s.add_argument("--stats-json", default="", metavar="PATH",
                   help="on exit, write the server's counters and its recent batched steps here")
    k = s.add_argument_group("link security (CurveZMQ unless --plaintext)")
    k.add_argument("--curve-secret", default="", metavar="FILE", help="the cloud's secret key (hat-keys generate)")
    k.add_argument("--curve-allow", default="", metavar="DIR", help="directory of the device public keys accepted")
    k.add_argument("--plaintext", action="store_true", help="no encryption or device authentication (a lab only)")
    s.add_argument("--status-file", default="", metavar="PATH",
                   help="while serving, rewrite the counters and every device's reported state here (hat-fleet)")
    s.add_argument("--status-interval", type=float, default=d["status_interval_s"].default, metavar="S")
    s.add_argument("--pipeline", type=int, default=d["pipeline"].default,
                   help="pipeline stages for the middle layers, one process each under torchrun (default %(default)s)")
    s.add_argument("--threads", type=int, default=d["threads"].default, help="torch threads (0: torch default)")
    s.add_argument("--dtype", default=d["dtype"].default, choices=MODEL_DTYPES,
                   help="model dtype (default %(default)s: bfloat16 where the hardware multiplies it, else float32)")
    s.add_argument("-v", "--verbose", action="store_true")
    return ap


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    try:
        config = CloudConfig(
            model=args.model,
            bind=args.bind,
            session_timeout_s=args.session_timeout,
            max_sessions=args.max_sessions,
            max_draft_len=args.max_draft_len,
            max_context=args.max_context,
            threads=args.threads,
            dtype=args.dtype,
            token_budget=args.token_budget,
            prefill_floor=args.prefill_floor,
            kv_positions=args.kv_positions,
            pipeline=args.pipeline,
            stats_json=args.stats_json,
            status_file=args.status_file,
            security=LinkSecurity("plaintext") if args.plaintext else LinkSecurity("curve", args.curve_secret,
                                                                                    allow_dir=args.curve_allow),
            status_interval_s=args.status_interval,
        )
    except ValueError as exc:
        print(f"hat-cloud: {exc}", file=sys.stderr)
        return 2
    if config.pipeline > 1 and "WORLD_SIZE" not in os.environ:
        relaunch_under_torchrun(config, argv)
    return serve(config)


def relaunch_under_torchrun(config: CloudConfig, argv) -> None:
    """Replace this process by torchrun starting `pipeline` copies of this command (never returns)."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(config.threads or max(1, (os.cpu_count() or 1) // config.pipeline)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={config.pipeline}",
           "-m", "cloud_runtime.cli", *argv]
    sys.stdout.flush()
    os.execve(sys.executable, cmd, env)


def serve(config: CloudConfig) -> int:
    import torch

    from cloud_runtime.server import CloudServer
    from hat_split.models.lm import CausalLM
    from hat_split.models.loading import load_model, vocab_fingerprint

    if config.threads:
        torch.set_num_threads(config.threads)
    rank, back = 0, None
    if config.pipeline > 1:
        from cloud_runtime import pipeline

        try:
            rank, back = pipeline.init(config.pipeline)
        except RuntimeError as exc:
            print(f"hat-cloud: {exc}", file=sys.stderr)
            return 2
    try:
        loaded = load_model(config.model, dtype=config.dtype)
    except (FileNotFoundError, KeyError, ValueError) as exc:
        print(f"hat-cloud: cannot load model {config.model!r}: {exc}", file=sys.stderr)
        return 2
    if config.pipeline > 1:
        try:
            pipeline.stage_bounds(loaded.model.config.num_hidden_layers, config.pipeline)
        except ValueError as exc:
            print(f"hat-cloud: --pipeline {config.pipeline}: {exc}", file=sys.stderr)
            return 2
    if rank > 0:
        pipeline.serve_stage(loaded.model, rank, config.pipeline, back)
        return 0
    name = loaded.spec.name if loaded.spec is not None else str(config.model)
    lm = CausalLM(loaded.model)
    lm.warm_up()  # so the first device's TTFT is not the disk's
    executor = pipeline.PipelineExecutor(loaded.model, config.pipeline, back) if config.pipeline > 1 else None
    server = CloudServer(config, lm, name, vocab_fingerprint(loaded.tokenizer), executor)
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    try:
        with server:
            print(f"{READY_LINE} endpoint={server.endpoint} model={name} "
                  f"dtype={str(loaded.model.dtype).removeprefix('torch.')} load_s={loaded.load_seconds:.1f} "
                  f"pipeline={config.pipeline}", flush=True)
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
                json.dump(server.report(), f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
