"""A parser for `tegrastats` lines (JetPack 4 to 7), pure: one line of text in, one `TegraSample` out.

tegrastats prints one line per interval; its fields changed across releases, and this parser reads all of them:
- JetPack 4 (L4T r32: Nano, TX2, Xavier): no timestamp; `EMC_FREQ 0%` / `GR3D_FREQ 0%` (with `@MHz` when known);
  power rails as bare milliwatts `NAME now/avg` (`POM_5V_IN 2090/2090`, `GPU 0/0 CPU 311/311`).
- JetPack 5 (r35: Orin): a leading `MM-DD-YYYY HH:MM:SS`; `EMC_FREQ 0%@2133`, `GR3D_FREQ 0%@[305,305]` (one frequency
  per GPC); `VIC_FREQ 729`, `APE 174`; temperatures `CPU@44.125C`, `-256C` for a sensor that is off; rails
  `VDD_GPU_SOC 2382mW/2382mW`.
- JetPack 6 (r36): as 5 with lower-case sensor names (`cpu@46.781C`, `tj@…`) and engines reported `off` or `%@MHz`.
- JetPack 7 (r38, Thor): `GR3D_FREQ @[f,f,f]` (no load), `NVENC0_FREQ @0`-style engines, a `VIN` input rail; JetPack
  7.2 prints rails as `now/avg/peak` and temperatures as `now/max`.
Spacing is not relied on; `NC` rails (not connected) are skipped; anything this parser does not know is kept in
`unknown`, so a new field shows up instead of being misread.

Units: memory MB (IRAM kB), frequencies MHz, temperatures °C, power mW. A field the line does not have is absent
(None / not in the dict), never zero: a board without power monitors has no power.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

# the rail that measures the whole module's input, where the board has one (Nano: POM_5V_IN; TX2, Orin NX/Nano: VDD_IN)
INPUT_RAILS = ("VDD_IN", "POM_5V_IN", "VIN")  # AGX Xavier / Orin have none: their rails are summed (as jtop does)
OFF_TEMPERATURE = -256.0  # what tegrastats prints for a thermal zone that is powered off

_TIMESTAMP = re.compile(r"^(\d{2}-\d{2}-\d{4} \d{2}:\d{2}:\d{2})\s+")
_PATTERNS: List[Tuple[str, re.Pattern]] = [
    ("ram", re.compile(r"RAM (\d+)/(\d+)MB(?: \(lfb (\d+)x(\d+)(MB|kB)\))?")),
    ("swap", re.compile(r"SWAP (\d+)/(\d+)MB(?: \(cached (\d+)MB\))?")),
    ("iram", re.compile(r"IRAM (\d+)/(\d+)kB ?(?:\(lfb (\d+)kB\))?")),
    ("cpu", re.compile(r"CPU \[([^\]]*)\]")),
    ("mts", re.compile(r"MTS fg (\d+)% bg (\d+)%")),
    ("gr3d", re.compile(r"GR3D_FREQ (?:(\d+)%)?(?:@\[?([\d,\s]+)\]?)?(?:\[[^\]]*\])?")),
    ("engine", re.compile(r"([A-Z][A-Z0-9_]*?)(?:_FREQ)? (off|\d+%@\[?[\d,]+\]?|\d+%|@\[?[\d,]+\]?|\d+)(?=\s|$)")),
    ("temp", re.compile(r"([A-Za-z][\w.-]*)@(-?\d+(?:\.\d+)?)C(?:/(-?\d+(?:\.\d+)?)C)?(?=\s|$)")),
    ("rail", re.compile(r"([A-Z][A-Z0-9_]*) (\d+)(?:mW)?/(\d+)(?:mW)?(?:/(\d+)mW)?(?=\s|$)")),
]


@dataclass
class TegraSample:
    timestamp: Optional[str] = None  # as printed (JetPack 5 on); no timezone
    ram_used_mb: Optional[int] = None
    ram_total_mb: Optional[int] = None
    largest_free_block: Optional[Tuple[int, float]] = None  # (count, MB each)
    swap_used_mb: Optional[int] = None
    swap_total_mb: Optional[int] = None
    swap_cached_mb: Optional[int] = None
    iram_used_kb: Optional[int] = None
    iram_total_kb: Optional[int] = None
    cpu: List[Optional[Tuple[int, Optional[int]]]] = field(default_factory=list)  # per core (load %, MHz); None: off
    emc_pct: Optional[int] = None
    emc_mhz: Optional[int] = None
    gpu_pct: Optional[int] = None
    gpu_mhz: List[int] = field(default_factory=list)  # one per GPC (Orin), one (Xavier) or none
    engines: Dict[str, Optional[Tuple[Optional[int], Optional[int]]]] = field(default_factory=dict)
    # name → (load %, MHz), either may be None; None: the engine is off
    temperatures_c: Dict[str, float] = field(default_factory=dict)  # sensors that are on
    temperature_max_c: Dict[str, float] = field(default_factory=dict)  # JetPack 7.2: the maximum since start
    rails_mw: Dict[str, Tuple[int, int]] = field(default_factory=dict)  # rail → (now, running average)
    rail_peaks_mw: Dict[str, int] = field(default_factory=dict)  # JetPack 7.2: rail → peak
    unknown: List[str] = field(default_factory=list)  # text this parser did not recognise

    @property
    def power_mw(self) -> Optional[int]:
        """The module's power now: its input rail where it has one, else the sum of the rails it reports (AGX
        Xavier / Orin list only the big rails; see `power_source`). None without any rail."""
        for rail in INPUT_RAILS:
            if rail in self.rails_mw:
                return self.rails_mw[rail][0]
        return sum(now for now, _ in self.rails_mw.values()) if self.rails_mw else None

    @property
    def power_source(self) -> str:
        """What `power_mw` is: "rail NAME", "sum of N rails", or "none"."""
        for rail in INPUT_RAILS:
            if rail in self.rails_mw:
                return f"rail {rail}"
        return f"sum of {len(self.rails_mw)} rails" if self.rails_mw else "none"


class TegrastatsParseError(ValueError):
    pass


def parse_line(line: str) -> TegraSample:
    """One tegrastats line → TegraSample; TegrastatsParseError for a line that is not tegrastats output at all."""
    text = " ".join(line.split())  # runs of spaces (seen in the wild) and the trailing newline
    if not text:
        raise TegrastatsParseError("empty line")
    s = TegraSample()
    m = _TIMESTAMP.match(text)
    if m:
        s.timestamp = m.group(1)
        text = text[m.end():]
    spans: List[Tuple[int, int]] = []

    def free(a: int, b: int) -> bool:
        return all(b <= x or a >= y for x, y in spans)

    for kind, pattern in _PATTERNS:
        for m in pattern.finditer(text):
            if not free(m.start(), m.end()) or (kind == "gr3d" and m.end() == m.start() + len("GR3D_FREQ")):
                continue
            if _take(s, kind, m):
                spans.append((m.start(), m.end()))
    rest = text
    for a, b in sorted(spans, reverse=True):
        rest = rest[:a] + " " + rest[b:]
    s.unknown = rest.split()
    if s.ram_total_mb is None and not s.rails_mw and not s.cpu:
        raise TegrastatsParseError(f"not a tegrastats line (no RAM, CPU or power field): {line.strip()[:80]!r}")
    return s


def _take(s: TegraSample, kind: str, m: re.Match) -> bool:
    g = m.groups()
    if kind == "ram":
        s.ram_used_mb, s.ram_total_mb = int(g[0]), int(g[1])
        if g[2] is not None:
            s.largest_free_block = (int(g[2]), int(g[3]) / (1024.0 if g[4] == "kB" else 1.0))
    elif kind == "swap":
        s.swap_used_mb, s.swap_total_mb = int(g[0]), int(g[1])
        s.swap_cached_mb = int(g[2]) if g[2] is not None else None
    elif kind == "iram":
        s.iram_used_kb, s.iram_total_kb = int(g[0]), int(g[1])
    elif kind == "cpu":
        s.cpu = [_core(c.strip()) for c in g[0].split(",") if c.strip()]
    elif kind == "mts":
        s.engines["MTS_FG"], s.engines["MTS_BG"] = (int(g[0]), None), (int(g[1]), None)
    elif kind == "gr3d":
        s.gpu_pct = int(g[0]) if g[0] is not None else None
        s.gpu_mhz = [int(x) for x in re.split(r"[,\s]+", g[1].strip()) if x] if g[1] else []
    elif kind == "engine":
        name, value = g
        if name in ("RAM", "SWAP", "IRAM", "CPU", "GR3D"):
            return False
        load, mhz = _load_freq(value)
        if name == "EMC":
            s.emc_pct, s.emc_mhz = load, mhz
        elif name == "GR3D2":  # early r35: the AGX Orin's second GPC
            s.gpu_mhz.append(mhz) if mhz is not None else None
        else:
            s.engines[name] = None if value == "off" else (load, mhz)
    elif kind == "temp":
        value = float(g[1])
        if value != OFF_TEMPERATURE:
            s.temperatures_c[g[0]] = value
            if g[2] is not None:
                s.temperature_max_c[g[0]] = float(g[2])
    elif kind == "rail":
        if g[0] != "NC":  # a monitor channel that is not connected
            s.rails_mw[g[0]] = (int(g[1]), int(g[2]))
            if g[3] is not None:
                s.rail_peaks_mw[g[0]] = int(g[3])
    return True


def _core(text: str) -> Optional[Tuple[int, Optional[int]]]:
    if text == "off":
        return None
    load, mhz = _load_freq(text)
    if load is None:
        raise TegrastatsParseError(f"unreadable CPU core field {text!r}")
    return load, mhz


def _load_freq(text: str) -> Tuple[Optional[int], Optional[int]]:
    """`12%@1190` → (12, 1190); `12%` → (12, None); `729` → (None, 729); `12%@[305,305]` → (12, 305); off → Nones."""
    if text == "off":
        return None, None
    load: Optional[int] = None
    if "%" in text:
        head, _, text = text.partition("%")
        load = int(head)
        text = text.lstrip("@")
    digits = re.findall(r"\d+", text)
    return load, (int(digits[0]) if digits else None)
