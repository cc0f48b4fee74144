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
    assert F.cloud_argv(inv.cloud)[4:6] == ["--model", "qwen"] and "--dashboard-port" not in F.cloud_argv(inv.cloud)
    watched = json.loads(json.dumps(INVENTORY))
    watched["all"]["children"]["cloud"]["hosts"]["gpu-box"].update(hatspec_dashboard_port=8090,
                                                                    hatspec_metrics_port=9100)
    argv = F.cloud_argv(F.load_inventory(_write(tmp_path, watched)).cloud)
    assert argv[argv.index("--dashboard-port") + 1] == "8090" and argv[argv.index("--metrics-port") + 1] == "9100"
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
    from testbed.netns_fleet import unavailable

    return unavailable()


@pytest.mark.netns
@pytest.mark.real_models
@pytest.mark.skipif(_fleet_reason() is not None, reason=str(_fleet_reason()))
def test_fleet_up_status_logs_down_on_namespace_devices(smollm2, tmp_path):
    """Three namespace "Jetsons" (sshd each): `up` starts the cloud and an agent per device over ssh (the power mode
    cannot be set off a Jetson: recorded, not fatal), each agent reports its profile to the cloud; a request served
    by one agent shows in `status` (its drafting delay reaches the cloud); `down` leaves no agent or cloud process,
    and closing the local fleet leaves no namespace."""
    from testbed.netns_fleet import LocalFleet

    with LocalFleet(3, prefix="hsg", net=79, directory=tmp_path / "fleet") as local:
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
                   " data=json.dumps({'prompt': 'def add(a, b):', 'max_tokens': 8, 'temperature': 0}).encode())); "
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
            assert "hat-edge serve: hsg-dev2" in F.logs(inv, "hsg-dev2")["hsg-dev2"]
        finally:
            stopped = F.down(inv, grace_s=10)
        assert all(text.startswith(("stopped", "killed")) for text in stopped.values()), stopped
        assert F.main(["status", path]) == 1  # everything is down now
        assert not [d.name for d in inv.devices if F._alive(d, "edge")] and not F._alive(inv.cloud, "cloud")
        # this fleet's processes only (another test's agents may run beside it)
        left = subprocess.run(["pgrep", "-f", "edge_runtime.cli serve .*--device-id hsg-dev|cloud_runtime.cli serve "
                                           "--model smollm2-135m --bind tcp://0.0.0.0:5599"], capture_output=True,
                              text=True).stdout
        assert not left.strip(), left
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "hsg-dev" not in names
    assert not os.path.exists(tmp_path / "fleet" / "id_ed25519")  # the fleet's keys went with it


def test_up_refuses_a_device_whose_hatspec_or_protocol_differs_with_the_fix(tmp_path):
    """Versions are read through each host's hatspec_python before anything starts: a device reporting another
    hatspec version, and one with no hatspec at all, are named with the hat-flash --software command that fixes it."""
    from hat_split.version import describe

    mine = describe()
    older = tmp_path / "older-python"
    older.write_text("#!/bin/sh\necho '" + json.dumps({**mine, "hatspec": "0.0.9", "protocol": mine["protocol"] - 1})
                     + "'\n")
    older.chmod(0o755)
    cloud = F.Host("cloud", {"ansible_connection": "local", "hatspec_python": sys.executable})
    devices = [F.Host("jp5", {"ansible_connection": "local", "hatspec_python": str(older)}),
               F.Host("bare", {"ansible_connection": "local", "hatspec_python": str(tmp_path / "no-python")}),
               F.Host("same", {"ansible_connection": "local", "hatspec_python": sys.executable})]
    with pytest.raises(RuntimeError) as err:
        F.up(F.Inventory(cloud, devices), log=lambda *_: None, inventory_path="fleet.yml")
    text = str(err.value)
    assert f"device jp5: hatspec 0.0.9 (the cloud: {mine['hatspec']}); protocol version {mine['protocol'] - 1}" in text
    assert "device bare: no hatspec at" in text and "device same" not in text
    assert "hat-flash --software --inventory fleet.yml --limit jp5" in text
    assert "/opt/hatspec/venv/bin/python" in text
    assert not (tmp_path / "run").exists()  # nothing was started
    ok = F.check_versions(F.Inventory(cloud, devices[2:]))
    assert ok["same"]["hatspec"] == mine["hatspec"]


@pytest.mark.netns
@pytest.mark.real_models
@pytest.mark.skipif(_fleet_reason() is not None, reason=str(_fleet_reason()))
def test_software_on_a_namespace_device_then_its_agent_serves(smollm2_bundle, tmp_path):
    """A namespace "Jetson" (sshd, its own /opt/hatspec): `hat-flash --software --inventory` (export/deploy/
    software.yml) with Python 3.10 installs hatspec from wheels into /opt/hatspec/venv (no torch there); `hat-flash
    --software root@device` then finds it up to date over ssh and does nothing; the bundle is flashed; `hat-fleet up`
    with the device on that venv starts its agent, which answers an OpenAI completion; after the device's hatspec
    version is changed, `up` refuses it with the fix."""
    import shutil

    from export.deploy import flash_cli
    from export.deploy.flash import Target, flash
    from export.deploy.software import local_python
    from testbed.netns_fleet import LocalFleet

    base = local_python("3.10")
    if base is None:
        pytest.skip("no Python 3.10 interpreter here (pyenv install 3.10)")
    if shutil.which("ansible-playbook") is None:
        pytest.skip("ansible-core is not installed (the fleet extra)")
    with LocalFleet(1, prefix="hsw", net=81, directory=tmp_path / "fleet") as local:
        dev = local.devices[0]
        venv_py = "/opt/hatspec/venv/bin/python"
        inv_dict = local.inventory(sys.executable, cloud_port=5598, hatspec_bundle_dir="/opt/hatspec/bundle",
                                   hatspec_backend="onnxruntime", hatspec_precision="fp32",
                                   hatspec_edge_args=["--threads", "1"], hatspec_base_python=base)
        inv_dict["all"]["vars"]["hatspec_plaintext"] = True
        inv_dict["all"]["children"]["edge"]["hosts"][dev.name]["hatspec_python"] = venv_py
        inv_dict["all"]["children"]["cloud"]["hosts"]["cloud"].update(
            hatspec_model="smollm2-135m", hatspec_run_dir=str(tmp_path / "cloud"),
            hatspec_cloud_args=["--threads", "1", "--dtype", "float32"])
        path = _write(tmp_path, inv_dict)
        first = subprocess.run([sys.executable, "-m", "export.deploy.flash_cli", "--software", "--inventory", path,
                                "--quiet", "--json"], capture_output=True, text=True, timeout=900)
        assert first.returncode == 0, first.stderr[-3000:]
        done = json.loads(first.stdout[first.stdout.index("{"):])
        assert done[dev.name]["changed"] > 0 and done[dev.name]["extra"] == "edge-onnx", done
        ssh = [x for o in local.ssh_options()[2:] if o != "-o" for x in ("-o", o)]
        again = subprocess.run([sys.executable, "-m", "export.deploy.flash_cli", "--software",
                                f"root@{dev.address}:/opt/hatspec", "--python", base, "-i", str(local.key), *ssh,
                                "--quiet"], capture_output=True, text=True, timeout=300)
        assert again.returncode == 0 and "already installed: nothing to do" in again.stdout, again.stdout + again.stderr
        assert "engines: onnxruntime" in again.stdout and "Python 3.10." in again.stdout
        assert flash_cli.main(["--software", "--inventory", str(tmp_path / "missing.yml")]) == 2
        probe = subprocess.run(local.ssh(dev) + [f"{venv_py} -c 'import importlib.util as u; "
                                                 "print(u.find_spec(\"torch\"), u.find_spec(\"transformers\"))'"],
                               capture_output=True, text=True, timeout=60)
        assert probe.stdout.strip() == "None None", probe.stdout + probe.stderr
        flash(smollm2_bundle, Target.parse(f"root@{dev.address}:/opt/hatspec/bundle", local.ssh_options()),
              progress=False)
        inv = F.load_inventory(path)
        try:
            outcome = F.up(inv, timeout_s=300, log=lambda *_: None, inventory_path=path)
            assert outcome[dev.name]["state"] == "ready", outcome
            ask = ("import json, urllib.request as u; r = u.urlopen(u.Request('http://127.0.0.1:8642/v1/completions',"
                   " data=json.dumps({'model': 'x', 'prompt': 'def add(a, b):', 'max_tokens': 6, 'temperature': 0})"
                   ".encode(), headers={'Content-Type': 'application/json'})); b = json.load(r); "
                   "print(b['usage']['completion_tokens'], repr(b['choices'][0]['text']))")
            rc, out = inv.devices[0].run(f"{venv_py} -c {F._q(ask)}", timeout=120)
            assert rc == 0 and out.strip().startswith("6 "), out
        finally:
            F.down(inv, grace_s=10)
        rc, out = inv.devices[0].run("sed -i 's/^Version: .*/Version: 0.0.1/' "
                                     "/opt/hatspec/venv/lib/python3.10/site-packages/hatspec-*.dist-info/METADATA")
        assert rc == 0, out
        with pytest.raises(RuntimeError, match=rf"device {dev.name}: hatspec 0.0.1 \(the cloud: .*hat-flash "
                                               rf"--software --inventory {path} --limit {dev.name}"):
            F.up(inv, timeout_s=60, log=lambda *_: None, inventory_path=path)
        assert not F._alive(inv.cloud, "cloud")  # refused before the cloud was started
