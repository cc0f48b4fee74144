"""`hat-flash --software`: install this checkout's hatspec on a device, offline there, into a venv that sees
JetPack's own packages.

Here (the workstation): a wheel of the checkout is built, and the wheels of what its device extra needs are
downloaded for the device's Python, machine and glibc (asked over ssh first), into a cache. On the device: the
wheels land verified in `<dir>/wheels` (only the missing ones are sent, export.deploy.flash.send_files),
`<dir>/venv` is made with `--system-site-packages` (so JetPack's TensorRT, onnxruntime-gpu and numpy serve), and pip
installs from those wheels alone (`--no-index`). Where the device's Python already imports onnxruntime (NVIDIA's
onnxruntime-gpu), `edge-onnx` installs the `edge` extra only, so the GPU build is not shadowed by PyPI's CPU one.

The venv records what it holds (hat_split.version.SOFTWARE_STAMP: version, a build id over the wheel's package files,
the extra); an install whose build and extra the device already has does nothing. After installing, the device's
`hat-edge version` must report this checkout's hatspec and protocol version and build, or the flash fails.
"""
from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

from export.deploy.flash import FlashError, Target, _call, run_playbook, send_files
from hat_split.models.registry import cache_dir
from hat_split.version import SOFTWARE_STAMP, describe

SOFTWARE_DIR = "/opt/hatspec"  # the device's hatspec root: venv/ and wheels/ (bundles in bundle/)
EXTRAS = ("edge-onnx", "edge-trt", "edge")
PACKAGES = ("hat_split", "hardware", "testbed", "edge_runtime", "cloud_runtime", "export", "profiles")
MIN_PYTHON = (3, 8)
SUMS = "SHA256SUMS"
_SAVED = re.compile(r"(?:Saved|File was already downloaded) (\S+\.whl)")
FACTS = ("import json, platform, sys\n"
         "from importlib.util import find_spec\n"
         "libc = platform.libc_ver()\n"
         "print(json.dumps({'python': platform.python_version(), 'machine': platform.machine(),\n"
         "                  'glibc': libc[1] if libc[0] == 'glibc' else '',\n"
         "                  'implementation': sys.implementation.name,\n"
         "                  'venv': find_spec('venv') is not None and find_spec('ensurepip') is not None,\n"
         "                  'onnxruntime': find_spec('onnxruntime') is not None,\n"
         "                  'tensorrt': find_spec('tensorrt') is not None}))\n")


@dataclass(frozen=True)
class DeviceFacts:
    python: str  # "3.8.18"
    machine: str  # x86_64 | aarch64
    glibc: str  # "2.31"; "" when not glibc (no manylinux wheels)
    venv: bool  # the venv module and ensurepip are there (Ubuntu: apt install python3-venv)
    onnxruntime: bool  # the device's Python imports onnxruntime itself (JetPack's onnxruntime-gpu)
    tensorrt: bool

    @property
    def tag(self) -> str:
        major, minor = self.python.split(".")[:2]
        return f"cp{major}{minor}-{self.machine}"


@dataclass
class SoftwareResult:
    target: str
    version: str
    build: str
    extra: str  # the extra installed (edge-onnx may become edge beside the device's own onnxruntime)
    changed: bool  # False: the device already had this build
    sent_files: List[str] = field(default_factory=list)
    sent_bytes: int = 0
    notes: List[str] = field(default_factory=list)
    device: Dict[str, object] = field(default_factory=dict)  # the device's `hat-edge version` afterwards


def device_facts(target: Target, python: str) -> DeviceFacts:
    out = _call(target.ssh(f"{shlex.quote(python)} -c {shlex.quote(FACTS)}"),
                f"asking {target.login} for its Python ({python})", timeout=60)
    try:
        f = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise FlashError(f"{target.login}: {python} did not answer as a Python 3 ({out.strip()[-200:]!r})") from None
    version = tuple(int(x) for x in f["python"].split(".")[:2])
    if version < MIN_PYTHON or f["implementation"] != "cpython":
        raise FlashError(f"{target.login}: {python} is {f['implementation']} {f['python']}; hatspec's device side "
                         "needs CPython >= 3.8 (JetPack 5: 3.8, JetPack 6: 3.10)")
    if not f["venv"]:
        raise FlashError(f"{target.login}: {python} cannot make a venv (no venv / ensurepip module): on Ubuntu / "
                         "JetPack, sudo apt install python3-venv")
    return DeviceFacts(f["python"], f["machine"], f["glibc"], f["venv"], f["onnxruntime"], f["tensorrt"])


def platform_tags(facts: DeviceFacts) -> List[str]:
    """pip's --platform values for the device: every manylinux its glibc runs, and pure-Python wheels."""
    m = facts.machine
    tags = ["any"]
    if facts.glibc:
        major, minor = (int(x) for x in facts.glibc.split(".")[:2])
        tags += [f"manylinux_{major}_{v}_{m}" for v in range(5 if m in ("x86_64", "i686") else 17, minor + 1)]
        legacy = {5: "manylinux1", 12: "manylinux2010", 17: "manylinux2014"}
        tags += [f"{name}_{m}" for v, name in legacy.items() if v <= minor]
    return tags


def checkout_root() -> Path:
    root = Path(__file__).resolve().parents[2]
    if not (root / "pyproject.toml").is_file():
        raise FlashError(f"hat-flash --software builds the wheel from a hatspec checkout; {root} has no "
                         "pyproject.toml (give --wheel FILE)")
    return root


def build_wheel(source: Path, out: Path) -> Path:
    """A wheel of the checkout at `source` (no dependencies, the build tools installed here). Builds of one checkout
    take turns (`_checkout_lock`): the build tools stage the packages in the checkout's build/, and two builds at once
    (two flashes from one checkout, two test workers) removed each other's staged files."""
    with _checkout_lock(source):
        _call([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
               "--disable-pip-version-check", "-w", str(out), str(source)], "building hatspec's wheel", timeout=600)
    wheels = sorted(out.glob("hatspec-*.whl"))
    if len(wheels) != 1:
        raise FlashError(f"building hatspec's wheel left {len(wheels)} wheels in {out}")
    return wheels[0]


@contextmanager
def _checkout_lock(source: Path) -> Iterator[None]:
    """The checkout's build/ to this process alone for the block (an exclusive lock on a file in it; another
    process, or another thread here, waits)."""
    build = source / "build"
    try:
        build.mkdir(exist_ok=True)
        lock = open(build / ".wheel-lock", "a", encoding="utf-8")
    except OSError as exc:
        raise FlashError(f"building hatspec's wheel needs to write {build}: {exc}") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def build_id(wheel: Path) -> str:
    """sha256 over the wheel's package files (name and content): equal for equal code, whatever the zip's dates."""
    h = hashlib.sha256()
    with zipfile.ZipFile(wheel) as z:
        for name in sorted(n for n in z.namelist() if n.split("/")[0] in PACKAGES):
            h.update(name.encode() + b"\0" + hashlib.sha256(z.read(name)).digest())
    return h.hexdigest()[:16]


def wheel_version(wheel: Path) -> str:
    return wheel.name.split("-")[1]


def local_python(version: str) -> Optional[str]:
    """An interpreter of that major.minor here (PATH or pyenv), or None."""
    major, minor = version.split(".")[:2]
    pyenv = [str(p) for p in sorted(Path.home().glob(f".pyenv/versions/{major}.{minor}.*/bin/python{major}.{minor}"))]
    for candidate in [*pyenv[::-1], shutil.which(f"python{major}.{minor}")]:
        if candidate and subprocess.run([candidate, "-m", "pip", "--version"], capture_output=True).returncode == 0:
            return candidate  # (a pyenv shim of a version not selected fails here)
    return None


def requirements(wheel: Path, extra: str, facts: DeviceFacts) -> List[str]:
    """hatspec's requirements for `extra` (and the extras it names) with their markers evaluated for the device."""
    from packaging.markers import default_environment
    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    reqs = [Requirement(line.split(":", 1)[1].strip()) for line in meta.splitlines()
            if line.startswith("Requires-Dist:")]
    env = dict(default_environment(), python_version=".".join(facts.python.split(".")[:2]),
               python_full_version=facts.python, platform_machine=facts.machine, implementation_name="cpython",
               platform_python_implementation="CPython", sys_platform="linux", platform_system="Linux")
    todo, seen, out = [""] + [extra], set(), []
    while todo:
        e = todo.pop()
        if e in seen:
            continue
        seen.add(e)
        for r in reqs:
            if r.marker is not None and not r.marker.evaluate(dict(env, extra=e)):
                continue
            if r.marker is None and e:
                continue  # a core requirement: taken with e == ""
            if r.name == "hatspec":
                todo += sorted(r.extras)
            else:
                text = f"{r.name}{''.join(sorted('[' + x + ']' for x in r.extras))}{r.specifier}"
                out += [text] if text not in out else []
    return out


def download_wheels(wheel: Path, extra: str, facts: DeviceFacts, cache: Path) -> Dict[str, str]:
    """The wheels `wheel[extra]` needs on the device, downloaded into (or found in) `cache`, and this hatspec wheel
    copied beside them; {file name: sha256}. pip resolves with an interpreter of the device's Python version when
    this machine has one (its markers are then the device's, all the way down); otherwise with this Python, for the
    device's tags, after hatspec's own markers are evaluated for the device."""
    cache.mkdir(parents=True, exist_ok=True)
    major, minor = facts.python.split(".")[:2]
    same = local_python(facts.python)
    cmd = [same or sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--only-binary", ":all:",
           "-d", str(cache)]
    if same is None:
        cmd += ["--python-version", f"{major}.{minor}", "--implementation", "cp", "--abi", f"cp{major}{minor}",
                "--abi", "abi3", "--abi", "none"]
    for tag in platform_tags(facts):
        cmd += ["--platform", tag]
    wanted = [f"{wheel}[{extra}]"] if same else requirements(wheel, extra, facts)
    out = _call(cmd + wanted, f"downloading the wheels hatspec[{extra}] needs on Python {major}.{minor} "
                f"{facts.machine}", 1800)
    names = {Path(p).name for p in _SAVED.findall(out)} - {wheel.name}
    missing = [n for n in names if not (cache / n).is_file()]
    if missing:
        raise FlashError(f"pip download named wheels it did not leave in {cache}: {', '.join(missing)}")
    if wheel.resolve() != (cache / wheel.name).resolve():
        shutil.copyfile(wheel, cache / wheel.name)  # this build, beside its dependencies
    return {n: hashlib.sha256((cache / n).read_bytes()).hexdigest() for n in sorted(names | {wheel.name})}


def choose_extra(extra: str, facts: DeviceFacts, python: str) -> Tuple[str, List[str]]:
    """The extra to install on this device, and notes: `edge-onnx` becomes `edge` where the device's Python imports
    onnxruntime itself (JetPack's onnxruntime-gpu, not to be shadowed by PyPI's CPU build)."""
    if extra not in EXTRAS:
        raise ValueError(f"extra must be one of {', '.join(EXTRAS)}, got {extra!r}")
    if extra == "edge-onnx" and facts.onnxruntime:
        return "edge", [f"{python} imports onnxruntime itself (JetPack's onnxruntime-gpu): the venv uses it, and "
                        "installs the edge extra only"]
    if extra == "edge-trt" and not facts.tensorrt:
        return extra, [f"{python} does not import tensorrt: the tensorrt backend needs JetPack's TensorRT"]
    return extra, []


def install(target: Target, python: str = "python3", extra: str = "edge-onnx", wheel: Optional[Path] = None,
            cache: Optional[Path] = None, progress: bool = True) -> SoftwareResult:
    """Install hatspec[extra] into target.path/venv on the device with `python`; see the module's docstring."""
    facts = device_facts(target, python)
    chosen, notes = choose_extra(extra, facts, python)
    with tempfile.TemporaryDirectory(prefix="hatspec-wheel-") as tmp:
        wheel = Path(wheel) if wheel else build_wheel(checkout_root(), Path(tmp))
        version, build = wheel_version(wheel), build_id(wheel)
        label = f"{target.login}:{target.path}"
        have = installed(target)
        if have is not None and (have.get("build"), have.get("extra")) == (build, chosen):
            return SoftwareResult(label, version, build, chosen, False, notes=notes, device=have)
        cache = Path(cache) if cache else cache_dir() / "device-wheels" / facts.tag
        files = download_wheels(wheel, chosen, facts, cache)
        wheels = dataclasses.replace(target, path=f"{target.path}/wheels")
        _call(target.ssh(f"mkdir -p {shlex.quote(wheels.path)}"), f"mkdir on {target.login}")
        sent, sent_bytes = send_files(cache, files, wheels, progress=progress)
        _call(target.ssh(_install_script(target.path, python, wheel.name, chosen, version, build)),
              f"installing hatspec[{chosen}] on {target.login}", timeout=1800)
    device = _describe(target)
    mine = describe()
    if (device.get("hatspec"), device.get("protocol"), device.get("build")) != (version, mine["protocol"], build):
        raise FlashError(f"{label}: after installing, the device reports hatspec {device.get('hatspec')} protocol "
                         f"{device.get('protocol')} build {device.get('build')}; expected {version} protocol "
                         f"{mine['protocol']} build {build}")
    return SoftwareResult(label, version, build, chosen, True, sent, sent_bytes, notes, device)


def _install_script(root: str, python: str, wheel: str, extra: str, version: str, build: str) -> str:
    venv, wheels = f"{root}/venv", f"{root}/wheels"
    pip = f"{shlex.quote(venv)}/bin/python -m pip install --quiet --disable-pip-version-check --no-index " \
          f"--find-links {shlex.quote(wheels)}"
    whl = shlex.quote(f"{wheels}/{wheel}")
    stamp = json.dumps({"hatspec": version, "build": build, "extra": extra, "wheel": wheel})
    return " && ".join([
        "set -e",
        f"[ -x {shlex.quote(venv)}/bin/python ] || {shlex.quote(python)} -m venv --system-site-packages "
        f"{shlex.quote(venv)}",
        f"rm -f {shlex.quote(venv)}/{SOFTWARE_STAMP}",  # a failed install leaves no stamp: the next one redoes it
        f"{pip} {shlex.quote(f'{wheels}/{wheel}[{extra}]')}",  # its dependencies (hatspec itself if absent)
        f"{pip} --no-deps --force-reinstall {whl}",  # this build of hatspec, over an older one of the same version
        f"printf '%s\\n' {shlex.quote(stamp)} > {shlex.quote(venv)}/{SOFTWARE_STAMP}",
    ])


def _version_argv(root: str) -> str:
    """The venv's own hat-edge (a console script: the current directory is not on its import path)."""
    return f"{shlex.quote(root)}/venv/bin/hat-edge version --json"


def _describe(target: Target) -> Dict[str, object]:
    out = _call(target.ssh(_version_argv(target.path)), f"hat-edge version on {target.login}", timeout=120)
    return json.loads(out.strip().splitlines()[-1])


def installed(target: Target) -> Optional[Dict[str, object]]:
    """The device venv's `hat-edge version` (its build and extra come from the venv's stamp), or None where there is
    no working hatspec venv."""
    r = subprocess.run(target.ssh(_version_argv(target.path) + " 2>/dev/null"), capture_output=True, text=True,
                       timeout=120)
    try:
        return json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else None
    except (ValueError, IndexError):
        return None


def parse_targets(texts: List[str], ssh_options: List[str]) -> List[Target]:
    return [Target.parse(t, ssh_options, default_path=SOFTWARE_DIR) for t in texts]


def summary(r: SoftwareResult) -> Tuple[str, ...]:
    """Lines hat-flash prints for one device."""
    what = (f"installed hatspec {r.version} (build {r.build}, [{r.extra}]), sent {len(r.sent_files)} wheels "
            f"({r.sent_bytes / 2 ** 20:.1f} MB)") if r.changed else \
        f"hatspec {r.version} (build {r.build}, [{r.extra}]) already installed: nothing to do"
    engines = ", ".join(f"{k} {v}" for k, v in (r.device.get("engines") or {}).items() if v)
    return (f"hat-flash: {r.target}: {what}; Python {r.device.get('python')}, engines: {engines or 'none'}",
            *(f"hat-flash: {r.target}: note: {n}" for n in r.notes))


def inventory_targets(inventory: Path, limit: str = "",
                      ssh_options: Tuple[str, ...] = ()) -> List[Tuple[str, Target, str]]:
    """(name, target, base Python) of every device of a hat-fleet inventory (or the one named `limit`): its ssh
    connection variables, `hatspec_root` (default /opt/hatspec) and `hatspec_base_python` (default python3)."""
    from export.deploy.fleet import load_inventory

    out = []
    for dev in load_inventory(str(inventory)).devices:
        if limit and dev.name != limit:
            continue
        opts = [*ssh_options, *shlex.split(str(dev.get("ansible_ssh_common_args", "")))]
        if dev.get("ansible_ssh_private_key_file"):
            opts += ["-i", str(dev.get("ansible_ssh_private_key_file"))]
        root = str(dev.get("hatspec_root", SOFTWARE_DIR))
        target = Target("localhost", path=root, local=True) if dev.local else \
            Target(str(dev.get("ansible_host", dev.name)), str(dev.get("ansible_user") or ""),
                   int(dev.get("ansible_port") or 22), root, tuple(opts))
        out.append((dev.name, target, str(dev.get("hatspec_base_python", "python3"))))
    if not out:
        raise ValueError(f"{inventory}: no device {'named ' + limit if limit else 'in the edge group'}")
    return out


def _stage(cache: Path, files: Dict[str, str], stage: Path) -> Path:
    """The wheels one kind of device needs, linked into a directory of their own with their SHA256SUMS (what
    software.yml copies as one directory and checks with sha256sum -c)."""
    stage.mkdir(parents=True)
    for name in files:
        try:
            (stage / name).hardlink_to(cache / name)
        except OSError:
            shutil.copyfile(cache / name, stage / name)
    (stage / SUMS).write_text("".join(f"{digest}  {name}\n" for name, digest in sorted(files.items())))
    return stage


def install_fleet(inventory: Path, extra: str = "edge-onnx", limit: str = "", ssh_options: Tuple[str, ...] = (),
                  wheel: Optional[Path] = None) -> Dict[str, Dict[str, object]]:
    """`install` on every device of a hat-fleet inventory through export/deploy/software.yml: each device is asked
    for its Python and what its venv holds here (over ssh, with the inventory's connection variables), the wheels of
    the devices not up to date are downloaded once per (Python, machine, extra), and Ansible sends them, runs the
    same install script and checks the device's `hat-edge version`. {host: {"changed": tasks changed, "ok": tasks
    ok, "hatspec", "build", "extra"}}."""
    per_host: Dict[str, Dict[str, object]] = {}
    prepared: Dict[Tuple[str, str], Path] = {}
    protocol = describe()["protocol"]
    with tempfile.TemporaryDirectory(prefix="hatspec-wheel-") as tmp:
        wheel = Path(wheel) if wheel else build_wheel(checkout_root(), Path(tmp))
        version, build = wheel_version(wheel), build_id(wheel)
        for name, target, python in inventory_targets(inventory, limit, ssh_options):
            facts = device_facts(target, python)
            chosen, _ = choose_extra(extra, facts, python)
            have = installed(target)
            if have is not None and (have.get("build"), have.get("extra")) == (build, chosen):
                # up to date: the playbook leaves the host at its first check ("false": never reached)
                per_host[name] = {"stage": "", "extra": chosen, "version": version, "build": build,
                                  "protocol": protocol, "script": "false"}
                continue
            if (facts.tag, chosen) not in prepared:
                cache = cache_dir() / "device-wheels" / facts.tag
                files = download_wheels(wheel, chosen, facts, cache)
                prepared[facts.tag, chosen] = _stage(cache, files, Path(tmp) / f"{facts.tag}-{chosen}")
            per_host[name] = {"stage": str(prepared[facts.tag, chosen]), "extra": chosen, "version": version,
                              "build": build, "protocol": protocol,
                              "script": _install_script(target.path, python, wheel.name, chosen, version, build)}
        recap = run_playbook("software.yml", inventory, {"hatspec_software": per_host}, limit,
                             " ".join(ssh_options), "software install")
    return {host: {**r, "hatspec": version, "build": build, "extra": per_host[host]["extra"]}
            for host, r in recap.items()}
