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
DEVICE_PACKAGES = ("hat_split", "edge_runtime", "profiles.device")
NEEDS_TORCH = ("edge_runtime.training.distill", "hat_split.models.adapter", "hat_split.models.draft_lm")
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

    with CloudProcess("smollm2-135m", extra_args=["--dtype", "float32"], threads=1) as cloud:
        yield cloud


CHAT = "Write a haiku about the sea."


@pytest.mark.real_models
def test_bundles_run_in_the_device_env_exactly(device_python, smollm2, smollm2_bundle, smollm2_cloud, tmp_path):
    """In the venv (no torch, no transformers; the bundle's tokenizer through tokenizers + jinja2): `slm` on the fp32
    draft and `hat` on the split parts give the whole model's greedy tokens; `sd` with the int4 draft gives the cloud
    target's greedy tokens, for a raw prompt and a chat prompt (the bundle's chat template). On Python 3.8 the newest
    onnxruntime (1.19) cannot run int4 artifacts (GatherBlockQuantized): refused in one line, and `sd` runs on fp32."""
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
              "--server", smollm2_cloud.endpoint, "--max-new-tokens", str(n), "--threads", "1", "--quiet",
              "--plaintext"]
    runs = {"split": common + ["--precision", "fp32", "--prompts-file", str(tmp_path / "p.json"), "--protocol",
                               "slm,hat", "--m", "2", "--hidden-format", "float32", "--json", str(tmp_path / "a.json")],
            "sd": common + ["--precision", "int4" if new_ort else "fp32", "--prompts-file", str(tmp_path / "pc.json"),
                            "--protocol", "sd", "--json", str(tmp_path / "b.json")]}
    for name, args in runs.items():
        r = _run(device_python, args, tmp_path)
        assert r.returncode == 0, (name, r.stderr[-3000:])
    split = json.loads((tmp_path / "a.json").read_text())["results"]
    assert [(x["protocol"], x["tokens"]) for x in split] == [("slm", ref[FIB]), ("hat", ref[FIB])]
    assert split[1]["drafted"] > 0
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
