"""`hat-fleet`: launch, inspect and stop a fleet — one cloud server and an edge agent on every device — from an
inventory, over ssh.

    hat-fleet up INVENTORY          refuse a device whose hatspec or protocol version is not the cloud's (the
                                    message says how to install it: hat-flash --software), start the cloud (wait
                                    until it serves), then on every device (in parallel): set
                                    its power mode, start `hat-edge serve` with its bundle or model, wait until it
                                    has reported to the cloud
    hat-fleet status INVENTORY      the cloud's view (each device's reported profile, power mode, drafting delay)
                                    and each agent's own status; exit 1 if anything is down
    hat-fleet logs INVENTORY [--host NAME] [--lines N]
    hat-fleet down INVENTORY        stop every agent and the cloud (TERM, then KILL after a grace period)
    hat-fleet top [INVENTORY] [--url URL] [--once]   the cloud's live fleet view (export/deploy/top.py)
    hat-fleet local up K --dir DIR  K network-namespace "Jetsons" with sshd on this machine (root) and an inventory
    hat-fleet local down --dir DIR  remove them

The inventory is an Ansible YAML inventory (the same file drives `hat-flash --inventory`): a `cloud` group with one
host and an `edge` group, with `ansible_host`, `ansible_user`, `ansible_port`, `ansible_ssh_private_key_file`,
`ansible_ssh_common_args` or `ansible_connection: local`, and hatspec's variables (docs/FLEET.md):
  all / group / host vars: hatspec_config (a role's config file on that host, docs/CONFIG.md: `--config FILE`; the
  variables below that the inventory sets override its keys, the fleet's defaults do not), hatspec_python (the
  Python with hatspec on that host), hatspec_run_dir (pid, log and status files), hatspec_model (cloud: the target;
  device: the draft for the torch backend), hatspec_cloud_args;
  cloud: hatspec_bind; edge: hatspec_server (the endpoint the device dials), hatspec_bundle_dir, hatspec_backend,
  hatspec_precision, hatspec_profile (hardware/devices), hatspec_power_mode (id or name in that profile),
  hatspec_protocol, hatspec_edge_args, hatspec_port, hatspec_mode_cycle / hatspec_mode_every (switch power modes every
  N requests, as HAT's testbed does); link security: hatspec_curve_secret (each host's secret key), hatspec_curve_allow
  (cloud: the allow-list directory), hatspec_curve_server_key (device: the cloud's public key), or hatspec_plaintext.
"""
from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from hat_split.net.security import ephemeral
from hat_split.net.ssh import ssh_argv
from hat_split.version import mismatch
from hardware.device_profiles import ProfileError, get_profile
from testbed.netns_fleet import LocalFleet, unavailable

SSH_TIMEOUT = ("-o", "ConnectTimeout=10")  # s: an unreachable device fails a fleet command after this, not minutes


class InventoryError(ValueError):
    pass


@dataclass
class Host:
    name: str
    vars: Dict[str, object] = field(default_factory=dict)

    def get(self, key: str, default=None):
        return self.vars.get(key, default)

    @property
    def local(self) -> bool:
        return self.get("ansible_connection") == "local"

    @property
    def python(self) -> str:
        return str(self.get("hatspec_python", "python3"))

    @property
    def run_dir(self) -> str:
        return str(self.get("hatspec_run_dir", "/tmp/hatspec-run"))

    @property
    def config(self) -> str:
        """The role's config file on this host (hatspec_config), or ""."""
        return str(self.get("hatspec_config", ""))

    def command(self, script: str) -> List[str]:
        """argv running the shell `script` on this host (ssh, or locally)."""
        if self.local:
            return ["sh", "-c", script]
        port = self.get("ansible_port")
        return ssh_argv(str(self.get("ansible_host", self.name)), script, user=str(self.get("ansible_user") or ""),
                        port=int(port) if port else None,
                        identity=str(self.get("ansible_ssh_private_key_file") or ""),
                        options=[*SSH_TIMEOUT, *shlex.split(str(self.get("ansible_ssh_common_args", "")))])

    def run(self, script: str, timeout: float = 120.0) -> Tuple[int, str]:
        try:
            r = subprocess.run(self.command(script), capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return 124, f"timed out after {timeout:.0f} s"
        return r.returncode, (r.stdout + r.stderr).strip()


@dataclass
class Inventory:
    cloud: Host
    devices: List[Host]


def load_inventory(path: str) -> Inventory:
    """Read and check an inventory; InventoryError naming the host and the problem. A host with a config file
    (hatspec_config) may leave what the file holds (endpoints, models, keys) out of the inventory."""
    import yaml  # PyYAML comes with the fleet extra (ansible-core)

    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise InventoryError(f"{path}: {exc}") from None
    top = (data or {}).get("all", data or {})
    if not isinstance(top, dict):
        raise InventoryError(f"{path}: not an inventory (a mapping with `all` or the groups)")
    base = dict(top.get("vars") or {})
    groups = top.get("children") or {}
    hosts: Dict[str, List[Host]] = {}
    for group in ("cloud", "edge"):
        g = groups.get(group)
        if not isinstance(g, dict) or not g.get("hosts"):
            raise InventoryError(f"{path}: needs a `{group}` group with hosts")
        gvars = {**base, **(g.get("vars") or {})}
        hosts[group] = [Host(name, {**gvars, **(v or {})}) for name, v in g["hosts"].items()]
    if len(hosts["cloud"]) != 1:
        raise InventoryError(f"{path}: the cloud group has {len(hosts['cloud'])} hosts; give exactly one")
    for dev in hosts["edge"]:
        if not dev.get("hatspec_server") and not dev.config:
            raise InventoryError(f"{path}: device {dev.name}: hatspec_server (the cloud endpoint it dials) is missing")
        if not (dev.get("hatspec_bundle_dir") or dev.get("hatspec_model") or dev.config):
            raise InventoryError(f"{path}: device {dev.name}: give hatspec_bundle_dir or hatspec_model")
        profile = dev.get("hatspec_profile")
        modes = ([dev.get("hatspec_power_mode")] if dev.get("hatspec_power_mode") is not None else []) + \
            list(dev.get("hatspec_mode_cycle") or [])
        if modes and not profile:
            raise InventoryError(f"{path}: device {dev.name}: power modes (hatspec_power_mode, hatspec_mode_cycle) "
                                 "need hatspec_profile")
        if profile:
            try:
                p = get_profile(str(profile))
                for m in modes:
                    p.mode(str(m))
            except ProfileError as exc:
                raise InventoryError(f"{path}: device {dev.name}: {exc}") from None
    for host, role, keys in [(hosts["cloud"][0], "cloud", ("hatspec_curve_secret", "hatspec_curve_allow"))] + \
            [(d, "device", ("hatspec_curve_secret", "hatspec_curve_server_key")) for d in hosts["edge"]]:
        if not host.get("hatspec_plaintext") and not all(host.get(k) for k in keys) and not host.config:
            raise InventoryError(f"{path}: {role} {host.name}: the link is CurveZMQ: give {' and '.join(keys)} "
                                 "(hat-keys generate), or hatspec_plaintext: true")
    if not hosts["cloud"][0].get("hatspec_model") and not hosts["cloud"][0].config:
        raise InventoryError(f"{path}: the cloud needs hatspec_model (the target model)")
    return Inventory(hosts["cloud"][0], hosts["edge"])


# -- what runs where ------------------------------------------------------------------------------------------------
def _q(x) -> str:
    return shlex.quote(str(x))


def _start_script(host: Host, name: str, argv: List[str]) -> str:
    """Start argv detached on the host (survives the ssh session), pid and log under its run dir."""
    run = host.run_dir
    return (f"mkdir -p {_q(run)} && cd {_q(run)} && "
            f"if [ -f {name}.pid ] && kill -0 $(cat {name}.pid) 2>/dev/null; then "
            f"echo already running: pid $(cat {name}.pid); exit 3; fi; "
            f"rm -f {name}.status.json; nohup setsid {' '.join(_q(a) for a in argv)} > {name}.log 2>&1 < /dev/null & "
            f"echo $! > {name}.pid; echo started pid $!")


def _stop_script(host: Host, name: str, grace_s: float) -> str:
    run = host.run_dir
    return (f"cd {_q(run)} 2>/dev/null || exit 0; [ -f {name}.pid ] || exit 0; p=$(cat {name}.pid); "
            f"kill -TERM -$p 2>/dev/null || kill -TERM $p 2>/dev/null; i=0; "
            f"while kill -0 $p 2>/dev/null && [ $i -lt {int(grace_s * 10)} ]; do sleep 0.1; i=$((i+1)); done; "
            f"if kill -0 $p 2>/dev/null; then kill -KILL -$p 2>/dev/null || kill -KILL $p; echo killed $p; "
            f"else echo stopped $p; fi; rm -f {name}.pid")


def _security_args(host: Host, role: str) -> List[str]:
    """CurveZMQ key flags from hatspec_curve_secret and hatspec_curve_allow (cloud) / hatspec_curve_server_key
    (device), or --plaintext where hatspec_plaintext is true."""
    if host.get("hatspec_plaintext"):
        return ["--plaintext"]
    other = ("--curve-allow", "hatspec_curve_allow") if role == "cloud" else \
        ("--curve-server-key", "hatspec_curve_server_key")
    return [a for flag, var in (("--curve-secret", "hatspec_curve_secret"), other) if host.get(var)
            for a in (flag, str(host.get(var)))]


def _flags(host: Host, table: Sequence[Tuple[str, str, object]]) -> List[str]:
    """`flag value` for each (variable, flag, the fleet's default) of `table`; on a host with a config file only the
    variables the inventory sets, so that the file's keys stand where the inventory says nothing."""
    out: List[str] = []
    for var, flag, default in table:
        value = host.get(var, None if host.config else default)
        if value is not None:
            out += [flag, str(value)]
    return out


def _config_args(host: Host) -> List[str]:
    return ["--config", host.config] if host.config else []


def cloud_argv(cloud: Host) -> List[str]:
    return [cloud.python, "-m", "cloud_runtime.cli", "serve", *_config_args(cloud),
            *_flags(cloud, [("hatspec_model", "--model", None), ("hatspec_bind", "--bind", "tcp://0.0.0.0:5555"),
                            ("hatspec_metrics_port", "--metrics-port", None),
                            ("hatspec_dashboard_port", "--dashboard-port", None)]),
            "--status-file", f"{cloud.run_dir}/cloud.status.json", "--status-interval", "1",
            *_security_args(cloud, "cloud"), *[str(a) for a in cloud.get("hatspec_cloud_args", [])]]


def edge_argv(dev: Host) -> List[str]:
    argv = [dev.python, "-m", "edge_runtime.cli", "serve", *_config_args(dev),
            *_flags(dev, [("hatspec_server", "--server", None)]), *_security_args(dev, "device"),
            "--device-id", dev.name, "--status-file", f"{dev.run_dir}/edge.status.json",
            *_flags(dev, [("hatspec_port", "--port", 8642), ("hatspec_report_interval", "--report-interval", 5),
                          ("hatspec_protocol", "--protocol", "sd")])]
    if dev.get("hatspec_bundle_dir"):
        argv += _flags(dev, [("hatspec_backend", "--backend", "onnxruntime"), ("hatspec_bundle_dir", "--bundle", None),
                             ("hatspec_precision", "--precision", "fp32")])
    else:
        argv += _flags(dev, [("hatspec_model", "--model", None)])
    if dev.get("hatspec_profile"):
        argv += ["--device-profile", str(dev.get("hatspec_profile"))]
    if dev.get("hatspec_mode_cycle"):
        argv += ["--mode-cycle", ",".join(str(m) for m in dev.get("hatspec_mode_cycle")),
                 "--mode-every", str(dev.get("hatspec_mode_every", 4))]
    return argv + [str(a) for a in dev.get("hatspec_edge_args", [])]


def _status_file(host: Host, name: str) -> Optional[dict]:
    rc, out = host.run(f"cat {_q(host.run_dir)}/{name}.status.json 2>/dev/null", timeout=30)
    try:
        return json.loads(out) if rc == 0 and out else None
    except json.JSONDecodeError:
        return None


def _alive(host: Host, name: str) -> bool:
    rc, out = host.run(f"cd {_q(host.run_dir)} 2>/dev/null && [ -f {name}.pid ] && kill -0 $(cat {name}.pid) "
                       "2>/dev/null && echo alive", timeout=30)
    return rc == 0 and "alive" in out


def _wait(pred, timeout_s: float, interval_s: float = 0.5) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval_s)
    return False


DESCRIBE = "import json; from hat_split.version import describe; print(json.dumps(describe()))"


def versions(inv: Inventory) -> Dict[str, Tuple[Optional[dict], str]]:
    """{host name: (its hat_split.version.describe() through its hatspec_python, or None; what it printed)}."""
    def ask(host: Host) -> Tuple[str, Tuple[Optional[dict], str]]:
        rc, text = host.run(f"cd / && {_q(host.python)} -c {_q(DESCRIBE)}", timeout=120)  # not a checkout in cwd
        try:
            return host.name, (json.loads(text.splitlines()[-1]) if rc == 0 else None, text)
        except (ValueError, IndexError):
            return host.name, (None, text)

    with ThreadPoolExecutor(max_workers=min(16, 1 + len(inv.devices))) as pool:
        return dict(pool.map(ask, [inv.cloud, *inv.devices]))


def check_versions(inv: Inventory, inventory_path: str = "INVENTORY") -> Dict[str, dict]:
    """Every host's version; RuntimeError naming each device whose hatspec or protocol version differs from the
    cloud's (or that has no hatspec at its hatspec_python), with the command that installs the cloud's."""
    found = versions(inv)
    cloud, text = found[inv.cloud.name]
    if cloud is None:
        raise RuntimeError(f"cloud {inv.cloud.name}: no hatspec at {inv.cloud.python} (hatspec_python): "
                           f"{text.strip()[-300:]}")
    problems = []
    for dev in inv.devices:
        info, text = found[dev.name]
        fix = (f"install the cloud's hatspec ({cloud['hatspec']}) on it from the same checkout: hat-flash --software "
               f"--inventory {inventory_path} --limit {dev.name}, with hatspec_python: "
               f"{dev.get('hatspec_root', '/opt/hatspec')}/venv/bin/python")
        if info is None:
            problems.append(f"device {dev.name}: no hatspec at {dev.python} ({text.strip()[-200:]}): {fix}")
        elif mismatch(info, cloud):
            problems.append(f"device {dev.name}: {mismatch(info, cloud)}: {fix}")
    if problems:
        raise RuntimeError("refused: the devices must run the cloud's hatspec and protocol version\n"
                           + "\n".join(problems))
    return {name: info for name, (info, _) in found.items()}


# -- commands -------------------------------------------------------------------------------------------------------
def up(inv: Inventory, timeout_s: float = 600.0, log=print, inventory_path: str = "INVENTORY") -> dict:
    """Check every host's hatspec and protocol version against the cloud's, then start everything; {host: outcome}.
    Raises RuntimeError when a version differs, or the cloud or any device does not come up."""
    out: dict = {}
    cloud = inv.cloud
    found = check_versions(inv, inventory_path)
    log(f"versions: hatspec {found[cloud.name]['hatspec']}, protocol {found[cloud.name]['protocol']} on every host")
    rc, text = cloud.run(_start_script(cloud, "cloud", cloud_argv(cloud)))
    if rc not in (0, 3):
        raise RuntimeError(f"cloud {cloud.name}: could not start: {text}")
    log(f"cloud {cloud.name}: {text}")
    _wait(lambda: (_status_file(cloud, "cloud") or {}).get("endpoint") is not None or not _alive(cloud, "cloud"),
          timeout_s)
    if (_status_file(cloud, "cloud") or {}).get("endpoint") is None:
        _, tail = cloud.run(f"tail -n 20 {_q(cloud.run_dir)}/cloud.log")
        raise RuntimeError(f"cloud {cloud.name} did not start serving within {timeout_s:.0f} s:\n{tail}")
    out[cloud.name] = "serving"
    log(f"cloud {cloud.name}: serving")

    def device_up(dev: Host) -> Tuple[str, dict]:
        record: dict = {}
        mode = dev.get("hatspec_power_mode")
        if mode is not None:
            rc, text = dev.run(f"{_q(dev.python)} -m profiles.profile_cli mode {_q(mode)} --profile "
                               f"{_q(dev.get('hatspec_profile'))}", timeout=120)
            record["power_mode"] = text.splitlines()[-1] if text else ""
            record["power_mode_set"] = rc == 0  # off a Jetson: the reason, and the agent runs in whatever mode it is
        rc, text = dev.run(_start_script(dev, "edge", edge_argv(dev)))
        if rc not in (0, 3):
            return dev.name, {**record, "state": "failed", "error": text}
        def settled() -> bool:  # ready, or the agent already exited (its log says why)
            return (_status_file(dev, "edge") or {}).get("state") == "ready" or not _alive(dev, "edge")

        _wait(settled, timeout_s)
        status = _status_file(dev, "edge") or {}
        if status.get("state") != "ready":
            _, tail = dev.run(f"tail -n 20 {_q(dev.run_dir)}/edge.log")
            return dev.name, {**record, "state": status.get("state", "not started"), "error": tail}
        return dev.name, {**record, "state": "ready", "pid": status.get("pid")}

    with ThreadPoolExecutor(max_workers=min(16, len(inv.devices))) as pool:
        for name, record in pool.map(device_up, inv.devices):
            out[name] = record
            log(f"device {name}: {record['state']}" + (f" (power mode: {record['power_mode']})"
                                                        if "power_mode" in record else "")
                + (f"\n{record['error']}" if record.get("error") else ""))
    failed = {n: r for n, r in out.items() if isinstance(r, dict) and r["state"] != "ready"}
    if failed:
        raise RuntimeError("device(s) did not come up:\n" + "\n".join(
            f"{n}: {r['state']}: {r.get('error', '')[-800:]}" for n, r in failed.items()))
    return out


def status(inv: Inventory) -> dict:
    cloud = inv.cloud
    report = {"cloud": {"host": cloud.name, "alive": _alive(cloud, "cloud"), "status": _status_file(cloud, "cloud")},
              "devices": {}}

    def one(dev: Host):
        return dev.name, {"alive": _alive(dev, "edge"), "status": _status_file(dev, "edge")}

    with ThreadPoolExecutor(max_workers=min(16, len(inv.devices))) as pool:
        report["devices"] = dict(pool.map(one, inv.devices))
    return report


def logs(inv: Inventory, host: str = "", lines: int = 50) -> Dict[str, str]:
    hosts = [(inv.cloud, "cloud")] + [(d, "edge") for d in inv.devices]
    out = {}
    for h, name in hosts:
        if host and h.name != host:
            continue
        _, text = h.run(f"tail -n {int(lines)} {_q(h.run_dir)}/{name}.log 2>/dev/null")
        out[h.name] = text
    if host and not out:
        raise InventoryError(f"no host {host!r} in the inventory")
    return out


def down(inv: Inventory, grace_s: float = 10.0) -> Dict[str, str]:
    out = {}

    def one(dev: Host):
        return dev.name, dev.run(_stop_script(dev, "edge", grace_s))[1] or "not running"

    with ThreadPoolExecutor(max_workers=min(16, len(inv.devices))) as pool:
        out.update(pool.map(one, inv.devices))
    out[inv.cloud.name] = inv.cloud.run(_stop_script(inv.cloud, "cloud", grace_s))[1] or "not running"
    return out


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="hat-fleet", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    for name in ("up", "status", "logs", "down"):
        p = sub.add_parser(name)
        p.add_argument("inventory")
    sub.choices["up"].add_argument("--timeout", type=float, default=600.0, help="seconds to wait for each start")
    sub.choices["logs"].add_argument("--host", default="")
    sub.choices["logs"].add_argument("--lines", type=int, default=50)
    sub.choices["down"].add_argument("--grace", type=float, default=10.0, help="seconds between TERM and KILL")
    sub.choices["status"].add_argument("--json", action="store_true")
    top = sub.add_parser("top", help="the cloud's live fleet view in this terminal (export/deploy/top.py)")
    top.add_argument("inventory", nargs="?", help="the dashboard of its cloud host (hatspec_dashboard_port)")
    top.add_argument("--url", default="", help="the cloud's dashboard, http://HOST:PORT (hat-cloud --dashboard-port)")
    top.add_argument("--interval", type=float, default=2.0, help="seconds between two reads (default %(default)s)")
    top.add_argument("--once", action="store_true", help="print the table once and exit (1: unreachable)")
    loc = sub.add_parser("local", help="a local fleet of network-namespace devices (root)")
    loc.add_argument("action", choices=("up", "down"))
    loc.add_argument("k", nargs="?", type=int, default=2)
    loc.add_argument("--dir", required=True, help="where its keys, state and inventory.yml live")
    loc.add_argument("--model", default="smollm2-135m", help="the cloud's model and the devices' draft")
    loc.add_argument("--profile", default="agx-orin-64gb", help="the device profile every device claims")
    args = ap.parse_args(argv)
    try:
        if args.command == "local":
            return _local(args)
        if args.command == "top":
            return _top(args)
        inv = load_inventory(args.inventory)
        if args.command == "up":
            up(inv, args.timeout, inventory_path=args.inventory)
        elif args.command == "status":
            report = status(inv)
            if args.json:
                print(json.dumps(report, indent=1))
            else:
                _print_status(report)
            down_hosts = [n for n, d in report["devices"].items() if not d["alive"]] + \
                ([inv.cloud.name] if not report["cloud"]["alive"] else [])
            return 1 if down_hosts else 0
        elif args.command == "logs":
            for host, text in logs(inv, args.host, args.lines).items():
                print(f"==> {host} <==\n{text}\n")
        elif args.command == "down":
            for host, text in down(inv, args.grace).items():
                print(f"{host}: {text}")
    except (InventoryError, RuntimeError) as exc:
        print(f"hat-fleet {args.command}: {exc}", file=sys.stderr)
        return 1
    return 0


def _top(args) -> int:
    from export.deploy import top

    if not args.url and not args.inventory:
        print("hat-fleet top: give --url http://HOST:PORT (the cloud's dashboard) or an inventory", file=sys.stderr)
        return 2
    if not args.interval > 0:
        print(f"hat-fleet top: --interval must be > 0 s, got {args.interval}", file=sys.stderr)
        return 2
    try:
        url = top.view_url(args.url or top.inventory_url(load_inventory(args.inventory).cloud))
    except ValueError as exc:  # InventoryError is one
        print(f"hat-fleet top: {exc}", file=sys.stderr)
        return 2
    if args.once:
        top.once(url, shutil.get_terminal_size().columns if sys.stdout.isatty() else None)
        return 0
    return top.live(url, args.interval)


def _print_status(report: dict) -> None:
    c = report["cloud"]
    cs = c["status"] or {}
    print(f"cloud {c['host']}: {'alive' if c['alive'] else 'DOWN'}"
          + (f", {cs.get('model')} at {cs.get('endpoint')}, sessions opened {cs['server']['sessions_opened']}"
             if cs.get("server") else ""))
    seen = {d.get("device_id"): d for d in cs.get("devices", [])}
    for name, d in report["devices"].items():
        s = d["status"] or {}
        cloud_view = seen.get(name, {})
        print(f"  {name}: {'alive' if d['alive'] else 'DOWN'}, {s.get('state', '?')}, {s.get('backend', '?')} "
              f"{s.get('precision', '')}, profile {s.get('profile') or '-'}, power mode "
              f"{s.get('power_mode') or 'unavailable'}, requests {s.get('requests', 0)}; cloud sees: "
              f"{cloud_view.get('power_mode', '-') or '-'} γ={1e3 * cloud_view.get('draft_s', 0.0):.1f} ms")


def local_keys(inv: dict, directory: Path) -> None:
    """CurveZMQ keys for a local fleet's cloud and devices (in `directory`), written into its inventory."""
    edge = inv["all"]["children"]["edge"]["hosts"]
    cloud_keys, device_keys = ephemeral(directory, list(edge))
    inv["all"]["children"]["cloud"]["hosts"]["cloud"].update(hatspec_curve_secret=cloud_keys.secret_key,
                                                             hatspec_curve_allow=cloud_keys.allow_dir)
    for name, host in edge.items():
        host.update(hatspec_curve_secret=device_keys[name].secret_key,
                    hatspec_curve_server_key=device_keys[name].server_key)


def _local(args) -> int:
    import yaml  # the fleet extra

    if args.action == "down":
        fleet = LocalFleet.attach(args.dir)
        names = [d.name for d in fleet.devices]
        fleet.close()
        print(f"hat-fleet local: removed {', '.join(names) or 'nothing'}")
        return 0
    reason = unavailable()
    if reason:
        print(f"hat-fleet local: {reason}", file=sys.stderr)
        return 1
    fleet = LocalFleet(args.k, directory=args.dir).start()  # left running: `local down` stops it
    fleet.save()
    inv = fleet.inventory(sys.executable, hatspec_model=args.model, hatspec_profile=args.profile,
                          hatspec_power_mode=get_profile(args.profile).default.name)
    local_keys(inv, Path(args.dir) / "keys")
    inv["all"]["children"]["cloud"]["hosts"]["cloud"].update(hatspec_model=args.model,
                                                             hatspec_run_dir=str(Path(args.dir) / "cloud"))
    path = Path(args.dir) / "inventory.yml"
    path.write_text(yaml.safe_dump(inv, sort_keys=False))
    print(f"hat-fleet local: {args.k} devices ({', '.join(d.address for d in fleet.devices)}); inventory {path}")
    return 0
