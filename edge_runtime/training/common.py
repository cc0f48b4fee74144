"""What hat-distill's two drafters share: the training and held-out data, the visiting order and learning-rate
schedule, the teacher cache, and the held-out acceptance (greedy HAT in this process)."""
from __future__ import annotations

import math
import shutil
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from edge_runtime.backends.split_parts import TorchSplitParts
from edge_runtime.split_drafter import SplitDrafter, TreeDraft
from hat_split.math.sampling import SamplingParams
from hat_split.math.tree import TreeVerdict, below_chain, parse_shapes, shape_name
from hat_split.models.adapter import rank_vocab
from hat_split.models.chat import encode, encode_chat
from hat_split.models.distill import CacheSpec, TeacherCache
from hat_split.models.partition import PartCache
from hat_split.prompt_sets import (
    DISTILL_SPLIT,
    HUMANEVAL_SPLIT,
    humaneval_prompts,
    long_chat_prompts,
    read_conversations,
    sharegpt_conversations,
)

TRAIN_FROM = DISTILL_SPLIT  # ShareGPT conversations [0, TRAIN_FROM) are held out (evaluation and benchmarks)


def windows(tokenizer, n_windows: int, seq_len: int, offset: int, per_conversation: int = 4,
            corpus: str = "", conversations: Optional[List[List[dict]]] = None) -> List[List[int]]:
    """n_windows token windows of exactly seq_len tokens from ShareGPT's conversations offset, offset + 1, ..., or
    (corpus: a JSON Lines file, hat_split.prompt_sets.read_conversations) from that file's, in its order
    (conversations: the file as already read)."""

    out: List[List[int]] = []
    at = offset
    own = conversations if conversations is not None else read_conversations(corpus) if corpus else None
    while len(out) < n_windows:
        convs = sharegpt_conversations(256, at) if own is None else own[at - offset:at - offset + 256]
        if not convs:
            raise ValueError(f"{corpus or 'ShareGPT'} ran out after {len(out)} windows of {seq_len} tokens")
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


def teacher_cache(args, out: Path, name: str, split, train: List[List[int]], deadline: Optional[float] = None
                  ) -> TeacherCache:
    """The frozen model's states of every training window, on disk: filled now where missing (a progress bar;
    an interrupted fill resumes), then read by every step. deadline: stop filling then (TeacherCache.fill)."""
    from tqdm import tqdm

    hidden = int(split.model.config.hidden_size)
    spec = CacheSpec(name, args.m, args.seq_len, len(train), hidden, args.cache_dtype,
                     CacheSpec.digest_of(train), str(next(split.model.parameters()).dtype).removeprefix("torch."))
    cache = TeacherCache(Path(args.cache) if args.cache else out / "teacher-cache", spec)
    if not cache.complete and args.grow_from:
        copied = cache.grow_from(args.grow_from, train)
        print(f"hat-distill: {copied} windows copied from the teacher cache in {args.grow_from}", file=sys.stderr)
    if not cache.complete:
        gb = 2 * len(train) * args.seq_len * hidden * (2 if args.cache_dtype == "float16" else 4) / 1e9
        print(f"hat-distill: caching the teacher's states of {len(train)} windows ({gb:.2f} GB) in {cache.path}",
              file=sys.stderr)
        with tqdm(total=len(train), initial=cache.done, desc="teacher", unit="window") as bar:
            cache.fill(split, train, args.batch, bar.update, deadline)
    return cache


def copy_record(args, meta: Path) -> None:
    """--record FILE: the artifact's metadata (its training record, held-out figures and provenance, as written into
    the artifact's directory) copied to FILE too, e.g. into results/; its weights stay in the directory."""
    if args.record:
        Path(args.record).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(meta, args.record)
        print(f"hat-distill: record written to {args.record}", file=sys.stderr)


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


def acceptance(split, adapter, tokenizer, args, eta: float, draft_ids=None,
               tree: Optional[Tuple[int, int, int]] = None) -> dict:
    """Greedy HAT decoding in this process on held-out prompts: accepted drafts and tokens per round, on ShareGPT
    conversations (templated) and on HumanEval problems of the evaluation split (raw completion prompts); chains of
    at most --max-draft, or trees of `tree` = (nodes, depth, width)."""

    eos = tokenizer.eos_token_id
    sets = {"sharegpt": long_chat_prompts(tokenizer, args.eval_prompts, 32, 512),
            "humaneval": [encode(tokenizer, p.text, p.chat)
                          for p in humaneval_prompts(min(args.eval_prompts, HUMANEVAL_SPLIT))]}
    return {name: local_accept_length(split, adapter, prompts, args.eval_tokens, eta, args.max_draft,
                                      frozenset([eos] if eos is not None else []), draft_ids, tree)
            for name, prompts in sets.items()}




def print_acceptance(args, at_eta: dict, sweep: dict) -> None:
    """One line per η and prompt set: accepted drafts and tokens per round."""
    vocab = f", draft over {args.draft_vocab} tokens" if args.draft_vocab else ""
    for eta, by_set in [(args.eta, at_eta), *sweep.items()]:
        for name, a in by_set.items():
            print(f"held-out acceptance on {name} (greedy, η={eta}{vocab}): {a['accepted_per_round']:.2f} accepted "
                  f"drafts per round, {a['tokens_per_round']:.2f} tokens per round over {a['rounds']} rounds",
                  file=sys.stderr)


CHECKPOINT = "checkpoint.pt"
ADDED_ARGS = {"data": ""}  # arguments newer than some checkpoints, with the value those checkpoints ran with


def resume(out: Path, args, keys: Sequence[str], module: Any, opt: Any) -> Tuple[int, list]:
    """The step and history of OUT/checkpoint.pt, with `module`'s and `opt`'s state and torch's random state restored
    from it; ValueError naming every argument in `keys` the checkpoint was made with otherwise."""
    import torch

    ckpt = out / CHECKPOINT
    if not ckpt.is_file():
        raise FileNotFoundError(f"--resume: no checkpoint at {ckpt}")
    state = torch.load(ckpt, weights_only=False, map_location="cpu")  # load_state_dict moves it to the weights
    state["args"] = {**ADDED_ARGS, **state["args"]}  # a checkpoint from before an argument existed ran without it
    differ = [k for k in keys if state["args"].get(k) != vars(args)[k]]
    if differ:
        raise ValueError(f"{ckpt} was made with other " + ", ".join(
            f"--{k.replace('_', '-')} ({state['args'].get(k)!r} there, {vars(args)[k]!r} here)" for k in differ))
    # checkpoints written before this function keep the weights under "adapter" or "drafter"
    module.load_state_dict(next(state[k] for k in ("module", "adapter", "drafter") if k in state))
    opt.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["torch_rng"])
    return state["step"], state["history"]


def save_checkpoint(out: Path, args, module: Any, opt: Any, step: int, history: list) -> None:
    """OUT/checkpoint.pt, written whole or not at all."""
    import torch

    out.mkdir(parents=True, exist_ok=True)
    torch.save({"args": vars(args), "module": module.state_dict(), "optimizer": opt.state_dict(), "step": step,
                "history": history, "torch_rng": torch.get_rng_state()}, out / (CHECKPOINT + ".tmp"))
    (out / (CHECKPOINT + ".tmp")).replace(out / CHECKPOINT)


def train_steps(args, out: Path, module: Any, opt: Any, order: List[int], start: int, history: list,
                loss_at: Callable[[int, List[int], Any], dict], desc: str) -> None:
    """Steps start .. args.steps: the windows `order` gives each step, the cosine learning rate, `loss_at(step, idx,
    generator)` (its "loss" a graph, and floats "smooth_l1", "ce", "top1", maybe "top1_steps"), the gradient clipped
    to norm 1, a progress bar, the history row [step, loss, smooth_l1, ce, top1(, top1_steps)] and a checkpoint every
    --checkpoint-every steps and at the end. `generator` seeds the step's CE positions."""
    import torch
    from tqdm import tqdm

    bar = tqdm(range(start, args.steps), initial=start, total=args.steps, desc=desc, unit="step")
    module.train()
    for step in bar:
        idx = order[step * args.batch:(step + 1) * args.batch]
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr)
        r = loss_at(step, idx, torch.Generator().manual_seed(args.seed * 1_000_003 + step))
        opt.zero_grad(set_to_none=True)
        r["loss"].backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        opt.step()
        loss = float(r["loss"].detach())
        extra = [r["top1_steps"]] if "top1_steps" in r else []
        history.append([step, loss, r["smooth_l1"], r["ce"], r["top1"], *extra])
        bar.set_postfix(loss=f"{loss:.3f}", top1=f"{r['top1']:.3f}",
                        **({"last": f"{r['top1_steps'][-1]:.3f}"} if extra else {}))
        if (step + 1) % args.checkpoint_every == 0 or step + 1 == args.steps:
            save_checkpoint(out, args, module, opt, step + 1, history)
    bar.close()


def held_out_acceptance(split, module: Any, tokenizer, args, out: Path) -> dict:
    """The record's acceptance at --eta (and the --eta-sweep), with the draft vocabulary when --draft-vocab asks
    (keys suffixed `_draft_vocab_N`: kept apart from the whole vocabulary's figures); printed as it goes."""
    from hat_split.models.adapter import load_draft_vocab

    draft_ids = load_draft_vocab(out, args.draft_vocab) if args.draft_vocab else None
    suffix = f"_draft_vocab_{args.draft_vocab}" if args.draft_vocab else ""
    record = {"acceptance" + suffix: acceptance(split, module, tokenizer, args, args.eta, draft_ids)}
    sweep = {eta: acceptance(split, module, tokenizer, args, eta, draft_ids) for eta in etas(args.eta_sweep)}
    if sweep:
        record["eta_sweep" + suffix] = {str(eta): a for eta, a in sweep.items()}
    print_acceptance(args, record["acceptance" + suffix], sweep)
    trees = {shape_name(*t): acceptance(split, module, tokenizer, args, args.eta, draft_ids, t)
             for t in parse_shapes(args.eval_trees)}
    if trees:
        record["trees" + suffix] = trees
        for shape, by_set in trees.items():
            for name, a in by_set.items():
                print(f"held-out acceptance on {name} (greedy, η={args.eta}, tree {shape}): "
                      f"{a['tokens_per_round']:.2f} tokens per round, {a['nodes_per_round']:.1f} nodes drafted, over "
                      f"{a['rounds']} rounds", file=sys.stderr)
    return record


def local_accept_length(split: Any, adapter: Any, prompts: List[List[int]], max_new_tokens: int,
                        eta: float, max_draft: int, eos: frozenset = frozenset(),
                        draft_ids: Optional[np.ndarray] = None,
                        tree: Optional[Tuple[int, int, int]] = None) -> Dict[str, float]:
    """Greedy HAT decoding with the middle part in this process: accepted drafts and tokens per round (draft_ids: the
    draft's head over those tokens only); chains of at most max_draft, or trees of `tree` = (nodes, depth, width)
    (nodes_per_round: what each round drafted)."""
    dev = SplitDrafter(TorchSplitParts(split, adapter, draft_ids), SamplingParams(temperature=0.0), seed=0)
    rounds = accepted = produced = drafted = 0
    for prompt in prompts:
        dev.start(prompt)
        middle = PartCache()
        shallow = dev.prompt_states(len(prompt))
        dev.lam_prefill(shallow)
        deep = split.middle.forward(middle, shallow)
        dev.commit([dev.sample_target(dev.target_logits(deep, 0, 1))])
        n_out = 1
        while n_out < max_new_tokens and dev.tokens[-1] not in eos:
            limit = max(1, min(tree[1] if tree else max_draft, max_new_tokens - n_out - 1))
            if tree:
                draft = dev.draft_tree(tree[0], limit, tree[2], eta)
                n = len(local_tree_round(dev, split, middle, draft).path)
                drafted += len(draft.tree.tokens)
            else:
                state = dev.draft(limit, eta)
                position = state.base
                middle.crop(position)
                deep = split.middle.forward(middle, dev.upload_states(state))
                n, token = dev.verify(state, dev.target_logits(deep, position, len(state.drafts) + 1))
                dev.commit(state.drafts[:n] + [token], n)
                drafted += len(state.drafts)
            rounds += 1
            accepted += n
            produced += n + 1
            n_out += n + 1
    return {"rounds": rounds, "accepted_per_round": accepted / max(rounds, 1),
            "tokens_per_round": produced / max(rounds, 1), "nodes_per_round": drafted / max(rounds, 1),
            "prompts": len(prompts), "eta": eta, "max_draft": max_draft,
            **({"tree": list(tree)} if tree else {})}


def local_tree_round(dev: SplitDrafter, split: Any, middle: PartCache, draft: TreeDraft) -> TreeVerdict:
    """A drafted tree verified with the middle part in this process: the middle layers over its 1 + N shallow
    states under the tree's mask, the device's verdict, the accepted path kept on both sides and committed."""
    t = draft.tree
    parents = below_chain(1, t.parents)
    middle.crop(draft.base)
    deep = split.middle.forward_tree(middle, draft.shallow, parents)
    logits = dev.target_logits(deep, draft.base, len(t.tokens) + 1, tree=parents)
    verdict = dev.verify_tree(draft, logits)
    dev.keep_tree_path(draft, verdict.path, logits)
    middle.keep(draft.base, [0] + [n + 1 for n in verdict.path])
    dev.commit([int(t.tokens[n]) for n in verdict.path] + [verdict.token], len(verdict.path))
    return verdict
