"""Fleet launch (issue 8): inventories, and `hat-fleet up / status / logs / down` against network-namespace devices
running sshd (root), with the real smollm2-135m as the cloud's model and the devices' draft."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from export.deploy import fleet as F

INVENTORY = {"all": {"vars": {"hatspec_python": "python3", "hatspec_plaintext": True}, "children": {
    "cloud": {"hosts": {"gpu-box": {"ansible_host": "10.0.0.1", "ansible_user": "ops", "hatspec_model": "qwen"}}},
    "edge": {"vars": {"hatspec_bundle_dir": "/opt/hatspec/bundle", "hatspec_precision": "int4"}, "hosts": {
        "orin-1": {"ansible_host": "10.0.0.11", "ansible_port": 2222, "hatspec_server": "tcp://10.0.0.1:5555",
                   "hatspec_profile": "agx-orin-64gb", "hatspec_power_mode": "MODE_50W"},
        "xavier-1": {"ansible_host": "10.0.0.12", "hatspec_server": "tcp://10.0.0.1:5555",
                     "hatspec_profile": "agx-xavier-32gb", "hatspec_power_mode": 7,
                     "hatspec_model": "smollm2-135m"}}}}}}


def _write(tmp_path, inv) -> str:
    path = tmp_path / "inventory.yml"
    path.write_text(yaml.safe_dump(inv))
    return str(path)


def test_inventory_reads_hosts_and_builds_the_commands(tmp_path):
    inv = F.load_inventory(_write(tmp_path, INVENTORY))
    assert inv.cloud.name == "gpu-box" and [d.name for d in inv.devices] == ["orin-1", "xavier-1"]
    orin = inv.devices[0]
    assert orin.command("true")[:1] == ["ssh"] and "-p" in orin.command("true") and "ops" not in orin.command("x")[-2]
    argv = F.edge_argv(orin)
    assert argv[:4] == ["python3", "-m", "edge_runtime.cli", "serve"]
    assert argv[argv.index("--bundle") + 1] == "/opt/hatspec/bundle" and "--device-profile" in argv
    assert argv[argv.index("--precision") + 1] == "int4"
    assert F.cloud_argv(inv.cloud)[4:6] == ["--model", "qwen"]
    cycling = json.loads(json.dumps(INVENTORY))
    cycling["all"]["children"]["edge"]["hosts"]["xavier-1"].update(hatspec_mode_cycle=[2, "MODE_30W_ALL"],
                                                                     hatspec_mode_every=3)
    argv = F.edge_argv(F.load_inventory(_write(tmp_path, cycling)).devices[1])
    assert argv[argv.index("--mode-cycle") + 1] == "2,MODE_30W_ALL" and argv[argv.index("--mode-every") + 1] == "3"
    assert inv.cloud.command("true")[-2] == "ops@10.0.0.1"


@pytest.mark.parametrize("edit,error", [
    (lambda i: i["all"]["children"].pop("cloud"), "needs a `cloud` group"),
    (lambda i: i["all"]["children"]["edge"]["hosts"]["orin-1"].pop("hatspec_server"), "orin-1: hatspec_server"),
    (lambda i: i["all"]["children"]["edge"]["hosts"]["orin-1"].update(hatspec_power_mode="MODE_99W"),
     "orin-1: agx-orin-64gb has no power mode 'MODE_99W'"),
    (lambda i: i["all"]["children"]["edge"]["hosts"]["orin-1"].update(hatspec_profile="jetson-9000"),
     "unknown device profile"),
    (lambda i: i["all"]["children"]["cloud"]["hosts"]["gpu-box"].pop("hatspec_model"), "the cloud needs hatspec_model"),
    (lambda i: i["all"]["children"]["edge"]["hosts"]["xavier-1"].update(hatspec_mode_cycle=[2, "MODE_50W"]),
     "xavier-1: agx-xavier-32gb has no power mode 'MODE_50W'"),
    (lambda i: i["all"]["children"]["edge"].pop("vars"), "orin-1: give hatspec_bundle_dir or hatspec_model"),
    (lambda i: i["all"]["vars"].pop("hatspec_plaintext"), "cloud gpu-box: the link is CurveZMQ: give"),
])
def test_a_bad_inventory_is_refused_with_the_host_named(tmp_path, edit, error):
    inv = json.loads(json.dumps(INVENTORY))
    edit(inv)
    with pytest.raises(F.InventoryError, match=error):
        F.load_inventory(_write(tmp_path, inv))


def _fleet_reason():
    from profiles.testbed.netns_fleet import unavailable

    return unavailable()


@pytest.mark.netns
@pytest.mark.real_models
@pytest.mark.skipif(_fleet_reason() is not None, reason=str(_fleet_reason()))
def test_fleet_up_status_logs_down_on_namespace_devices(smollm2, tmp_path):
    """Three namespace "Jetsons" (sshd each): `up` starts the cloud and an agent per device over ssh (the power mode
    cannot be set off a Jetson: recorded, not fatal), each agent reports its profile to the cloud; a request served
    by one agent shows in `status` (its drafting delay reaches the cloud); `down` leaves no agent or cloud process,
    and closing the local fleet leaves no namespace."""
    from profiles.testbed.netns_fleet import LocalFleet

    with LocalFleet(3, prefix="hsf", net=79, directory=tmp_path / "fleet") as local:
        inv_dict = local.inventory(sys.executable, cloud_port=5599, hatspec_model="smollm2-135m",
                                   hatspec_profile="agx-orin-64gb", hatspec_power_mode="MODE_30W",
                                   hatspec_edge_args=["--threads", "1"])
        inv_dict["all"]["children"]["cloud"]["hosts"]["cloud"].update(
            hatspec_model="smollm2-135m", hatspec_run_dir=str(tmp_path / "cloud"),
            hatspec_bind="tcp://0.0.0.0:5599", hatspec_cloud_args=["--threads", "1", "--dtype", "float32"])
        F.local_keys(inv_dict, tmp_path / "keys")  # the fleet's link is CurveZMQ with an allow-list
        path = _write(tmp_path, inv_dict)
        inv = F.load_inventory(path)
        try:
            outcome = F.up(inv, timeout_s=300, log=lambda *_: None)
            assert all(outcome[d.name]["state"] == "ready" for d in inv.devices)
            assert all(not outcome[d.name]["power_mode_set"] and "not a Jetson" in outcome[d.name]["power_mode"]
                       for d in inv.devices)
            dev = inv.devices[0]
            ask = ("import json, urllib.request as u; r = u.urlopen(u.Request('http://127.0.0.1:8642/hatspec/generate',"
                   " data=json.dumps({'prompt': 'def add(a, b):', 'max_tokens': 8}).encode())); "
                   "print(json.load(r)['n_tokens'])")
            rc, out = dev.run(f"{sys.executable} -c {F._q(ask)}", timeout=120)
            assert rc == 0 and out.strip().endswith("8"), out
            agent = F._status_file(dev, "edge")
            assert agent["requests"] == 1 and agent["draft_s"] > 0 and agent["profile"] == "agx-orin-64gb"
            dev_ids = set()

            def cloud_knows():
                seen = {d["device_id"]: d for d in (F._status_file(inv.cloud, "cloud") or {}).get("devices", [])}
                dev_ids.update(seen)
                return all(d.name in seen for d in inv.devices) and seen[dev.name].get("draft_s", 0) > 0

            assert F._wait(cloud_knows, 30), dev_ids
            report = F.status(inv)
            assert report["cloud"]["alive"] and all(d["alive"] for d in report["devices"].values())
            assert F.main(["status", path]) == 0
            assert "hat-edge serve: hsf-dev2" in F.logs(inv, "hsf-dev2")["hsf-dev2"]
        finally:
            stopped = F.down(inv, grace_s=10)
        assert all(text.startswith(("stopped", "killed")) for text in stopped.values()), stopped
        assert F.main(["status", path]) == 1  # everything is down now
        assert not [d.name for d in inv.devices if F._alive(d, "edge")] and not F._alive(inv.cloud, "cloud")
        left = subprocess.run(["pgrep", "-f", "edge_runtime.cli serve|cloud_runtime.cli serve --model smollm2-135m "
                                           "--bind tcp://0.0.0.0:5599"], capture_output=True, text=True).stdout
        assert not left.strip(), left
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "hsf-dev" not in names
    assert not os.path.exists(tmp_path / "fleet" / "id_ed25519")  # the fleet's keys went with it
