"""HAT's distillation over a teacher cache (hat_split.models.distill.TeacherCache): the cached teacher is the teacher
the live trainer computes, training over the cache gives the live losses step for step, a fill resumes where it
stopped, a cache made for other data is refused; and `hat-distill` runs end to end on the real SmolLM2 cut."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hat_split.models.adapter import Adapter, adapter_stack
from hat_split.models.adapter import load_adapter, read_adapter_meta, save_adapter
from hat_split.models.registry import default_adapter_dir
from hat_split.models.distill import CacheSpec, TeacherCache, ce_positions, student_loss, teacher, teacher_probs
from hat_split.models.partition import SplitModel
from tests.conftest import TINY_VOCAB, tiny_model

SEQ = 12


@pytest.fixture(scope="module")
def split():
    return SplitModel(tiny_model(7, layers=4).requires_grad_(False), 1, 1)


def _windows(n, seed=0):
    return np.random.default_rng(seed).integers(0, TINY_VOCAB, (n, SEQ)).tolist()


def _cache(tmp_path, split, windows, dtype="float32", name="tiny"):
    spec = CacheSpec(name, 1, SEQ, len(windows), split.model.config.hidden_size, dtype,
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
    got_p, live_p = teacher_probs(split, got.features), teacher_probs(split, live.features)
    assert float((got_p - live_p).abs().max()) <= 10 * tol


def test_the_teacher_does_not_depend_on_the_tail_so_one_cache_serves_every_tail(split):
    tokens = torch.tensor(_windows(2, seed=6))
    with_tail, without = teacher(split, tokens), teacher(SplitModel(split.model, 1, 0), tokens)
    assert torch.allclose(with_tail.shallow, without.shallow) and torch.allclose(with_tail.features, without.features,
                                                                                 rtol=1e-5, atol=1e-6)


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


def test_the_ce_term_on_a_subset_of_positions_is_the_mean_over_those_positions(split):
    t = teacher(split, torch.tensor(_windows(3, seed=4)))
    lam = adapter_stack(split, Adapter(split.model, 1))
    assert ce_positions((3, SEQ), 1.0, torch.Generator()) is None
    every = torch.randperm(3 * SEQ, generator=torch.Generator().manual_seed(1))
    whole, permuted = student_loss(split, lam, t), student_loss(split, lam, t, positions=every)
    assert permuted["ce"] == pytest.approx(whole["ce"], rel=1e-5) and permuted["top1"] == whole["top1"]
    some = ce_positions((3, SEQ), 0.25, torch.Generator().manual_seed(2))
    assert len(some) == 9 and len(set(some.tolist())) == 9
    per_position = [student_loss(split, lam, t, positions=torch.tensor([int(i)]))["ce"] for i in some]
    got = student_loss(split, lam, t, positions=some)
    assert got["ce"] == pytest.approx(float(np.mean(per_position)), rel=1e-5)
    assert got["smooth_l1"] == pytest.approx(whole["smooth_l1"], rel=1e-6)  # SmoothL1 keeps every position
    with pytest.raises(ValueError, match="CE fraction"):
        ce_positions((3, SEQ), 0.0, torch.Generator())


def test_a_bfloat16_teacher_trains_float32_weights_of_lambda(split):
    model16 = tiny_model(7, layers=4).requires_grad_(False).to(torch.bfloat16)
    split16 = SplitModel(model16, 1, 1)
    tokens = torch.tensor(_windows(2, seed=5))
    t = teacher(split16, tokens)
    assert t.shallow.dtype == torch.bfloat16
    torch.manual_seed(0)
    adapter = Adapter(model16, 1).float()
    lam = adapter_stack(split16, adapter)
    opt = torch.optim.AdamW(adapter.parameters(), lr=1e-3)
    losses = []
    for _ in range(5):
        r = student_loss(split16, lam, t)
        opt.zero_grad()
        r["loss"].backward()
        assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in adapter.parameters())
        opt.step()
        losses.append(float(r["loss"].detach()))
    assert losses[-1] < losses[0]
    ref = student_loss(split, adapter_stack(split, Adapter(split.model, 1)), teacher(split, tokens))
    assert losses[0] == pytest.approx(ref["loss"].item(), rel=0.05)  # bfloat16 rounding of the float32 loss


def test_lambda_starts_from_layer_m_the_last_layer_or_random_and_loads_back(tmp_path, split):
    layers = split.model.model.layers
    copies = {"layer-m": layers[1], "last": layers[3]}
    for init, layer in copies.items():
        a = Adapter(split.model, 1, init)
        assert torch.equal(a.self_attn.q_proj.weight, layer.self_attn.q_proj.weight)
    torch.manual_seed(3)
    rnd = Adapter(split.model, 1, "random")
    assert not any(torch.equal(rnd.self_attn.q_proj.weight, layer.self_attn.q_proj.weight) for layer in layers)
    std = split.model.config.initializer_range
    assert float(rnd.self_attn.o_proj.weight.detach().std()) == pytest.approx(std, rel=0.2)
    assert torch.equal(rnd.input_layernorm.weight, torch.ones_like(rnd.input_layernorm.weight))
    last = Adapter(split.model, 1, "last")
    save_adapter(tmp_path / "a", last, split, "tiny", {}, {"git_commit": "c" * 40})
    assert read_adapter_meta(tmp_path / "a")["provenance"] == {"git_commit": "c" * 40}
    back = load_adapter(tmp_path / "a", split)
    assert back.template == 3 and torch.equal(back.self_attn.q_proj.weight, last.self_attn.q_proj.weight)
    with pytest.raises(ValueError, match="unknown adapter init"):
        Adapter(split.model, 1, "middle")


@pytest.mark.real_models
def test_hat_distill_trains_over_its_cache_on_the_real_cut(smollm2, tmp_path, capsys):
    from edge_runtime.training.distill import main

    out = tmp_path / "adapter"
    args = ["--model", "smollm2-135m", "--m", "2", "--steps", "3", "--batch", "2", "--seq-len", "32", "--windows", "5",
            "--ce-fraction", "0.5", "--init", "last", "--eta-sweep", "0.3",
            "--eval-windows", "1", "--eval-prompts", "1", "--eval-tokens", "4", "--out", str(out)]
    assert main(args) == 0
    record = json.loads((out / "adapter.json").read_text())["record"]
    assert record["teacher_cache"]["dtype"] == "float16" and len(record["history"]) == 3
    assert record["init"] == "last" and record["windows"] == 5
    stamp = json.loads((out / "adapter.json").read_text())["provenance"]
    assert len(stamp["git_commit"]) == 40 and stamp["command"] and "simd" in stamp["machine"]
    assert set(record["acceptance"]) == set(record["eta_sweep"]["0.3"]) == {"sharegpt", "humaneval"}
    meta = json.loads((out / "teacher-cache" / "meta.json").read_text())
    assert meta["done"] == meta["spec"]["windows"] == 5 and meta["spec"]["hidden"] == 576


@pytest.mark.parametrize("model,m,tail,expected", [
    ("qwen2.5-coder-1.5b", 2, 0, "runs/adapters/qwen2.5-coder-1.5b-m2"),   # a registry name keeps its dots
    ("smollm2-135m", 2, 2, "runs/adapters/smollm2-135m-m2-t2"),
    ("/models/Qwen2.5-Coder-1.5B-Q8_0.gguf", 4, 0, "runs/adapters/Qwen2.5-Coder-1.5B-Q8_0-m4"),
    ("/models/qwen2.5-coder-1.5b/", 2, 0, "runs/adapters/qwen2.5-coder-1.5b-m2"),  # an HF directory
])
def test_the_default_adapter_folder_is_named_after_the_whole_model_name(model, m, tail, expected):
    assert default_adapter_dir(model, m, tail).as_posix() == expected


def test_a_larger_cache_grows_from_a_smaller_one_of_its_first_windows(tmp_path, split):
    """--grow-from: the first windows are copied, the rest computed; the grown cache equals one filled from scratch;
    a source of other data, another cut or more windows is refused naming why."""
    windows = _windows(7, seed=4)
    small = _cache(tmp_path / "small", split, windows[:3])
    small.fill(split, windows[:3], batch=2)
    grown = _cache(tmp_path / "grown", split, windows)
    assert grown.grow_from(tmp_path / "small" / "cache", windows) == 3 and grown.done == 3
    assert json.loads((tmp_path / "grown" / "cache" / "meta.json").read_text())["done"] == 3
    assert grown.grow_from(tmp_path / "small" / "cache", windows) == 0  # already there
    grown.fill(split, windows, batch=3)
    scratch = _cache(tmp_path / "scratch", split, windows)
    scratch.fill(split, windows, batch=7)
    np.testing.assert_allclose(np.asarray(grown.shallow), np.asarray(scratch.shallow), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(grown.features), np.asarray(scratch.features), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="not the first windows of this run"):
        _cache(tmp_path / "g2", split, _windows(7, seed=5)).grow_from(tmp_path / "small" / "cache", _windows(7, seed=5))
    with pytest.raises(ValueError, match="holds 7 windows, more than the 3"):
        _cache(tmp_path / "g3", split, windows[:3]).grow_from(tmp_path / "grown" / "cache", windows[:3])
    with pytest.raises(ValueError, match="dtype 'float32' there, 'float16' here"):
        _cache(tmp_path / "g4", split, windows, dtype="float16").grow_from(tmp_path / "small" / "cache", windows)
    with pytest.raises(ValueError, match="no teacher cache in"):
        _cache(tmp_path / "g5", split, windows).grow_from(tmp_path / "nothing", windows)


@pytest.mark.parametrize("device,says", [("tpu", "device must be one of auto | cpu | cuda | cuda:N, got 'tpu'"),
                                         ("cuda:7", "--device cuda:7: ")])
def test_hat_distill_refuses_a_device_it_cannot_use_before_loading_a_model(device, says, capsys):
    """`hat-distill --device` is resolved before any model loads: a name that is no device, or a GPU this process
    cannot use (a CPU-only torch, none visible, an index out of range), is refused in one line."""
    import torch

    from edge_runtime.training.distill import main

    if device.startswith("cuda") and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    assert main(["--model", "no-such-model", "--device", device]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hat-distill: ") and says in err and len(err.strip().splitlines()) == 1, err
