"""HAT's feature drafter: the device drafts from the target's own top-layer features (EAGLE-style, paper 004's Λ
replaced; EAGLE-3's training-time test).

The target's feature f_p is the normed state right before the LM head at position p (norm(tail(deep_p))): the device
computes it anyway to turn the cloud's deep states into distributions, so the drafter costs no byte on the link beyond
what verification already brings back. Position p of the drafter holds the pair (f_{p-1}, s_p): the feature that
sampled token x_p, and x_p's own state on the device (its shallow state after the m input layers, or its embedding:
`token_input`). One fusion layer and one decoder layer of the model's family turn the pairs into f̂_p, the prediction
of f_p; the device's head (or the draft-vocabulary head) turns f̂_p into the draft of x_{p+1}. Later draft positions
feed the drafter its own f̂ (autoregression on features), so a draft of L tokens costs L drafter steps and no upload.

    fused_p = fc([norm_f(f_{p-1}); norm_s(s_p)])      fc: 2h → h, no bias
    f̂_p    = norm_o(layer(fused_p | fused_<p))        layer: a copy of the model's last decoder layer
    q(x_{p+1}) = softmax(head(f̂_p) / T)

f_{-1} is the zero vector (position 0 has no feature before it), so the drafter's positions are the sequence's.

Training (`ttt_loss`): the teacher cache's shallow states and features of a window, unrolled `unroll` times. Step 0
is teacher-forced (true features in every pair); step j feeds each pair the prediction of step j − 1 at the position
before, and its queries see what an inference-time draft step j would see: the true pairs up to p − j and the
predicted pairs p − j + 1 .. p of steps 1..j (EAGLE-3's training-time test masks). The loss sums, over steps weighted
0.8^j, SmoothL1(f̂, f) + w_ce · CE(head(f) ‖ head(f̂)) over the positions where step j is a real draft step (p ≥ j).

Artifact: a directory with `drafter.safetensors` and `drafter.json` (format, kind, base model and fingerprint, cut,
token input, parameter count, training record, provenance) and `draft_vocab.npy` (hat_split.models.adapter's ranking).
`load_feature_drafter` refuses one made for another model, cut or token input, naming the difference.
"""
from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from hat_split.files.atomic import write_json
from hat_split.models.partition import SplitModel, Stack, layer_types, lm_head_logits, model_fingerprint

FEATURE_FORMAT = 1
KIND = "feature"
TOKEN_INPUTS = ("shallow", "embedding")  # what stands for the token in a pair: its shallow state, or its embedding
WEIGHTS = "drafter.safetensors"
META = "drafter.json"
STEP_DECAY = 0.8  # the weight of unroll step j is STEP_DECAY ** j


def _module_base():
    import torch

    return torch.nn.Module


class FeatureDrafter(_module_base()):
    """The fusion layer, one decoder layer shaped like the model's last, and the norms around them."""

    def __init__(self, model: Any, token_input: str = "shallow"):
        import torch

        super().__init__()
        layers = model.model.layers
        if token_input not in TOKEN_INPUTS:
            raise ValueError(f"token_input must be one of {', '.join(TOKEN_INPUTS)}, got {token_input!r}")
        self.token_input = token_input
        template = len(layers) - 1
        self.layer_type = layer_types(model.config)[template]
        self.layer = copy.deepcopy(layers[template])
        self.layer.self_attn.layer_idx = len(layers) + 1  # its own key in a PartCache (Λ has len(layers))
        self.norm_f = copy.deepcopy(model.model.norm)
        self.norm_s = copy.deepcopy(layers[template].input_layernorm)
        self.norm_o = copy.deepcopy(model.model.norm)
        hidden = int(model.config.hidden_size)
        weight = model.model.embed_tokens.weight
        self.fc = torch.nn.Linear(2 * hidden, hidden, bias=False, device=weight.device, dtype=weight.dtype)
        with torch.no_grad():  # start as "the feature before, plus a little of the token": f̂_p ≈ f_{p-1}
            self.fc.weight.zero_()
            self.fc.weight[:, :hidden].copy_(torch.eye(hidden))
            self.fc.weight[:, hidden:].normal_(0.0, float(getattr(model.config, "initializer_range", 0.02)))
        for p in self.parameters():
            p.requires_grad_(True)

    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def stack(self, split: SplitModel) -> Stack:
        """The decoder layer as a Stack of its own on the model's rotary embedding (no model layer)."""
        return Stack(split.model, split.m, split.m, extra_layers=[(self.layer, self.layer_type)])

    def fuse(self, features: Any, tokens: Any) -> Any:
        """Pairs `# [B, n, hidden]` each (f_{p-1}, s_p) → the layer's input `# [B, n, hidden]`."""
        import torch

        return self.fc(torch.cat([self.norm_f(features), self.norm_s(tokens.to(features.dtype))], dim=-1))

    def step(self, stack: Stack, cache: Any, features: Any, tokens: Any, train: bool = False) -> Any:
        """Predicted features f̂ `# [B, n, hidden]` of n pairs at positions cache.length .. (the cache grows by n)."""
        import torch

        with torch.enable_grad() if train else torch.inference_mode():
            return self.norm_o(stack.forward(cache, self.fuse(features, tokens), train=train))

    def step_tree(self, stack: Stack, cache: Any, features: Any, tokens: Any, parents: Sequence[int],
                  start: int) -> Any:
        """Predicted features f̂ `# [1, n, hidden]` of a draft tree's n new nodes, each pair (its parent's f̂, its own
        state), under the tree's mask (Stack.forward_tree: `parents` the tree so far, its last n the new nodes, the
        tree begun at cache position `start`)."""
        import torch

        with torch.inference_mode():
            return self.norm_o(stack.forward_tree(cache, self.fuse(features, tokens), parents, start))


def draft_logits(model: Any, fhat: Any, rows: Any = None, train: bool = False) -> Any:
    """The draft's float32 logits `# [..., vocab or subset]` from predicted features (they are already normed)."""
    return lm_head_logits(model, fhat, train=train, rows=rows)


# -- training-time test ---------------------------------------------------------------------------------------------

class _Blocks:
    """The `past_key_values` of one unrolled step: the keys and values of every earlier step stay, the step's own are
    appended, and the layer attends over all of them (under `ttt_mask`)."""

    def __init__(self) -> None:
        self.kv: Dict[int, List[Any]] = {}

    def update(self, key: Any, value: Any, layer_idx: int, *_: Any, **__: Any):
        import torch

        blocks = self.kv.setdefault(layer_idx, [])
        blocks.append((key, value))
        return torch.cat([k for k, _ in blocks], dim=-2), torch.cat([v for _, v in blocks], dim=-2)


def ttt_mask(n: int, step: int, dtype: Any, device: Any = "cpu") -> Any:
    """`# [1, 1, n, (step + 1) · n]` additive mask of unroll step `step`: query p sees block 0 (true pairs) at
    q <= p − step and block k = 1..step (predicted pairs) at q = p − step + k only."""
    import torch

    p = torch.arange(n, device=device)[:, None]
    q = torch.arange(n, device=device)[None, :]
    ok = [q <= p - step] + [q == p - step + k for k in range(1, step + 1)]
    allowed = torch.cat(ok, dim=1)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


def shift_features(features: Any) -> Any:
    """f_{p-1} at position p (zeros at position 0): `# [B, n, hidden]` → the same shape."""
    import torch

    return torch.cat([torch.zeros_like(features[:, :1]), features[:, :-1]], dim=1)


def ttt_forward(drafter: FeatureDrafter, stack: Stack, features: Any, tokens: Any, unroll: int,
                train: bool = True) -> List[Any]:
    """f̂ of every unroll step `[# [B, n, hidden]] * unroll` for a window's true features and token states."""
    import torch

    if unroll < 1:
        raise ValueError(f"unroll must be >= 1, got {unroll}")
    n = features.shape[1]
    positions = torch.arange(n, device=features.device)[None].expand(features.shape[0], n)
    cache, outs = _Blocks(), []
    inputs = shift_features(features)
    for j in range(unroll):
        fused = drafter.fuse(inputs, tokens)
        out = stack.run_layers(cache, fused, lambda kind, window, j=j: ttt_mask(n, j, fused.dtype, fused.device),
                               positions, train)
        fhat = drafter.norm_o(out)
        outs.append(fhat)
        inputs = shift_features(fhat)
    return outs


def ttt_loss(split: SplitModel, drafter: FeatureDrafter, stack: Stack, features: Any, tokens: Any, unroll: int,
             w_ce: float, rows: Any = None, positions: Any = None, train: bool = True) -> Dict[str, Any]:
    """The training-time test's loss for a batch `features, tokens # [B, n, hidden]`: {"loss" (a graph), and floats
    "smooth_l1", "ce", "top1" of step 0 and "top1_steps" per step}. rows: `head_rows` of the draft vocabulary (the CE
    over those tokens, the teacher's distribution renormalised on them); positions: flat indices where the CE is taken
    (hat_split.models.distill.ce_positions), None: all."""
    import torch
    import torch.nn.functional as F

    outs = ttt_forward(drafter, stack, features, tokens, unroll, train)
    n = features.shape[1]
    with torch.no_grad():
        teacher = torch.softmax(draft_logits(split.model, features.flatten(0, 1), rows), dim=-1)  # [B·n, V']
    valid_pos = torch.arange(n, device=features.device).repeat(features.shape[0])  # position of each flat row
    keep = torch.ones_like(valid_pos, dtype=torch.bool)
    if positions is not None:
        keep = torch.zeros_like(keep)
        keep[positions.to(keep.device)] = True
    total = features.new_zeros((), dtype=torch.float32)
    stats: Dict[str, Any] = {"top1_steps": []}
    for j, fhat in enumerate(outs):
        rows_j = valid_pos >= j
        flat = fhat.flatten(0, 1)
        l_sl = F.smooth_l1_loss(flat[rows_j].float(), features.flatten(0, 1)[rows_j].float())
        ce_rows = rows_j & keep
        logits = draft_logits(split.model, flat[ce_rows], rows, train=True)
        target = teacher[ce_rows]
        l_ce = -(target * torch.log_softmax(logits, dim=-1)).sum(-1).mean()
        total = total + STEP_DECAY ** j * (l_sl + w_ce * l_ce)
        with torch.no_grad():
            top1 = float((logits.argmax(-1) == target.argmax(-1)).float().mean())
        stats["top1_steps"].append(top1)
        if j == 0:
            stats.update(smooth_l1=float(l_sl.detach()), ce=float(l_ce.detach()), top1=top1)
    stats["loss"] = total
    return stats


# -- artifact ---------------------------------------------------------------------------------------------------------

def save_feature_drafter(path: str | os.PathLike[str], drafter: FeatureDrafter, split: SplitModel, base_model: str,
                         record: Dict[str, Any], provenance: Optional[Dict[str, Any]] = None) -> Path:
    """Weights first, metadata last (a directory with drafter.json is complete)."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in drafter.state_dict().items()}, str(out / WEIGHTS))
    meta = {"format": FEATURE_FORMAT, "kind": KIND, "base_model": base_model,
            "fingerprint": model_fingerprint(split.model), "model_type": split.model.config.model_type,
            "m": split.m, "tail": split.tail, "token_input": drafter.token_input, "layer_type": drafter.layer_type,
            "params": drafter.n_params(), "record": record}
    if provenance is not None:
        meta["provenance"] = provenance
    write_json(out / META, meta, indent=1)
    return out


def is_feature_drafter(path: str | os.PathLike[str]) -> bool:
    return (Path(path) / META).is_file()


def read_feature_meta(path: str | os.PathLike[str]) -> Dict[str, Any]:
    meta_path = Path(path) / META
    if not meta_path.is_file():
        raise FileNotFoundError(f"{path} is not a feature drafter (no {META}); make one with "
                                "`hat-distill --drafter feature`")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != FEATURE_FORMAT or meta.get("kind") != KIND:
        raise ValueError(f"{meta_path}: format {meta.get('format')} kind {meta.get('kind')!r} is not "
                         f"{FEATURE_FORMAT} {KIND!r}")
    return meta


def load_feature_drafter(path: str | os.PathLike[str], split: SplitModel) -> FeatureDrafter:
    from safetensors.torch import load_file

    from hat_split.models.adapter import check_cut

    meta = read_feature_meta(path)
    check_cut(meta, split, f"feature drafter {path}", "trained", "train")
    drafter = FeatureDrafter(split.model, meta["token_input"])
    missing, unexpected = drafter.load_state_dict(load_file(str(Path(path) / WEIGHTS)), strict=False)
    if missing or unexpected:
        raise ValueError(f"feature drafter {path}: weights do not fit (missing {missing}, unexpected {unexpected})")
    drafter.to(device=split.model.model.embed_tokens.weight.device, dtype=split.dtype).eval()
    return drafter.requires_grad_(False)


def token_states(split: SplitModel, drafter: FeatureDrafter, shallow: Any, tokens: Sequence[int] | Any) -> Any:
    """What stands for the tokens in the pairs: their shallow states as given, or their embeddings."""
    if drafter.token_input == "shallow":
        return shallow
    import torch

    ids = tokens if hasattr(tokens, "shape") else torch.tensor([list(tokens)], dtype=torch.long)
    with torch.inference_mode():
        return split.model.model.embed_tokens(ids.to(split.model.model.embed_tokens.weight.device))


def load_drafter(path: str | os.PathLike[str], split: SplitModel) -> Any:
    """The draft module in a hat-distill directory: the feature drafter (drafter.json) or Λ (adapter.json)."""
    from hat_split.models.adapter import load_adapter

    return load_feature_drafter(path, split) if is_feature_drafter(path) else load_adapter(path, split)
