"""A llama.cpp cloud: its steps are planned by the cloud's scheduler (a prompt longer than the step's budget is
prefilled over several steps, a context or a KV pool too large is refused with the numbers), it spreads a model over
llama.cpp RPC servers with the same tokens as one machine, a pair of different vocabularies is refused at the
handshake, and a CLI asked for llama.cpp where it is not installed runs torch and says so."""
from __future__ import annotations

import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from cloud_runtime.cache_runner import CacheRunner
from cloud_runtime.config import CloudConfig
from cloud_runtime.process import CloudProcess, free_port
from edge_runtime.client import CloudError
from edge_runtime.config import EdgeConfig, EngineConfig, LinkConfig
from edge_runtime.runtime import EdgeRuntime
from hat_split.math.logprobs import concat
from hat_split.math.sampling import SamplingParams
from hat_split.models.loading import load_tokenizer, vocab_fingerprint
from hat_split.models.registry import gguf_path
from hat_split.net.security import LinkSecurity
from tests.conftest import refusing_port, requires_real_pair, serving

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (scripts/install_llamacpp.sh)")

from hat_split.models import llamacpp_rpc  # noqa: E402
from hat_split.models.llamacpp_lm import LlamaCppLM, LlamaCppSettings  # noqa: E402


def _device(endpoint: str, **fields) -> EdgeConfig:
    return EdgeConfig(model="smollm2-135m", engine=EngineConfig(backend="llamacpp", n_ctx=1024, threads=1),
                      link=LinkConfig(endpoint, security=LinkSecurity.plaintext()), **fields)


def test_the_scheduler_plans_a_llama_cpp_clouds_steps(smollm2_gguf, smollm2, smollm2_ids):
    """n_batch = 16: a 70-token prompt is prefilled over several steps of at most 16 positions, and `sd` still
    returns the target's greedy tokens; a context longer than n_ctx is refused, naming the limit."""
    long_ids = (smollm2_ids * 4)[:70]
    target = LlamaCppLM(smollm2_gguf, LlamaCppSettings(n_ctx=160, n_batch=16, n_threads=2, n_seq_max=4))
    reference = target.greedy(long_ids, 12)
    with serving(target, vocab=vocab_fingerprint(smollm2.tokenizer), max_draft_len=4) as server:
        with EdgeRuntime(_device(server.endpoint, draft_len=3)) as rt:
            result = rt.generate(long_ids, "sd", SamplingParams(0.0), 12, seed=0, logprobs=3)
            assert result.tokens == reference
            # the llama.cpp rows' log-probabilities came back with the verdicts: greedy tokens are each row's best
            lp = concat(result.logprobs)
            assert len(lp) == 12 and lp.k == 3 and (lp.top_ids[:, 0] == reference).all()
            assert np.allclose(lp.values, lp.top_values[:, 0]) and (np.diff(lp.top_values, axis=1) <= 0).all()
            stats = server.work.stats
            assert stats.steps >= 70 // 16 + 1 and max(t for t, _, _ in stats.step_log) <= 16
            with pytest.raises(CloudError, match="context_full.*limit is 160"):
                rt.generate(smollm2_ids * 10, "sd", SamplingParams(0.0), 4, seed=0)


def test_the_kv_pool_of_a_llama_cpp_context_bounds_every_session_together(smollm2_gguf, smollm2_ids):
    """The runner admits work against n_ctx positions of all sessions: a second session's prompt that does not fit
    what the first holds is refused with what is free, and taken once the first is closed; decode segments go
    before a waiting prompt, which is chunked into the rest of the step."""
    from cloud_runtime.server import scheduler_config
    from hat_split.math.chunking import DelayModel
    from hat_split.wire.messages import ProtocolError

    lm = LlamaCppLM(smollm2_gguf, LlamaCppSettings(n_ctx=160, n_batch=16, n_threads=2, n_seq_max=4))
    config = scheduler_config(CloudConfig(model="m", engine="llamacpp", n_batch=16, max_draft_len=4, prefill_floor=8,
                                          token_budget=64, security=LinkSecurity.plaintext()), lm)
    assert (config.token_budget, config.kv_capacity, config.max_context, config.max_sessions) == (16, 160, 160, 4)
    runner = CacheRunner(lm, config, decode_limit=5, load=DelayModel())
    runner.open("a", 0, 0)
    runner.submit_tokens("a", (smollm2_ids * 10)[:120], 1, _Tag())
    runner.open("b", 0, 0)
    with pytest.raises(ProtocolError, match="50 positions of KV cache needed, 40 of 160 free"):
        runner.submit_tokens("b", (smollm2_ids * 10)[:50], 1, _Tag())
    done = []
    while runner.busy:
        done += runner.step().done
    assert [rows.shape for _, rows in done] == [(1, lm.vocab_size)]
    runner.submit_tokens("a", smollm2_ids[:3], 3, _Tag())  # a verify of 3 ...
    runner.submit_tokens("b", (smollm2_ids * 10)[:30], 1, _Tag())  # ... and a prompt: the verify first, then it
    runner.step()
    assert runner.stats.step_log[-1][:2] == (16, 2) and runner.held("a") == (123, 0) and runner.held("b") == (13, 17)
    runner.close("a")
    runner.submit_tokens("b", (smollm2_ids * 10)[:100], 0, _Tag())
    assert runner.held("b") == (13, 117)


class _Tag:
    """A request handle for work queued straight into the runner."""

    def __init__(self):
        self.compute_s = 0.0
        self.session = self


def _rpc_servers(n: int):
    """n `hat-cloud rpc-server` processes on free loopback ports, answering."""
    ports = [free_port() for _ in range(n)]
    procs = [subprocess.Popen([sys.executable, "-m", "cloud_runtime.cli", "rpc-server", "--port", str(p),
                               "--threads", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for p in ports]
    deadline = time.monotonic() + 60
    for port in ports:
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
    return procs, tuple(f"127.0.0.1:{p}" for p in ports)


def test_a_model_spread_over_two_rpc_servers_gives_the_tokens_of_one_machine(smollm2_gguf, smollm2, smollm2_ids):
    """Two local RPC servers hold the layers (llama.cpp's RPC backend): the logits equal one machine's, greedy
    tokens too, in this process and through `hat-cloud serve --engine llamacpp --rpc` with a device running `sd`."""
    with LlamaCppLM(smollm2_gguf, LlamaCppSettings(n_ctx=512, n_batch=64, n_threads=2)) as alone:
        reference = alone.greedy(smollm2_ids, 16)
        logits = alone.forward(alone.new_state(), smollm2_ids, n_logits=4)
    procs, endpoints = _rpc_servers(2)
    try:
        assert llamacpp_rpc.device_names(llamacpp_rpc.rpc_devices(endpoints))[-2:] != []
        with LlamaCppLM(smollm2_gguf, LlamaCppSettings(n_ctx=512, n_batch=64, n_threads=2, rpc=endpoints)) as spread:
            assert spread.greedy(smollm2_ids, 16) == reference
            got = spread.forward(spread.new_state(), smollm2_ids, n_logits=4)
            assert abs(got - logits).max() <= 1e-3 * abs(logits).max()
        with CloudProcess("smollm2-135m", extra_args=["--engine", "llamacpp", "--n-ctx", "1024", "--rpc",
                                                      ",".join(endpoints)], threads=1, ready_timeout_s=300) as cloud:
            assert f"rpc={','.join(endpoints)}" in cloud.ready_info
            with EdgeRuntime(_device(cloud.endpoint)) as rt:
                assert rt.generate(smollm2_ids, "sd", SamplingParams(0.0), 16, seed=0).tokens == reference
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=10)


def test_rpc_settings_are_checked_and_an_unreachable_server_is_named(smollm2_gguf):
    with pytest.raises(ValueError, match="HOST:PORT"):
        CloudConfig(model="m", engine="llamacpp", rpc="localhost", security=LinkSecurity.plaintext())
    with pytest.raises(ValueError, match="rpc servers run the llamacpp engine"):
        CloudConfig(model="m", rpc="127.0.0.1:50052", security=LinkSecurity.plaintext())
    with pytest.raises(ValueError, match="n_gpu_layers must be >= 0, or -1"):
        CloudConfig(model="m", engine="llamacpp", n_gpu_layers=-2, security=LinkSecurity.plaintext())
    with pytest.raises(ValueError, match="n_gpu_layers must be >= 0, or -1"):
        EngineConfig(backend="llamacpp", n_gpu_layers=-3)
    from cloud_runtime import cli as cloud_cli

    assert cloud_cli.main(["rpc-server", "--port", "0"]) == 2
    with refusing_port() as port, pytest.raises(RuntimeError, match=f"127.0.0.1:{port} cannot be reached"):
        LlamaCppLM(smollm2_gguf, LlamaCppSettings(n_ctx=64, rpc=(f"127.0.0.1:{port}",)))


@requires_real_pair
def test_a_pair_with_different_vocabularies_is_refused_at_the_handshake(smollm2_gguf, smollm2_ids):
    """A SmolLM2 device on llama.cpp against a llama.cpp cloud serving Qwen2.5-Coder-0.5B: refused with both
    vocabularies named, before any work."""
    qwen = "qwen2.5-coder-0.5b"
    target = LlamaCppLM(gguf_path(qwen), LlamaCppSettings(n_ctx=256, n_batch=32, n_threads=2, n_seq_max=2))
    with serving(target, vocab=vocab_fingerprint(load_tokenizer(qwen))) as server:
        with EdgeRuntime(_device(server.endpoint)) as rt:
            with pytest.raises(CloudError, match="vocab_mismatch.*cannot generate together"):
                rt.generate(smollm2_ids, "sd", SamplingParams(0.0), 4, seed=0)


def test_the_clis_run_torch_and_say_so_when_llama_cpp_is_absent(monkeypatch, capsys):
    from cloud_runtime import cli as cloud_cli
    from edge_runtime import cli as edge_cli

    monkeypatch.setattr(edge_cli, "llama_cpp_installed", lambda: False)
    args = edge_cli.build_parser().parse_args(["generate", "--model", "smollm2-135m", "--engine", "llamacpp"])
    config = edge_cli._configs(edge_cli.build_parser(), args, ["--engine", "llamacpp"])
    assert config.engine.backend == "torch"
    assert "llama-cpp-python is not installed" in capsys.readouterr().err
    monkeypatch.setattr(cloud_cli, "llama_cpp_installed", lambda: False)
    assert cloud_cli.main(["serve", "--model", "smollm2-135m", "--engine", "llamacpp", "--rpc", "127.0.0.1:1",
                           "--plaintext"]) == 2
    assert "rpc servers need llama.cpp" in capsys.readouterr().err
    served = []
    monkeypatch.setattr(cloud_cli, "run_server", lambda config, server, details: served.append(details) or 0)
    assert cloud_cli.main(["serve", "--model", "smollm2-135m", "--engine", "llamacpp", "--plaintext",
                           "--dtype", "float32"]) == 0
    assert "running the torch engine instead" in capsys.readouterr().err and "dtype=float32" in served[0]
