"""`hat-profile`: device profiles, this board's power modes and power sampling, and the power × latency sweep.

    hat-profile list                       the packaged device profiles
    hat-profile show agx-orin-64gb         one profile: modes, memory, JetPack / Python / TensorRT
    hat-profile validate FILE.toml ...     check profile files (exit 1 and the reason on the first bad one)
    hat-profile detect                     which board this is, its L4T release and power mode
    hat-profile mode [ID|NAME]             query (or, as root on a Jetson, set) the nvpmodel power mode
    hat-profile sample --seconds 5         the sampler this machine gets, what it cannot measure, and readings
    hat-profile sweep --modes all --backends torch,onnxruntime:int4 --bundle DIR --draft-lengths 1,4,8
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import List, Optional

from profiles.bench.profile_sweep import add_arguments, run
from hardware import device_profiles as D
from hardware import jetson_control as J
from hardware.power import BackendUnavailable, open_sampler
from hat_split.files import strict_json


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="hat-profile", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the packaged device profiles")
    s = sub.add_parser("show", help="one device profile")
    s.add_argument("name")
    s.add_argument("--jetpack", default="", help="the JetPack release whose software to show (default: newest)")
    s = sub.add_parser("validate", help="check profile files")
    s.add_argument("files", nargs="+")
    sub.add_parser("detect", help="which board this is")
    s = sub.add_parser("mode", help="query or set the power mode")
    s.add_argument("mode", nargs="?", default="")
    s.add_argument("--profile", default="", help="profile that names the modes (default: detected)")
    s.add_argument("--reboot", action="store_true", help="allow a mode that needs a reboot (the board reboots)")
    s = sub.add_parser("sample", help="power and load sampling on this machine")
    s.add_argument("--seconds", type=float, default=3.0)
    s.add_argument("--interval-s", type=float, default=0.5)
    s = sub.add_parser("sweep", help="power mode × draft backend × draft length: speed and energy (JSON + PNG)")
    add_arguments(s)
    args = parser.parse_args(argv)
    try:
        if args.command == "list":
            for name in D.list_profiles():
                p = D.get_profile(name)
                print(f"{name:22s} {p.module:32s} {p.memory_gb:4d} GB  JetPack {', '.join(p.jetpack):22s} "
                      f"modes: {', '.join(m.name for m in p.modes)} (default {p.default.name})")
        elif args.command == "show":
            p = D.get_profile(args.name)
            sw = p.software(args.jetpack or None)
            print(f"{p.module} ({p.part}, {p.soc}, compute capability {p.compute_capability}): {p.memory_gb} GB "
                  f"at {p.memory_bandwidth_gbs:g} GB/s, {p.cpu_cores} × {p.cpu}, {p.gpu}")
            print("decodes slower than one cloud GPU by the bandwidth ratio: " + ", ".join(
                f"{g.name} {D.speed_ratio(p, key):.2f}x" for key, g in D.cloud_gpus().items()))
            print(f"JetPack {sw.version}: L4T {sw.l4t}, Ubuntu {sw.ubuntu}, Python {sw.python}, CUDA {sw.cuda}, "
                  f"TensorRT {sw.tensorrt}, cuDNN {sw.cudnn} (runs {', '.join(p.jetpack)})")
            print(f"nvpmodel ({p.nvpmodel_conf}), default {p.default.id} {p.default.name}:")
            for m in p.modes:
                extra = [f"{m.cpus} CPUs" if m.cpus else "", f"CPU ≤ {m.cpu_max_khz / 1e6:.2f} GHz" if m.cpu_max_khz
                         else "", f"GPU ≤ {m.gpu_max_hz / 1e6:.0f} MHz" if m.gpu_max_hz else "",
                         "reboot to switch" if m.reboot else ""]
                budget = f"{m.watts:g} W" if m.watts else "no budget"
                print(f"  {m.id} {m.name:18s} {budget:10s} {', '.join(e for e in extra if e)}")
            print(f"power rails: {', '.join(p.power_rails)} (module power: "
                  f"{'rail ' + p.input_rail if p.input_rail else 'their sum'})")
            if p.note:
                print(f"note: {p.note}")
        elif args.command == "validate":
            for f in args.files:
                p = D.load_profile(f)
                print(f"{f}: ok ({p.module}, {len(p.modes)} modes)")
        elif args.command == "detect":
            try:
                modes = J.list_modes()
            except J.JetsonControlError:
                modes = None
            board = J.detect_board(modes=modes)
            print(f"{board.model}; L4T {board.l4t or 'unknown'}; profile {board.profile or 'unknown'}")
            name, mode = J.query_mode()
            print(f"power mode {mode} {name}")
        elif args.command == "mode":
            if not args.mode:
                name, mode = J.query_mode()
                print(f"{mode} {name}")
            else:
                profile = D.get_profile(args.profile or J.detect_board().profile or "")
                m = profile.mode(args.mode)
                name, mode = J.set_mode(m.id, reboot=args.reboot)
                print(f"now {mode} {name}")
        elif args.command == "sample":
            sampler = open_sampler(interval_s=args.interval_s)
            print(strict_json.dumps(sampler.describe(), indent=1))
            with sampler:
                t0 = time.perf_counter()
                time.sleep(args.seconds)
                t1 = time.perf_counter()
            for r in sampler.readings:
                print(strict_json.dumps({k: v for k, v in vars(r).items() if v not in (None, {}, [])}))
            print(strict_json.dumps({"window": sampler.window(t0, t1)}))
        elif args.command == "sweep":
            return run(args)
    except (D.ProfileError, J.JetsonControlError, BackendUnavailable, ValueError) as exc:
        print(f"hat-profile {args.command}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
