"""The device's OpenAI-compatible endpoint (issue 9), driven by the real `openai` client: a `hat-cloud serve` process
with smollm2-135m and an agent holding smollm2-135m as its draft (same model both sides, so every exact protocol at
temperature 0 gives the whole model's greedy tokens)."""
from __future__ import annotations

import threading
import time

import pytest

from edge_runtime.api import openai_api as O
from edge_runtime.request import RequestDefaults
from hat_split.net.security import LinkSecurity

openai = pytest.importorskip("openai", reason="the openai client is not installed (test extra)")


def test_request_checking_names_the_field():
    ok = O.parse_request({"prompt": "x", "max_tokens": 5, "stop": "\n", "hatspec": {"protocol": "llm"}}, False,
                         ("sd", "llm"), RequestDefaults())
    assert (ok.max_tokens, ok.stop, ok.protocol, ok.temperature) == (5, ["\n"], "llm", 1.0)
    ids = O.parse_request({"prompt": [[3, 0, 7]], "hatspec": {"tokens": True}}, False, ("sd",), RequestDefaults())
    assert ids.prompt == [3, 0, 7] and ids.return_tokens
    auto = O.parse_request({"prompt": "x", "hatspec": {"protocol": "auto", "private": True, "allow_lossy": False}},
                           False, ("sd", "auto"), RequestDefaults())
    assert (auto.protocol, auto.private, auto.allow_lossy) == ("auto", True, False)
    for body, chat, param in [({"prompt": "x", "n": 2}, False, "n"),
                              ({"prompt": "x", "presence_penalty": 0.5}, False, "presence_penalty"),
                              ({"prompt": "x", "max_tokens": 0}, False, "max_tokens"),
                              ({"prompt": "x", "temperature": 3}, False, "temperature"),
                              ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, False, "stop"),
                              ({"prompt": "x", "hatspec": {"protocol": "carrier-pigeon"}}, False, "hatspec"),
                              ({"prompt": "x", "frobnicate": 1}, False, "frobnicate"),
                              ({"messages": [{"role": "robot", "content": "hi"}]}, True, "messages"),
                              ({"messages": "hi"}, True, "messages"), ({"prompt": ""}, False, "prompt"),
                              ({"prompt": [1, -2]}, False, "prompt"), ({"prompt": [1, True]}, False, "prompt"),
                              ({"prompt": []}, False, "prompt"), ({"prompt": [[1], [2]]}, False, "prompt"),
                              ({"prompt": "x", "hatspec": {"tokens": "yes"}}, False, "hatspec"),
                              ({"prompt": "x", "hatspec": {"private": 1}}, False, "hatspec"),
                              ({"prompt": "x", "hatspec": {"allow_lossy": "no"}}, False, "hatspec"),
                              ({"prompt": "x", "hatspec": {"cheap": True}}, False, "hatspec"),
                              ({"prompt": "x", "logprobs": 21}, False, "logprobs"),
                              ({"prompt": "x", "logprobs": True}, False, "logprobs"),
                              ({"prompt": "x", "top_logprobs": 2}, False, "top_logprobs"),
                              ({"prompt": "x", "echo": True, "logprobs": 1}, False, "echo"),
                              ({"messages": [{"role": "user", "content": "hi"}], "logprobs": 3}, True, "logprobs"),
                              ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, True,
                               "top_logprobs"),
                              ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                                "top_logprobs": 21}, True, "top_logprobs")]:
        with pytest.raises(O.ApiError) as info:
            O.parse_request(body, chat, ("sd", "llm"), RequestDefaults())
        assert info.value.param == param and info.value.body()["error"]["type"] == "invalid_request_error"


def test_logprobs_parameters_and_their_response_shapes():
    chat = [{"role": "user", "content": "hi"}]
    assert O.parse_request({"prompt": "x", "logprobs": 3}, False, ("sd",), RequestDefaults()).logprobs == 3
    assert O.parse_request({"prompt": "x"}, False, ("sd",), RequestDefaults()).logprobs is None
    assert O.parse_request({"messages": chat, "logprobs": True}, True, ("sd",), RequestDefaults()).logprobs == 0
    assert O.parse_request({"messages": chat, "logprobs": False}, True, ("sd",), RequestDefaults()).logprobs is None
    req = O.parse_request({"messages": chat, "logprobs": True, "top_logprobs": 2}, True, ("sd",), RequestDefaults())
    entries = [O.TokenLogprob("Hé", -0.5, [("Hé", -0.5), ("A", -1.5)], "target", 0),
               O.TokenLogprob("!", -2.0, [("?", -0.1), ("!", -2.0)], "draft", 2)]
    body = O.logprobs_body(req, entries)["content"]
    assert body[0]["bytes"] == list("Hé".encode()) and body[1]["top_logprobs"][0] == {
        "token": "?", "logprob": -0.1, "bytes": [63]} and [e["hatspec_source"] for e in body] == ["target", "draft"]
    req = O.parse_request({"prompt": "x", "logprobs": 2}, False, ("sd",), RequestDefaults())
    assert O.logprobs_body(req, entries) == {"tokens": ["Hé", "!"], "token_logprobs": [-0.5, -2.0],
                                             "top_logprobs": [{"Hé": -0.5, "A": -1.5}, {"?": -0.1, "!": -2.0}],
                                             "text_offset": [0, 2], "hatspec_sources": ["target", "draft"]}
    assert O.logprobs_body(O.parse_request({"prompt": "x"}, False, ("sd",), RequestDefaults()), entries) is None


def test_stop_matcher_holds_back_what_may_become_a_stop():
    m = O.StopMatcher(["\n\n", "END"])
    out = [m.feed(d) for d in ["def f", "(x):\n", "    return", " x\n", "\nmore"]]
    assert out == ["def f", "(x):", "\n    return", " x", ""] and m.stopped and m.text == "def f(x):\n    return x"
    m = O.StopMatcher(["END"])
    assert [m.feed(d) for d in ["abE", "N", "x", "EN"]] == ["ab", "", "ENx", ""] and m.flush() == "EN"
    assert O.cut_at_stop("a\nb", ["\n"]) == ("a", True) and O.cut_at_stop("ab", ["\n"]) == ("ab", False)


@pytest.fixture(scope="module")
def endpoint(smollm2_module):
    from cloud_runtime.process import CloudProcess
    from edge_runtime.api.agent import Agent, AgentConfig
    from edge_runtime.config import EdgeConfig, EngineConfig, LinkConfig

    with CloudProcess("smollm2-135m", extra_args=["--dtype", "float32"], threads=1) as cloud:
        link = LinkConfig(cloud.endpoint, security=LinkSecurity.plaintext(), device_id="openai-test")
        agent = Agent(AgentConfig(EdgeConfig(model="smollm2-135m", link=link, engine=EngineConfig(threads=1)),
                                  port=0, report_interval_s=30.0))
        thread = threading.Thread(target=agent.serve_forever, daemon=True)
        thread.start()
        client = openai.OpenAI(base_url=agent.address + "/v1", api_key="unused", max_retries=0, timeout=300)
        yield client, agent
        agent.stop()
        thread.join(timeout=30)


@pytest.fixture(scope="module")
def smollm2_module():
    from hat_split.models.registry import is_installed

    if not is_installed("smollm2-135m"):
        pytest.skip("smollm2-135m is not installed")
    from hat_split.models.loading import load_model

    return load_model("smollm2-135m", dtype="float32")


FIB = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


def _greedy_text(loaded, ids, n):
    from tests.test_hat import greedy_reference

    return loaded.tokenizer.decode(greedy_reference(loaded.model, ids, n), skip_special_tokens=True)


@pytest.mark.real_models
def test_completion_and_chat_through_the_openai_client(endpoint, smollm2_module):
    client, agent = endpoint
    assert [m.id for m in client.models.list().data] == ["smollm2-135m"]
    want = _greedy_text(smollm2_module, smollm2_module.tokenizer(FIB)["input_ids"], 16)
    for protocol in ("sd", "llm", "auto"):
        r = client.completions.create(model="smollm2-135m", prompt=FIB, max_tokens=16, temperature=0,
                                      extra_body={"hatspec": {"protocol": protocol}})
        assert r.choices[0].text == want and r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == 16 and r.model_extra["hatspec"]["protocol"] == protocol
    ran = r.model_extra["hatspec"]["auto"]  # auto says what ran, for how many tokens and why
    assert sum(s["tokens"] for s in ran) == 16 and ran[0]["reason"].startswith("measuring")
    ids = smollm2_module.tokenizer(FIB)["input_ids"]  # the prompt as token ids; the answer's ids come back
    r = client.completions.create(model="m", prompt=ids, max_tokens=16, temperature=0,
                                  extra_body={"hatspec": {"tokens": True}})
    assert r.choices[0].text == want and smollm2_module.tokenizer.decode(r.model_extra["hatspec"]["tokens"]) == want
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client.completions.create(model="m", prompt=[1, 10 ** 7])
    from hat_split.prompt_sets import encode_chat

    messages = [{"role": "user", "content": "Name a prime number."}]
    chat = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=12, temperature=0)
    ids = encode_chat(smollm2_module.tokenizer, messages, add_generation_prompt=True)
    assert chat.choices[0].message.content == _greedy_text(smollm2_module, ids, 12).split("<|im_end|>")[0]
    assert chat.choices[0].message.role == "assistant" and chat.usage.prompt_tokens == len(ids)
    with pytest.raises(openai.BadRequestError, match="hatspec.protocol"):
        client.completions.create(model="m", prompt="x", extra_body={"hatspec": {"protocol": "smoke-signals"}})
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        client.completions.create(model="m", prompt="x", n=2)


@pytest.mark.real_models
def test_streaming_and_stop_sequences(endpoint):
    client, agent = endpoint
    full = client.completions.create(model="m", prompt=FIB, max_tokens=24, temperature=0).choices[0].text
    events = list(client.completions.create(model="m", prompt=FIB, max_tokens=24, temperature=0, stream=True))
    assert "".join(e.choices[0].text for e in events) == full and len(events) > 3
    assert events[-1].choices[0].finish_reason == "length"
    assert "\n" in full
    stopped = client.completions.create(model="m", prompt=FIB, max_tokens=24, temperature=0, stop=["\n"])
    assert stopped.choices[0].text == full.split("\n")[0] and stopped.choices[0].finish_reason == "stop"
    assert agent.last["finish"] == "stop" and agent.last["tokens"] < 24  # generation ended at the stop
    messages = [{"role": "user", "content": "Count to five."}]
    answer = client.chat.completions.create(model="m", messages=messages, max_tokens=20, temperature=0)
    answer = answer.choices[0].message.content
    word = answer.split()[1]  # stop at the answer's second word
    chunks = list(client.chat.completions.create(model="m", messages=messages, max_tokens=20, temperature=0,
                                                 stream=True, stop=[word], stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == answer[:answer.find(word)] and chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop" and chunks[-1].usage.total_tokens


def _target_logprobs(loaded, prompt_ids, tokens):
    """smollm2's own log-softmax at each generated position `# [n, vocab]`."""
    import torch

    with torch.no_grad():
        logits = loaded.model(torch.tensor([list(prompt_ids) + list(tokens)])).logits[0].double()
    return torch.log_softmax(logits, -1)[len(prompt_ids) - 1:len(prompt_ids) - 1 + len(tokens)].numpy()


@pytest.mark.real_models
def test_logprobs_through_the_openai_client_equal_the_targets(endpoint, smollm2_module):
    """sd at temperature 0: each token's logprob and its top 5 are smollm2's own log-softmax (the cloud's float32
    rows); streamed chat chunks carry the same entries as the whole response."""
    import numpy as np

    client, _ = endpoint
    ids = smollm2_module.tokenizer(FIB)["input_ids"]
    r = client.completions.create(model="m", prompt=ids, max_tokens=12, temperature=0, logprobs=5,
                                  extra_body={"hatspec": {"tokens": True}})
    tokens, lp = r.model_extra["hatspec"]["tokens"], r.choices[0].logprobs
    ref = _target_logprobs(smollm2_module, ids, tokens)
    assert len(lp.token_logprobs) == len(tokens) == r.usage.completion_tokens
    np.testing.assert_allclose(lp.token_logprobs, ref[np.arange(len(tokens)), tokens], atol=2e-3)
    decode = smollm2_module.tokenizer.decode
    for row, top in zip(ref, lp.top_logprobs):
        best = np.argsort(-row)[:5]
        assert list(top) == [decode([int(t)]) for t in best] or len(set(decode([int(t)]) for t in best)) < 5
        np.testing.assert_allclose(sorted(top.values(), reverse=True), row[best], atol=2e-3)
    assert "".join(lp.tokens) == r.choices[0].text and lp.model_extra["hatspec_sources"] == ["target"] * len(tokens)
    messages = [{"role": "user", "content": "Name a prime number."}]
    whole = client.chat.completions.create(model="m", messages=messages, max_tokens=10, temperature=0,
                                           logprobs=True, top_logprobs=3)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens and all(len(e.top_logprobs) == 3 for e in content)
    assert all(e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob >= e.top_logprobs[2].logprob
               and e.logprob <= e.top_logprobs[0].logprob + 1e-6 for e in content)
    chunks = list(client.chat.completions.create(model="m", messages=messages, max_tokens=10, temperature=0,
                                                 logprobs=True, top_logprobs=3, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == [(e.token, round(e.logprob, 5)) for e in content]


@pytest.mark.real_models
def test_a_client_that_goes_away_cancels_the_generation(endpoint):
    client, agent = endpoint
    before = agent.requests
    stream = client.completions.create(model="m", prompt=FIB, max_tokens=400, temperature=0, stream=True)
    got = [next(iter(stream)) for _ in range(2)]
    stream.close()  # the connection goes away mid-answer
    assert got
    deadline = time.monotonic() + 60
    while agent.requests == before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert agent.last["finish"] == "cancelled" and agent.last["tokens"] < 400
    r = client.completions.create(model="m", prompt="x = ", max_tokens=4, temperature=0)  # still serving
    assert r.usage.completion_tokens == 4


def _post(agent, body):
    """A raw POST to /v1/completions: (status, Retry-After header or None, JSON body)."""
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(agent.address + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, r.headers.get("Retry-After"), json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Retry-After"), json.loads(exc.read())


@pytest.mark.real_models
def test_a_full_queue_answers_429_and_the_openai_client_retries(endpoint):
    """max_queue 0: while one generation runs, another request is answered 429 with Retry-After (the expected wait);
    the openai client waits that long by itself and gets its answer (its retries cover a minute: the CI's slowest
    machine ran the first request past six retries of 2 s)."""
    client, agent = endpoint
    agent.max_queue = 0
    try:
        running = threading.Thread(target=lambda: client.completions.create(model="m", prompt=FIB, max_tokens=64,
                                                                            temperature=0))
        running.start()
        deadline = time.monotonic() + 30
        while agent._admitted == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        status, retry_after, body = _post(agent, {"prompt": "x = ", "max_tokens": 4})
        assert status == 429 and int(retry_after) >= 1 and body["error"]["type"] == "rate_limit_exceeded"
        r = client.with_options(max_retries=30).completions.create(model="m", prompt="x = ", max_tokens=4,
                                                                   temperature=0)
        assert r.usage.completion_tokens == 4
        running.join(timeout=120)
        assert agent.shed["queue_full"] >= 1
    finally:
        agent.max_queue = 8


@pytest.mark.real_models
def test_a_cloud_that_sheds_load_gives_503_and_the_openai_client_retries(endpoint):
    """The cloud refusing a session for load (busy, memory full, a quota) is answered 503 with Retry-After, not 502;
    the openai client retries and is served once the cloud takes the request."""
    from edge_runtime.client import CloudError
    from hat_split.wire import messages as P

    client, agent = endpoint
    real, refusals = agent.runtime.run, []

    def shedding(*args, **kwargs):
        if len(refusals) < 2:
            refusals.append(True)
            raise CloudError(P.Error("busy", "the cloud holds its limit of 64 sessions"))
        return real(*args, **kwargs)

    agent.runtime.run = shedding
    try:
        status, retry_after, body = _post(agent, {"prompt": "x = ", "max_tokens": 4})
        assert status == 503 and retry_after == "2" and "the cloud sheds load: busy" in body["error"]["message"]
        r = client.with_options(max_retries=2).completions.create(model="m", prompt="x = ", max_tokens=4,
                                                                  temperature=0)
        assert r.usage.completion_tokens == 4 and len(refusals) == 2 and agent.shed["cloud"] >= 2
    finally:
        agent.runtime.run = real


@pytest.mark.real_models
def test_every_entry_point_gives_a_request_the_same_defaults(endpoint):
    """The agent's /hatspec/generate, its /v1/completions and `hat-edge generate`, each with the same defaults
    (those of `hat-edge serve FLAGS`) and a request naming nothing: the runtime is handed equal requests."""
    import dataclasses

    from edge_runtime import cli
    from hat_split.math.sampling import SamplingParams
    from tests.test_request import FLAGS, _parsed

    _, agent = endpoint
    argv = ["serve", "--model", "smollm2-135m", "--plaintext", *FLAGS]
    parser, args = _parsed(argv)
    served = cli._configs(parser, args, argv)
    _, gen_args = _parsed(["generate", "--model", "m", *FLAGS, "x"])
    from_cli = cli._request_defaults(gen_args, "llm").request("x = ")
    seen, real, kept = [], agent.runtime.run, agent.config

    def recording(req):
        seen.append(req)
        return real(req)

    agent.runtime.run, agent.config = recording, dataclasses.replace(agent.config, request=served.request)
    try:
        out = agent.generate({"prompt": "x = "})
        status, _, body = _post(agent, {"prompt": "x = "})
        assert status == 200, body
    finally:
        agent.runtime.run, agent.config = real, kept
    assert len(seen) == 2
    for req in seen:
        assert (req.protocol, req.sampling, req.max_new_tokens, req.seed) == \
            (from_cli.protocol, from_cli.sampling, from_cli.max_new_tokens, from_cli.seed) == \
            ("llm", SamplingParams(0.7, 5, 1.0), 3, 11)
    assert out["n_tokens"] == 3 and body["usage"]["completion_tokens"] == 3
    assert out["tokens"] == body["hatspec"].get("tokens", out["tokens"])
