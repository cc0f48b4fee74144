"""`hat-bench resummarise FILE...`: a stored report's summary recomputed from its own per-request records with the
current code's summariser and interval rule (profiles.bench.stats), without rerunning anything.

A report whose intervals rest on fewer than 8 values was written with a percentile bootstrap, which over 2 or 3 values
is the min and the max. This reads the records the report kept (`hat-bench hat`: every request of every row;
`hat-bench engines`: every sample alone and every prompt of every hybrid run; `hat-bench auto`: every request of every
phase), summarises them again with the bench's own `summarise` (and Table 4 for hat), and writes the result into the
same file under KEY (default "resummarised"), beside the original summary, with the provenance of the recomputation and
the rule. Nothing else in the file changes, except that the file is written as strict JSON: a non-finite number (a
report written before hat_split.files.strict_json wrote `NaN`) becomes null, and how many did is recorded under
"strict_json" with the rewrite's provenance. `--strict-only` does only that, for a report of any bench.
"""
from __future__ import annotations

import json
import math
import sys
from typing import Callable, Dict

from hat_split.files.atomic import write_json
from hat_split.files.provenance import provenance
from profiles.bench import bench_auto, bench_engines, bench_hat
from profiles.bench.stats import MIN_BOOTSTRAP_N

RULE = (f"profiles.bench.stats.mean_ci: a percentile bootstrap (10000 resamples, seed 0) from n = {MIN_BOOTSTRAP_N} "
        f"values, a Student-t interval for 2 <= n < {MIN_BOOTSTRAP_N}, none below 2; 95 %")


def _hat(report: dict) -> dict:
    tables = {link: bench_hat.summarise(entry["runs"]) for link, entry in report["links"].items()}
    table4 = bench_hat.table4({"tables": tables, "links": report["links"],
                               "trained_parameters": report.get("trained_parameters")})
    return {"tables": tables, "table4": table4}


def _auto(report: dict) -> dict:
    protocols = list(dict.fromkeys(r["protocol"] for r in report["rows"]))  # the first repetition runs them in order
    phases = [bench_auto.Phase(**p) for p in report["phases"]]
    return {"summary": bench_auto.summarise(report["rows"], phases, protocols)}


def _engines(report: dict) -> dict:
    return {"summary": bench_engines.summarise(report["alone"], report["hybrid"], report["max_new_tokens"])}


def kind(report: dict) -> str:
    """Which bench wrote `report`, from the records it keeps."""
    if "links" in report and "tables" in report and "table4" in report:
        return "hat"
    if {"alone", "hybrid", "summary"} <= set(report):
        return "engines"
    if {"phases", "rows", "summary"} <= set(report):
        return "auto"
    raise ValueError("not a report whose records this can summarise again (hat-bench hat, engines or auto)")


SUMMARISERS: Dict[str, Callable[[dict], dict]] = {"hat": _hat, "engines": _engines, "auto": _auto}


def resummarise(report: dict) -> dict:
    """{"rule", "bench", <the recomputed summary>} of `report`'s stored records."""
    bench = kind(report)
    return {"rule": RULE, "bench": bench, **SUMMARISERS[bench](report)}


def non_finite(obj) -> int:
    """How many non-finite numbers `obj` (a parsed report) holds."""
    if isinstance(obj, float):
        return int(not math.isfinite(obj))
    if isinstance(obj, dict):
        return sum(non_finite(v) for v in obj.values())
    if isinstance(obj, list):
        return sum(non_finite(v) for v in obj)
    return 0


def add_parser(sub) -> None:
    s = sub.add_parser("resummarise", help="recompute stored reports' summaries from their records with the current "
                                           "code's summariser and interval rule; written into each file under --key")
    s.add_argument("files", nargs="+", help="reports of hat-bench hat, engines or auto (JSON)")
    s.add_argument("--key", default="resummarised", help="where in each file the recomputed summary goes")
    s.add_argument("--strict-only", action="store_true",
                   help="only rewrite each report as strict JSON (any bench's: NaN becomes null, counted)")


def run(args) -> int:
    for path in args.files:
        with open(path, encoding="utf-8") as f:
            report = json.load(f)
        if args.key in ("provenance", "summary", "tables", "table4"):
            raise ValueError(f"--key {args.key} would overwrite the run's own {args.key}")
        nulls = non_finite(report)
        if not args.strict_only:
            report[args.key] = {**resummarise(report), "from": "the records stored in this file",
                                "provenance": provenance()}
            print(f"hat-bench resummarise: {path}: {report[args.key]['bench']} summary recomputed under "
                  f"{args.key!r}", file=sys.stderr)
        if nulls:
            report["strict_json"] = {"non_finite_written_as_null": nulls, "provenance": provenance()}
            print(f"hat-bench resummarise: {path}: {nulls} non-finite numbers written as null", file=sys.stderr)
        write_json(path, report, indent=1)
    return 0
