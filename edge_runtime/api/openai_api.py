"""The OpenAI-compatible API of `hat-edge serve`, without I/O: request checking, stop sequences, response bodies.

Routes (edge_runtime.api.agent serves them): `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions`,
streaming (`"stream": true`, server-sent events ending in `data: [DONE]`) or not. Supported: `max_tokens` (chat also
`max_completion_tokens`), `temperature` (0..2), `top_p` (0..1], `stop` (a string or up to 4), `seed`, `n` = 1,
`stream_options.include_usage`, a completion prompt as text or as an array of token ids, and the extension
`hatspec` = {"protocol": "sd" | "hat" | ... | "auto", "tokens": bool, "private": bool, "allow_lossy": bool,
"sla_tokens_per_s": number} choosing the device-cloud protocol per request (auto: the device chooses; private: token
ids never leave the device; allow_lossy: auto may choose slm; sla_tokens_per_s: auto keeps that pace at the least
cloud compute per token) and asking for the generated token ids (the openai client sends it with
`extra_body`); the response's `hatspec` says what ran (`auto`: protocols, tokens, reasons). Fields that would change
the output distribution and that hatspec does not implement (penalties, logit_bias, n > 1, tools, echo, ...) are refused
with a 400 naming the field, rather than silently ignored.

Log-probabilities: completions `logprobs` = k (0..20), chat `logprobs: true` with `top_logprobs` = k (0..20), streamed
too (each chunk carries its tokens'). They are the target's log-softmax of each emitted token (and its k most probable
alternatives), exact wherever the target computed the token's distribution; a token the device committed without
the target (a skipped upload, a degraded stretch, the device-only protocol) carries the draft's, marked in the
extension fields `hatspec_source` (chat, per token) and `hatspec_sources` (completions): "target" or "draft".
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union

from edge_runtime.request import MAX_NEW_TOKENS_LIMIT, RequestDefaults
from hat_split.math.logprobs import MAX_TOP_LOGPROBS

MAX_STOPS = 4
MAX_TOKENS_LIMIT = MAX_NEW_TOKENS_LIMIT
HATSPEC_KEYS = frozenset({"protocol", "tokens", "private", "allow_lossy", "sla_tokens_per_s"})  # the extension's
IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls"}  # no effect on the text
NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "best_of": 1, "echo": False, "suffix": None,
           "logit_bias": None, "tools": None, "tool_choice": None, "response_format": None, "functions": None,
           "function_call": None}  # accepted only at these values


class ApiError(ValueError):
    """A request the endpoint refuses: HTTP status, OpenAI error type and the parameter at fault."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = 400,
                 kind: str = "invalid_request_error", retry_after_s: int = 0):
        """retry_after_s > 0: the response's Retry-After header (429, 503), which OpenAI clients wait before
        retrying."""
        super().__init__(message)
        self.param, self.status, self.kind, self.retry_after_s = param, status, kind, retry_after_s

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": None}}


@dataclass
class CompletionRequest:
    chat: bool
    prompt: Union[str, List[int], None]  # completions: text, or token ids (OpenAI's array-of-tokens form)
    messages: Optional[List[dict]]  # chat
    max_tokens: int
    temperature: float
    top_p: float
    stop: List[str]
    seed: Optional[int]
    stream: bool
    include_usage: bool
    protocol: str
    return_tokens: bool = False  # hatspec.tokens: the generated token ids in the response's hatspec object
    logprobs: Optional[int] = None  # k: each token's log-probability and its k most probable alternatives; None: off
    private: Optional[bool] = None  # hatspec.private: token ids never leave the device (None: the agent's default)
    allow_lossy: Optional[bool] = None  # hatspec.allow_lossy: auto may choose slm (None: the agent's default)
    sla_tokens_per_s: Optional[float] = None  # hatspec.sla_tokens_per_s: the pace auto keeps at the least cloud
    # compute per token (None: the agent's default)


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's entry of a response's logprobs."""

    token: str  # its text
    logprob: float
    top: List[Tuple[str, float]]  # the most probable alternatives, most probable first
    source: str  # "target" | "draft" (hat_split.math.logprobs)
    offset: int  # where its text starts in the completion (characters)


def parse_request(body: Any, chat: bool, protocols: Tuple[str, ...], defaults: RequestDefaults) -> CompletionRequest:
    """An OpenAI (chat) completion body, checked; what it leaves out comes from `defaults` (the agent's: the same
    a `/hatspec/generate` request or `hat-edge generate` gets, edge_runtime.request)."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    known = {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "stop",
             "seed", "n", "stream", "stream_options", "hatspec", "logprobs", "top_logprobs"} | IGNORED | set(NEUTRAL)
    unknown = sorted(set(body) - known)
    if unknown:
        raise ApiError(f"unsupported parameter(s): {', '.join(unknown)}", unknown[0])
    for key, neutral in NEUTRAL.items():
        if body.get(key) is not None and body[key] != neutral:
            raise ApiError(f"{key}={body[key]!r} is not supported: hatspec keeps the model's distribution exact "
                           f"(only {neutral!r})", key)
    if body.get("n", 1) != 1:
        raise ApiError("n must be 1", "n")
    prompt = messages = None
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError("messages must be a non-empty list", "messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer"):
                raise ApiError(f"messages[{i}] needs a role of system, developer, user or assistant", "messages")
            content = m.get("content")
            if isinstance(content, list):  # content parts: text only
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):
                    raise ApiError(f"messages[{i}].content: only text parts are supported", "messages")
            elif not isinstance(content, str):
                raise ApiError(f"messages[{i}].content must be a string or text parts", "messages")
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        is_ids = isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                  for t in prompt)
        if not (isinstance(prompt, str) or is_ids) or not prompt:
            raise ApiError("prompt must be a non-empty string or a non-empty array of token ids (one prompt per "
                           "request)", "prompt")
    max_key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(max_key)
    max_tokens = defaults.max_new_tokens if max_tokens is None else max_tokens
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or not 1 <= max_tokens <= MAX_TOKENS_LIMIT:
        raise ApiError(f"{max_key} must be an integer in 1..{MAX_TOKENS_LIMIT}", max_key)
    temperature = _number(body, "temperature", defaults.temperature, 0.0, 2.0)
    top_p = _number(body, "top_p", defaults.top_p, 0.0, 1.0)
    if top_p == 0.0:
        raise ApiError("top_p must be in (0, 1]", "top_p")
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOPS or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(f"stop must be a non-empty string or a list of at most {MAX_STOPS}", "stop")
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise ApiError("seed must be an integer", "seed")
    if seed is not None:
        seed %= 2**63  # any integer a client sends (negative ones too) names one non-negative stream
    else:
        seed = defaults.seed
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError("stream must be true or false", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError("stream_options must be an object", "stream_options")
    ext = body.get("hatspec") or {}
    if not isinstance(ext, dict) or set(ext) - HATSPEC_KEYS:
        raise ApiError(f"hatspec must be an object with at most {', '.join(sorted(HATSPEC_KEYS))}", "hatspec")
    for key in ("tokens", "private", "allow_lossy"):
        if not isinstance(ext.get(key, False), bool):
            raise ApiError(f"hatspec.{key} must be true or false", "hatspec")
    sla = ext.get("sla_tokens_per_s")
    if sla is not None and (isinstance(sla, bool) or not isinstance(sla, (int, float)) or not sla >= 0):
        raise ApiError("hatspec.sla_tokens_per_s must be a number of tokens/s >= 0", "hatspec")
    protocol = ext.get("protocol", defaults.protocol)
    if protocol not in protocols:
        raise ApiError(f"hatspec.protocol {protocol!r} is not one of {', '.join(protocols)}", "hatspec")
    return CompletionRequest(chat, prompt, messages, max_tokens, temperature, top_p, stop, seed, stream,
                             bool(options.get("include_usage")), protocol, ext.get("tokens", False),
                             _logprobs(body, chat), ext.get("private"), ext.get("allow_lossy"), sla)


def _logprobs(body: dict, chat: bool) -> Optional[int]:
    """k alternatives per token, or None: completions `logprobs` = k; chat `logprobs` = true, `top_logprobs` = k."""
    def count(key: str) -> int:
        value = body[key]
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_TOP_LOGPROBS:
            raise ApiError(f"{key} must be an integer in 0..{MAX_TOP_LOGPROBS}", key)
        return value

    if not chat:
        if body.get("top_logprobs") is not None:
            raise ApiError("top_logprobs is a chat parameter: completions take logprobs = k", "top_logprobs")
        return None if body.get("logprobs") is None else count("logprobs")
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise ApiError("logprobs must be true or false (chat; the alternatives are top_logprobs)", "logprobs")
    if body.get("top_logprobs") is None:
        return 0 if wanted else None
    if not wanted:
        raise ApiError("top_logprobs needs logprobs: true", "top_logprobs")
    return count("top_logprobs")


def logprobs_body(req: CompletionRequest, entries: List[TokenLogprob]) -> Optional[dict]:
    """A choice's `logprobs` object in OpenAI's shape for chat or completions (None when not asked)."""
    if req.logprobs is None:
        return None
    if req.chat:
        return {"content": [{"token": e.token, "logprob": e.logprob, "bytes": list(e.token.encode("utf-8")),
                             "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}
                                              for t, lp in e.top],
                             "hatspec_source": e.source} for e in entries], "refusal": None}
    return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [dict(e.top) for e in entries] if req.logprobs else None,
            "text_offset": [e.offset for e in entries], "hatspec_sources": [e.source for e in entries]}


def _number(body: dict, key: str, default: float, lo: float, hi: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise ApiError(f"{key} must be a number in [{lo:g}, {hi:g}]", key)
    return float(value)


def chat_messages(messages: List[dict]) -> List[dict]:
    """Messages for the tokenizer's chat template: text parts joined, `developer` as `system`."""
    out = []
    for m in messages:
        content = m["content"] if isinstance(m["content"], str) else "".join(p["text"] for p in m["content"])
        out.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
    return out


@dataclass
class StopMatcher:
    """Cuts generated text at the first stop sequence, and holds back what could still become one while streaming."""

    stops: List[str]
    text: str = ""  # everything generated so far
    emitted: int = 0  # characters handed out
    stopped: bool = field(default=False, init=False)

    def feed(self, delta: str) -> str:
        """Add newly generated text; return what can be emitted now."""
        if self.stopped:
            return ""
        self.text += delta
        cut = min((i for i in (self.text.find(s, self.emitted) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            out, self.emitted = self.text[self.emitted:cut], cut
            self.text = self.text[:cut]
            return out
        hold = max((k for s in self.stops for k in range(len(s) - 1, 0, -1) if self.text.endswith(s[:k])), default=0)
        end = max(self.emitted, len(self.text) - hold)
        out, self.emitted = self.text[self.emitted:end], end
        return out

    def flush(self) -> str:
        """At the end: whatever was held back (it did not become a stop sequence)."""
        out, self.emitted = self.text[self.emitted:], len(self.text)
        return out


def cut_at_stop(text: str, stops: List[str]) -> Tuple[str, bool]:
    """The text up to the first stop sequence, and whether one was found."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def finish_reason(reason: str) -> str:
    """Generation's reasons in OpenAI's terms: eos and stop sequences are "stop", the length limit "length"."""
    return "length" if reason == "length" else "stop"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response(req: CompletionRequest, rid: str, model: str, text: str, reason: str, prompt_tokens: int,
             completion_tokens: int, extra: Dict[str, Any], logprobs: Optional[dict] = None) -> dict:
    """`logprobs`: the choice's (logprobs_body)."""
    base = {"id": rid, "created": int(time.time()), "model": model,
            "usage": usage(prompt_tokens, completion_tokens), "hatspec": extra}
    if req.chat:
        return {**base, "object": "chat.completion", "choices": [{
            "index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason(reason),
            "logprobs": logprobs}]}
    return {**base, "object": "text_completion", "choices": [{
        "index": 0, "text": text, "finish_reason": finish_reason(reason), "logprobs": logprobs}]}


def chunk(req: CompletionRequest, rid: str, model: str, text: Optional[str], reason: Optional[str] = None,
          role: bool = False, logprobs: Optional[dict] = None) -> dict:
    """One streamed event: a text delta (or the role opening a chat stream, or the final finish reason), with its
    tokens' `logprobs` (logprobs_body) when asked."""
    base = {"id": rid, "created": int(time.time()), "model": model}
    if req.chat:
        delta: Dict[str, Any] = {"role": "assistant", "content": ""} if role else \
            ({"content": text} if text else {})
        return {**base, "object": "chat.completion.chunk", "choices": [{
            "index": 0, "delta": delta, "finish_reason": finish_reason(reason) if reason else None,
            "logprobs": logprobs}]}
    return {**base, "object": "text_completion", "choices": [{
        "index": 0, "text": text or "", "finish_reason": finish_reason(reason) if reason else None,
        "logprobs": logprobs}]}


def usage_chunk(req: CompletionRequest, rid: str, model: str, prompt_tokens: int, completion_tokens: int) -> dict:
    return {"id": rid, "created": int(time.time()), "model": model,
            "object": "chat.completion.chunk" if req.chat else "text_completion", "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}


def models(model: str) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "hatspec"}]}
