"""A prompt as token ids: raw text, or turns through the tokenizer's own chat template (the device, the benchmarks and
the trainers all encode prompts this one way)."""
from __future__ import annotations

from typing import List


def encode_chat(tokenizer, messages: List[dict], add_generation_prompt: bool = False) -> List[int]:
    """Token ids of a whole conversation through the tokenizer's chat template."""
    templated = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return list(tokenizer(templated, add_special_tokens=False)["input_ids"])


def encode(tokenizer, text: str, chat: bool) -> List[int]:
    """Token ids of a prompt: raw text, or one user turn through the tokenizer's chat template."""
    if chat:
        return encode_chat(tokenizer, [{"role": "user", "content": text}], add_generation_prompt=True)
    return list(tokenizer(text)["input_ids"])
