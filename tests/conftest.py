"""Shared fixtures: tiny random models for plumbing, the real packaged pair loaded once per session."""
from __future__ import annotations

import contextlib
import os
import shutil
import sys
import threading
from pathlib import Path

import pytest

TINY_VOCAB = 512


def _share_the_cores() -> None:
    """Under pytest-xdist each worker gets its share of the cores for OpenMP (torch's CPU kernels), it and the
    processes its tests start (they inherit the variable), unless OMP_NUM_THREADS is set already. Two workers at two
    threads each on two cores spin against each other: the export validation's 44 forwards of SmolLM2, run in a
    process beside the suite, took 90 s at two threads and 18 s at one (2026-11-28)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        if "torch" in sys.modules:  # loaded before this file (a plugin): the variable came too late for it
            sys.modules["torch"].set_num_threads(threads)


_share_the_cores()


def tiny_model(seed: int, layers: int = 2):
    """A randomly initialised float32 Qwen2 (plumbing only: its outputs mean nothing)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=False)
    return Qwen2ForCausalLM(cfg).eval()


def tiny_model_dir(path: Path) -> Path:
    """A tiny random Llama with SmolLM2's vocabulary and tokenizer, saved as a Hugging Face directory (processes load
    it by path). The tokenizer: $HATSPEC_GPU_TOKENIZER (scripts/gpu_kit.sh carries it), else the local cache's."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    source = Path(os.environ.get("HATSPEC_GPU_TOKENIZER", Path.home() / ".cache/hatspec/hf/smollm2-135m"))
    if not (source / "tokenizer.json").is_file():
        pytest.skip(f"no tokenizer at {source} (run scripts/gpu_kit.sh)")
    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(path)
    for f in source.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            shutil.copy(f, path / f.name)
    return path


@pytest.fixture(autouse=True)
def _no_census(monkeypatch):
    """auto's census requests are drawn at random (EdgeConfig.auto_census): no test's reads or choices may hang on
    the draw, so no request is one unless a test says so (monkeypatching EdgeRuntime._census itself)."""
    from edge_runtime.runtime import EdgeRuntime

    monkeypatch.setattr(EdgeRuntime, "_census", lambda self, kind: False)


@pytest.fixture(scope="session")
def tiny_pair():
    """(draft, target) CausalLMs sharing the tiny vocabulary."""
    from hat_split.models.lm import CausalLM

    return CausalLM(tiny_model(1, layers=1)), CausalLM(tiny_model(2, layers=2))


@contextlib.contextmanager
def serving(lm, security=None, bind="tcp://127.0.0.1:0", vocab="tiny-vocab", name="tiny-target", **config):
    """A CloudServer over `lm` serving from a thread (a free loopback port by default; plaintext unless `security`;
    `vocab`: the vocabulary fingerprint it declares; `name`: the model name it states)."""
    from cloud_runtime.config import CloudConfig
    from cloud_runtime.server import CloudServer
    from hat_split.net.security import LinkSecurity

    cfg = CloudConfig(model="tiny", bind=bind, poll_ms=20, max_context=1024,
                      security=security or LinkSecurity.plaintext(), **config)
    stop = threading.Event()
    with CloudServer(cfg, lm, name, vocab) as server:
        thread = threading.Thread(target=server.serve_forever, kwargs={"until": stop.is_set}, daemon=True)
        thread.start()
        try:
            yield server
        finally:  # a failed test's server stops polling before its socket closes
            stop.set()
            thread.join(timeout=10)


@pytest.fixture
def tiny_server(tiny_pair):
    """The tiny target served from a thread."""
    with serving(tiny_pair[1], max_message_bytes=1 << 20) as server:
        yield server


def real_models_available() -> bool:
    from hat_split.models.registry import is_installed

    return all(is_installed(n) for n in ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"))


requires_real_pair = pytest.mark.skipif(
    os.environ.get("HATSPEC_SKIP_REAL") == "1" or not real_models_available(),
    reason="the real Qwen pair is not installed (run `hat-models install qwen2.5-coder-0.5b qwen2.5-coder-1.5b`)",
)


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M (float32), the model the HAT tests cut; skipped when not installed."""
    from hat_split.models.registry import is_installed

    if os.environ.get("HATSPEC_SKIP_REAL") == "1" or not is_installed("smollm2-135m"):
        pytest.skip("smollm2-135m is not installed (run `hat-models install smollm2-135m`)")
    from hat_split.models.loading import load_model

    return load_model("smollm2-135m", dtype="float32")


def finishes_within(fn, seconds: float, what: str) -> float:
    """Run fn() on a thread and wait at most `seconds`: a call that would block forever fails the test (saying
    `what` blocked) instead of hanging the suite. Returns the seconds it took."""
    import threading
    import time

    worker = threading.Thread(target=fn, daemon=True)
    t0 = time.monotonic()
    worker.start()
    worker.join(timeout=seconds)
    assert not worker.is_alive(), f"{what} blocked"
    return time.monotonic() - t0


@contextlib.contextmanager
def refusing_port():
    """A loopback port that refuses every connection while the block runs: bound and never listening, so that no other
    process (a test running beside this one) can take it, as it could a port found free and let go."""
    import socket

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    try:
        yield held.getsockname()[1]
    finally:
        held.close()


@contextlib.contextmanager
def once_per_run(tmp_path_factory, name: str):
    """(directory, done): a directory this test run's processes share (pytest-xdist's workers each have their own
    session, so a session fixture alone would build its product once per worker), held under a file lock; `done`
    says whether an earlier holder finished building it. Without xdist, a fresh directory of this session."""
    from filelock import FileLock

    if not os.environ.get("PYTEST_XDIST_WORKER"):
        yield tmp_path_factory.mktemp(name), False
        return
    root = tmp_path_factory.getbasetemp().parent  # the run's directory, above every worker's own
    with FileLock(str(root / f"{name}.lock")):
        out = root / name
        yield out, (out / ".complete").exists()
        (out / ".complete").touch()


@pytest.fixture(scope="session")
def smollm2_bundle(smollm2, tmp_path_factory):
    """The real SmolLM2-135M as a device bundle, exported once per test run (73 s here): the whole model as a draft
    (fp32, int4) and HAT's parts at m = 2 (fp32; an untrained Λ: exactness does not depend on it)."""
    pytest.importorskip("onnxscript", reason="the export extra is not installed")
    from export.config import ExportConfig
    from export.onnx_export import export_bundle
    from hat_split.models.adapter import Adapter
    from hat_split.prompt_sets import validation_prompts

    with once_per_run(tmp_path_factory, "smollm2-bundle") as (out, done):
        if not done:
            out.mkdir(exist_ok=True)
            prompts = validation_prompts(smollm2.tokenizer, 2)
            export_bundle(smollm2, ExportConfig(smollm2.name, str(out), "draft", precisions=("fp32", "int4")),
                          prompts=prompts, progress=False)
            export_bundle(smollm2, ExportConfig(smollm2.name, str(out), "hat", m=2, precisions=("fp32",)),
                          adapter=Adapter(smollm2.model, 2).eval().requires_grad_(False), prompts=prompts,
                          progress=False)
    return out


CODE_PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


@pytest.fixture(scope="session")
def smollm2_gguf(smollm2):
    """SmolLM2-135M's own GGUF file, as the registry assembled it (the llama.cpp engine's tests)."""
    from hat_split.models.registry import gguf_path

    return gguf_path("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_ids(smollm2):
    """A real code prompt's token ids under SmolLM2's tokenizer."""
    return list(smollm2.tokenizer(CODE_PROMPT)["input_ids"])


@pytest.fixture
def pd_driven(monkeypatch):
    """Parallel drafting driven, not hoped for: each round drafts at least one candidate step before it looks for the
    cloud's reply (the planned steps are at least 1, and the first look says "not yet"), as a round does whenever the
    link and the board leave time for one. Whether a loaded machine leaves that time is no longer the test's
    question; what the device does with a reply it sees only after a draft step is."""
    from edge_runtime.rounds import hat as rounds

    real = rounds._draft_candidates

    def at_least_one_step(dev, cands, steps, c, stop):
        looked = []

        def late(*args):
            if not looked:
                looked.append(True)
                return False
            return stop(*args)
        return real(dev, cands, max(1, steps), c, late)

    monkeypatch.setattr(rounds, "_draft_candidates", at_least_one_step)
