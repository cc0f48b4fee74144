"""Power and load sampling behind one interface, with backends tried in order and what each cannot measure reported.

Backends, in the default order:
1. `jtop`       jetson-stats (optional extra `jetson`, AGPL-3.0): needs its root service (jtop.service) on a Jetson.
2. `tegrastats` JetPack's tegrastats as a subprocess, read with hardware.tegrastats.
3. `ina3221`    the INA3221 power monitors in sysfs (hwmon on JetPack 5+, the ina3221x IIO driver on JetPack 4).
4. `psutil`     CPU load and memory on any machine; no power.
`open_sampler()` takes the first that starts and records why each earlier one did not (`Sampler.attempts`);
`Sampler.unavailable` names every quantity the chosen backend cannot measure and why. Nothing is estimated: on a
machine without a power monitor, power is None and the reason says so.

A Sampler polls its backend on a thread at a fixed interval while a workload runs; `window(t0, t1)` gives the mean
power over the window and the energy (trapezoidal integral of the power samples), which the sweep divides by tokens.
"""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Protocol, Sequence, Tuple

from hardware.tegrastats import INPUT_RAILS, TegraSample, TegrastatsParseError, parse_line

QUANTITIES = ("power", "rails", "cpu", "memory", "gpu", "temperature")
ORDER = ("jtop", "tegrastats", "ina3221", "psutil")


@dataclass
class Reading:
    t: float  # time.perf_counter() of the reading
    power_mw: Optional[float] = None  # the module's power (input rail, or the sum of the rails: see power_source)
    rails_mw: Dict[str, float] = field(default_factory=dict)
    cpu_pct: Optional[float] = None  # mean over online cores
    memory_used_mb: Optional[float] = None
    gpu_pct: Optional[float] = None
    temperatures_c: Dict[str, float] = field(default_factory=dict)


class BackendUnavailable(RuntimeError):
    """A backend that cannot run here; the message is the reason recorded in Sampler.attempts."""


class Backend(Protocol):
    name: str
    measures: Tuple[str, ...]  # which of QUANTITIES it reports
    power_source: str  # what power_mw is ("rail VDD_IN", "sum of 3 rails", "none")
    reasons: Dict[str, str]  # quantity → why it is not measured

    def read(self) -> Reading: ...

    def close(self) -> None: ...


# -- jtop -----------------------------------------------------------------------------------------------------------
class JtopBackend:
    name = "jtop"

    def __init__(self, interval_s: float = 0.1):
        try:
            from jtop import jtop  # jetson-stats; optional extra `jetson`
        except ImportError:
            raise BackendUnavailable("jetson-stats is not installed "
                                     "(pip install 'hatspec[jetson]'; AGPL-3.0)") from None
        self._jetson = jtop(interval=interval_s)
        try:
            self._jetson.start()
        except Exception as exc:  # JtopException: the jtop.service is not running (always so off a Jetson)
            raise BackendUnavailable(f"jetson-stats cannot reach its service: {' '.join(str(exc).split())}") from None
        self.measures = QUANTITIES
        self.power_source = "jtop tot"
        self.reasons: Dict[str, str] = {}

    def read(self) -> Reading:
        j = self._jetson
        power = j.power or {}
        tot = power.get("tot", {})
        stats = j.stats or {}
        cores = [v for k, v in stats.items() if k.startswith("CPU") and isinstance(v, (int, float))]
        temps = {k[5:]: float(v) for k, v in stats.items() if k.startswith("Temp ") and isinstance(v, (int, float))
                 and v > -256}
        self.power_source = f"rail {tot['name']}" if "name" in tot else "sum of rails (jtop)"
        return Reading(time.perf_counter(), float(tot["power"]) if "power" in tot else None,
                       {k: float(v.get("power", 0)) for k, v in power.get("rail", {}).items()},
                       sum(cores) / len(cores) if cores else None,
                       None, float(stats["GPU"]) if isinstance(stats.get("GPU"), (int, float)) else None, temps)

    def close(self) -> None:
        self._jetson.close()


# -- tegrastats -----------------------------------------------------------------------------------------------------
class TegrastatsBackend:
    name = "tegrastats"

    def __init__(self, interval_s: float = 0.1, command: Sequence[str] = ("tegrastats",)):
        if shutil.which(command[0]) is None:
            raise BackendUnavailable(f"{command[0]} is not on PATH (not a Jetson)")
        ms = max(1, int(interval_s * 1000))
        self._proc = subprocess.Popen([*command, "--interval", str(ms)], stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, bufsize=1)
        self._latest: Optional[Tuple[float, TegraSample]] = None
        self._error = ""
        self._ready = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()
        if not self._ready.wait(max(3.0, 20 * interval_s)) or self._latest is None:
            self.close()
            raise BackendUnavailable(f"tegrastats printed no readable line ({self._error or 'nothing'})")
        sample = self._latest[1]
        self.power_source = sample.power_source
        self.measures = tuple(q for q, ok in (("power", bool(sample.rails_mw)), ("rails", bool(sample.rails_mw)),
                                              ("cpu", bool(sample.cpu)), ("memory", sample.ram_used_mb is not None),
                                              ("gpu", sample.gpu_pct is not None),
                                              ("temperature", bool(sample.temperatures_c))) if ok)
        self.reasons = {q: "tegrastats does not print it on this board (power rails: run as root on some boards)"
                        for q in QUANTITIES if q not in self.measures}

    def _pump(self) -> None:
        for line in self._proc.stdout:
            try:
                self._latest = (time.perf_counter(), parse_line(line))
                self._ready.set()
            except TegrastatsParseError as exc:
                self._error = str(exc)
        self._ready.set()

    def read(self) -> Reading:
        t, s = self._latest
        cores = [c[0] for c in s.cpu if c is not None]
        return Reading(t, None if s.power_mw is None else float(s.power_mw),
                       {k: float(v[0]) for k, v in s.rails_mw.items()}, sum(cores) / len(cores) if cores else None,
                       None if s.ram_used_mb is None else float(s.ram_used_mb),
                       None if s.gpu_pct is None else float(s.gpu_pct), dict(s.temperatures_c))

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()


# -- INA3221 in sysfs -----------------------------------------------------------------------------------------------
@dataclass
class _Channel:
    rail: str
    power: Optional[str] = None  # JetPack 4: in_power<N>_input, mW
    volts: Optional[str] = None  # JetPack 5+: in<N>_input, mV
    amps: Optional[str] = None  # JetPack 5+: curr<N>_input, mA


def find_ina3221(sys_root: str = "/sys") -> List[_Channel]:
    """The INA3221 channels under sys_root: hwmon (`in<N>_label`, `in<N>_input` mV, `curr<N>_input` mA; channel 7 is
    the shunt-voltage sum, NC channels are unconnected) and JetPack 4's IIO (`rail_name_<N>`, `in_power<N>_input`)."""
    channels: List[_Channel] = []
    for hw in sorted(glob.glob(os.path.join(sys_root, "bus/i2c/drivers/ina3221/*/hwmon/hwmon*"))):
        for label in sorted(glob.glob(os.path.join(hw, "in[0-9]_label"))):
            n = os.path.basename(label)[2:-6]
            rail = _cat(label)
            if n == "7" or not rail or "NC" in rail.split():
                continue
            channels.append(_Channel(rail, volts=os.path.join(hw, f"in{n}_input"),
                                     amps=os.path.join(hw, f"curr{n}_input")))
    for iio in sorted(glob.glob(os.path.join(sys_root, "bus/i2c/drivers/ina3221x/*/iio:device*"))):
        for name in sorted(glob.glob(os.path.join(iio, "rail_name_[0-9]"))):
            n = name.rsplit("_", 1)[1]
            rail = _cat(name)
            if rail and rail != "NC":
                channels.append(_Channel(rail, power=os.path.join(iio, f"in_power{n}_input")))
    return channels


def _cat(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return ""


def _number(path: str) -> Optional[float]:
    text = _cat(path)
    try:
        return float(text.split()[0]) if text else None
    except ValueError:
        return None


class Ina3221Backend:
    name = "ina3221"

    def __init__(self, sys_root: str = "/sys"):
        self.channels = find_ina3221(sys_root)
        if not self.channels:
            raise BackendUnavailable(f"no INA3221 power monitor under {sys_root}/bus/i2c/drivers (not a Jetson)")
        rails = [c.rail for c in self.channels]
        self.input_rail = next((r for r in INPUT_RAILS if r in rails), None)
        self.power_source = f"rail {self.input_rail}" if self.input_rail else f"sum of {len(rails)} rails"
        self.measures = ("power", "rails")
        self.reasons = {q: "the power monitors measure power only" for q in QUANTITIES if q not in self.measures}

    def read(self) -> Reading:
        rails: Dict[str, float] = {}
        for c in self.channels:
            if c.power:
                value = _number(c.power)
            else:
                mv, ma = _number(c.volts), _number(c.amps)
                value = None if mv is None or ma is None else mv * ma / 1000.0
            if value is not None:
                rails[c.rail] = value
        total = rails.get(self.input_rail) if self.input_rail else (sum(rails.values()) if rails else None)
        return Reading(time.perf_counter(), total, rails)

    def close(self) -> None:
        pass


# -- psutil ---------------------------------------------------------------------------------------------------------
class PsutilBackend:
    name = "psutil"

    def __init__(self):
        import psutil

        self._psutil = psutil
        psutil.cpu_percent(None)  # the first call only starts the measurement
        temps = getattr(psutil, "sensors_temperatures", lambda: {})() or {}
        self.power_source = "none"
        self.measures = ("cpu", "memory") + (("temperature",) if temps else ())
        self.reasons = {"power": "no power monitor on this machine that hatspec can read (jtop, tegrastats and "
                                 "INA3221 are Jetson-only); power is not estimated",
                        "rails": "no power rails (not a Jetson)", "gpu": "no GPU load without a Jetson backend"}
        if not temps:
            self.reasons["temperature"] = "no temperature sensors exposed here"

    def read(self) -> Reading:
        ps = self._psutil
        temps = {}
        for name, entries in (getattr(ps, "sensors_temperatures", lambda: {})() or {}).items():
            for e in entries:
                temps[f"{name}/{e.label or 'temp'}"] = float(e.current)
        return Reading(time.perf_counter(), None, {}, float(ps.cpu_percent(None)),
                       (ps.virtual_memory().total - ps.virtual_memory().available) / 2**20, None, temps)

    def close(self) -> None:
        pass


BACKENDS: Dict[str, Callable[..., Backend]] = {"jtop": JtopBackend, "tegrastats": TegrastatsBackend,
                                               "ina3221": Ina3221Backend, "psutil": PsutilBackend}


class Sampler:
    """Polls one backend on a thread; `start()`, `stop()`, then `window(t0, t1)` over the readings."""

    def __init__(self, backend: Backend, attempts: List[Tuple[str, str]], interval_s: float = 0.1):
        self.backend = backend
        self.attempts = attempts  # (backend, why it was not used) for each one tried before
        self.interval_s = interval_s
        self.readings: List[Reading] = []
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @property
    def unavailable(self) -> Dict[str, str]:
        return dict(self.backend.reasons)

    def describe(self) -> dict:
        return {"backend": self.backend.name, "measures": list(self.backend.measures),
                "power_source": self.backend.power_source, "unavailable": self.unavailable,
                "tried": [{"backend": n, "reason": r} for n, r in self.attempts], "interval_s": self.interval_s}

    def __enter__(self) -> "Sampler":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def close(self) -> None:
        self.stop()
        self.backend.close()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.readings.append(self.backend.read())
            self._stop.wait(self.interval_s)

    def window(self, t0: float, t1: float) -> dict:
        """Mean power (mW), energy (J) and mean CPU load over readings in [t0, t1]; None where not measured."""
        inside = [r for r in self.readings if t0 <= r.t <= t1]
        powered = [r for r in inside if r.power_mw is not None]
        out = {"samples": len(inside), "power_mw": None, "energy_j": None, "cpu_pct": None}
        if len(powered) >= 2:
            energy_mj = sum((b.t - a.t) * (a.power_mw + b.power_mw) / 2 for a, b in zip(powered, powered[1:]))
            span = powered[-1].t - powered[0].t
            out["power_mw"] = energy_mj / span if span > 0 else powered[0].power_mw
            out["energy_j"] = out["power_mw"] / 1000.0 * (t1 - t0)  # the mean power over the whole window
        elif len(powered) == 1:
            out["power_mw"] = powered[0].power_mw
            out["energy_j"] = powered[0].power_mw / 1000.0 * (t1 - t0)
        loads = [r.cpu_pct for r in inside if r.cpu_pct is not None]
        if loads:
            out["cpu_pct"] = sum(loads) / len(loads)
        return out


def open_sampler(order: Sequence[str] = ORDER, interval_s: float = 0.1,
                 options: Optional[Dict[str, dict]] = None) -> Sampler:
    """The first backend of `order` that starts here, with the reasons the earlier ones did not."""
    attempts: List[Tuple[str, str]] = []
    unknown = [n for n in order if n not in BACKENDS]
    if unknown:
        raise ValueError(f"unknown sampler backend(s) {unknown}; known: {', '.join(BACKENDS)}")
    for name in order:
        kwargs = dict((options or {}).get(name, {}))
        if name in ("jtop", "tegrastats"):
            kwargs.setdefault("interval_s", interval_s)
        try:
            return Sampler(BACKENDS[name](**kwargs), attempts, interval_s)
        except BackendUnavailable as exc:
            attempts.append((name, str(exc)))
    raise BackendUnavailable("no sampler backend works here: " + "; ".join(f"{n}: {r}" for n, r in attempts))
