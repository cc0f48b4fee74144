"""Knowledge distillation of HAT's adapter Λ against the middle part (paper 004, eq. 4).

For a batch of token sequences `# [B, n]`, the frozen model gives the teacher: shallow states s = input(tokens), deep
states d = middle(s), features f_L = norm(output_tail(d)) and logits H(f_L). The student replaces the middle part by
Λ: f_S = norm(output_tail(Λ(s))). The loss is

    SmoothL1(f_S, f_L) + w_ce · CE(softmax(H(f_L)), H(f_S))

averaged over positions, with f the hidden state right before the LM head (after the final norm, so every dimension
is on one scale), and CE the cross-entropy of the student's head output against the teacher's distribution (soft
targets). w_ce = 0.1 as in the paper. Only Λ is trained; the head, norms and tail layers are frozen but carry gradients.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Dict

from hat_split.models.partition import PartCache, SplitModel, Stack, lm_head_logits

W_CE = 0.1  # HAT eq. 4


@dataclass
class Teacher:
    """The frozen model's view of one batch (plain tensors: safe to train against)."""

    shallow: Any  # [B, n, hidden] input-part output
    features: Any  # [B, n, hidden] teacher f_L (normed)
    probs: Any  # [B, n, vocab] float32 teacher distribution


def teacher(split: SplitModel, tokens: Any) -> Teacher:
    """tokens `# [B, n]` int64 → the teacher's states (inference mode, then cloned into ordinary tensors)."""
    import torch

    with torch.inference_mode():
        embedded = split.model.model.embed_tokens(tokens)  # [B, n, hidden]
    shallow = split.input.forward(PartCache(), embedded)
    deep = split.middle.forward(PartCache(), shallow)
    feats = _features(split, deep, train=False)
    with torch.inference_mode():
        probs = torch.softmax(lm_head_logits(split.model, feats), dim=-1)
    return Teacher(shallow.clone(), feats.clone(), probs.clone())


def _features(split: SplitModel, hidden: Any, train: bool) -> Any:
    import torch

    if len(split.output):
        hidden = split.output.forward(PartCache(), hidden, train=train)
    with contextlib.nullcontext() if train else torch.inference_mode():
        return split.model.model.norm(hidden)


def student_loss(split: SplitModel, lam: Stack, t: Teacher, w_ce: float = W_CE) -> Dict[str, Any]:
    """Eq. 4 for one batch: {"loss" (a graph to backpropagate), "smooth_l1", "ce", "top1" (floats)}."""
    import torch
    import torch.nn.functional as F

    student = lam.forward(PartCache(), t.shallow, train=True)
    feats = _features(split, student, train=True)
    logits = lm_head_logits(split.model, feats, train=True)
    l_sl = F.smooth_l1_loss(feats.float(), t.features.float())
    l_ce = -(t.probs * torch.log_softmax(logits, dim=-1)).sum(-1).mean()
    with torch.no_grad():
        top1 = (logits.argmax(-1) == t.probs.argmax(-1)).float().mean()
    return {"loss": l_sl + w_ce * l_ce, "smooth_l1": float(l_sl.detach()), "ce": float(l_ce.detach()),
            "top1": float(top1)}
