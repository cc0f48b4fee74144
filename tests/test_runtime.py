"""The device runtime (edge_runtime/runtime.py: `EdgeRuntime`) and the device's model behind it
(edge_runtime/engine.py: `open_engine`), on the tiny random models of tests/conftest.py with a byte-level stand-in
tokenizer: a request runs whole, the cloud is connected only when its protocol needs one, the request's callbacks are
called as edge_runtime/request.py says, and each engine gives or refuses what it can or cannot run.

The scenarios the runtime takes part in (link drops between requests, HAT over the real SmolLM2, the agent) are in
tests/test_faults.py, tests/test_hat.py and tests/test_openai.py; tests/README.md maps them."""
from __future__ import annotations

import pytest

from edge_runtime.client import CloudUnavailable
from edge_runtime.config import EdgeConfig, EngineConfig, LinkConfig, SplitConfig
from edge_runtime.engine import LlamaCppEngine, TorchEngine, open_engine
from edge_runtime.request import GenerationRequest
from edge_runtime.runtime import EdgeRuntime
from hat_split.math.sampling import SamplingParams
from hat_split.models.lm import CausalLM
from hat_split.models.loading import LoadedModel, vocab_fingerprint
from hat_split.net.security import LinkSecurity
from hat_split.wire import messages as P
from tests.conftest import TINY_VOCAB, refusing_port, serving

PROMPT = [5, 17, 99, 3, 250, 7]
GREEDY = SamplingParams(0.0)


class ByteTokenizer:
    """The tiny models' tokenizer: text is its UTF-8 bytes (ids 0..255); ids below 128 decode to their ASCII character,
    the others to "<id>" (every decoded text is complete, so a request's on_text sees all of it). `eos`: its end token
    (the tiny models name none of their own); it does not change the vocabulary's fingerprint."""

    all_special_ids: list = []

    def __init__(self, eos=None):
        self.eos_token_id = eos

    def get_vocab(self):
        return {f"<{i}>": i for i in range(TINY_VOCAB)}

    def __call__(self, text):
        return {"input_ids": list(text.encode("utf-8"))}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) if i < 128 else f"<{i}>" for i in ids)


FINGERPRINT = vocab_fingerprint(ByteTokenizer())


def loaded(lm: CausalLM, eos=None) -> LoadedModel:
    """A tiny model as hat_split.models.loading.load_model would give it (the runtime's `loaded`)."""
    return LoadedModel(lm.model, ByteTokenizer(eos), None, "tiny", 0.0, False, "tiny")


def config(endpoint: str, **fields) -> EdgeConfig:
    link = LinkConfig(endpoint, device_id="runtime-test", security=LinkSecurity.plaintext(), connect_timeout_s=0.3,
                      connect_retries=1, backoff_s=0.05)
    return EdgeConfig(model="tiny", link=link, **fields)


@pytest.fixture(scope="module")
def reference(tiny_pair):
    """The tiny target's and draft's greedy continuations of PROMPT (the exact protocols' answers at T = 0)."""
    draft, target = tiny_pair
    return {"target": target.greedy(PROMPT, 24), "draft": draft.greedy(PROMPT, 24),
            "text": target.greedy(list(b"def f():"), 10)}


@pytest.fixture(scope="module")
def cloud(tiny_pair, reference):
    """The tiny target served from a thread, declaring ByteTokenizer's vocabulary."""
    with serving(tiny_pair[1], vocab=FINGERPRINT) as server:
        yield server


@pytest.fixture(scope="module")
def runtime(tiny_pair, cloud):
    """One runtime on the tiny draft against `cloud`, shared by the tests that only run requests."""
    with EdgeRuntime(config(cloud.endpoint), loaded(tiny_pair[0])) as rt:
        yield rt


# -- EdgeRuntime ------------------------------------------------------------------------------------------------------
def test_slm_runs_with_no_cloud_reachable_and_never_connects(tiny_pair, reference):
    """A local protocol needs no cloud: the runtime does not even try the (refusing) address; a token protocol on the
    same runtime tries it and fails with the server's address in the message."""
    with refusing_port() as port, EdgeRuntime(config(f"tcp://127.0.0.1:{port}"), loaded(tiny_pair[0])) as rt:
        result = rt.generate(PROMPT, "slm", GREEDY, 12, seed=0)
        assert result.tokens == reference["draft"][:12] and result.finish_reason == "length"
        assert rt.client is None and (result.up_bytes, result.down_bytes, result.round_trips) == (0, 0, 0)
        with pytest.raises(CloudUnavailable, match=f"tcp://127.0.0.1:{port}"):
            rt.generate(PROMPT, "sd", GREEDY, 4, seed=0)
        assert rt.client is None


def test_sd_at_temperature_0_equals_the_targets_greedy_tokens(runtime, cloud, reference):
    """Token ids and text prompts alike; the connection is opened by the first request and kept for the next."""
    result = runtime.generate(PROMPT, "sd", GREEDY, 24, seed=0)
    assert result.tokens == reference["target"] and result.finish_reason == "length"
    assert result.protocol == "sd" and result.drafted > 0 and result.round_trips >= 3  # open, verify..., close
    client = runtime.client
    text = runtime.run(GenerationRequest("def f():", "sd", GREEDY, 10, seed=0))
    assert text.tokens == reference["text"] and text.prompt_tokens == len(b"def f():")
    assert runtime.client is client
    assert cloud.report()["sessions"]["open"] == 0  # both requests closed their sessions in the cloud


def test_the_engines_end_token_ends_a_request(tiny_pair, cloud, reference):
    ref = reference["target"]
    eos = ref[5]
    with EdgeRuntime(config(cloud.endpoint), loaded(tiny_pair[0], eos=eos)) as rt:
        result = rt.generate(PROMPT, "sd", GREEDY, 24, seed=0)
    assert result.tokens == ref[: ref.index(eos) + 1] and result.finish_reason == "eos"


def test_on_tokens_comes_before_on_text_and_they_add_up_to_the_result(runtime):
    events = []
    request = GenerationRequest(PROMPT, "sd", SamplingParams(1.0), 20, seed=3, logprobs=2,
                                on_tokens=lambda toks, lp: events.append(("tokens", list(toks), lp)),
                                on_text=lambda delta: events.append(("text", delta, None)))
    result = runtime.run(request)
    assert events and events[0][0] == "tokens"
    for i, (kind, _, _) in enumerate(events):
        if kind == "text":
            assert events[i - 1][0] == "tokens"  # each commit's text follows its tokens
    tokens = [e for e in events if e[0] == "tokens"]
    assert [t for _, toks, _ in tokens for t in toks] == result.tokens
    assert all(len(lp) == len(toks) and lp.k == 2 for _, toks, lp in tokens)  # logprobs asked: with each commit
    assert "".join(e[1] for e in events if e[0] == "text") == result.text == ByteTokenizer().decode(result.tokens)


def test_should_stop_ends_the_request_with_its_reason(runtime, cloud, reference):
    """Asked after every commit; its reason is the finish reason, the tokens so far are the target's, and the cloud's
    session is closed all the same."""
    seen, commits, asked = [], [], []

    def on_tokens(toks, lp):
        seen.extend(toks)
        commits.append(len(seen))

    def should_stop():
        asked.append(len(seen))
        return "stop" if len(seen) >= 5 else ""

    result = runtime.generate(PROMPT, "sd", GREEDY, 24, seed=0, on_tokens=on_tokens, should_stop=should_stop)
    assert result.finish_reason == "stop"
    assert 5 <= result.n < 24 and result.tokens == seen == reference["target"][: result.n]
    assert asked == commits  # once after every commit, none after the one it stopped
    assert cloud.report()["sessions"]["open"] == 0


def test_a_seed_gives_the_same_tokens_twice_at_temperature_1(runtime):
    hot = SamplingParams(1.0)
    a, b, c = (runtime.generate(PROMPT, "sd", hot, 16, seed=s).tokens for s in (7, 7, 8))
    assert a == b and a != c


@pytest.mark.parametrize("fields,message", [
    (dict(prompt=[]), "the prompt is empty"),
    (dict(protocol="nope"), "nope"),
    (dict(max_new_tokens=0), "max_new_tokens must be an integer"),
    (dict(seed=-1), "seed must be an integer"),
    (dict(logprobs=1000), "logprobs must be an integer"),
    (dict(sampling=0.7), "sampling must be a SamplingParams"),
])
def test_a_bad_request_is_refused_before_anything_runs(tiny_pair, fields, message):
    """On a runtime whose cloud refuses connections: a request that got as far as connecting would fail with
    CloudUnavailable, not with its own ValueError."""
    request = {**dict(prompt=PROMPT, protocol="sd", sampling=GREEDY, max_new_tokens=4, seed=0), **fields}
    with refusing_port() as port, EdgeRuntime(config(f"tcp://127.0.0.1:{port}"), loaded(tiny_pair[0])) as rt:
        with pytest.raises(ValueError, match=message):
            rt.generate(request.pop("prompt"), request.pop("protocol"), request.pop("sampling"),
                        request.pop("max_new_tokens"), **request)
        assert rt.client is None


def test_report_connects_and_tells_the_cloud_the_device_state(tiny_pair, cloud):
    with EdgeRuntime(config(cloud.endpoint), loaded(tiny_pair[0])) as rt:
        assert rt.client is None
        state = rt.report()
        assert isinstance(state, P.CloudState) and rt.client is not None
        devices = [d for d in cloud.report()["devices"] if d["device_id"] == "runtime-test"]
        assert devices and "report_at" in devices[-1]


# -- open_engine ------------------------------------------------------------------------------------------------------
def test_the_torch_engine_states_the_model_and_keeps_its_parts_per_hat_and_draft_vocabulary(tiny_pair, tmp_path):
    """token_lm is the whole model; split_parts are built once per (hat, draft vocabulary): U-shape's parts ignore the
    draft vocabulary, HAT's with and without one are different parts (a request after another gets its own)."""
    from edge_runtime.backends.split_parts import TorchSplitParts
    from hat_split.models.adapter import Adapter, rank_vocab, save_adapter, save_draft_vocab
    from hat_split.models.partition import SplitModel

    model = tiny_pair[1].model  # two layers: cut at m = 1
    cfg = EdgeConfig(model="tiny")
    engine = open_engine(cfg, loaded(tiny_pair[1], eos=9))
    assert isinstance(engine, TorchEngine) and isinstance(engine.lm, CausalLM)
    assert (engine.vocab_size, engine.model_name, engine.fingerprint, engine.eos_ids) == \
        (TINY_VOCAB, "tiny", FINGERPRINT, frozenset({9}))
    assert engine.token_lm(cfg) is engine.lm

    ushape = engine.split_parts(False, SplitConfig(m=1))
    assert isinstance(ushape, TorchSplitParts) and not ushape.has_adapter
    assert engine.split_parts(False, SplitConfig(m=1, draft_vocab=3)) is ushape
    with pytest.raises(ValueError, match="protocol hat needs a distilled adapter"):
        engine.split_parts(True, SplitConfig(m=1))

    save_adapter(tmp_path, Adapter(model, 1).eval(), SplitModel(model, 1), "tiny", {"steps": 0})
    save_draft_vocab(tmp_path, rank_vocab([[4, 4, 8, 15, 16, 23, 42]], TINY_VOCAB))
    hat = engine.split_parts(True, SplitConfig(m=1, adapter=str(tmp_path)))
    sub = engine.split_parts(True, SplitConfig(m=1, adapter=str(tmp_path), draft_vocab=3))
    assert hat.has_adapter and hat.draft_ids is None and hat is not ushape
    assert sub is not hat and sub.draft_ids.tolist() == [4, 8, 15]
    assert engine.split_parts(True, SplitConfig(m=1, adapter=str(tmp_path))) is hat
    assert engine.split_parts(True, SplitConfig(m=1, adapter=str(tmp_path), draft_vocab=3)) is sub

    adapter_cfg = EdgeConfig(model="tiny", engine=EngineConfig(token_draft="adapter"),
                             split=SplitConfig(m=1, adapter=str(tmp_path)))
    drafts = engine.token_lm(adapter_cfg)
    assert drafts is not engine.lm and engine.token_lm(adapter_cfg) is drafts  # the adapter's draft, built once


def test_a_pre_loaded_model_is_refused_unless_the_engine_can_use_it(tiny_pair, tmp_path):
    for engine in (EngineConfig(backend="onnxruntime", bundle=str(tmp_path)), EngineConfig(backend="llamacpp")):
        with pytest.raises(ValueError, match=f"backend {engine.backend} runs .* no pre-loaded torch model"):
            open_engine(EdgeConfig(model="tiny", engine=engine), loaded(tiny_pair[0]))
    with pytest.raises(ValueError, match="weight_quant applies when the runtime loads the model"):
        open_engine(EdgeConfig(model="tiny", engine=EngineConfig(weight_quant="int8")), loaded(tiny_pair[0]))


@pytest.fixture
def fake_llamacpp(monkeypatch, tiny_pair):
    """The llama.cpp engine over a stand-in for hat_split.models.llamacpp_lm.LlamaCppLM (the tiny draft, with
    llama.cpp's end-of-generation list), so it runs without llama-cpp-python or a GGUF file."""
    import edge_runtime.engine as engine_module

    class FakeLlamaCppLM(CausalLM):
        warmed = False

        def __init__(self, gguf, settings):
            super().__init__(tiny_pair[0].model)
            self.gguf, self.settings = gguf, settings

        def warm_up(self):
            FakeLlamaCppLM.warmed = True

        def eog_ids(self):
            return [11, 12]

    monkeypatch.setattr(engine_module, "LlamaCppLM", FakeLlamaCppLM)
    monkeypatch.setattr(engine_module, "model_gguf", lambda model: f"/models/{model}.gguf")
    monkeypatch.setattr(engine_module, "load_tokenizer", lambda model: ByteTokenizer())
    return FakeLlamaCppLM


def test_the_llamacpp_engine_runs_token_protocols_and_refuses_the_split_ones_saying_why(fake_llamacpp, cloud,
                                                                                        reference):
    cfg = config(cloud.endpoint, engine=EngineConfig(backend="llamacpp", n_ctx=256, threads=1))
    with EdgeRuntime(cfg) as rt:
        engine = rt.engine
        assert isinstance(engine, LlamaCppEngine) and fake_llamacpp.warmed
        assert (engine.lm.gguf, engine.lm.settings.n_ctx, engine.eos_ids) == ("/models/tiny.gguf", 256,
                                                                              frozenset({11, 12}))
        assert engine.token_lm(cfg) is engine.lm
        assert rt.generate(PROMPT, "slm", GREEDY, 6, seed=0).tokens == reference["draft"][:6]
        for protocol in ("ushape", "hat"):
            with pytest.raises(ValueError, match=r"the split protocols \(ushape, hat\) .* this device runs llamacpp"):
                rt.generate(PROMPT, protocol, GREEDY, 4, seed=0)
