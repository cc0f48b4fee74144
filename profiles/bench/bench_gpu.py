"""`hat-bench gpu`: the cloud's batched steps on a GPU, per model shape, against the memory-bandwidth limit.

The models are randomly initialised with the real architectures (profiles/bench/gpu_models/*.json: Hugging Face
configs of Qwen2.5-1.5B, Qwen2.5-7B, SmolLM2-135M); a step's time does not depend on the weights' values, so no
weights travel to the GPU machine. Every figure runs through the cloud's own StageRunner and ModelEnds (embeddings,
layers on the session's KV, final norm + head, logits copied to the host), in three ways:

- `dynamic`: growing caches (the CPU cloud's layout), eager;
- `slots`: the static slot layout (hat_split.models.slots), eager;
- `graphs`: the slot layout with decode / verify steps replayed from captured CUDA graphs (CUDA only).

Per model and way: single-session decode tokens/s at a 512-token context, verify-step time for γ = 1..8 (γ + 1
positions, cropped back after each), batched decode steps of 1..64 sessions (tokens/s of the whole cloud), prefill
tokens/s of a 2k prompt (eager in every way: prefill is not captured). The limit: a decode step must read every weight
once, so tokens/s ≤ measured copy bandwidth / weight bytes, where the bandwidth is a device-to-device copy's bytes
read + written per second. The ways are measured side by side: each figure's steps are split into rounds in which the
ways take turns. Writes JSON and a PNG under --out.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Sequence

import numpy as np

from hat_split.files.figures import NO_MATPLOTLIB, pyplot, save_figure
from profiles.bench.gpu_distill import add_arguments as add_distill_arguments
from profiles.bench.gpu_distill import check_arguments as check_distill_arguments
from profiles.bench.gpu_distill import measure_distill
from profiles.bench.provenance import write_report

MODELS_DIR = Path(__file__).resolve().parent / "gpu_models"
MODELS = ("smollm2-135m", "qwen2.5-1.5b", "qwen2.5-7b")
WAYS = ("dynamic", "slots", "graphs")


def add_parser(sub) -> None:
    s = sub.add_parser("gpu", help="the cloud's decode / verify / batched / prefill steps on a GPU: eager vs CUDA "
                                   "graphs, against the memory-bandwidth limit (random weights, real shapes)")
    s.add_argument("--models", default=",".join(MODELS),
                   help="names in profiles/bench/gpu_models, or paths of Hugging Face config.json files")
    s.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default %(default)s)")
    s.add_argument("--dtype", default="auto", help="auto (bfloat16 where the device has it) | float32 | ...")
    s.add_argument("--context", type=int, default=512, help="positions held before the decode / verify steps")
    s.add_argument("--prefill", type=int, default=2048, help="prompt positions of the prefill figure")
    s.add_argument("--batches", default="1,2,4,8,16,32,64", help="sessions per batched step")
    s.add_argument("--gammas", default="1,2,3,4,5,6,7,8", help="drafts per verify step (γ + 1 positions)")
    s.add_argument("--graph-positions", type=int, default=9,
                   help="positions per session a captured step reaches (a verify of γ = this − 1 drafts; a draft "
                        "tree's nodes + 1); longer steps run eagerly (default %(default)s)")
    s.add_argument("--steps", type=int, default=32, help="timed steps per figure (after one untimed)")
    s.add_argument("--batch-verify", type=int, default=5,
                   help="positions per session of the batched verify figure (γ + 1; 0: no such figure): a step of "
                        "each --batches count of sessions verifying that many positions each")
    s.add_argument("--figures", default="steps", metavar="steps,distill",
                   help="which figures: steps (the cloud's decode / verify / batched / prefill steps, each way), "
                        "distill (the teacher's rate and the feature drafter's training step: gpu_distill.py)")
    add_distill_arguments(s)
    s.add_argument("--profile", action="store_true",
                   help="also print torch.profiler's table of each way's decode steps (after the figures)")
    s.add_argument("--out", default="runs/gpu-bench", help="directory of gpu_bench.json and gpu_bench.png")
    s.add_argument("--plot-from", default="", metavar="JSON",
                   help="measure nothing: draw the PNG of a gpu_bench.json written elsewhere (a GPU machine's kit "
                        "carries no matplotlib) into --out")


def model_config(name: str) -> Any:
    from transformers import AutoConfig

    path = Path(name) if name.endswith(".json") else MODELS_DIR / f"{name}.json"
    if not path.is_file():
        known = ", ".join(p.stem for p in sorted(MODELS_DIR.glob("*.json")))
        raise ValueError(f"unknown model shape {name!r}: one of {known}, or a config.json path")
    data = json.loads(path.read_text())
    return AutoConfig.for_model(data.pop("model_type"), **data)


def random_model(config: Any, device: str, dtype: Any) -> Any:
    """The architecture with random weights, built directly on the device in its dtype."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def copy_bandwidth(device: str, nbytes: int) -> float:
    """Bytes read + written per second by a device-to-device copy of `nbytes` (best of 5)."""
    import torch

    from hat_split.models.placement import synchronize

    src = torch.ones(nbytes, dtype=torch.uint8, device=device)  # written: an untouched host page reads as the one
    dst = torch.ones_like(src)  # shared zero page, from cache

    best = float("inf")
    for _ in range(6):
        synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


class Cloud:
    """One way of running the cloud's steps on a model: a StageRunner and the model's ends, sessions by id."""

    def __init__(self, model: Any, way: str, max_rows: int, length: int, graph_positions: int = 9):
        from cloud_runtime.runner import KvLayout, ModelEnds, StageRunner

        layout = KvLayout() if way == "dynamic" else KvLayout(max_rows + 1, length, way == "graphs", graph_positions,
                                                               max_rows)
        self.runner = StageRunner(model, layout=layout)
        self.ends = ModelEnds(model)
        self.layers = model.config.num_hidden_layers
        self.vocab = model.config.vocab_size
        self.held: Dict[int, int] = {}
        self.parts = [0.0, 0.0, 0.0]  # s in the inputs, the layers, the head and copy to the host (when `timed`)
        self.timed = False  # a synchronize between the parts: their times add up, at the cost of the overlap

    def step(self, work: Dict[int, List[int]]) -> None:
        """One batched step: each session's tokens embedded, run, and its last position's logits to the host."""
        from cloud_runtime.runner import Job
        from hat_split.models.placement import synchronize

        t0 = time.perf_counter()
        jobs = [Job(sid, 0, self.layers, self.held.get(sid, 0), len(tokens)) for sid, tokens in work.items()]
        xs = self.ends.inputs([np.asarray(tokens, dtype=np.int64) for tokens in work.values()])
        if self.timed:
            synchronize(self.runner.device)
        t1 = time.perf_counter()
        outs, _ = self.runner.run(jobs, xs)  # synchronized at its end
        t2 = time.perf_counter()
        self.ends.rows([(out, 1, 0) for out in outs])
        if self.timed:
            for i, t in enumerate((t1 - t0, t2 - t1, time.perf_counter() - t2)):
                self.parts[i] += t
        for sid, tokens in work.items():
            self.held[sid] = self.held.get(sid, 0) + len(tokens)

    def crop(self, sid: int, length: int) -> None:
        from cloud_runtime.runner import CROP

        self.runner.apply([(CROP, sid, length)])
        self.held[sid] = length

    def close(self) -> None:
        from cloud_runtime.runner import CLOSE

        self.runner.apply([(CLOSE, sid, 0) for sid in self.held])
        self.held.clear()


ROUNDS = 3  # each figure's timed steps are split into this many rounds, the ways taking turns (interleaved)


def interleaved(clouds: Dict[str, Cloud], setup: Callable[[Cloud], None], step: Callable[[Cloud], None],
                steps: int) -> Dict[str, float]:
    """Seconds per step of each way: `setup` on each cloud, one untimed step each (graphs are captured there), then
    ROUNDS rounds in which every way in turn times steps / ROUNDS steps; the clouds' sessions are closed after."""
    per_round = max(1, steps // ROUNDS)
    total = {way: 0.0 for way in clouds}
    for cloud in clouds.values():
        setup(cloud)
        step(cloud)
    for _ in range(ROUNDS):
        for way, cloud in clouds.items():
            t0 = time.perf_counter()
            for _ in range(per_round):
                step(cloud)
            total[way] += time.perf_counter() - t0
    for cloud in clouds.values():
        cloud.close()
    return {way: t / (ROUNDS * per_round) for way, t in total.items()}


def profile_table(fn: Callable[[], Any], rows: int = 18) -> str:
    """torch.profiler's table of `fn`'s operators, the device's time first (CPU time where there is no device)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    averages = prof.key_averages()
    keys = ("self_device_time_total", "self_cuda_time_total") if torch.cuda.is_available() else ()
    for key in (*keys, "self_cpu_time_total"):
        try:
            return averages.table(sort_by=key, row_limit=rows, max_name_column_width=60)
        except (AttributeError, KeyError, ValueError):
            continue
    return str(averages)


def measure(model: Any, ways: Sequence[str], args: argparse.Namespace, batches: List[int],
            gammas: List[int]) -> Dict[str, Dict[str, Any]]:
    """Every figure of one model, the ways interleaved."""
    import random

    rng = random.Random(0)
    vocab = model.config.vocab_size

    def tokens(n: int) -> List[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    length = max(args.context + max(gammas) + 8, args.prefill + 1)
    clouds = {way: Cloud(model, way, max(batches), length, args.graph_positions) for way in ways}
    out: Dict[str, Dict[str, Any]] = {way: {} for way in ways}
    ctx = args.context

    def one_session(c: Cloud) -> None:
        c.step({0: tokens(ctx)})

    def decode(n: int) -> Callable[[Cloud], None]:
        def step(c: Cloud) -> None:  # a decode (n = 1) or a verify of n − 1 drafts, cropped back
            c.step({0: tokens(n)})
            c.crop(0, ctx)
        return step

    for way, t in interleaved(clouds, one_session, decode(1), args.steps).items():
        out[way]["decode_tok_s"] = 1 / t
        out[way]["verify_ms"] = {}
    for c in clouds.values():  # where a decode step's time goes, the parts synchronized apart
        c.timed, c.parts = True, [0.0, 0.0, 0.0]
    interleaved(clouds, one_session, decode(1), args.steps)
    for way, c in clouds.items():
        c.timed = False
        n = ROUNDS * max(1, args.steps // ROUNDS) + 1  # the untimed step is counted in the parts too
        out[way]["decode_parts_ms"] = dict(zip(("inputs", "layers", "head_to_host"), (1e3 * t / n for t in c.parts)))
    if args.profile:
        for way, c in clouds.items():
            print(f"== {way}: the profiler over {args.steps} decode steps", flush=True)
            print(profile_table(lambda c=c: (one_session(c), [decode(1)(c) for _ in range(args.steps)], c.close())),
                  flush=True)
    for g in gammas:
        for way, t in interleaved(clouds, one_session, decode(g + 1), max(ROUNDS, args.steps // 4)).items():
            out[way]["verify_ms"][str(g)] = t * 1e3
    held = min(ctx, 256)
    for way in ways:
        out[way]["batched_tok_s"] = {}
    for b in batches:
        def sessions(c: Cloud, b: int = b) -> None:
            c.step({sid: tokens(held) for sid in range(1, b + 1)})

        def many(c: Cloud, b: int = b) -> None:
            c.step({sid: tokens(1) for sid in range(1, b + 1)})
            for sid in range(1, b + 1):
                c.crop(sid, held)

        for way, t in interleaved(clouds, sessions, many, max(ROUNDS, args.steps // 4)).items():
            out[way]["batched_tok_s"][str(b)] = b / t
        if args.batch_verify:
            def verify(c: Cloud, b: int = b) -> None:  # b sessions verifying batch_verify positions each
                c.step({sid: tokens(args.batch_verify) for sid in range(1, b + 1)})
                for sid in range(1, b + 1):
                    c.crop(sid, held)

            for way, t in interleaved(clouds, sessions, verify, max(ROUNDS, args.steps // 4)).items():
                out[way].setdefault("batched_verify_ms", {})[str(b)] = 1e3 * t

    def prefill(c: Cloud) -> None:
        c.step({99: tokens(args.prefill)})
        c.close()

    for way, t in interleaved(clouds, lambda c: None, prefill, ROUNDS).items():
        out[way]["prefill_tok_s"] = args.prefill / t
    for way, cloud in clouds.items():
        out[way]["graphs"] = cloud.runner.graphs.report()
    return out


def run(args: argparse.Namespace) -> int:
    if args.plot_from:
        try:
            result = json.loads(Path(args.plot_from).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"--plot-from {args.plot_from}: {exc}") from None
        if not isinstance(result, dict) or "models" not in result:
            raise ValueError(f"--plot-from {args.plot_from}: not a gpu_bench.json (no \"models\")")
        png = Path(args.out) / (Path(args.plot_from).stem + ".png")
        png.parent.mkdir(parents=True, exist_ok=True)
        print(plot(result, png) or f"wrote {png}")
        return 0
    import torch

    from hat_split.models.loading import resolve_dtype
    from hat_split.models.placement import is_cuda, resolve_device

    figures = set(args.figures.split(","))
    if not figures or figures - {"steps", "distill"}:
        raise ValueError(f"--figures: a comma-separated list of steps, distill; got {args.figures!r}")
    if "distill" in figures:
        check_distill_arguments(args)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    batches = [int(x) for x in args.batches.split(",")]
    gammas = [int(x) for x in args.gammas.split(",")]
    ways = WAYS if is_cuda(device) else WAYS[:2]
    bandwidth = copy_bandwidth(device, 1 << 30)  # 1 GiB: beyond any cache
    result: Dict[str, Any] = {"device": device, "name": torch.cuda.get_device_name(device) if is_cuda(device)
                              else "cpu", "dtype": dtype, "torch": torch.__version__, "copy_GBps": bandwidth / 1e9,
                              "context": args.context, "steps": args.steps, "models": {}}
    print(f"{result['name']}: {dtype}, device-to-device copy {bandwidth / 1e9:.0f} GB/s", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.models.split(","):
        config = model_config(name)
        label = Path(name).stem if name.endswith(".json") else name
        model = random_model(config, device, getattr(torch, dtype))
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        limit = bandwidth / weight_bytes  # tokens/s if a decode only read the weights once
        row: Dict[str, Any] = {"weight_bytes": weight_bytes, "limit_tok_s": limit, "ways": {}}
        for way, m in (measure(model, ways, args, batches, gammas) if "steps" in figures else {}).items():
            m["decode_of_limit"] = m["decode_tok_s"] / limit
            row["ways"][way] = m
            print(f"{label} {way:>7}: decode {m['decode_tok_s']:.1f} tok/s "
                  f"({100 * m['decode_of_limit']:.0f} % of the {limit:.0f} tok/s limit), verify γ=4 "
                  f"{m['verify_ms'].get('4', float('nan')):.2f} ms, {batches[-1]} sessions "
                  f"{m['batched_tok_s'][str(batches[-1])]:.0f} tok/s, prefill {m['prefill_tok_s']:.0f} tok/s; "
                  "a decode step: " + ", ".join(f"{k} {v:.2f} ms" for k, v in m["decode_parts_ms"].items()),
                  flush=True)
        if "graphs" in row["ways"]:
            row["graphs_over_eager_decode"] = (row["ways"]["graphs"]["decode_tok_s"]
                                               / row["ways"]["slots"]["decode_tok_s"])
        if "distill" in figures:
            d = row["distill"] = measure_distill(model, device, args)
            print(f"{label} distill: teacher {d['teacher_tok_s']:.0f} tok/s; a training step of the feature drafter "
                  f"({d['drafter_params'] / 1e6:.1f}M, {d['batch']} x {d['seq_len']} tokens): " + ", ".join(
                      f"unroll {u} {x['step_ms']:.0f} ms ({x['positions_per_s']:.0f} positions/s)"
                      for u, x in d["train"].items()), flush=True)
        result["models"][label] = row
        write_report(str(out / "gpu_bench.json"), result)  # after each model: a run stopped early keeps what it did
        del model
        if is_cuda(device):
            torch.cuda.empty_cache()
    print(f"wrote {out / 'gpu_bench.json'}; {plot(result, out / 'gpu_bench.png') or 'and gpu_bench.png'}")
    return 0


def plot(result: Dict[str, Any], path: Path) -> str:
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    models = {name: row for name, row in result["models"].items() if row["ways"]}
    if not models:
        return "no PNG (no step figures)"
    fig, axes = plt.subplots(len(models), 2, figsize=(10, 3.2 * len(models)), squeeze=False)
    for (name, row), (ax_v, ax_b) in zip(models.items(), axes):
        for way, m in row["ways"].items():
            ax_v.plot([int(g) for g in m["verify_ms"]], list(m["verify_ms"].values()), marker="o", label=way)
            ax_b.plot([int(b) for b in m["batched_tok_s"]], list(m["batched_tok_s"].values()), marker="o", label=way)
        ax_v.set(title=f"{name}: verify step", xlabel="γ (drafts)", ylabel="ms")
        sizes = [int(b) for b in next(iter(row["ways"].values()))["batched_tok_s"]]
        ax_b.plot(sizes, [row["limit_tok_s"] * b for b in sizes], "k--", lw=0.8, label="weights read once a step")
        ax_b.set(title=f"{name}: batched decode", xlabel="sessions", ylabel="tokens/s", xscale="log",
                 yscale="log")
    return save_figure(fig, axes, str(path))
