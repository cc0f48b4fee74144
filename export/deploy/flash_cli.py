"""`hat-flash`: put a hat-export bundle on devices over ssh, verified on each device; a second flash sends nothing.

    hat-flash BUNDLE DEVICE...            DEVICE = [user@]host[:port][:/absolute/path] (default /opt/hatspec/bundle)
    hat-flash BUNDLE --inventory INV.yml  a fleet, through export/deploy/flash.yml (ansible-playbook)
    hat-flash --config flash.toml         a FlashConfig (docs/CONFIG.md); a bundle, devices or flags given here win
    hat-flash --software DEVICE...        install this checkout's hatspec on devices (DEVICE path: the hatspec root,
                                          default /opt/hatspec; `local:/path` for this machine): a venv there with
                                          --system-site-packages, from wheels installed offline (export/deploy/software)
    hat-flash --software --inventory INV.yml   the same on every device of a hat-fleet inventory (or --limit NAME),
                                          through export/deploy/software.yml (ansible-playbook)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

from export.deploy.flash import FlashConfig, FlashError, flash, flash_fleet, ssh_args
from export.deploy.software import EXTRAS, install, install_fleet, parse_targets, summary
from hat_split.files.bundle import BundleError
from hat_split.files.config_file import add_config_argument, config_from_flags
from hat_split.files.settings import add_flags, overrides
from hat_split.files import strict_json


def _parser() -> argparse.ArgumentParser:
    """--config, the positionals (the bundle and devices), a flag for every other FlashConfig key
    (hat_split.files.settings; --software uses --inventory, --limit, -i and -o as well) and --software's own."""
    p = argparse.ArgumentParser(prog="hat-flash", description=__doc__.split("\n\n")[0])
    add_config_argument(p, "flash")
    p.add_argument("bundle", nargs="?", default="",
                   help="a hat-export bundle directory (checked before anything is sent; required without --config)")
    p.add_argument("devices", nargs="*", help="[user@]host[:port][:/absolute/path]")
    p.set_defaults(flag_keys=add_flags(p, FlashConfig))
    s = p.add_argument_group("software (--software)")
    s.add_argument("--software", action="store_true",
                   help="install hatspec itself (this checkout's wheel and its device extra) instead of a bundle")
    s.add_argument("--python", default="python3", help="the device's Python the venv is made with (default python3)")
    s.add_argument("--extra", default="edge-onnx", choices=EXTRAS,
                   help="edge-onnx: onnxruntime backend (JetPack's onnxruntime-gpu kept where present); edge-trt: "
                        "TensorRT backend (JetPack's TensorRT); edge: tokenizer only")
    s.add_argument("--wheel", default="", help="install this hatspec wheel instead of building one of the checkout")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print a JSON report")
    return p


def flash_config(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: Sequence[str]) -> FlashConfig:
    """The --config file with the bundle, devices and flags typed on this command line on top of it, or those
    alone."""
    typed = overrides(args, args.flag_keys)
    if args.bundle:
        typed["bundle"] = args.bundle
    if args.devices:
        typed["devices"] = tuple(args.devices)
    if not args.config and "bundle" not in typed:
        raise ValueError("give a bundle directory (or --config FILE naming one)")
    return config_from_flags(FlashConfig, args.config, typed)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _parser()
    args = parser.parse_args(argv)
    if args.software:
        return _software(args)
    try:
        config = flash_config(parser, args, argv)
        if config.inventory:
            report = flash_fleet(Path(config.bundle), Path(config.inventory), config.limit,
                                 " ".join(config.ssh_args()))
            for host, r in report.items():
                print(f"hat-flash: {host}: verified, {r['changed']} changed")
        else:
            report = {}
            for target in config.targets():
                r = flash(Path(config.bundle), target, progress=not args.quiet)
                report[r.target] = r.__dict__
                print(f"hat-flash: {r.target}: verified {r.files} files, sent {len(r.sent_files)} "
                      f"({r.sent_bytes / 2 ** 20:.1f} MB)")
        if args.json:
            print(strict_json.dumps(report, indent=1))
        return 0
    except (ValueError, FlashError, BundleError, OSError) as exc:  # a ConfigError is a ValueError
        print(f"hat-flash: error: {exc}", file=sys.stderr)
        return 2


def _software(args: argparse.Namespace) -> int:
    devices = [d for d in [args.bundle, *args.devices] if d]
    typed = overrides(args, args.flag_keys)  # FlashConfig's flags --software uses: devices through ssh, or a fleet
    inventory = typed.get("inventory", "")
    try:
        if bool(devices) == bool(inventory):
            raise ValueError("hat-flash --software: give devices or --inventory (one of the two)")
        ssh = ssh_args(typed.get("identity", ""), typed.get("ssh_options", ()))
        report = {}
        wheel = Path(args.wheel) if args.wheel else None
        if inventory:
            report = install_fleet(Path(inventory), args.extra, typed.get("limit", ""), tuple(ssh), wheel)
            for host, r in report.items():
                print(f"hat-flash: {host}: hatspec {r['hatspec']} (build {r['build']}, [{r['extra']}]) "
                      + ("installed" if r["changed"] else "already installed: nothing to do"))
        for target in parse_targets(devices, ssh):
            r = install(target, args.python, args.extra, wheel, progress=not args.quiet)
            print("\n".join(summary(r)))
            report[r.target] = r.__dict__
        if args.json:
            print(strict_json.dumps(report, indent=1))
        return 0
    except (ValueError, FlashError, OSError) as exc:
        print(f"hat-flash: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
