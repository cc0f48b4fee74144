"""hat-flash (issue 7): bundles onto namespace "devices" over real ssh (testbed.netns_fleet), one by one and
as a fleet through the Ansible playbook; verified on the device, idempotent, and refused when the bundle is damaged."""
from __future__ import annotations

import shutil
import subprocess
import types

import pytest

from hat_split.files import bundle as M

pytestmark = pytest.mark.netns


@pytest.fixture(scope="module")
def fleet():
    from testbed.netns_fleet import LocalFleet, unavailable

    why = unavailable()
    if why:
        pytest.skip(f"no local namespace fleet: {why}")
    with LocalFleet(2, prefix="hsf", net=78) as f:
        yield f
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "hsf-dev" not in out  # nothing left behind


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    pytest.importorskip("onnxruntime", reason="the export extra is not installed")
    from export.config import ExportConfig
    from export.onnx_export import export_bundle
    from tests.test_export import PROMPTS
    from tests.test_hat import _family

    out = tmp_path_factory.mktemp("flash-bundle")
    export_bundle(types.SimpleNamespace(model=_family("llama"), tokenizer=None, name="tiny-llama"),
                  ExportConfig("tiny-llama", str(out), "draft", precisions=("fp32", "int8")), prompts=PROMPTS,
                  progress=False)
    return out


def _device_sums(fleet, dev, path):
    out = subprocess.run(fleet.ssh(dev) + [f"cd {path} && sha256sum $(find . -type f | sort)"], capture_output=True,
                         text=True).stdout
    return {name[2:]: digest for digest, name in (line.split("  ", 1) for line in out.splitlines())}


def test_flash_two_devices_lands_verified_files_and_a_second_flash_sends_nothing(fleet, bundle):
    from export.deploy.flash import Target, bundle_files, flash

    files = bundle_files(bundle)
    targets = [Target.parse(f"root@{d.address}:/opt/hatspec/bundle", fleet.ssh_options()) for d in fleet.devices]
    first = [flash(bundle, t, progress=False) for t in targets]
    for r in first:
        assert r.verified and sorted(r.sent_files) == sorted(files)
        assert r.sent_bytes == sum((bundle / f).stat().st_size for f in files)
    sums = [_device_sums(fleet, d, "/opt/hatspec/bundle") for d in fleet.devices]
    assert sums[0] == sums[1] == files  # identical, verified, nothing else left there (no .incoming)
    again = [flash(bundle, t, progress=False) for t in targets]
    assert all(r.verified and r.sent_files == [] and r.sent_bytes == 0 for r in again)
    # a file damaged on one device: only that file goes again
    subprocess.run(fleet.ssh(fleet.devices[0]) + ["sh -c 'echo x >> /opt/hatspec/bundle/draft.int8.onnx.data'"],
                   check=True)
    repair = flash(bundle, targets[0], progress=False)
    assert repair.sent_files == ["draft.int8.onnx.data"] and repair.verified


def test_a_damaged_bundle_is_refused_before_anything_is_sent(fleet, bundle, tmp_path, capsys):
    from export.deploy.flash_cli import main

    bad = tmp_path / "bad"
    shutil.copytree(bundle, bad)
    with open(bad / "draft.fp32.onnx.data", "r+b") as f:
        f.write(b"\0\0\0\0")
    dev = fleet.devices[1]
    opts = sum((["-o", o] for o in fleet.ssh_options()[3::2]), [])
    assert main([str(bad), f"root@{dev.address}:/opt/hatspec/damaged", "-i", str(fleet.key), *opts, "--quiet"]) == 2
    assert "does not match its checksum" in capsys.readouterr().err
    probe = subprocess.run(fleet.ssh(dev) + ["test -e /opt/hatspec/damaged"], capture_output=True)
    assert probe.returncode != 0  # nothing was created on the device
    assert main([str(bundle), "--quiet"]) == 2
    assert "give devices or --inventory" in capsys.readouterr().err


def test_fleet_flash_through_ansible_is_verified_and_idempotent(fleet, bundle, tmp_path):
    if shutil.which("ansible-playbook") is None:
        pytest.skip("ansible-core is not installed (the fleet extra)")
    from export.deploy.flash import bundle_files, flash_fleet

    inv = tmp_path / "inventory.yml"
    hosts = "".join(f"    {d.name}:\n      ansible_host: {d.address}\n" for d in fleet.devices)
    inv.write_text("all:\n  hosts:\n" + hosts + "  vars:\n    ansible_user: root\n"
                   f"    ansible_ssh_private_key_file: {fleet.key}\n"
                   "    ansible_ssh_common_args: -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null\n"
                   "    ansible_python_interpreter: /usr/bin/python3\n    hatspec_bundle_dir: /opt/hatspec/fleet\n")
    first = flash_fleet(bundle, inv)
    assert set(first) == {d.name for d in fleet.devices} and all(r["changed"] > 0 for r in first.values())
    files = bundle_files(bundle)
    for d in fleet.devices:
        assert _device_sums(fleet, d, "/opt/hatspec/fleet") == files
    second = flash_fleet(bundle, inv)
    assert all(r["changed"] == 0 for r in second.values())
    bad = tmp_path / "bad.yml"
    # a host that refuses ssh at once (a closed port here) rather than one that times out: the same failure, 10 s sooner
    bad.write_text(inv.read_text().replace(f"ansible_host: {fleet.devices[1].address}\n",
                                           "ansible_host: 127.0.0.1\n      ansible_port: 9\n"))
    with pytest.raises(Exception, match="fleet flash failed on"):
        flash_fleet(bundle, bad)
    assert M.load(bundle)  # the local bundle is untouched

