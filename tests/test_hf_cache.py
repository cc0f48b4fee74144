"""Both of transformers' cache conventions reach hatspec's caches: the keyword a forward declares (`cache` from 5.24,
`past_key_values` before) and both `update` call forms (a positional `cache_kwargs`, or `kwargs=` from 5.24)."""
from __future__ import annotations

import torch

from hat_split.models.hf_cache import cache_kwargs, output_cache
from hat_split.models.partition import PartCache


class _New(torch.nn.Module):
    def forward(self, hidden_states, cache=None, **kwargs):
        return cache


class _Old(torch.nn.Module):
    def forward(self, hidden_states, past_key_values=None, **kwargs):
        return past_key_values


def test_the_cache_goes_under_the_keyword_each_forward_declares():
    assert cache_kwargs(_New(), "kv") == {"cache": "kv"}
    assert cache_kwargs(_Old(), "kv") == {"past_key_values": "kv"}
    assert _New()(None, **cache_kwargs(_New(), "kv")) == "kv" and _Old()(None, **cache_kwargs(_Old(), "kv")) == "kv"


def test_the_returned_cache_is_found_under_either_name():
    class Out(dict):
        past_key_values = "old"

    assert output_cache(Out(cache="new")) == "new"
    assert output_cache(Out(logits=1)) == "old"


def test_a_part_cache_takes_both_update_call_forms():
    c = PartCache()
    k = torch.zeros(1, 2, 3, 4)
    a = c.update(k, k, 0, {"cache_position": None})  # transformers before 5.24
    b = c.update(k, k, 0, kwargs={"position_ids": None})  # 5.24: kwargs=
    assert a[0].shape[-2] == 3 and b[0].shape[-2] == 6
