"""A long trace's report continued where it stopped (`hat-bench auto --resume`), pure: no models, no processes.

`hat-bench auto` runs for an hour or two at the issue's repetitions, and a run that dies (a killed session, a full
disk, a crash in its 90th minute) kept nothing until it finished. It now writes its report after every cell (one
phase of one repetition: every protocol's request on that phase's prompt, the unit its ratios pair), marked
`complete: false` until the last. `--resume` reads that report, keeps its complete cells and runs only the others; a
larger `--repetitions` extends a finished report the same way.

A resumed report mixes two processes' rows, so it is continued only where they measure the same thing: the same
commit and uncommitted files, the same machine (CPU model, SIMD features, core count) and the same arguments but
`--out`, `--resume` and `--repetitions`. Anything else is refused before a model loads, naming what differs, and the
file is left as it was. What is not carried over: a runtime's memory (auto's estimates, the engines' caches), so a
resumed auto starts afresh at the next cell unless `--auto-record` keeps its estimates (written after each of its
requests, read by the new runtime); each invocation's provenance is kept in `runs`.
"""
from __future__ import annotations

import json
import os
from typing import Dict, Iterable, List, Optional, Set, Tuple

Cell = Tuple[int, str]  # (repetition, phase name)
FREE_ARGS = ("out", "resume", "repetitions")  # what a resumed run may change
SAME_MACHINE = ("cpu_model", "simd", "cpus")  # a machine's fields two runs of one report must share


def cells_done(rows: Iterable[dict], protocols: List[str]) -> Set[Cell]:
    """The cells that hold a row of every protocol (a cell cut short by a crash holds fewer: it is run again)."""
    seen: Dict[Cell, Set[str]] = {}
    for r in rows:
        seen.setdefault((r["rep"], r["phase"]), set()).add(r["protocol"])
    return {cell for cell, names in seen.items() if set(protocols) <= names}


def kept_rows(rows: Iterable[dict], done: Set[Cell]) -> List[dict]:
    """The rows of complete cells, in their order."""
    return [r for r in rows if (r["rep"], r["phase"]) in done]


def differences(earlier: dict, now: dict, free: Iterable[str] = FREE_ARGS) -> List[str]:
    """`key: earlier → now` for every key of either dict but `free` whose values differ (a missing key: None)."""
    free = set(free)
    return [f"{k}: {earlier.get(k)!r} → {now.get(k)!r}" for k in sorted((set(earlier) | set(now)) - free)
            if earlier.get(k) != now.get(k)]


def check(report: dict, path: str, args: dict, here: dict, repo: str = "") -> None:
    """ValueError naming why `report` (read from `path`) cannot be continued by a run of `args` on `here` (the
    current provenance: git_commit, dirty, machine; dirty paths relative to `repo`, the report's own file among
    them left out: a tracked report changes as it is written)."""
    ran = report.get("provenance") or {}
    own = os.path.abspath(path)
    before, after = ([d for d in (p.get("dirty") or []) if os.path.abspath(os.path.join(repo, d)) != own]
                     for p in (ran, here))
    if ran.get("git_commit") != here.get("git_commit") or sorted(before) != sorted(after):
        raise ValueError(f"--resume: {path} ran on commit {ran.get('git_commit')} (uncommitted: "
                         f"{before or 'none'}), this is {here.get('git_commit')} (uncommitted: {after or 'none'}): "
                         "rows of two codes are not one trace; run without --resume (another --out) or from that "
                         "commit")
    was, now = ran.get("machine") or {}, here.get("machine") or {}
    moved = differences({k: was.get(k) for k in SAME_MACHINE}, {k: now.get(k) for k in SAME_MACHINE}, free=())
    if moved:
        raise ValueError(f"--resume: {path} ran on another machine ({'; '.join(moved)}): its speeds are not this "
                         "one's")
    changed = differences(report.get("args") or {}, args)
    if changed:
        raise ValueError(f"--resume: {path} ran with other arguments ({'; '.join(changed)}); only "
                         f"{', '.join('--' + a.replace('_', '-') for a in FREE_ARGS)} may change")
    held = max((r["rep"] for r in report.get("rows") or []), default=-1) + 1
    if held > args["repetitions"]:
        raise ValueError(f"--resume: {path} holds {held} repetitions, more than --repetitions {args['repetitions']}")


def load(path: str, args: dict, here: dict, repo: str = "") -> Optional[dict]:
    """The report at `path` to continue, checked (`check`); None when there is none (the run starts afresh).
    ValueError when it cannot be read or continued; the file is never changed here."""
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            report = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--resume: {path} cannot be read as a report ({exc}); it is left as it is") from None
    rows = report.get("rows") if isinstance(report, dict) else None
    if not isinstance(rows, list) or not all(
            isinstance(r, dict) and isinstance(r.get("rep"), int) and isinstance(r.get("phase"), str)
            and isinstance(r.get("protocol"), str) for r in rows):
        raise ValueError(f"--resume: {path} is not a hat-bench auto report (rows with rep, phase and protocol); it "
                         "is left as it is")
    check(report, path, args, here, repo)
    return report
