"""A draft model played back from a recording, for benches that emulate many devices on one machine
(`hat-bench capacity`): what the real draft model predicts greedily from every prefix a greedy request can reach, and
how long its forwards take, so that N emulated devices cost this machine sleeps rather than N models' compute while
the cloud they talk to does all of its real work.

`record` runs the real model (any object with the CausalLM interface: new_state / forward / crop) along the target's
greedy continuation of a prompt: from every position of it, a greedy draft of up to `gamma` tokens; each forward's
next token is kept under its prefix. A greedy request of any protocol commits the target's tokens (every protocol is
exact), so every prefix its drafts start from, and every draft prefix up to `gamma`, is in the table. `RecordedLM`
answers those prefixes with the recorded token (its logit 0, every other one far below) after sleeping what the real
model took: `step_s` for a forward of one or two tokens, `prefill_s_per_token` a token for longer ones. A prefix
outside the table (the cloud's batched steps can round a near tie the other way, so its greedy tokens leave the
recorded path; a γ above the recording's) drafts token 0, which the cloud rejects unless it is right — the cost of a
wrong draft, as a real draft model that guessed wrong would have — and is counted (`misses`); `strict` refuses it
instead, naming the prefix.

A cloud that batches sessions rounds near ties either way (its sessions share one KV cache: docs/TREES.md), so its
greedy tokens may leave the lone target's path wherever the target's top two logits are close. `near_ties` finds
those positions from the target's logits along its path, and `branches` gives the target's lone greedy continuation
after the runner-up at each of them: recording the draft along every branch as well keeps a request that took the
runner-up on the recording (a second near tie on a branch is not followed: it still misses).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

import numpy as np

from hat_split.models.lm import KVState, check_crop, check_feed

FAR_BELOW = -1.0e4  # every token's logit but the recorded one: its probability underflows to 0


@dataclass
class Recording:
    """Next tokens by prefix, and the real model's timings."""

    vocab_size: int
    step_s: float  # a forward of one token (a draft step)
    prefill_s_per_token: float  # a forward of many tokens, per token
    next_token: Dict[Tuple[int, ...], int] = field(default_factory=dict)

    def merge(self, other: "Recording") -> None:
        self.next_token.update(other.next_token)


def record(lm, prompt: Sequence[int], target: Sequence[int], gamma: int, start: int = 0) -> Recording:
    """The real model `lm` from every prefix prompt + target[:p] (p = start .. len(target)): a greedy draft of `gamma`
    tokens, each forward's argmax kept under its prefix; the prefill (of the prompt and target[:start]) and every
    draft step timed. `start` > 0 skips the prefixes a recording of another answer with the same target[:start]
    already holds (a branch's)."""
    if len(prompt) < 2 or gamma < 1 or not 0 <= start <= len(target):
        raise ValueError("record needs a prompt of 2 tokens or more, gamma >= 1 and 0 <= start <= len(target)")
    state = lm.new_state()
    seq = list(prompt) + list(target[:start])
    t0 = time.perf_counter()
    lm.forward(state, seq[:-1], n_logits=0)
    prefill = (time.perf_counter() - t0) / (len(seq) - 1)
    steps, table = [], {}
    for p in range(start, len(target) + 1):
        base, chain, tok = state.length, [], seq[-1]  # the cache holds seq[:-1]
        for _ in range(gamma):
            t0 = time.perf_counter()
            logits = lm.forward(state, [tok], n_logits=1)
            steps.append(time.perf_counter() - t0)
            tok = int(np.argmax(logits[0]))
            table[tuple(seq + chain)] = tok
            chain.append(tok)
        lm.crop(state, base)
        if p < len(target):
            lm.forward(state, [seq[-1]], n_logits=0)
            seq.append(int(target[p]))
    return Recording(int(lm.vocab_size), statistics.median(steps), prefill, table)


def near_ties(logits: np.ndarray, path: Sequence[int], margin: float) -> List[Tuple[int, int]]:
    """The positions i of `path` where the target's top two logits (logits[i]: its row before path[i]) are less than
    `margin` apart, each with the one of the two that path[i] is not."""
    if logits.ndim != 2 or len(logits) != len(path) or margin < 0:
        raise ValueError(f"near_ties needs one row of logits per token of the path and a margin >= 0, got "
                         f"{logits.shape} rows for {len(path)} tokens, margin {margin}")
    out = []
    for i, tok in enumerate(path):
        row = logits[i]
        first, second = sorted(np.argpartition(row, -2)[-2:], key=lambda t: -row[t])
        if row[first] - row[second] < margin:
            out.append((i, int(second if first == tok else first)))
    return out


def branches(target_lm, prompt: Sequence[int], path: Sequence[int], margin: float) -> List[Tuple[int, List[int]]]:
    """The target's lone greedy answers of len(path) tokens that take the other token at one near tie i of its path
    (`near_ties`) and follow the target from there, each with its i (path[:i] is theirs in common)."""
    if margin <= 0 or not path:
        return []
    logits = target_lm.forward(target_lm.new_state(), list(prompt) + list(path[:-1]), n_logits=len(path))
    out = []
    for i, other in near_ties(logits, path, margin):
        head = list(path[:i]) + [other]
        out.append((i, head + target_lm.greedy(list(prompt) + head, len(path) - len(head)) if len(head) < len(path)
                    else head))
    return out


@dataclass
class _State(KVState):
    tokens: List[int] = field(default_factory=list)


@dataclass
class RecordedLM:
    """The CausalLM interface over a Recording (module docstring)."""

    recording: Recording
    strict: bool = False  # refuse a prefix outside the recording (else draft token 0 and count it)
    misses: int = 0

    @property
    def vocab_size(self) -> int:
        return self.recording.vocab_size

    def warm_up(self) -> None:
        pass

    def eog_ids(self) -> List[int]:
        return []

    def new_state(self) -> KVState:
        return _State()

    def forward(self, state: _State, tokens: Sequence[int], n_logits: int = 1) -> np.ndarray:
        n = len(tokens)
        check_feed(n, n_logits)
        rec = self.recording
        seconds = rec.step_s if n <= 2 else max(rec.step_s, n * rec.prefill_s_per_token)
        state.tokens.extend(int(t) for t in tokens)
        out = np.full((n_logits, rec.vocab_size), FAR_BELOW, np.float32)
        for i in range(n_logits):
            prefix = tuple(state.tokens[:len(state.tokens) - n_logits + i + 1])
            if prefix not in rec.next_token and self.strict:
                raise KeyError(f"the recording holds no draft after this prefix of {len(prefix)} tokens (ending "
                               f"{list(prefix[-4:])}): recorded drafts serve greedy requests on the recorded prompts")
            self.misses += prefix not in rec.next_token
            out[i, rec.next_token.get(prefix, 0)] = 0.0
        time.sleep(seconds)
        state.length += n
        state.forward_s += seconds
        state.forward_tokens += n
        return out

    def crop(self, state: _State, length: int) -> None:
        check_crop(state, length)
        del state.tokens[length:]
        state.length = length
