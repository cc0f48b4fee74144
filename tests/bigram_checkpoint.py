"""Hugging Face checkpoints whose every next-token distribution is known in closed form, for statistical tests of the
real CLIs (`hat-cloud serve`, `hat-edge generate`) across processes.

A Llama model with its attention and MLP outputs zeroed is a bigram model: the residual stream at a position is the
embedding of the token there, the final RMS norm scales it, and the head reads the logits off it. Token x embeds as
c·e_x (a one-hot of width `hidden` ≥ V); the norm turns that into sqrt(hidden)·e_x (its weight left at 1); the head
row of token v holds log table[x, v] / sqrt(hidden) in column x. So the logits after token x are log table[x] and the
model's next-token law is row x of `table` (float32 exactly up to rounding). The layers stay in the graph (every cut,
KV cache and batched step runs as for a real model); they add zero.

The tokenizer is a word-level one over "t0" .. "t{V-1}" (whitespace-separated), saved with the model, so a text
prompt "t0 t3" is the token ids [0, 3] and both sides' vocabulary fingerprints agree. No end-of-sequence token: a
generation runs to its length.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np


def token_text(ids) -> str:
    return " ".join(f"t{int(i)}" for i in ids)


def save_tokenizer(out: Path, vocab: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(str(out))  # llama: AutoTokenizer reads it as is


def save_bigram(out: Path, table: np.ndarray, layers: int = 2, hidden: int = 0) -> Path:
    """A Llama checkpoint at `out` whose next-token law after token x is table[x] (rows positive, summing to 1)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    table = np.asarray(table, dtype=np.float64)
    V = table.shape[0]
    if table.shape != (V, V) or (table <= 0).any() or not np.allclose(table.sum(1), 1.0):
        raise ValueError("table must be [V, V] with positive rows summing to 1")
    hidden = hidden or max(16, int(math.ceil(V / 8.0)) * 8)
    cfg = LlamaConfig(vocab_size=V, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                      tie_word_embeddings=False, rms_norm_eps=1e-6, eos_token_id=None, bos_token_id=None)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = torch.zeros(V, hidden)
        emb[torch.arange(V), torch.arange(V)] = 1.0
        model.model.embed_tokens.weight.copy_(emb)
        head = torch.zeros(V, hidden, dtype=torch.float64)
        head[:, :V] = torch.from_numpy(np.log(table)).T / math.sqrt(hidden)
        model.lm_head.weight.copy_(head.float())
    model.generation_config.eos_token_id = None
    out = Path(out)
    model.save_pretrained(str(out))
    save_tokenizer(out, V)
    return out
