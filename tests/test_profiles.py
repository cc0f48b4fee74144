"""Device profiles, the tegrastats parser, power sampling and the nvpmodel / jetson_clocks wrappers (issue 8).

Recorded tegrastats lines of JetPack 4, 5, 6 and 7 boards are in tests/fixtures/tegrastats.txt. Board tools that do
not exist here (tegrastats, nvpmodel) are stood in for by small scripts that print recorded output, so the
subprocess handling is exercised; the parsers are checked on the recorded text itself.
"""
from __future__ import annotations

import os
import stat
import sys
import time
from pathlib import Path

import pytest

from hardware import device_profiles as D
from hardware import jetson_control as J
from hardware import power
from hardware.tegrastats import TegrastatsParseError, parse_line

FIXTURES = Path(__file__).parent / "fixtures" / "tegrastats.txt"


def _fixture_lines():
    """(jetpack, board, line) for every recorded line."""
    out, head = [], None
    for line in FIXTURES.read_text().splitlines():
        if line.startswith("# ") and " | " in line:
            head = [x.strip() for x in line[2:].split(" | ")]
        elif line and not line.startswith("#"):
            out.append((head[0], head[1], line))
    return out


LINES = _fixture_lines()


def test_fixtures_cover_every_jetpack_generation():
    assert {jp for jp, _, _ in LINES} == {"4", "5", "6", "7", "7.2"}


@pytest.mark.parametrize("jetpack,board,line", LINES, ids=[f"jp{j}-{b[:30]}" for j, b, _ in LINES])
def test_every_recorded_tegrastats_line_is_read_completely(jetpack, board, line):
    s = parse_line(line)
    assert s.unknown == [], f"unparsed: {s.unknown}"
    assert s.ram_total_mb and s.ram_used_mb <= s.ram_total_mb
    assert s.cpu and all(c is None or 0 <= c[0] <= 100 for c in s.cpu)
    assert (s.timestamp is not None) == (jetpack != "4" and not line.startswith("RAM"))
    assert all(v > -256 for v in s.temperatures_c.values())  # sensors that are off are left out
    assert "NC" not in s.rails_mw
    if s.rails_mw:
        assert s.power_mw > 0
        inputs = [r for r in ("VDD_IN", "POM_5V_IN", "VIN") if r in s.rails_mw]
        if inputs:
            assert s.power_source == f"rail {inputs[0]}" and s.power_mw == s.rails_mw[inputs[0]][0]
        else:
            assert s.power_mw == sum(now for now, _ in s.rails_mw.values())


def test_tegrastats_fields_by_generation():
    by_board = {b: parse_line(line) for _, b, line in LINES}
    xavier = by_board["Jetson AGX Xavier 32GB (sudo, four cores off)"]  # JetPack 4: bare mW, cores off, MTS
    assert xavier.cpu[:2] == [(2, 1190), (0, 1190)] and xavier.cpu[4:] == [None] * 4
    assert xavier.rails_mw["SOC"] == (932, 932) and xavier.power_source == "sum of 6 rails"
    assert xavier.gpu_pct == 0 and xavier.gpu_mhz == [318] and xavier.engines["MTS_FG"] == (0, None)
    nano = by_board["Jetson Nano 4GB (sudo)"]
    assert nano.iram_total_kb == 252 and nano.power_mw == 1057 and nano.rails_mw["POM_5V_IN"] == (1057, 1057)
    orin5 = by_board["Jetson AGX Orin 64GB (JetPack 5.1, sudo, GR3D + GR3D2)"]  # two GPCs as two fields
    assert orin5.timestamp == "04-24-2023 00:01:24" and orin5.gpu_mhz == [0, 0] and orin5.emc_mhz == 2133
    assert "CV0" not in orin5.temperatures_c and orin5.temperatures_c["tj"] == 42.593
    assert orin5.engines["VIC"] == (None, 729)
    orin6 = by_board["Jetson AGX Orin 64GB (L4T R36.4.4, sudo, NVENC busy)"]
    assert orin6.engines["NVENC"] == (79, 166) and orin6.engines["NVDEC"] is None and orin6.gpu_mhz == [0, 0]
    assert orin6.rails_mw["VIN_SYS_5V0"] == (4707, 4707)
    nx = by_board["Jetson Orin NX 8GB (sudo, busy engines)"]
    assert nx.gpu_pct == 84 and nx.gpu_mhz == [713] and nx.power_mw == 17946 and nx.largest_free_block == (5, 1.0)
    thor = by_board["Jetson AGX Thor devkit (L4T R38.4.0, sudo)"]  # GPU frequencies without a load figure
    assert thor.gpu_pct is None and thor.gpu_mhz == [0, 0, 0] and thor.engines["NVENC0"] == (None, 0)
    assert len(thor.cpu) == 14 and thor.rails_mw["VDD_CPU_SOC_MSS"] == (4923, 4544)
    thor72 = by_board["Jetson AGX Thor (JetPack 7.2, now/avg/peak power)"]
    assert thor72.rails_mw["VIN"] == (87426, 43713) and thor72.rail_peaks_mw["VIN"] == 87426
    orin72 = by_board["Jetson AGX Orin 64GB (JetPack 7.2, temperatures now/max)"]
    assert orin72.temperatures_c["soc0"] == 49.406 and orin72.temperature_max_c["soc0"] == 49.5
    spaced = by_board["Jetson AGX Orin devkit (irregular spacing)"]
    assert spaced.engines["PVA0"] is None and spaced.engines["APE"] == (None, 174)


def test_not_a_tegrastats_line_is_refused():
    with pytest.raises(TegrastatsParseError, match="empty"):
        parse_line("  \n")
    with pytest.raises(TegrastatsParseError, match="not a tegrastats line"):
        parse_line("Segmentation fault (core dumped)")
    s = parse_line(LINES[-1][2] + " NEWTHING 12/frob")
    assert s.unknown == ["NEWTHING", "12/frob"]  # a field from a future release shows up instead of being misread


# -- device profiles --------------------------------------------------------------------------------------------------
def test_every_packaged_profile_validates():
    names = D.list_profiles()
    assert {"agx-orin-64gb", "agx-orin-32gb", "agx-xavier-32gb", "orin-nx-16gb", "orin-nano-8gb",
            "orin-nano-8gb-super", "agx-thor"} <= set(names)
    for name in names:
        p = D.get_profile(name)
        assert p.default in p.modes and p.software().python and p.software().tensorrt
    orin = D.get_profile("agx-orin-64gb")
    assert [(m.id, m.name, m.watts) for m in orin.modes] == [
        (0, "MAXN", None), (1, "MODE_15W", 15.0), (2, "MODE_30W", 30.0), (3, "MODE_50W", 50.0)]
    assert orin.default.name == "MODE_30W" and orin.mode("MODE_50W").id == 3 and orin.mode("1").name == "MODE_15W"
    xavier = D.get_profile("agx-xavier-32gb")
    assert [m.name for m in xavier.modes[3:7]] == ["MODE_30W_ALL", "MODE_30W_6CORE", "MODE_30W_4CORE",
                                                    "MODE_30W_2CORE"]
    assert xavier.mode(1).reboot and xavier.software("5.1").tensorrt == "8.5" and xavier.software("4.6").python == "3.6"
    assert D.get_profile("orin-nx-16gb").software("6.2").python == "3.10"
    with pytest.raises(D.ProfileError, match="does not run JetPack 6.2"):
        xavier.software("6.2")
    with pytest.raises(D.ProfileError, match="no power mode 'MODE_50W'.*MODE_15W_DESKTOP"):
        xavier.mode("MODE_50W")
    with pytest.raises(D.ProfileError, match="unknown device profile 'jetson-tx9'"):
        D.get_profile("jetson-tx9")


def test_a_device_is_slower_than_a_cloud_gpu_by_their_memory_bandwidths():
    gpus = D.cloud_gpus()
    assert gpus["a6000"].memory_bandwidth_gbs == 768.0 and "data sheet" in gpus["a6000"].source
    assert D.speed_ratio("agx-orin-32gb", "a6000") == pytest.approx(768 / 204.8)  # HAT's pair: 3.75
    assert D.speed_ratio("agx-xavier-32gb", "a6000") == pytest.approx(768 / 136.5)
    assert all(D.speed_ratio(name, "h100-sxm") > 10 for name in D.list_profiles())
    with pytest.raises(D.ProfileError, match="unknown cloud GPU 'v100'.*a6000"):
        D.speed_ratio("agx-orin-32gb", "v100")


BAD = [
    ("memory_gb = 64", "memory_gb = 64\ncolour = \"green\"", "unknown key.*colour"),
    ("default_mode = 2", "default_mode = 9", "default_mode 9 is not a mode id"),
    ("name = \"MODE_50W\"\nwatts = 50", "name = \"MODE_50W\"", "only MAXN modes have no power budget"),
    ("id = 3", "id = 2", r"duplicate mode id\(s\) \[2\]"),
    ('jetpack = ["5.1", "6.0", "6.1", "6.2", "7.2"]', 'jetpack = ["5.1", "9.9"]', "unknown: \\['9.9'\\]"),
    ("memory_gb = 64", "memory_gb = \"64\"", "memory_gb = '64' is not an integer"),
    ("memory_bandwidth_gbs = 204.8", "memory_bandwidth_gbs = 0", "memory_bandwidth_gbs must be positive"),
    ("memory_bandwidth_gbs = 204.8\n", "", "missing memory_bandwidth_gbs"),
    ("cpus = 8", "cpus = 80", "cpus 80 is not in 1..12"),
    ('input_rail = ""', 'input_rail = "VDD_IN"', "input_rail 'VDD_IN' is not one of power_rails"),
    ('name = "agx-orin-64gb"', 'name = "agx-orin"', "must match the file name"),
    ('[[mode]]\nid = 0', '[[mode\nid = 0', "not valid TOML"),
]


@pytest.mark.parametrize("old,new,error", BAD, ids=[b[2][:30] for b in BAD])
def test_a_bad_profile_is_refused_with_the_field_named(tmp_path, old, new, error):
    text = (D.DEVICES_DIR / "agx-orin-64gb.toml").read_text()
    assert old in text
    path = tmp_path / "agx-orin-64gb.toml"
    path.write_text(text.replace(old, new, 1))
    with pytest.raises(D.ProfileError, match=error) as info:
        D.load_profile(path)
    assert str(path) in str(info.value)


# -- sampling ---------------------------------------------------------------------------------------------------------
def _on_a_jetson() -> bool:
    return os.path.exists("/proc/device-tree/model") and "jetson" in Path("/proc/device-tree/model").read_text(
        errors="replace").lower()


@pytest.mark.skipif(_on_a_jetson(), reason="on a Jetson the Jetson backends start")
def test_sampler_falls_back_to_psutil_here_with_the_reasons_recorded():
    sampler = power.open_sampler(interval_s=0.02)
    info = sampler.describe()
    assert info["backend"] == "psutil"
    assert [t["backend"] for t in info["tried"]] == ["jtop", "tegrastats", "ina3221"]
    reasons = {t["backend"]: t["reason"] for t in info["tried"]}
    assert "jtop.service is not active" in reasons["jtop"] or "not installed" in reasons["jtop"]
    assert "not on PATH" in reasons["tegrastats"] and "no INA3221" in reasons["ina3221"]
    assert "power" in info["unavailable"] and "not estimated" in info["unavailable"]["power"]
    with sampler:
        t0 = time.perf_counter()
        time.sleep(0.3)  # the sampler thread reads every 20 ms meanwhile
        t1 = time.perf_counter()
    w = sampler.window(t0, t1)
    assert w["samples"] >= 2 and w["power_mw"] is None and w["energy_j"] is None and w["cpu_pct"] is not None


def _sysfs(tmp_path):
    """The INA3221 layouts: JetPack 5+ hwmon (Orin NX: VDD_IN first) and JetPack 4 IIO (AGX Xavier)."""
    hw = tmp_path / "bus/i2c/drivers/ina3221/1-0040/hwmon/hwmon3"
    hw.mkdir(parents=True)
    for n, (label, mv, ma) in enumerate([("VDD_IN", 5000, 1040), ("VDD_CPU_GPU_CV", 4928, 216),
                                         ("VDD_SOC", 4936, 312)], 1):
        (hw / f"in{n}_label").write_text(label + "\n")
        (hw / f"in{n}_input").write_text(f"{mv}\n")
        (hw / f"curr{n}_input").write_text(f"{ma}\n")
    (hw / "in7_label").write_text("sum of shunt voltages\n")
    iio = tmp_path / "bus/i2c/drivers/ina3221x/1-0041/iio:device1"
    iio.mkdir(parents=True)
    for n, (rail, mw) in enumerate([("CV", 0), ("VDDRQ", 621), ("NC", 5)]):
        (iio / f"rail_name_{n}").write_text(rail + "\n")
        (iio / f"in_power{n}_input").write_text(f"{mw}\n")
    return tmp_path


def test_ina3221_reads_both_sysfs_layouts(tmp_path):
    backend = power.Ina3221Backend(str(_sysfs(tmp_path)))
    assert [c.rail for c in backend.channels] == ["VDD_IN", "VDD_CPU_GPU_CV", "VDD_SOC", "CV", "VDDRQ"]
    r = backend.read()
    assert r.rails_mw["VDD_IN"] == pytest.approx(5200.0) and r.rails_mw["VDDRQ"] == 621.0
    assert r.power_mw == pytest.approx(5200.0) and backend.power_source == "rail VDD_IN"
    assert "cpu" in backend.reasons
    with pytest.raises(power.BackendUnavailable, match="no INA3221"):
        power.Ina3221Backend(str(tmp_path / "empty"))


def _script(path: Path, body: str) -> Path:
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def test_tegrastats_backend_reads_a_running_tegrastats(tmp_path):
    """A stand-in tegrastats replaying a recorded Orin NX line at the requested interval."""
    line = next(line for _, b, line in LINES if b.startswith("Jetson Orin NX 16GB"))
    tool = _script(tmp_path / "tegrastats", f"""import sys, time
ms = int(sys.argv[sys.argv.index("--interval") + 1])
while True:
    print({line!r}, flush=True)
    time.sleep(ms / 1000)
""")
    # run by the interpreter, not exec'd: a script just written can be "Text file busy" to exec while another
    # thread's fork holds its write descriptor for an instant (seen once under pytest-xdist)
    with power.Sampler(power.TegrastatsBackend(0.02, command=(sys.executable, str(tool))), [], 0.02) as sampler:
        t0 = time.perf_counter()
        time.sleep(0.3)
        t1 = time.perf_counter()
    assert sampler.backend.power_source == "rail VDD_IN" and "power" in sampler.backend.measures
    w = sampler.window(t0, t1)
    assert w["samples"] >= 3 and w["power_mw"] == pytest.approx(5299.0)
    assert w["energy_j"] == pytest.approx(5.299 * (t1 - t0))
    assert sampler.backend._proc.poll() is not None  # the subprocess is gone


# -- nvpmodel and jetson_clocks ---------------------------------------------------------------------------------------
def test_nvpmodel_output_is_read():
    assert J.parse_query("NV Power Mode: MODE_30W\n2\n") == ("MODE_30W", 2)
    assert J.parse_query("NV Fan Mode:quiet\nNV Power Mode: MODE_15W_DESKTOP\n7\n") == ("MODE_15W_DESKTOP", 7)
    assert J.parse_query("NV Power Mode: 15W\n0\nNVPM ERROR: Error opening /sys/kernel/nvpmodel_emc_cap/"
                         "emc_iso_cap: 13\n") == ("15W", 0)
    listed = J.parse_modes("NVPM VERB: Config file: /etc/nvpmodel.conf\nNVPM VERB: PM_CONFIG: DEFAULT=25W(1)\n"
                           "NVPM VERB: POWER_MODEL: ID=0 NAME=15W\nNVPM VERB: POWER_MODEL: ID=1 NAME=25W\n"
                           "NVPM VERB: POWER_MODEL: ID=2 NAME=MAXN_SUPER\n")
    assert listed.modes == {0: "15W", 1: "25W", 2: "MAXN_SUPER"} and listed.default == (1, "25W")
    with pytest.raises(J.JetsonControlError, match="unreadable"):
        J.parse_query("bash: nvpmodel: command not found")


def test_board_tools_say_why_they_cannot_run(monkeypatch):
    if J.shutil.which("nvpmodel") is None:
        with pytest.raises(J.JetsonControlError, match="nvpmodel is not installed: this is not a Jetson"):
            J.query_mode()
    monkeypatch.setattr(J, "is_root", lambda: False)
    with pytest.raises(J.JetsonControlError, match="needs root"):
        J.set_mode(1)
    with pytest.raises(J.JetsonControlError, match=r"needs root \(even --show\)"):
        J.jetson_clocks("show")


def test_set_mode_switches_verifies_and_refuses_a_reboot(tmp_path, monkeypatch):
    """A stand-in nvpmodel keeping the mode in a file, with AGX Xavier's modes (MODE_10W asks for a reboot)."""
    state = tmp_path / "mode"
    state.write_text("7")
    _script(tmp_path / "nvpmodel", f"""import sys
names = {{0: "MAXN", 1: "MODE_10W", 2: "MODE_15W", 7: "MODE_15W_DESKTOP"}}
state = {str(state)!r}
if sys.argv[1] == "-q":
    m = int(open(state).read()); print(f"NV Power Mode: {{names[m]}}"); print(m)
elif sys.argv[1] == "-m":
    m = int(sys.argv[2])
    if m not in names:
        print(f"NVPM ERROR: request for bad power mode {{m}}"); sys.exit(0)
    if m == 1:
        print("NVPM WARN: Reboot required for changing to this power mode: 1")
        print("NVPM WARN: DO YOU WANT TO REBOOT NOW? enter YES/yes to confirm:")
        if sys.stdin.readline().strip().lower() != "yes":
            sys.exit(0)
    open(state, "w").write(str(m))
""")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(J, "is_root", lambda: True)
    assert J.query_mode() == ("MODE_15W_DESKTOP", 7)
    assert J.set_mode(2) == ("MODE_15W", 2)
    with pytest.raises(J.JetsonControlError, match="needs a reboot"):
        J.set_mode(1)
    assert state.read_text() == "2"
    with pytest.raises(J.JetsonControlError, match="bad power mode 5"):  # exit status 0, error in the text
        J.set_mode(5)


def test_board_detection_reads_the_device_tree(tmp_path):
    dt = tmp_path / "proc/device-tree"
    dt.mkdir(parents=True)
    (dt / "model").write_bytes(b"NVIDIA Jetson Orin Nano Developer Kit\0")
    (dt / "compatible").write_bytes(b"nvidia,p3768-0000+p3767-0005\0nvidia,p3767-0005\0nvidia,tegra234\0")
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/nv_tegra_release").write_text("# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic, "
                                                   "EABI: aarch64, DATE: Wed Jan  8 01:49:37 UTC 2025\n")
    info = J.detect_board(str(tmp_path))
    assert (info.model, info.l4t, info.profile) == ("NVIDIA Jetson Orin Nano Developer Kit", "36.4.3",
                                                    "orin-nano-8gb")
    super_modes = J.NvpModes({0: "15W", 1: "25W", 2: "MAXN_SUPER"}, (1, "25W"))
    assert J.detect_board(str(tmp_path), super_modes).profile == "orin-nano-8gb-super"
    with pytest.raises(J.JetsonControlError, match="not a Jetson"):
        J.detect_board(str(tmp_path / "nothing"))


@pytest.mark.real_models
@pytest.mark.skipif(_on_a_jetson(), reason="on a Jetson the modes can be switched (as root)")
def test_sweep_measures_what_it_can_and_marks_the_rest_unavailable(smollm2, tmp_path):
    """Off a Jetson: the current mode is measured (speed and latency from a real draft), every named mode gets the
    reason it cannot be set, and power is None with the sampler's reason — nothing is filled in."""
    import json

    from profiles.profile_cli import main

    out = tmp_path / "sweep.json"
    assert main(["sweep", "--profile", "agx-xavier-32gb", "--modes", "MODE_15W,MODE_10W", "--backends", "torch",
                 "--model", "smollm2-135m", "--draft-lengths", "1,3", "--rounds", "2", "--prompt-tokens", "16",
                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    current, m15, m10 = report["modes"]
    assert current["mode"] == "current" and [c["draft_len"] for c in current["cells"]] == [1, 3]
    for c in current["cells"]:
        assert c["tokens"] == 2 * c["draft_len"] and c["tokens_per_s"] > 0 and c["latency_p90_ms"] > 0
        assert c["power_mw"] is None and c["energy_per_token_j"] is None
    assert "needs a reboot" in m10["unavailable"] and not m10["cells"]  # MODE_10W power-gates the GPU
    assert "not a Jetson" in m15["unavailable"] or "root" in m15["unavailable"]
    assert "power" in report["sampler"]["unavailable"] and (tmp_path / "sweep.png").exists()


def test_mode_cycle_switches_every_n_requests_and_stops_on_failure(tmp_path, monkeypatch):
    state = tmp_path / "mode"
    state.write_text("2")
    _script(tmp_path / "nvpmodel", f"""import sys
names = {{0: "MAXN", 1: "MODE_15W", 2: "MODE_30W", 3: "MODE_50W"}}
if sys.argv[1] == "-q":
    m = int(open({str(state)!r}).read()); print(f"NV Power Mode: {{names[m]}}"); print(m)
else:
    open({str(state)!r}, "w").write(sys.argv[2])
""")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(J, "is_root", lambda: True)
    cycle = J.ModeCycler([1, 3], every=2)
    seen = [cycle.after_request() for _ in range(6)]
    assert seen == [None, "MODE_15W", None, "MODE_50W", None, "MODE_15W"] and cycle.switches == 3
    monkeypatch.setattr(J, "is_root", lambda: False)
    assert [cycle.after_request() for _ in range(4)] == [None] * 4 and "needs root" in cycle.error
    assert cycle.switches == 3
