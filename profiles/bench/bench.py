"""`hat-bench`: the benchmarks, one subcommand each (`hat-bench speculative` is profiles/bench/bench_speculative.py;
every other subcommand names its module below). Every report is written through profiles.bench.provenance, which
stamps the commit, the command and the machine.
"""
from __future__ import annotations

import argparse
import sys

from profiles.bench.bench_cuhlm import add_parser as add_cuhlm_parser
from profiles.bench.bench_cuhlm import run as run_cuhlm
from profiles.bench.bench_curve import add_parser as add_curve_parser
from profiles.bench.bench_curve import run as run_curve
from profiles.bench.bench_edge import add_parser as add_edge_parser
from profiles.bench.bench_edge import run as run_edge
from profiles.bench.bench_engines import add_parser as add_engines_parser
from profiles.bench.bench_eta_tail import add_parser as add_eta_tail_parser
from profiles.bench.bench_eta_tail import run as run_eta_tail
from profiles.bench.bench_engines import run as run_engines
from profiles.bench.bench_fleet import add_parser as add_fleet_parser
from profiles.bench.bench_fleet import run as run_fleet
from profiles.bench.bench_gpu import add_parser as add_gpu_parser
from profiles.bench.bench_gpu import run as run_gpu
from profiles.bench.bench_hat import add_parser as add_hat_parser
from profiles.bench.bench_hat import run as run_hat
from profiles.bench.bench_memory import add_parser as add_memory_parser
from profiles.bench.bench_memory import run as run_memory
from profiles.bench.bench_auto import add_parser as add_auto_parser
from profiles.bench.bench_auto import run as run_auto
from profiles.bench.bench_capacity import add_parser as add_capacity_parser
from profiles.bench.bench_capacity import run as run_capacity
from profiles.bench.plan import add_parser as add_plan_parser
from profiles.bench.plan import run as run_plan
from profiles.bench.bench_qs import add_parser as add_qs_parser
from profiles.bench.bench_qs import run as run_qs
from profiles.bench.bench_speculative import add_hf_phase_parser, hf_phase
from profiles.bench.bench_speculative import add_parser as add_speculative_parser
from profiles.bench.bench_speculative import run as run_speculative
from profiles.bench.bench_tasks import add_parser as add_tasks_parser
from profiles.bench.bench_tasks import run as run_tasks
from profiles.bench.fuzz import add_parser as add_fuzz_parser
from profiles.bench.fuzz import run as run_fuzz
from profiles.bench.resummarise import add_parser as add_resummarise_parser
from profiles.bench.resummarise import run as run_resummarise
from profiles.bench.soak import add_parser as add_soak_parser
from profiles.bench.soak import run as run_soak
from profiles.bench.bench_verify import add_parser as add_verify_parser
from profiles.bench.bench_verify import run as run_verify

RUNS = {"speculative": run_speculative, "cuhlm": run_cuhlm, "qs": run_qs, "hat": run_hat, "fleet": run_fleet,
        "edge": run_edge, "engines": run_engines, "fuzz": run_fuzz, "soak": run_soak, "gpu": run_gpu,
        "tasks": run_tasks, "curve": run_curve, "resummarise": run_resummarise, "verify": run_verify,
        "memory": run_memory, "plan": run_plan, "auto": run_auto,
        "capacity": run_capacity, "eta-tail": run_eta_tail}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hat-bench", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    for add in (add_speculative_parser, add_cuhlm_parser, add_qs_parser, add_hat_parser, add_fleet_parser,
                add_gpu_parser, add_edge_parser, add_engines_parser, add_fuzz_parser, add_soak_parser,
                add_tasks_parser, add_curve_parser, add_resummarise_parser, add_verify_parser, add_memory_parser,
                add_plan_parser, add_auto_parser, add_capacity_parser, add_eta_tail_parser, add_hf_phase_parser):
        add(sub)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "_hf-phase":
        return hf_phase(args)
    try:
        return RUNS[args.command](args)
    except ValueError as exc:
        print(f"hat-bench {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
