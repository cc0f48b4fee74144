"""Knowledge distillation of HAT's adapter Λ against the middle part (paper 004, eq. 4).

For a batch of token sequences `# [B, n]`, the frozen model gives the teacher: shallow states s = input(tokens), deep
states d = middle(s), features f_L = norm(output_tail(d)) and logits H(f_L). The student replaces the middle part by
Λ: f_S = norm(output_tail(Λ(s))). The loss is

    SmoothL1(f_S, f_L) + w_ce · CE(softmax(H(f_L)), H(f_S))

averaged over positions, with f the hidden state right before the LM head (after the final norm, so every dimension
is on one scale), and CE the cross-entropy of the student's head output against the teacher's distribution (soft
targets). w_ce = 0.1 as in the paper. Only Λ is trained; the head, norms and tail layers are frozen but carry gradients.

The head is most of a step's cost (a vocabulary-wide matmul forward and backward, and one more for the teacher's
distribution: 152k columns for Qwen2.5), so the CE term may be estimated on a random subset of the positions
(`ce_positions`): an unbiased estimate of the same mean, at the fraction of the head's cost. The frozen model may run in
bfloat16 while Λ keeps float32 master weights (`autocast`): the matmuls in bfloat16, the optimizer's state in float32.

The teacher is frozen, so `TeacherCache` computes it once per training window and keeps what the loss needs on disk,
memory-mapped: the shallow states s (the student's input) and the features f_L (float16 by default). The teacher's
distribution is H(f_L): one head matmul recomputes it from the cached features at training time, instead of storing a
vocabulary-wide row per position. Training then runs only Λ, the tail and the head, never the middle part again.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

from hat_split.files.atomic import write_json

from hat_split.models.partition import PartCache, SplitModel, Stack, lm_head_logits
from hat_split.models.placement import to_device, to_host

W_CE = 0.1  # HAT eq. 4


@dataclass
class Teacher:
    """The frozen model's view of one batch (plain tensors: safe to train against). Its distribution is the frozen
    head on its features (`teacher_probs`), computed where the loss needs it."""

    shallow: Any  # [B, n, hidden] input-part output
    features: Any  # [B, n, hidden] teacher f_L (normed)


def teacher(split: SplitModel, tokens: Any) -> Teacher:
    """tokens `# [B, n]` int64 → the teacher's states (inference mode, then cloned into ordinary tensors)."""
    import torch

    embed = split.model.model.embed_tokens
    with torch.inference_mode():
        embedded = embed(tokens.to(embed.weight.device))  # [B, n, hidden]
    shallow = split.input.forward(PartCache(), embedded)
    deep = split.middle.forward(PartCache(), shallow)
    feats = _features(split, deep, train=False)
    return Teacher(shallow.clone(), feats.clone())


def teacher_probs(split: SplitModel, feats: Any) -> Any:
    """The teacher's distribution `# [..., vocab]` float32 from its features `# [..., hidden]` (the frozen head)."""
    import torch

    with torch.inference_mode():
        probs = torch.softmax(lm_head_logits(split.model, feats).float(), dim=-1)
    return probs.clone()  # an ordinary tensor: the loss saves it for backward


def autocast(split: SplitModel) -> Any:
    """The context a training step runs in: bfloat16 / float16 matmuls when the frozen model is in that dtype (Λ's
    float32 weights are cast per operation), nothing for a float32 model."""
    import torch

    weight = next(split.model.parameters())
    if weight.dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(weight.device.type, dtype=weight.dtype)


def ce_positions(shape: Sequence[int], fraction: float, generator: Any) -> Any:
    """A random subset of round(fraction · B · n) flat positions of a `# [B, n]` batch (at least one), or None for
    all positions (fraction 1)."""
    import torch

    if not 0 < fraction <= 1:
        raise ValueError(f"the CE fraction must be in (0, 1], got {fraction}")
    total = int(shape[0]) * int(shape[1])
    if fraction == 1:
        return None
    k = max(1, round(fraction * total))
    return torch.randperm(total, generator=generator)[:k]


def _features(split: SplitModel, hidden: Any, train: bool) -> Any:
    import torch

    if len(split.output):
        hidden = split.output.forward(PartCache(), hidden, train=train)
    with contextlib.nullcontext() if train else torch.inference_mode():
        return split.model.model.norm(hidden)


def student_loss(split: SplitModel, lam: Stack, t: Teacher, w_ce: float = W_CE, positions: Any = None
                 ) -> Dict[str, Any]:
    """Eq. 4 for one batch: {"loss" (a graph to backpropagate), "smooth_l1", "ce", "top1" (floats)}.

    positions: flat indices into the batch's B · n positions where the CE term (and top-1) is taken (`ce_positions`);
    None: all of them. The SmoothL1 term always covers every position."""
    import torch
    import torch.nn.functional as F

    with autocast(split):
        student = lam.forward(PartCache(), t.shallow, train=True)
        feats = _features(split, student, train=True)
        l_sl = F.smooth_l1_loss(feats.float(), t.features.float())
        flat, target = feats.flatten(0, 1), t.features.flatten(0, 1)
        if positions is not None:
            positions = positions.to(flat.device)
            flat, target = flat[positions], target[positions]
        logits = lm_head_logits(split.model, flat, train=True)  # [k, vocab]
    probs = teacher_probs(split, target)
    l_ce = -(probs * torch.log_softmax(logits, dim=-1)).sum(-1).mean()
    with torch.no_grad():
        top1 = (logits.argmax(-1) == probs.argmax(-1)).float().mean()
    return {"loss": l_sl + w_ce * l_ce, "smooth_l1": float(l_sl.detach()), "ce": float(l_ce.detach()),
            "top1": float(top1)}


# -- the teacher, cached --------------------------------------------------------------------------------------------

CACHE_DTYPES = ("float16", "float32")


@dataclass(frozen=True)
class CacheSpec:
    """What a teacher cache holds; a cache is reused only for the same spec. The device's tail layers are not part
    of it: the shallow states and the final features are the same for every tail (middle + tail = layers m..L)."""

    model: str  # the model's name (its registry name or path)
    m: int
    seq_len: int  # tokens per window
    windows: int
    hidden: int
    dtype: str  # storage of the states: float16 (half the disk, rounding ~1e-3 relative) | float32
    digest: str  # of the windows' token ids: the same data, in the same order
    teacher_dtype: str = "float32"  # the dtype the frozen model ran in

    @staticmethod
    def digest_of(windows: Sequence[Sequence[int]]) -> str:
        h = hashlib.sha256()
        for w in windows:
            h.update(np.asarray(w, dtype=np.int64).tobytes())
        return h.hexdigest()[:16]


class TeacherCache:
    """A folder of two memory-mapped arrays `# [windows, seq_len, hidden]` (shallow.npy, features.npy) and meta.json
    (the spec and how many windows are filled). Filling resumes where it stopped; a folder made for another spec is
    refused, naming the difference."""

    META = "meta.json"

    def __init__(self, path: Path | str, spec: CacheSpec):
        if spec.dtype not in CACHE_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(CACHE_DTYPES)}, got {spec.dtype!r}")
        self.path, self.spec = Path(path), spec
        meta = self.path / self.META
        shape = (spec.windows, spec.seq_len, spec.hidden)
        if meta.is_file():
            saved = json.loads(meta.read_text())
            differ = {k: (v, saved["spec"].get(k)) for k, v in asdict(spec).items() if saved["spec"].get(k) != v}
            if differ:
                raise ValueError(f"the teacher cache in {self.path} was made for another run: "
                                 + ", ".join(f"{k} {old!r} there, {new!r} here" for k, (new, old) in differ.items())
                                 + " (delete it, or give another --cache)")
            self.done = int(saved["done"])
            mode = "r+"
        else:
            self.path.mkdir(parents=True, exist_ok=True)
            self.done, mode = 0, "w+"
        self.shallow = np.lib.format.open_memmap(self.path / "shallow.npy", mode, spec.dtype, shape)
        self.features = np.lib.format.open_memmap(self.path / "features.npy", mode, spec.dtype, shape)
        if mode == "w+":
            self._save_meta()

    @property
    def complete(self) -> bool:
        return self.done == self.spec.windows

    def fill(self, split: SplitModel, windows: List[List[int]], batch: int,
             progress: Callable[[int], None] = lambda n: None, deadline: Optional[float] = None) -> None:
        """Compute the teacher for the windows not filled yet, `batch` at a time; meta.json records each batch, so
        an interrupted fill continues from the last one. deadline: a time.perf_counter() after which no batch starts
        (at least one batch is filled); the cache stays incomplete and a later fill continues it."""
        import time

        import torch

        if len(windows) != self.spec.windows or CacheSpec.digest_of(windows) != self.spec.digest:
            raise ValueError("these windows are not the ones the cache was made for")
        while self.done < self.spec.windows:
            if deadline is not None and self.done > 0 and time.perf_counter() >= deadline:
                return
            lo, hi = self.done, min(self.spec.windows, self.done + batch)
            t = teacher(split, torch.tensor(windows[lo:hi], dtype=torch.long))
            self.shallow[lo:hi] = to_host(t.shallow).astype(self.spec.dtype)
            self.features[lo:hi] = to_host(t.features).astype(self.spec.dtype)
            self.shallow.flush()
            self.features.flush()
            self.done = hi
            self._save_meta()
            progress(hi - lo)

    def grow_from(self, source: Path | str, windows: List[List[int]], chunk: int = 64) -> int:
        """Copy the filled windows of a smaller cache whose windows are the first ones of `windows` (the same model,
        cut, length, storage and teacher; its digest that of the prefix), so a larger run computes only the new
        windows. Returns how many windows were copied; a source that does not match is refused, naming why."""
        meta = Path(source) / self.META
        if not meta.is_file():
            raise ValueError(f"--grow-from: no teacher cache in {source} (no {self.META})")
        saved = json.loads(meta.read_text())
        theirs = CacheSpec(**saved["spec"])
        same = ("model", "m", "seq_len", "hidden", "dtype", "teacher_dtype")
        differ = [f"{k} {getattr(theirs, k)!r} there, {getattr(self.spec, k)!r} here"
                  for k in same if getattr(theirs, k) != getattr(self.spec, k)]
        if differ:
            raise ValueError(f"--grow-from: the cache in {source} was made for another run: " + ", ".join(differ))
        if theirs.windows > self.spec.windows:
            raise ValueError(f"--grow-from: the cache in {source} holds {theirs.windows} windows, more than the "
                             f"{self.spec.windows} of this run (give it as --cache, or a larger --windows)")
        if CacheSpec.digest_of(windows[:theirs.windows]) != theirs.digest:
            raise ValueError(f"--grow-from: the {theirs.windows} windows of {source} are not the first windows of "
                             "this run (other data or another order)")
        n = int(saved["done"])
        if n <= self.done:
            return 0
        shape = (theirs.windows, theirs.seq_len, theirs.hidden)
        for name, dst in (("shallow.npy", self.shallow), ("features.npy", self.features)):
            src = np.lib.format.open_memmap(Path(source) / name, "r", theirs.dtype, shape)
            for lo in range(self.done, n, chunk):
                dst[lo:min(n, lo + chunk)] = src[lo:min(n, lo + chunk)]
            dst.flush()
        copied, self.done = n - self.done, n
        self._save_meta()
        return copied

    def teacher(self, split: SplitModel, idx: Sequence[int]) -> Teacher:
        """The cached teacher of windows `idx`, on the model's device in its dtype."""
        if max(idx) >= self.done:
            raise ValueError(f"window {max(idx)} is not in the cache yet ({self.done} of {self.spec.windows} filled)")
        weight = next(split.model.parameters())
        shallow, feats = (to_device(np.asarray(a[list(idx)], dtype=np.float32), weight.device, weight.dtype)
                          for a in (self.shallow, self.features))
        return Teacher(shallow, feats)

    def _save_meta(self) -> None:
        write_json(self.path / self.META, {"spec": asdict(self.spec), "done": self.done})
