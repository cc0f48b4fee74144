"""Device profiles: what a Jetson module is and which power modes it reports, read from data files and validated.

One TOML file per module in hardware/devices/ (`<name>.toml`), plus hardware/devices/jetpack.toml, the
JetPack releases (L4T, Ubuntu, Python, CUDA, TensorRT, cuDNN). A profile lists the nvpmodel modes exactly as the board's
/etc/nvpmodel conf defines them — id, NAME, power budget (none for MAXN), online CPUs, CPU and GPU frequency caps, and
whether switching to it needs a reboot — and the default mode, memory, CPU and GPU, compute capability, the JetPack
releases it runs and the power rails its monitors report. A file with an unknown key, a missing or mistyped field, a
duplicate mode, a default that is not a mode, or a JetPack release that is not in the table is refused with the file
and the field named (ProfileError).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

try:
    import tomllib
except ImportError:  # Python 3.10 (JetPack 6)
    import tomli as tomllib

DEVICES_DIR = Path(__file__).parent / "devices"
JETPACK_FILE = DEVICES_DIR / "jetpack.toml"
CLOUD_GPUS_FILE = Path(__file__).parent / "cloud_gpus.toml"

_PROFILE_KEYS = {  # key: (type, required)
    "name": (str, True), "module": (str, True), "part": (str, True), "soc": (str, True),
    "compute_capability": (str, True), "memory_gb": (int, True),
    "memory_bandwidth_gbs": ((int, float), True), "cpu_cores": (int, True), "cpu": (str, True),
    "gpu": (str, True), "jetpack": (list, True), "nvpmodel_conf": (str, True), "default_mode": (int, True),
    "power_rails": (list, True), "input_rail": (str, False), "note": (str, False), "mode": (list, True),
}
_MODE_KEYS = {"id": (int, True), "name": (str, True), "watts": ((int, float), False), "cpus": (int, False),
              "cpu_max_khz": (int, False), "gpu_max_hz": (int, False), "reboot": (bool, False)}
_RELEASE_KEYS = ("l4t", "ubuntu", "python", "cuda", "tensorrt", "cudnn")


class ProfileError(ValueError):
    """A profile file that does not describe a device: the message names the file and the field."""


@dataclass(frozen=True)
class PowerMode:
    id: int
    name: str  # as `nvpmodel -q` prints it (MAXN, MODE_30W, 15W, MAXN_SUPER, ...)
    watts: Optional[float]  # the mode's power budget; None for MAXN (no budget)
    cpus: Optional[int] = None  # online CPU cores
    cpu_max_khz: Optional[int] = None  # None: the core's own maximum
    gpu_max_hz: Optional[int] = None
    reboot: bool = False  # switching to it power-gates hardware: nvpmodel asks for a reboot


@dataclass(frozen=True)
class JetPack:
    version: str
    l4t: str
    ubuntu: str
    python: str
    cuda: str
    tensorrt: str
    cudnn: str


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    module: str
    part: str
    soc: str
    compute_capability: str
    memory_gb: int
    memory_bandwidth_gbs: float  # peak DRAM bandwidth (NVIDIA's data sheet; docs/PROFILES.md): bounds a decode step
    cpu_cores: int
    cpu: str
    gpu: str
    jetpack: Tuple[str, ...]  # releases it runs, oldest first
    nvpmodel_conf: str
    default_mode: int
    power_rails: Tuple[str, ...]
    input_rail: str  # the rail that measures the whole module ("" when its rails are summed)
    note: str
    modes: Tuple[PowerMode, ...]

    def mode(self, key: Union[int, str]) -> PowerMode:
        """A mode by id or by name (as nvpmodel prints it); ProfileError listing the modes otherwise."""
        for m in self.modes:
            if m.id == key or (isinstance(key, str) and (m.name == key or key.isdigit() and m.id == int(key))):
                return m
        known = ", ".join(f"{m.id} {m.name}" for m in self.modes)
        raise ProfileError(f"{self.name} has no power mode {key!r} (it has: {known})")

    @property
    def default(self) -> PowerMode:
        return self.mode(self.default_mode)

    def software(self, jetpack: Optional[str] = None) -> JetPack:
        """What JetPack `jetpack` (default: the newest this module runs) puts on it."""
        version = jetpack or self.jetpack[-1]
        if version not in self.jetpack:
            raise ProfileError(f"{self.name} does not run JetPack {version} (it runs {', '.join(self.jetpack)})")
        return jetpack_releases()[version]


def jetpack_releases(path: Path = JETPACK_FILE) -> Dict[str, JetPack]:
    data = _read(path)
    releases = data.get("release")
    if not isinstance(releases, dict) or not releases:
        raise ProfileError(f"{path}: no [release.\"X.Y\"] tables")
    out = {}
    for version, fields in releases.items():
        missing = [k for k in _RELEASE_KEYS if not isinstance(fields.get(k), str)]
        extra = sorted(set(fields) - set(_RELEASE_KEYS))
        if missing or extra:
            raise ProfileError(f"{path}: JetPack {version}: " + "; ".join(
                ([f"missing or not a string: {', '.join(missing)}"] if missing else [])
                + ([f"unknown keys: {', '.join(extra)}"] if extra else [])))
        out[version] = JetPack(version, **{k: fields[k] for k in _RELEASE_KEYS})
    return out


def load_profile(path: Union[str, Path]) -> DeviceProfile:
    """Read and validate one profile file."""
    path = Path(path)
    data = _read(path)
    where = str(path)
    _check_keys(data, _PROFILE_KEYS, where)
    if data["name"] != path.stem:
        raise ProfileError(f"{where}: name {data['name']!r} must match the file name {path.stem!r}")
    if not re.fullmatch(r"\d+\.\d+", data["compute_capability"]):
        raise ProfileError(f"{where}: compute_capability {data['compute_capability']!r} is not MAJOR.MINOR")
    for key in ("memory_gb", "memory_bandwidth_gbs", "cpu_cores"):
        if data[key] <= 0:
            raise ProfileError(f"{where}: {key} must be positive, got {data[key]}")
    releases = jetpack_releases()
    unknown = [j for j in data["jetpack"] if j not in releases]
    if not data["jetpack"] or unknown:
        raise ProfileError(f"{where}: jetpack must list releases of {JETPACK_FILE.name} "
                           f"({', '.join(releases)}); unknown: {unknown or 'none given'}")
    rails = data["power_rails"]
    if not all(isinstance(r, str) and r for r in rails):
        raise ProfileError(f"{where}: power_rails must be rail names")
    input_rail = data.get("input_rail", "")
    if input_rail and input_rail not in rails:
        raise ProfileError(f"{where}: input_rail {input_rail!r} is not one of power_rails {rails}")
    modes = [_mode(m, f"{where}: mode #{i + 1}", data["cpu_cores"]) for i, m in enumerate(data["mode"])]
    if not modes:
        raise ProfileError(f"{where}: no [[mode]]")
    for attr in ("id", "name"):
        values = [getattr(m, attr) for m in modes]
        dupes = sorted({v for v in values if values.count(v) > 1}, key=str)
        if dupes:
            raise ProfileError(f"{where}: duplicate mode {attr}(s) {dupes}")
    if data["default_mode"] not in {m.id for m in modes}:
        raise ProfileError(f"{where}: default_mode {data['default_mode']} is not a mode id "
                           f"({', '.join(str(m.id) for m in modes)})")
    return DeviceProfile(
        name=data["name"], module=data["module"], part=data["part"], soc=data["soc"],
        compute_capability=data["compute_capability"], memory_gb=data["memory_gb"],
        memory_bandwidth_gbs=float(data["memory_bandwidth_gbs"]), cpu_cores=data["cpu_cores"],
        cpu=data["cpu"], gpu=data["gpu"], jetpack=tuple(data["jetpack"]), nvpmodel_conf=data["nvpmodel_conf"],
        default_mode=data["default_mode"], power_rails=tuple(rails), input_rail=input_rail,
        note=data.get("note", ""), modes=tuple(sorted(modes, key=lambda m: m.id)))


@dataclass(frozen=True)
class CloudGPU:
    key: str
    name: str
    memory_bandwidth_gbs: float
    source: str


def cloud_gpus(path: Path = CLOUD_GPUS_FILE) -> Dict[str, CloudGPU]:
    """The cloud GPUs of cloud_gpus.toml by key (a6000, h100-sxm, ...)."""
    data = _read(path).get("gpu")
    if not isinstance(data, dict) or not data:
        raise ProfileError(f"{path}: no [gpu.KEY] tables")
    out = {}
    for key, fields in data.items():
        _check_keys(fields, {"name": (str, True), "memory_bandwidth_gbs": ((int, float), True),
                             "source": (str, True)}, f"{path}: gpu {key}")
        out[key] = CloudGPU(key, fields["name"], float(fields["memory_bandwidth_gbs"]), fields["source"])
    return out


def speed_ratio(device: Union[str, DeviceProfile], gpu: str) -> float:
    """How many times slower the device decodes than one cloud GPU: the ratio of their memory bandwidths (a decode
    step streams the weights once; both sides are memory-bound at batch 1). ProfileError for an unknown GPU."""
    profile = device if isinstance(device, DeviceProfile) else get_profile(device)
    gpus = cloud_gpus()
    if gpu not in gpus:
        raise ProfileError(f"unknown cloud GPU {gpu!r}; known: {', '.join(gpus)}")
    return gpus[gpu].memory_bandwidth_gbs / profile.memory_bandwidth_gbs


def list_profiles() -> List[str]:
    return sorted(p.stem for p in DEVICES_DIR.glob("*.toml") if p != JETPACK_FILE)


def get_profile(name: Union[str, Path]) -> DeviceProfile:
    """A packaged profile by name, or a profile file by path."""
    path = Path(name)
    if path.suffix == ".toml" or path.exists():
        return load_profile(path)
    if str(name) not in list_profiles():
        raise ProfileError(f"unknown device profile {str(name)!r}; known: {', '.join(list_profiles())}")
    return load_profile(DEVICES_DIR / f"{name}.toml")


def _read(path: Path) -> Dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ProfileError(f"{path}: no such profile file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"{path}: not valid TOML: {exc}") from None


def _check_keys(data: Dict[str, Any], spec: Dict[str, tuple], where: str) -> None:
    extra = sorted(set(data) - set(spec))
    if extra:
        raise ProfileError(f"{where}: unknown key(s) {', '.join(extra)} (known: {', '.join(spec)})")
    for key, (kind, required) in spec.items():
        if key not in data:
            if required:
                raise ProfileError(f"{where}: missing {key}")
            continue
        value = data[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ProfileError(f"{where}: {key} = {value!r} is not {_kind_name(kind)}")


def _kind_name(kind) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join({int: "an integer", float: "a number", str: "a string", list: "a list", bool: "true/false"}[k]
                       for k in kinds)


def _mode(data: Any, where: str, cpu_cores: int) -> PowerMode:
    if not isinstance(data, dict):
        raise ProfileError(f"{where}: not a table")
    _check_keys(data, _MODE_KEYS, where)
    where = f"{where} ({data['name']})"
    if data["id"] < 0:
        raise ProfileError(f"{where}: id must be >= 0")
    if not re.fullmatch(r"[A-Z0-9_]+", data["name"]):
        raise ProfileError(f"{where}: name must be as nvpmodel prints it (capitals, digits, _)")
    watts = data.get("watts")
    if watts is None and not data["name"].startswith("MAXN"):
        raise ProfileError(f"{where}: only MAXN modes have no power budget; give watts")
    if watts is not None and not watts > 0:
        raise ProfileError(f"{where}: watts must be positive, got {watts}")
    cpus = data.get("cpus")
    if cpus is not None and not 1 <= cpus <= cpu_cores:
        raise ProfileError(f"{where}: cpus {cpus} is not in 1..{cpu_cores} (the module's cores)")
    for key in ("cpu_max_khz", "gpu_max_hz"):
        if key in data and data[key] <= 0:
            raise ProfileError(f"{where}: {key} must be positive")
    return PowerMode(data["id"], data["name"], None if watts is None else float(watts), cpus,
                     data.get("cpu_max_khz"), data.get("gpu_max_hz"), data.get("reboot", False))
