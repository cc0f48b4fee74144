"""The keyword under which a transformers forward takes its KV cache, and where its output returns it.

transformers 5.24 renamed `past_key_values` to `cache` (the old name warns until 5.40, then goes) and passes the
attention's extras to `cache.update(key, value, layer_idx, kwargs=...)` instead of a positional `cache_kwargs`. Every
cache hatspec hands to a model's layers (PartCache, BatchCache, SlotStep, the export's KVIO) takes
`update(key, value, layer_idx, *_, **__)`, so both call forms reach it; this module picks the keyword each forward
declares, so neither an older nor a newer transformers warns."""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable


@functools.lru_cache(maxsize=None)
def _keyword(forward: Callable) -> str:
    params = inspect.signature(forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_kwargs(module: Any, cache: Any) -> dict:
    """{keyword: cache} for calling `module` (a decoder layer, attention or model) with a KV cache."""
    return {_keyword(type(module).forward): cache}


def output_cache(out: Any) -> Any:
    """The cache a model's forward returned (`cache` from 5.24, `past_key_values` before)."""
    return out["cache"] if "cache" in out else out.past_key_values
