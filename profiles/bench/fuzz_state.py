"""`hat-bench fuzz --stateful`: requests mutated relative to the real state of sessions the fuzzer opened properly.

Frames mutated at random mostly die in the decoder or name sessions that do not exist; here the fuzzer says Hello with
the served model's vocabulary, opens token sessions (OpenSession: sd / hlm / llm / qs) and split sessions (OpenSplit
with the model's fingerprint and its middle layers: hat / ushape), and tracks each one from the cloud's replies: its
step, its position (committed tokens, or positions held) and, for token sessions, the committed tokens themselves.
Each case then sends one of Verify / Generate / CloseSession (token sessions), Hidden / CloseSession (split ones), a
Report, or a new session, either valid (it must succeed: the session advances, so later cases reach deep states) or
mutated against that state (MUTATIONS): position off by ±1 / ±k, step repeated / skipped / old, tensors of the wrong
shape or dtype or values, a distribution (dense / sparse / topk / lattice) or hidden payload (float16 / float32 /
int8) broken, payload bits flipped, an earlier valid frame replayed, two requests of one session in flight (in order
or swapped). Every request is decoded here as it was sent, so whatever the cloud accepts is tracked exactly.

Bugs: a case with no answer in 5 s, an `internal` error, a valid request refused, a reply disagreeing with the
tracked state (a position, a Closed digest of the committed tokens). Coverage: per request type, each reply type
(a Verdict proves the verify handler ran end to end) and each error code (a `desync` proves its validation did).
"""
from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import msgspec
import numpy as np
import zmq

from hat_split.wire import messages as P
from profiles.bench import fuzz_payloads as F

MAX_OPEN = 6  # sessions the fuzzer keeps open (a device's quota is 16)
MAX_POSITION = 600  # a session this long is closed (validly) before max_context refuses everything
TOKEN_PROTOCOLS = ("sd", "hlm", "llm", "qs")
SPLIT_PROTOCOLS = ("hat", "ushape")
MUTATIONS = ("valid", "position", "step", "payload", "flip", "replay", "in_order", "swapped", "wrong_session",
             "close_in_flight", "reopen_in_flight")
REPLY_WAIT_MS = 5000


@dataclass
class Tracked:
    """A session as the cloud's replies describe it."""

    sid: int
    protocol: str
    split: bool
    step: int = 0  # the last step the cloud accepted
    position: int = 0  # token sessions: committed tokens; split ones: positions held
    tokens: List[int] = field(default_factory=list)  # token sessions: the committed sequence
    sent: List[List[bytes]] = field(default_factory=list)  # its valid frames so far (the last 8), for replays
    close_p: float = 0.1  # chance a request of it is a CloseSession: most sessions end soon, a few grow long


@dataclass
class Facts:
    """What a correct device knows of the served model."""

    vocab: int  # vocabulary size
    vocab_fingerprint: str
    fingerprint: str  # hat_split.models.partition.model_fingerprint
    layers: int
    hidden: int  # hidden size
    max_draft_len: int = 16
    max_context: int = 1024  # the cloud's (hat-cloud serve --max-context)


class StatefulFuzzer:
    """One fuzzing device on one DEALER socket; `case()` runs one case and records it in `report`."""

    def __init__(self, endpoint: str, facts: Facts, rng: random.Random, report: Dict[str, Any]):
        self.endpoint, self.facts, self.rng, self.report = endpoint, facts, rng, report
        report.setdefault("coverage", {})
        report.setdefault("mutations", Counter())
        report.setdefault("deepest", {"token_position": 0, "split_position": 0, "step": 0})  # the furthest reached
        self.sessions: Dict[int, Tracked] = {}
        self.sock: Optional[zmq.Socket] = None
        self.case_no = 0
        self._connect()

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None

    def _connect(self) -> None:
        """A fresh identity (after a lost reply the old one may still get it): Hello again, no sessions."""
        self.close()
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(self.endpoint)
        self.sessions.clear()
        f = self.facts
        self._exchange("Hello", "valid", [P.Hello("fuzz-state", "tiny", f.vocab, f.vocab_fingerprint)])

    # -- one case --------------------------------------------------------------------------------------------------
    def case(self) -> None:
        self.case_no += 1
        rng = self.rng
        if len(self.sessions) < MAX_OPEN:
            return self._open(rng.random() < 0.5, rng.randrange(256))
        if rng.random() < 0.03:  # reopen an id: the new session replaces the old one
            return self._open(rng.random() < 0.5, rng.choice(sorted(self.sessions)))
        if rng.random() < 0.03:
            return self._report()
        if rng.random() < 0.005:
            return self._handshake()
        s = self.sessions[rng.choice(sorted(self.sessions))]
        if s.position > MAX_POSITION:
            return self._request(s, "CloseSession", "valid")
        kind = "CloseSession" if rng.random() < s.close_p else "Hidden" if s.split else rng.choice(
            ["Verify", "Verify", "Generate"])
        self._request(s, kind, rng.choice(MUTATIONS))

    def _open(self, split: bool, sid: int) -> None:
        rng, f = self.rng, self.facts
        valid = rng.random() < 0.7
        if split:
            protocol = rng.choice(SPLIT_PROTOCOLS)
            fields = dict(fingerprint=f.fingerprint, start=rng.randrange(1, f.layers), stop=f.layers,
                          hidden_format=rng.choice(F.HIDDEN_FORMATS), prompt_tokens=rng.randrange(0, 40))
            if not valid:
                what = rng.choice(["fingerprint", "start", "stop", "hidden_format", "protocol"])
                if what == "protocol":
                    protocol = rng.choice(["sd", "", "HAT"])
                else:
                    fields[what] = {"fingerprint": "0" * 32, "start": rng.choice([0, f.layers, f.layers + 1]),
                                    "stop": rng.choice([0, 1, f.layers + 1]), "hidden_format": "bf16"}[what]
            msg: Any = P.OpenSplit(sid, protocol, **fields)
        else:
            protocol = rng.choice(TOKEN_PROTOCOLS)
            prompt = F.tokens(rng, rng.randrange(1, 30), f.vocab)
            sampling = P.Sampling(rng.choice([0.0, 0.7, 1.0]), rng.choice([0, 5]), rng.choice([1.0, 0.9]))
            logprobs = rng.choice([None, None, 2])
            if not valid:
                what = rng.choice(["protocol", "prompt", "sampling", "logprobs"])
                protocol = rng.choice(["hat", "nope", ""]) if what == "protocol" else protocol
                prompt = rng.choice([np.zeros(0, np.int32), np.full(3, f.vocab, np.int32), prompt.astype(np.int64),
                                     np.zeros(2000, np.int32)]) if what == "prompt" else prompt
                sampling = P.Sampling(-1.0, -3, 2.0) if what == "sampling" else sampling
                logprobs = 10**6 if what == "logprobs" else logprobs
            msg = P.OpenSession(sid, protocol, prompt, sampling, rng.randrange(2**31), logprobs=logprobs)
        replies = self._exchange(type(msg).__name__, "valid" if valid else "payload", [msg])
        reply = replies[0] if replies else None
        if isinstance(reply, (P.SessionOpened, P.SplitOpened)):
            s = Tracked(sid, protocol, split, tokens=[] if split else msg.prompt.tolist())
            s.position, s.close_p = len(s.tokens), rng.choice([0.2, 0.05, 0.01, 0.002])
            self.sessions[sid] = s
            if isinstance(reply, P.SessionOpened):
                self._expect(reply.position == len(s.tokens), f"SessionOpened at {reply.position}, prompt "
                             f"{len(s.tokens)}")

    def _report(self) -> None:
        rng = self.rng
        valid = rng.random() < 0.6
        state = P.DeviceState(1e6, 1e6, 0.01, "MODE_30W") if valid else P.DeviceState(
            rng.choice([float("inf"), -1.0, float("nan")]), 1e6)
        stats = P.DeviceStats("ready", "torch", "tiny", 3, {"sd": 2, "hat": 1}, 40.0) if valid or rng.random() < 0.5 \
            else P.DeviceStats("ready", requests=5, protocols={"sd": 2, "zz": 1}, tokens_per_s=float("inf"))
        self._exchange("Report", "valid" if valid else "payload", [P.Report(state, stats)])

    def _handshake(self) -> None:
        """A new device whose Hello is refused (another vocabulary) must still be refused what follows it."""
        f, main = self.facts, self.sock
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(self.endpoint)
        try:
            self._exchange("Hello", "payload", [P.Hello("fuzz-stranger", "other", f.vocab, "f" * 64)])
            replies = self._exchange("Report", "no_hello", [P.Report(P.DeviceState())])
            if replies and not isinstance(replies[0], P.Error):
                self._bug("Report", "no_hello", "a device whose Hello was refused got a Reported")
        finally:
            self.sock.close(linger=0)
            self.sock = main

    # -- session requests ------------------------------------------------------------------------------------------
    def _request(self, s: Tracked, kind: str, mutation: str) -> None:
        rng = self.rng
        if mutation == "replay":
            if not s.sent:
                mutation = "valid"
            else:
                return self._send_frames(kind, mutation, [rng.choice(s.sent)], s)
        if mutation in ("in_order", "swapped") and kind != "CloseSession":
            first = self._build(s, kind, "valid", s.step + 1, s.position)
            nxt = s.position if not s.split else first.position + first.states.values.shape[0]
            second = self._build(s, kind, "valid", s.step + 2, nxt)
            msgs = [first, second] if mutation == "in_order" else [second, first]
            return self._send_frames(kind, mutation, [P.encode(m) for m in msgs], s)
        if mutation in ("close_in_flight", "reopen_in_flight") and kind != "CloseSession":
            last = P.CloseSession(s.sid) if mutation == "close_in_flight" else (
                P.OpenSplit(s.sid, s.protocol, self.facts.fingerprint, 1, self.facts.layers) if s.split else
                P.OpenSession(s.sid, s.protocol, F.tokens(rng, 3, self.facts.vocab)))
            first = self._build(s, kind, "valid", s.step + 1, s.position)
            return self._send_frames(kind, mutation, [P.encode(first), P.encode(last)], s)
        if mutation == "wrong_session":  # the other family's request, or a session never opened
            other = next((t for t in self.sessions.values() if t.split != s.split), None)
            kind = rng.choice(["Hidden", "Verify", "Generate"] if other is None else
                              ["Verify", "Generate"] if s.split else ["Hidden"])
            target = s if other is None else other
            msg = self._build(target, kind, "valid", target.step + 1, target.position)
            msg = msgspec.structs.replace(msg, session_id=s.sid if other is not None else 1000 + rng.randrange(50))
            return self._send_frames(kind, mutation, [P.encode(msg)], None)
        if mutation in ("in_order", "swapped", "close_in_flight", "reopen_in_flight"):
            mutation = "valid"
        msg = self._build(s, kind, mutation, s.step + 1, s.position)
        frames = P.encode(msg)
        if mutation == "flip":
            frames = F.byte_flips(rng, [bytes(f) for f in frames])
        self._send_frames(kind, mutation, [frames], s)

    def _build(self, s: Tracked, kind: str, mutation: str, step: int, position: int) -> Any:
        """The request `kind` of session s at `step` and `position`: valid, or with the one thing `mutation` names
        made wrong ("flip" builds a valid one: its bits are flipped once encoded)."""
        rng, f = self.rng, self.facts
        if mutation == "position":
            position = max(0, position + rng.choice([-1, 1, -2, 2, -rng.randrange(3, 50), rng.randrange(3, 50)]))
        if mutation == "step":
            step = max(0, rng.choice([step - 1, step + 1, step - rng.randrange(2, 20), 0, step + 1000]))
        broken = mutation == "payload"
        if kind == "CloseSession":
            return self._close_msg(s, mutation, position)
        if kind == "Hidden":
            n = rng.choice([1, 2, 5, rng.randrange(1, 40)])
            n = f.max_context - position + 1 if broken and rng.random() < 0.1 else n  # past max_context
            if mutation == "valid" and step == s.step + 1 and position and rng.random() < 0.3:  # rejected drafts
                position = max(0, position - rng.randrange(1, 6))
            payload = F.hidden(rng, n, f.hidden)
            if broken and rng.random() < 0.8:
                payload = F.broken_hidden(rng, payload, f.hidden)
            want = rng.randrange(0, n + 1) if not (broken and rng.random() < 0.5) else n + rng.randrange(1, 4)
            return P.Hidden(s.sid, step, position, payload, want)
        new = F.tokens(rng, rng.choice([0, 0, 1, 2]), f.vocab)
        if broken and rng.random() < 0.3:
            new = rng.choice([np.full(2, f.vocab, np.int32), np.full(2, -1, np.int32), new.astype(np.int64),
                              np.zeros((2, 2), np.int32), F.tokens(rng, f.max_context - position, f.vocab)])
        if kind == "Generate":
            n = rng.randrange(1, 5) if not (broken and rng.random() < 0.5) else rng.choice([257, 2000])
            return P.Generate(s.sid, step, position, new, n)
        length = rng.randrange(1, f.max_draft_len + 1) if rng.random() < 0.2 else rng.randrange(1, 5)
        payload, draft = F.dist(rng, rng.choice(F.DIST_FORMATS), length, f.vocab)
        if broken and rng.random() < 0.7:
            what = rng.choice(["dist", "dist", "draft", "length"])
            if what == "dist":
                payload = F.broken_dist(rng, payload, length, f.vocab)
            elif what == "draft":
                draft = rng.choice([draft.astype(np.int64), draft.reshape(1, -1), np.full(length, f.vocab, np.int32)])
            else:
                draft = rng.choice([draft[:0], F.tokens(rng, f.max_draft_len + 1, f.vocab), draft[:-1]])
        return P.Verify(s.sid, step, position, new, draft, payload)

    def _close_msg(self, s: Tracked, mutation: str, position: int) -> P.CloseSession:
        rng = self.rng
        if s.split:
            return P.CloseSession(s.sid)
        new = F.tokens(rng, rng.choice([0, 1, 2]), self.facts.vocab) if rng.random() < 0.5 else None
        total = len(s.tokens) + (0 if new is None else len(new))
        length = rng.choice([None, total, max(total - 1, 0)])
        if mutation == "payload":
            new = rng.choice([np.full(1, -1, np.int32), np.zeros(1, np.int64), new])
            length = total + rng.randrange(1, 5)
        return P.CloseSession(s.sid, position if new is not None else None, new, length)

    # -- sending, replies and state ---------------------------------------------------------------------------------
    def _exchange(self, kind: str, mutation: str, msgs: List[Any]) -> List[Optional[P.Message]]:
        return self._send_frames(kind, mutation, [P.encode(m) for m in msgs], None)

    def _send_frames(self, kind: str, mutation: str, sends: List[List[Any]], s: Optional[Tracked]
                     ) -> List[Optional[P.Message]]:
        """Send each message (all before reading any reply), collect one reply each, record them and update `s`;
        returns the replies in the order of `sends` ([] when one did not come)."""
        sends = [[bytes(f) for f in frames] for frames in sends]
        for frames in sends:
            self.sock.send_multipart(frames)
        replies = self._collect(len(sends))
        if len(replies) < len(sends):
            self._bug(kind, mutation, f"{len(sends) - len(replies)} of {len(sends)} requests unanswered in "
                      f"{REPLY_WAIT_MS / 1000:.0f} s")
            self.report["unanswered"] += len(sends) - len(replies)
            self._connect()
            return []
        ordered = list(enumerate(sends))
        if mutation == "swapped":  # replies apply in step order (the cloud takes a session's steps in order)
            ordered.reverse()
        answers: List[Optional[P.Message]] = [None] * len(sends)
        for i, frames in ordered:
            msg = _decoded(frames)
            answers[i] = reply = _reply_for(msg, replies)
            self._record(kind if msg is None else type(msg).__name__, mutation, reply)
            if s is not None and msg is not None:
                self._apply(s, msg, reply, frames, mutation)
        return answers

    def _collect(self, n: int) -> List[P.Message]:
        out: List[P.Message] = []
        while len(out) < n and self.sock.poll(REPLY_WAIT_MS):
            out.append(P.decode(self.sock.recv_multipart()))
        return out

    def _record(self, kind: str, mutation: str, reply: P.Message) -> None:
        outcome = f"error:{reply.code}" if isinstance(reply, P.Error) else f"ok:{type(reply).__name__}"
        cov = self.report["coverage"].setdefault(kind, Counter())
        cov[outcome] += 1
        self.report["mutations"][f"{kind} {mutation} {outcome}"] += 1
        if isinstance(reply, P.Error) and reply.code == "internal":
            self._bug(kind, mutation, reply.message)
        if mutation == "valid" and isinstance(reply, P.Error):
            self._bug(kind, mutation, f"a valid request refused: {reply.code}: {reply.message}")

    def _apply(self, s: Tracked, msg: Any, reply: P.Message, frames: List[bytes], mutation: str) -> None:
        """Track what the cloud accepted (the request as decoded here) from its reply."""
        if isinstance(reply, P.Error):
            if reply.code == "no_session" and type(msg) is not P.OpenSession:
                self.sessions.pop(s.sid, None)  # expired or evicted: nothing to track any more
            return
        if mutation == "valid":
            s.sent = (s.sent + [frames])[-8:]
        if isinstance(reply, (P.SessionOpened, P.SplitOpened)):  # reopened: a new session under the same id
            s.step, s.tokens = 0, [] if s.split else msg.prompt.tolist()
            s.position = len(s.tokens)
            return
        s.step = getattr(reply, "step", s.step)
        if isinstance(reply, P.Verdict):
            s.tokens += msg.new_tokens.tolist() + msg.draft.tolist()[:reply.n_accepted] + [reply.token]
        elif isinstance(reply, P.Generated):
            s.tokens += msg.new_tokens.tolist() + reply.tokens.tolist()
        elif isinstance(reply, P.Closed):
            self.sessions.pop(s.sid, None)
            if not s.split:
                tokens = s.tokens + ([] if msg.new_tokens is None else msg.new_tokens.tolist())
                length = len(tokens) if msg.length is None else msg.length
                self._expect(reply.n_tokens == len(tokens) and reply.digest == P.sequence_digest(tokens[:length]),
                             f"Closed {reply.n_tokens} tokens digest {reply.digest}, tracked {len(tokens)}")
            return
        deepest = self.report["deepest"]
        deepest["step"] = max(deepest["step"], s.step)
        if isinstance(reply, P.Deep):
            s.position = reply.position
            deepest["split_position"] = max(deepest["split_position"], s.position)
            return
        s.position = len(s.tokens)
        deepest["token_position"] = max(deepest["token_position"], s.position)
        self._expect(getattr(reply, "position", s.position) == s.position,
                     f"{type(reply).__name__} position {getattr(reply, 'position', None)}, tracked {s.position}")

    def _expect(self, ok: bool, what: str) -> None:
        if not ok:
            self._bug("state", "", what)

    def _bug(self, kind: str, mutation: str, error: str) -> None:
        self.report["bugs"].append({"case": self.case_no, "where": "stateful", "kind": f"{kind} {mutation}",
                                    "error": error[:300]})


def _decoded(frames: List[bytes]) -> Any:
    """The request as the cloud decodes it; None when it does not decode."""
    try:
        return P.decode(frames)
    except P.ProtocolError:
        return None


def _reply_for(msg: Any, replies: List[P.Message]) -> P.Message:
    """Take the reply that answers `msg` from the replies to requests of one session: by step (None for requests
    without one), else the first."""
    step = getattr(msg, "step", None)
    for i, r in enumerate(replies):
        if getattr(r, "step", None) == step:
            return replies.pop(i)
    return replies.pop(0)


def coverage_table(coverage: Dict[str, Dict[str, int]]) -> str:
    """Per request type: requests sent, the replies that prove its handler ran end to end, then its error codes."""
    lines = [f"{'request':<14}{'requests':>9}  replies | error codes"]
    for kind in sorted(coverage):
        c = coverage[kind]
        ok = ", ".join(f"{k[3:]} {v}" for k, v in sorted(c.items()) if k.startswith("ok:"))
        errors = ", ".join(f"{k[6:]} {v}" for k, v in sorted(c.items(), key=lambda kv: -kv[1])
                           if k.startswith("error:"))
        lines.append(f"{kind:<14}{sum(c.values()):>9}  {ok or '-'} | {errors or '-'}")
    return "\n".join(lines)


def run_stateful(endpoint: str, facts: Facts, cases: int, rng: random.Random, report: Dict[str, Any],
                 between: Callable[[int], None]) -> None:
    """`cases` stateful cases from one fuzzing device; `between(i)` after each (the bystander's checks)."""
    fuzzer = StatefulFuzzer(endpoint, facts, rng, report)
    try:
        for i in range(cases):
            fuzzer.case()
            between(i)
    finally:
        fuzzer.close()
    report["coverage"] = {k: dict(v) for k, v in report["coverage"].items()}
    report["mutations"] = dict(report["mutations"])
