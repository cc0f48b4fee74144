"""What hat-distill's two drafters share: the training and held-out data, the visiting order and learning-rate
schedule, the teacher cache, and the held-out acceptance (greedy HAT in this process)."""
from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import List

from edge_runtime.split_drafter import local_accept_length
from hat_split.models.adapter import rank_vocab
from hat_split.models.chat import encode, encode_chat
from hat_split.models.distill import CacheSpec, TeacherCache
from hat_split.prompt_sets import (DISTILL_SPLIT, HUMANEVAL_SPLIT, humaneval_prompts, long_chat_prompts,
                                   sharegpt_conversations)

TRAIN_FROM = DISTILL_SPLIT  # ShareGPT conversations [0, TRAIN_FROM) are held out (evaluation and benchmarks)


def windows(tokenizer, n_windows: int, seq_len: int, offset: int, per_conversation: int = 4) -> List[List[int]]:
    """n_windows token windows of exactly seq_len tokens from conversations offset, offset + 1, ..."""

    out: List[List[int]] = []
    at = offset
    while len(out) < n_windows:
        convs = sharegpt_conversations(256, at)
        if not convs:
            raise ValueError(f"ShareGPT ran out after {len(out)} windows of {seq_len} tokens")
        at += len(convs)
        for conv in convs:
            ids = encode_chat(tokenizer, conv)
            for k in range(min(per_conversation, len(ids) // seq_len)):
                out.append(ids[k * seq_len:(k + 1) * seq_len])
                if len(out) == n_windows:
                    return out
    return out


def visit_order(n: int, count: int, seed: int) -> List[int]:
    """`count` window indices: passes over range(n), each in its own random order (seeded)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    order: List[int] = []
    while len(order) < count:
        order += torch.randperm(n, generator=gen).tolist()
    return order[:count]


def lr_at(step: int, steps: int, peak: float) -> float:
    warm = max(1, steps // 20)
    if step < warm:
        return peak * (step + 1) / warm
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, steps - warm)))


def teacher_cache(args, out: Path, name: str, split, train: List[List[int]]) -> TeacherCache:
    """The frozen model's states of every training window, on disk: filled now where missing (a progress bar;
    an interrupted fill resumes), then read by every step."""
    from tqdm import tqdm

    hidden = int(split.model.config.hidden_size)
    spec = CacheSpec(name, args.m, args.seq_len, len(train), hidden, args.cache_dtype,
                     CacheSpec.digest_of(train), str(next(split.model.parameters()).dtype).removeprefix("torch."))
    cache = TeacherCache(Path(args.cache) if args.cache else out / "teacher-cache", spec)
    if not cache.complete:
        gb = 2 * len(train) * args.seq_len * hidden * (2 if args.cache_dtype == "float16" else 4) / 1e9
        print(f"hat-distill: caching the teacher's states of {len(train)} windows ({gb:.2f} GB) in {cache.path}",
              file=sys.stderr)
        with tqdm(total=len(train), initial=cache.done, desc="teacher", unit="window") as bar:
            cache.fill(split, train, args.batch, bar.update)
    return cache


def etas(text: str) -> List[float]:
    """"0.3,0.8" → [0.3, 0.8]; ValueError for a value outside (0, 1)."""
    out = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        try:
            eta = float(item)
        except ValueError:
            raise ValueError(f"--eta-sweep: {item!r} is not a number") from None
        if not 0 < eta < 1:
            raise ValueError(f"--eta-sweep: η must be in (0, 1), got {eta}")
        out.append(eta)
    return out


def vocab_ranking(model, tokenizer, train: List[List[int]]):
    """The training windows' tokens by frequency, the end-of-sequence ids first (hat_split.models.adapter)."""
    eos = tokenizer.eos_token_id
    first = [eos] if isinstance(eos, int) else list(eos or [])
    return rank_vocab(train, int(model.lm_head.weight.shape[0]), first)


def acceptance(split, adapter, tokenizer, args, eta: float, draft_ids=None) -> dict:
    """Greedy HAT decoding in this process on held-out prompts: accepted drafts and tokens per round, on ShareGPT
    conversations (templated) and on HumanEval problems of the evaluation split (raw completion prompts)."""

    eos = tokenizer.eos_token_id
    sets = {"sharegpt": long_chat_prompts(tokenizer, args.eval_prompts, 32, 512),
            "humaneval": [encode(tokenizer, p.text, p.chat)
                          for p in humaneval_prompts(min(args.eval_prompts, HUMANEVAL_SPLIT))]}
    return {name: local_accept_length(split, adapter, prompts, args.eval_tokens, eta, args.max_draft,
                                      frozenset([eos] if eos is not None else []), draft_ids)
            for name, prompts in sets.items()}




def print_acceptance(args, at_eta: dict, sweep: dict) -> None:
    """One line per η and prompt set: accepted drafts and tokens per round."""
    vocab = f", draft over {args.draft_vocab} tokens" if args.draft_vocab else ""
    for eta, by_set in [(args.eta, at_eta), *sweep.items()]:
        for name, a in by_set.items():
            print(f"held-out acceptance on {name} (greedy, η={eta}{vocab}): {a['accepted_per_round']:.2f} accepted "
                  f"drafts per round, {a['tokens_per_round']:.2f} tokens per round over {a['rounds']} rounds",
                  file=sys.stderr)
