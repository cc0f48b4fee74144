"""The device as a Jetson has it (issue 23): hatspec's device side installed by `hat-flash --software` (a local
target, the same offline wheel install a device gets) into venvs of Python 3.10 (JetPack 6) and 3.8 (JetPack 5) with
no torch and no transformers, running real bundles against a cloud process of the main environment; and the one-line
error of a missing extra."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENVS = ROOT / ".device-envs"  # gitignored; made (or found up to date) by the first test that needs one
VERSIONS = ("3.10", "3.8")  # JetPack 6, JetPack 5
DEVICE_PACKAGES = ("hat_split", "edge_runtime", "hardware")
NEEDS_TORCH = ("edge_runtime.training.common", "edge_runtime.training.distill", "edge_runtime.training.feature",
               "hat_split.models.adapter", "hat_split.models.draft_lm", "hat_split.models.feature_drafter")
IMPORT_ALL = """
import importlib, json, pkgutil, sys
bad = {}
for name in sys.argv[1:]:
    mod = importlib.import_module(name)
    for info in pkgutil.walk_packages(mod.__path__, name + "."):
        try:
            importlib.import_module(info.name)
        except Exception as exc:
            bad[info.name] = f"{type(exc).__name__}: {exc}"
print(json.dumps({"failed": bad, "where": importlib.import_module("edge_runtime").__file__}))
"""


def _install(version: str):
    from export.deploy.flash import Target
    from export.deploy.software import install, local_python

    base = local_python(version)
    if base is None:
        pytest.skip(f"no Python {version} interpreter here (pyenv install {version}); the device side's check on it "
                    "is skipped")
    return install(Target.parse(f"local:{ENVS}/py{version}"), base, "edge-onnx", progress=False)


@pytest.fixture(scope="module", params=VERSIONS, ids=[f"py{v}" for v in VERSIONS])
def device_python(request, tmp_path_factory) -> Path:
    _install(request.param)
    return ENVS / f"py{request.param}" / "venv" / "bin" / "python"


def _run(python: Path, args, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run in the device venv, from a directory outside the checkout (so the installed copy is what imports)."""
    return subprocess.run([str(python), *args], capture_output=True, text=True, timeout=timeout, cwd=str(cwd))


def test_the_device_env_has_no_torch_and_imports_every_device_module(device_python, tmp_path):
    r = _run(device_python, ["-c", "import importlib.util as u; print([m for m in ('torch', 'transformers') "
                                   "if u.find_spec(m)])"], tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr
    r = _run(device_python, ["-c", IMPORT_ALL, *DEVICE_PACKAGES], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["where"].startswith(str(device_python.parent.parent))  # the installed wheel, not the checkout
    assert set(out["failed"]) == set(NEEDS_TORCH), out["failed"]  # only the trainers' torch modules
    assert all("torch" in why for why in out["failed"].values()), out["failed"]
    r = _run(device_python, ["-m", "edge_runtime.cli", "version", "--json"], tmp_path)
    info = json.loads(r.stdout)
    from hat_split.version import describe

    mine = describe()
    assert (info["hatspec"], info["protocol"], info["extra"]) == (mine["hatspec"], mine["protocol"], "edge-onnx")
    assert info["python"].startswith(device_python.parent.parent.parent.name[2:] + ".")
    assert info["engines"]["onnxruntime"] and not info["engines"]["torch"] and info["build"]


def test_a_second_install_of_the_same_build_does_nothing(device_python):
    version = device_python.parent.parent.parent.name[2:]
    stamp = (device_python.parent.parent / "hatspec-software.json").read_text()
    again = _install(version)
    assert not again.changed and not again.sent_files and again.device["build"] == json.loads(stamp)["build"]


def test_wheel_builds_of_one_checkout_take_turns(tmp_path, monkeypatch):
    """Two builds of one checkout at once (two flashes, two test workers) staged their files in the same build/ and
    removed each other's: they take turns; a checkout whose build/ cannot be written is named."""
    import threading
    import time

    from export.deploy import software
    from export.deploy.flash import FlashError

    spans = []

    def pip_wheel(cmd, what, timeout=600):  # as long as a build, and leaves its wheel where -w says
        start = time.monotonic()
        time.sleep(0.3)
        (Path(cmd[cmd.index("-w") + 1]) / "hatspec-0.1.0-py3-none-any.whl").write_bytes(b"")
        spans.append((start, time.monotonic()))
        return ""

    monkeypatch.setattr(software, "_call", pip_wheel)
    source = tmp_path / "checkout"
    source.mkdir()
    outs = [tmp_path / f"out{i}" for i in range(2)]
    builds = [threading.Thread(target=software.build_wheel, args=(source, out)) for out in outs]
    for out, build in zip(outs, builds):
        out.mkdir()
        build.start()
    for build in builds:
        build.join()
    (_, first_end), (second_start, _) = sorted(spans)
    assert len(spans) == 2 and first_end <= second_start, spans
    assert all((out / "hatspec-0.1.0-py3-none-any.whl").is_file() for out in outs)
    (tmp_path / "file").write_text("")
    with pytest.raises(FlashError, match="needs to write"):
        software.build_wheel(tmp_path / "file", tmp_path)  # its build/ cannot be made


def test_the_device_wheels_follow_the_device_pythons_markers(tmp_path):
    """Without an interpreter of the device's version here, hatspec's own requirements are evaluated for the device:
    Python 3.8 gets tomli, typing_extensions and a tokenizers with 3.8 wheels; 3.11 none of them."""
    import zipfile

    from export.deploy.software import DeviceFacts, build_wheel, checkout_root, platform_tags, requirements

    wheel = build_wheel(checkout_root(), tmp_path)
    assert zipfile.is_zipfile(wheel)
    jp5 = DeviceFacts("3.8.10", "aarch64", "2.31", True, False, True)
    reqs = requirements(wheel, "edge-onnx", jp5)
    assert {"tomli", "typing_extensions", "onnxruntime", "jinja2", "pyzmq"} <= {r.split(">")[0].split("<")[0]
                                                                                 for r in reqs}
    assert "tokenizers<0.21,>=0.15" in reqs or "tokenizers>=0.15,<0.21" in reqs
    new = requirements(wheel, "edge", DeviceFacts("3.11.9", "x86_64", "2.36", True, True, False))
    assert not any(r.startswith(("tomli", "typing_extensions", "onnxruntime")) for r in new)
    tags = platform_tags(jp5)
    assert "manylinux_2_31_aarch64" in tags and "manylinux2014_aarch64" in tags and "manylinux_2_32_aarch64" not in tags


# -- real bundles in the device venvs ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2_cloud(smollm2):
    from cloud_runtime.process import CloudProcess

    # the device stated and the slot layout CUDA uses (4 slots): every protocol below runs through them
    with CloudProcess("smollm2-135m", extra_args=["--dtype", "float32", "--device", "cpu", "--kv-layout", "slots",
                                                  "--kv-positions", "32768"], threads=1) as cloud:
        yield cloud


CHAT = "Write a haiku about the sea."
# with the fp32 draft (the whole model) every protocol's greedy tokens are the model's: each runs in the venv
SPLIT_RUN = ("slm", "ushape", "hat", "hlm", "llm", "uhlm", "randhlm", "cuhlm", "qs", "ksqs", "csqs", "sq")


@pytest.mark.real_models
def test_bundles_run_in_the_device_env_exactly(device_python, smollm2, smollm2_bundle, smollm2_cloud, tmp_path):
    """In the venv (no torch, no transformers; the bundle's tokenizer through tokenizers + jinja2): `slm` on the fp32
    draft, and `ushape` and `hat` on the split parts (chunked prefill), give the whole model's greedy tokens; `sd`
    with the int4 draft gives the cloud target's greedy tokens, for a raw prompt and a chat prompt (the bundle's chat
    template). Every other protocol runs there too (on the fp32 draft, which is the whole model: the model's tokens).
    On Python 3.8 the newest onnxruntime (1.19) cannot run the bundle's int4 artifacts
    (GatherBlockQuantized): refused in one line, and `sd` runs on fp32."""
    from hat_split.models.chat import encode
    from tests.test_hat import FIB, greedy_reference

    n = 16
    new_ort = not device_python.parent.parent.parent.name.endswith("3.8")
    if not new_ort:
        r = _run(device_python, ["-m", "edge_runtime.cli", "generate", "--backend", "onnxruntime", "--bundle",
                                 str(smollm2_bundle), "--precision", "int4", "--protocol", "slm",
                                 "--max-new-tokens", "2", "x"], tmp_path)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
        assert "cannot open draft.int4.onnx" in lines[0] and "GatherBlockQuantized" in lines[0], lines[0]
    ref = {text: greedy_reference(smollm2.model, encode(smollm2.tokenizer, text, chat), n)
           for text, chat in ((FIB, False), (CHAT, True))}
    (tmp_path / "p.json").write_text(json.dumps([FIB]))
    (tmp_path / "pc.json").write_text(json.dumps([FIB, {"text": CHAT, "chat": True}]))
    common = ["-m", "edge_runtime.cli", "generate", "--backend", "onnxruntime", "--bundle", str(smollm2_bundle),
              "--server", smollm2_cloud.endpoint, "--max-new-tokens", str(n), "--temperature", "0", "--threads", "1",
              "--quiet", "--plaintext"]
    runs = {"split": common + ["--precision", "fp32", "--prompts-file", str(tmp_path / "p.json"), "--protocol",
                               ",".join(SPLIT_RUN), "--m", "2", "--hidden-format", "float32", "--chunk-tokens", "7",
                               "--json", str(tmp_path / "a.json")],
            "sd": common + ["--precision", "int4" if new_ort else "fp32", "--prompts-file", str(tmp_path / "pc.json"),
                            "--protocol", "sd", "--json", str(tmp_path / "b.json")]}
    for name, args in runs.items():
        r = _run(device_python, args, tmp_path)
        assert r.returncode == 0, (name, r.stderr[-3000:])
    split = json.loads((tmp_path / "a.json").read_text())["results"]
    assert [(x["protocol"], x["tokens"]) for x in split] == [(p, ref[FIB]) for p in SPLIT_RUN]
    assert split[2]["drafted"] > 0 and split[1]["prefill_chunks"] > 1
    sd = json.loads((tmp_path / "b.json").read_text())["results"]
    assert [x["tokens"] for x in sd] == [ref[FIB], ref[CHAT]]
    assert all(x["protocol"] == "sd" and x["rounds"] > 0 for x in sd)


# -- a missing extra --------------------------------------------------------------------------------------------------
HIDE = "import sys; sys.modules[{mod!r}] = None; from edge_runtime.cli import main; sys.exit(main({argv!r}))"


@pytest.mark.parametrize("mod,argv,extra", [
    ("onnxruntime", ["generate", "--backend", "onnxruntime", "--bundle", "{bundle}", "x", "--plaintext"], "edge-onnx"),
    ("torch", ["generate", "--model", "smollm2-135m", "x", "--plaintext"], "models"),
])
def test_a_missing_extra_is_one_line_naming_it(tmp_path, mod, argv, extra):
    argv = [a.replace("{bundle}", str(tmp_path)) for a in argv]
    r = subprocess.run([sys.executable, "-c", HIDE.format(mod=mod, argv=argv)], capture_output=True, text=True,
                       timeout=300, cwd=str(ROOT))
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"needs {mod}, which is not installed: pip install 'hatspec[{extra}]'" in lines[0]


def test_need_names_the_extra_or_where_it_comes_from(monkeypatch):
    from hat_split.extras import MissingExtra, need

    monkeypatch.setitem(sys.modules, "tokenizers", None)
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    with pytest.raises(MissingExtra, match=r"reading X needs tokenizers, which is not installed: pip install "
                                           r"'hatspec\[edge-onnx\]'"):
        need("tokenizers", "reading X")
    with pytest.raises(MissingExtra, match="TensorRT comes with JetPack"):
        need("tensorrt", "the tensorrt backend")
    assert need("json", "anything").dumps([]) == "[]"


@pytest.mark.real_models
@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b"])
def test_the_bundle_tokenizer_reads_as_transformers_does(name, tmp_path):
    """BundleTokenizer (tokenizers + jinja2) on the directory a bundle stores gives transformers' ids, text, special
    ids, vocabulary fingerprint and rendered chat template, for code, Unicode, special-token text and a multi-turn
    conversation."""
    from hat_split.models.chat import encode
    from hat_split.models.loading import load_tokenizer, vocab_fingerprint
    from hat_split.models.registry import is_installed
    from hat_split.models.tokenizer import BundleTokenizer

    if not is_installed(name):
        pytest.skip(f"{name} is not installed (hat-models install {name})")
    hf = load_tokenizer(name)
    hf.save_pretrained(str(tmp_path))
    ours = BundleTokenizer(tmp_path)
    assert vocab_fingerprint(ours) == vocab_fingerprint(hf)
    assert sorted(ours.all_special_ids) == sorted(hf.all_special_ids)
    assert (ours.eos_token_id, ours.bos_token_id, ours.pad_token_id) == (hf.eos_token_id, hf.bos_token_id,
                                                                         hf.pad_token_id)
    texts = ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", "  Hello world . How's it ?",
             "日本語のテキスト 😀 \n\n\tx", "<|im_start|>user\nhi<|im_end|>", ""]
    for text in texts:
        for chat in (False, True):
            ids = encode(hf, text, chat)
            assert encode(ours, text, chat) == ids, (text, chat)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo"},
             {"role": "assistant", "content": "hi"}, {"role": "user", "content": "more"}]
    for gen in (False, True):
        assert ours.apply_chat_template(turns, add_generation_prompt=gen) == \
            hf.apply_chat_template(turns, tokenize=False, add_generation_prompt=gen)


def test_a_bundle_without_tokenizer_json_is_refused_with_the_fix(tmp_path):
    pytest.importorskip("tokenizers")
    from hat_split.models.tokenizer import BundleTokenizer, TokenizerError

    with pytest.raises(TokenizerError, match="no tokenizer.json .*export the bundle again"):
        BundleTokenizer(tmp_path)


GREEDY = """
import json, sys
import numpy as np
from edge_runtime.backends.onnx_backend import OrtPart
from edge_runtime.backends.part_lm import PartChainLM
from edge_runtime.drafter import Drafter
from hat_split.math.sampling import SamplingParams
path, vocab, prompt = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
d = Drafter(PartChainLM([OrtPart(path, ["CPUExecutionProvider"])], vocab), SamplingParams(0.0))
d.start(prompt)
rng, out = np.random.default_rng(0), []
for _ in range(16):
    t = d.sample_local(rng)
    out.append(int(t))
    d.commit([t])
print(json.dumps(out))
"""


def test_int4_without_quantized_embeddings_runs_on_jetpack5s_onnxruntime(tmp_path):
    """Python 3.8 (JetPack 5) stops at onnxruntime 1.19, which has no GatherBlockQuantized: an int4 draft exported
    with --no-int4-embeddings (its MatMuls only) opens there and drafts the same greedy tokens as here."""
    import types

    from export.config import ExportConfig
    from export.onnx_export import export_bundle
    from hat_split.files import bundle as M
    from tests.test_export import PROMPTS
    from tests.test_hat import _family

    _install("3.8")
    python = ENVS / "py3.8" / "venv" / "bin" / "python"
    export_bundle(types.SimpleNamespace(model=_family("llama"), tokenizer=None, name="tiny-llama"),
                  ExportConfig("tiny-llama", str(tmp_path), "draft", precisions=("int4",), int4_embeddings=False),
                  prompts=PROMPTS, progress=False)
    man = M.load(tmp_path)
    art = man.find("draft", "int4")
    assert art.quantization["ops"] == ["MatMul"] and art.quantization["bits"] == 4
    args = [GREEDY, str(tmp_path / art.path), str(man.model["vocab"]), json.dumps(PROMPTS[0])]
    here = subprocess.run([sys.executable, "-c", *args], capture_output=True, text=True, timeout=300, cwd=str(ROOT))
    there = _run(python, ["-c", *args], tmp_path)
    assert here.returncode == 0 and there.returncode == 0, here.stderr[-2000:] + there.stderr[-2000:]
    assert json.loads(there.stdout) == json.loads(here.stdout) and len(json.loads(here.stdout)) == 16
    version = _run(python, ["-c", "import onnxruntime; print(onnxruntime.__version__)"], tmp_path).stdout.strip()
    assert version.startswith("1.19"), version  # the point of the test: an onnxruntime without GatherBlockQuantized
