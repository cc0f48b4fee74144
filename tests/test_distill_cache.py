"""HAT's distillation over a teacher cache (hat_split.models.distill.TeacherCache): the cached teacher is the teacher
the live trainer computes, training over the cache gives the live losses step for step, a fill resumes where it
stopped, a cache made for other data is refused; and `hat-distill` runs end to end on the real SmolLM2 cut."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hat_split.models.adapter import Adapter, adapter_stack
from hat_split.models.distill import CacheSpec, TeacherCache, student_loss, teacher
from hat_split.models.partition import SplitModel
from tests.conftest import TINY_VOCAB, tiny_model

SEQ = 12


@pytest.fixture(scope="module")
def split():
    return SplitModel(tiny_model(7, layers=4).requires_grad_(False), 1, 1)


def _windows(n, seed=0):
    return np.random.default_rng(seed).integers(0, TINY_VOCAB, (n, SEQ)).tolist()


def _cache(tmp_path, split, windows, dtype="float32", name="tiny"):
    spec = CacheSpec(name, 1, 1, SEQ, len(windows), split.model.config.hidden_size, dtype,
                     CacheSpec.digest_of(windows))
    return TeacherCache(tmp_path / "cache", spec)


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("float16", 2e-3)])
def test_the_cached_teacher_is_the_live_teacher(tmp_path, split, dtype, tol):
    windows = _windows(6)
    cache = _cache(tmp_path, split, windows, dtype)
    cache.fill(split, windows, batch=4)  # batches of 4 and 2: not the batches read back
    live = teacher(split, torch.tensor([windows[i] for i in (5, 0, 3)]))
    got = cache.teacher(split, [5, 0, 3])
    for a, b in ((got.shallow, live.shallow), (got.features, live.features)):
        assert float((a - b).abs().max()) <= tol * float(b.abs().max())
    assert float((got.probs - live.probs).abs().max()) <= 10 * tol


def test_training_over_the_cache_gives_the_live_losses(tmp_path, split):
    windows = _windows(8, seed=1)
    cache = _cache(tmp_path, split, windows)
    cache.fill(split, windows, batch=3)
    losses = {}
    for mode in ("live", "cache"):
        torch.manual_seed(0)
        adapter = Adapter(split.model, 1)
        lam = adapter_stack(split, adapter)
        opt = torch.optim.AdamW(adapter.parameters(), lr=1e-3)
        losses[mode] = []
        for step in range(4):
            idx = [2 * step, 2 * step + 1]
            live = torch.tensor([windows[i] for i in idx])
            t = cache.teacher(split, idx) if mode == "cache" else teacher(split, live)
            r = student_loss(split, lam, t)
            opt.zero_grad()
            r["loss"].backward()
            opt.step()
            losses[mode].append(float(r["loss"].detach()))
    assert losses["cache"] == pytest.approx(losses["live"], rel=1e-5, abs=1e-6)
    assert losses["live"][-1] < losses["live"][0]  # it trains


def test_a_fill_resumes_and_a_cache_for_other_data_is_refused(tmp_path, split):
    windows = _windows(5, seed=2)
    first = _cache(tmp_path, split, windows)
    with pytest.raises(RuntimeError, match="stop"):
        first.fill(split, windows, batch=2, progress=lambda n: (_ for _ in ()).throw(RuntimeError("stop")))
    assert first.done == 2 and json.loads((tmp_path / "cache" / "meta.json").read_text())["done"] == 2
    again = _cache(tmp_path, split, windows)  # reopened: continues at window 2
    assert again.done == 2
    again.fill(split, windows, batch=2)
    whole = _cache(tmp_path / "other", split, windows)
    whole.fill(split, windows, batch=5)
    np.testing.assert_allclose(np.asarray(again.features), np.asarray(whole.features), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="made for another run: windows 5 there, 6 here"):
        _cache(tmp_path, split, _windows(6, seed=2))
    with pytest.raises(ValueError, match="not the ones the cache was made for"):
        again.fill(split, _windows(5, seed=3), batch=2)
    with pytest.raises(ValueError, match="window 4 is not in the cache yet"):
        _cache(tmp_path / "empty", split, windows).teacher(split, [4])


@pytest.mark.real_models
def test_hat_distill_trains_over_its_cache_on_the_real_cut(smollm2, tmp_path, capsys):
    from edge_runtime.training.distill import main

    out = tmp_path / "adapter"
    args = ["--model", "smollm2-135m", "--m", "2", "--steps", "3", "--batch", "2", "--seq-len", "32",
            "--eval-windows", "1", "--eval-prompts", "1", "--eval-tokens", "4", "--out", str(out)]
    assert main(args) == 0
    record = json.loads((out / "adapter.json").read_text())["record"]
    assert record["teacher_cache"]["dtype"] == "float16" and len(record["history"]) == 3
    meta = json.loads((out / "teacher-cache" / "meta.json").read_text())
    assert meta["done"] == meta["spec"]["windows"] == 6 and meta["spec"]["hidden"] == 576
