"""A bundle's tokenizer without transformers: `tokenizer.json` through the `tokenizers` package and the chat template
through jinja2, as a device with only `hatspec[edge-onnx]` runs it.

`BundleTokenizer` offers what hatspec asks of a tokenizer (hat_split.models.chat, vocab_fingerprint, the edge runtime's
text stream and OpenAI API): calling it on text, decode, get_vocab, the special ids and apply_chat_template. It reads
the directory `save_pretrained` of a fast tokenizer writes (tokenizer.json, tokenizer_config.json and the template in
chat_template.jinja or in the config). The chat template renders the way transformers renders it: a sandboxed
environment with trim_blocks and lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, a `tojson` that
keeps non-ASCII text, the special tokens as variables, and `{% generation %}` blocks rendered as their body.
The bundle's vocabulary fingerprint, checked when a bundle opens, is computed from this object, so a tokenizer that
read a directory differently from the one it was exported with is refused there.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from hat_split.extras import need

SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
LIST_KEYS = ("additional_special_tokens", "extra_special_tokens")
# transformers' clean-up of decoded text (clean_up_tokenization_spaces), when the config asks for it
CLEANUP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
           (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


class TokenizerError(ValueError):
    pass


def _content(value: Any) -> Optional[str]:
    """A special token as the config stores it: a string, or {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class BundleTokenizer:
    def __init__(self, directory: str | Path):
        tokenizers = need("tokenizers", "reading a bundle's tokenizer")
        root = Path(directory)
        if not (root / "tokenizer.json").is_file():
            raise TokenizerError(f"{root} has no tokenizer.json (a fast tokenizer's file): export the bundle again "
                                 "with a current hat-export")
        self.name_or_path = str(root)
        self._tok = tokenizers.Tokenizer.from_file(str(root / "tokenizer.json"))
        cfg_path = root / "tokenizer_config.json"
        cfg: Dict[str, Any] = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
        self.clean_up_spaces = bool(cfg.get("clean_up_tokenization_spaces", False))
        self.special_tokens_map: Dict[str, Any] = {}
        for key in SPECIAL_KEYS:
            tok = _content(cfg.get(key))
            if tok is not None:
                self.special_tokens_map[key] = tok
        extra: List[str] = []
        for key in LIST_KEYS:
            value = cfg.get(key) or []
            values = value.values() if isinstance(value, dict) else value
            extra += [t for t in (_content(v) for v in values) if t is not None and t not in extra]
        if extra:
            self.special_tokens_map["additional_special_tokens"] = extra
        template = root / "chat_template.jinja"
        self.chat_template: Optional[str] = (template.read_text(encoding="utf-8") if template.is_file()
                                             else cfg.get("chat_template"))
        if isinstance(self.chat_template, list):  # named templates: the default one
            named = {t.get("name"): t.get("template") for t in self.chat_template}
            self.chat_template = named.get("default")
        self._compiled = None

    # --- the special tokens ---------------------------------------------------------------------------------------
    def _id(self, key: str) -> Optional[int]:
        tok = self.special_tokens_map.get(key)
        return None if tok is None else self._tok.token_to_id(tok)

    @property
    def eos_token_id(self) -> Optional[int]:
        return self._id("eos_token")

    @property
    def bos_token_id(self) -> Optional[int]:
        return self._id("bos_token")

    @property
    def pad_token_id(self) -> Optional[int]:
        return self._id("pad_token")

    @property
    def all_special_ids(self) -> List[int]:
        tokens = [self.special_tokens_map[k] for k in SPECIAL_KEYS if k in self.special_tokens_map]
        tokens += self.special_tokens_map.get("additional_special_tokens", [])
        ids = [self._tok.token_to_id(t) for t in tokens]
        return list(dict.fromkeys(i for i in ids if i is not None))

    # --- text ↔ ids -----------------------------------------------------------------------------------------------
    def __call__(self, text: str, add_special_tokens: bool = True) -> Dict[str, List[int]]:
        return {"input_ids": list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)}

    def encode(self, text: str, add_special_tokens: bool = True) -> List[int]:
        return self(text, add_special_tokens)["input_ids"]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        text = self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        if self.clean_up_spaces:
            for a, b in CLEANUP:
                text = text.replace(a, b)
        return text

    def get_vocab(self) -> Dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    # --- the chat template ----------------------------------------------------------------------------------------
    def apply_chat_template(self, messages: List[dict], tokenize: bool = False, add_generation_prompt: bool = False,
                            **kwargs: Any) -> Any:
        """The conversation through the bundle's chat template: text, or its ids (tokenize=True, no special tokens
        added beyond the template's own)."""
        if self.chat_template is None:
            raise TokenizerError(f"{self.name_or_path} has no chat template")
        if self._compiled is None:
            self._compiled = _compile(self.chat_template)
        values = {**self.special_tokens_map, "tools": None, "documents": None, **kwargs}
        text = self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt, **values)
        return self(text, add_special_tokens=False)["input_ids"] if tokenize else text


def _compile(template: str) -> Any:
    jinja2 = need("jinja2", "a bundle's chat template")
    from jinja2 import ext, nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(ext.Extension):  # {% generation %}…{% endgeneration %}: the body, as transformers renders it
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)
