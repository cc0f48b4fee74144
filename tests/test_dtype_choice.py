"""`--dtype auto` for work on many tokens at once (hat_split.models.loading.resolve_dtype with rows): the faster of
bfloat16 and float32 on this CPU, measured, never read off the CPU's flags alone."""
from __future__ import annotations

import pytest

from hat_split.models import loading


@pytest.fixture(autouse=True)
def _fresh():
    loading.faster_cpu_dtype.cache_clear()
    yield
    loading.faster_cpu_dtype.cache_clear()


@pytest.mark.parametrize("bf16_s,f32_s,expected", [(0.5, 1.0, "bfloat16"), (1.7, 1.0, "float32")])
def test_auto_takes_the_dtype_measured_faster(monkeypatch, bf16_s, f32_s, expected):
    """A CPU with a bfloat16 multiply: the measured times decide (AMX: bfloat16; AVX512-BF16 alone on long windows:
    float32), and a few tokens still get bfloat16 from the flags as before."""
    calls = []

    def timed(dtype, rows, **_):
        calls.append((dtype, rows))
        return bf16_s if dtype == "bfloat16" else f32_s
    monkeypatch.setattr(loading, "cpu_has_bf16_matmul", lambda: True)
    monkeypatch.setattr(loading, "matmul_seconds", timed)
    assert loading.resolve_dtype("auto", rows=1024) == expected
    assert loading.resolve_dtype("auto", rows=1024) == expected and len(calls) == 2  # measured once
    assert loading.resolve_dtype("auto") == "bfloat16" and loading.resolve_dtype("float16", rows=8) == "float16"


def test_a_cpu_without_a_bfloat16_multiply_is_not_measured(monkeypatch):
    monkeypatch.setattr(loading, "cpu_has_bf16_matmul", lambda: False)
    monkeypatch.setattr(loading, "matmul_seconds", lambda *a, **k: pytest.fail("measured"))
    assert loading.resolve_dtype("auto", rows=1024) == "float32"


def test_the_measurement_is_real_and_positive():
    """matmul_seconds runs the product it names on this CPU (whatever its flags say)."""
    assert 0 < loading.matmul_seconds("float32", 4, inner=64, cols=64) < 1.0
    assert loading.faster_cpu_dtype(8) in ("bfloat16", "float32")
