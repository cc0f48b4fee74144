"""Protocol auto's record: what a device's AutoEstimates learned, kept in a JSON file from run to run
(EdgeConfig.auto_record), so that a new runtime — each `hat-edge generate` is one — starts from what the device
measured before instead of measuring every protocol again (a fresh runtime's first request runs sd, llm and each
draft tree for MEASURE_ROUNDS rounds before it chooses: 0.78–0.85 × the llm row's pace on loopback here).

What it keeps is what outlives a link and a cloud's load: the drafting protocols' acceptance per kind of sampling
(the two models' agreement, the same on any hardware), the draft trees' tokens a round, the census requests' reads
of the answers (each token's agreement and the draft's confidence: what an η-ended chain would do), the device's own
times per power mode (draft step, catch-up, the device alone, round overheads and the rounds each was measured on),
the frames' bytes and the rounds observed per protocol. A field added since version 1 (ADDED) may be absent: an older
record is read with it empty; one it no longer keeps (DROPPED) is passed over, one it never kept refused. What it does
not keep is measured afresh by every runtime: the cloud's curve and load (the cloud reports them at each session's
opening), the link's round trip and rate, the cloud's speed drift, what ran recently.

A file holds one entry per (draft model, target model, vocabulary fingerprint, device profile): `pair_key`. The
entry's figures are checked field by field as the cloud's cost report is (finite, in range, of the right type); a
file or an entry that fails is not read (the runtime measures afresh, the reason logged with the field named) and a
file that cannot be parsed is never written over (`RecordFile.save`: its other entries are not lost).

`to_record` and `restore` are pure; `RecordFile` reads and writes the file.
"""
from __future__ import annotations

import dataclasses
import datetime
import logging
import math
import os
from typing import Any, Callable, Dict, List, Tuple

from edge_runtime.acceptance import Acceptance
from edge_runtime.auto_estimates import CENSUS_KEPT, DEVICE_TIMES, AutoEstimates, device_overhead
from hat_split.files import strict_json
from hat_split.files.atomic import write_json
from hat_split.math.chunking import DelayModel

log = logging.getLogger("hatspec.edge")

FORMAT = "hatspec.auto-record"
VERSION = 1
MAX_SECONDS = 1.0e4  # a device time or round overhead beyond this (s) is absurd
MAX_BYTES = 1.0e9  # a frame's bytes beyond this are absurd
MAX_COUNT = 10 ** 9

Decode = Callable[[str, Any], Any]


class RecordError(ValueError):
    """A record that cannot be read: the message names the field."""


def pair_key(draft: str, target: str, fingerprint: str, device_profile: str) -> str:
    """The entry of a record that a runtime reads and writes: its draft model, the cloud's target model (Welcome),
    their vocabulary's fingerprint and the device's profile ("" unnamed)."""
    return f"{draft} | {target} | {fingerprint} | {device_profile}"


# ---- decoding, each value checked (the path names the field in the error) ----

def _fail(path: str, why: str) -> RecordError:
    return RecordError(f"{path}: {why}")


def _real(lo: float, hi: float) -> Decode:
    def dec(path: str, v: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
            raise _fail(path, f"expected a finite number in [{lo:g}, {hi:g}], got {v!r}")
        return float(v)
    return dec


def _count(path: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_COUNT:
        raise _fail(path, f"expected a whole count in [0, {MAX_COUNT}], got {v!r}")
    return v


def _text(path: str, v: Any) -> str:
    if not isinstance(v, str) or len(v) > 200:
        raise _fail(path, f"expected a string of at most 200 characters, got {v!r}")
    return v


def _optional(dec: Decode) -> Decode:
    return lambda path, v: None if v is None else dec(path, v)


def _shape(path: str, v: Any) -> Tuple[int, int, int]:
    if not isinstance(v, list) or len(v) != 3 or any(isinstance(x, bool) or not isinstance(x, int) or not 1 <= x <= 4096
                                                     for x in v):
        raise _fail(path, f"expected a draft tree's [nodes, depth, width], each in 1..4096, got {v!r}")
    return (v[0], v[1], v[2])


def _tuple(*parts: Decode) -> Decode:
    def dec(path: str, v: Any) -> tuple:
        if not isinstance(v, list) or len(v) != len(parts):
            raise _fail(path, f"expected {len(parts)} values, got {v!r}")
        return tuple(part(f"{path}[{i}]", x) for i, (part, x) in enumerate(zip(parts, v)))
    return dec


def _table(key: Decode, value: Decode) -> Decode:
    """A dict written as a list of [key, value] (its keys may be tuples, which JSON objects cannot hold)."""
    def dec(path: str, v: Any) -> dict:
        if not isinstance(v, list) or len(v) > 10_000:
            raise _fail(path, f"expected a list of [key, value] of at most 10000, got {type(v).__name__}")
        out = {}
        for i, item in enumerate(v):
            if not isinstance(item, list) or len(item) != 2:
                raise _fail(f"{path}[{i}]", f"expected [key, value], got {item!r}")
            out[key(f"{path}[{i}].key", item[0])] = value(f"{path}[{i}].value", item[1])
        return out
    return dec


def _fields(cls, decoders: Dict[str, Decode]) -> Decode:
    """A dataclass written as an object of the fields `decoders` names, each present."""
    def dec(path: str, v: Any):
        if not isinstance(v, dict):
            raise _fail(path, f"expected an object, got {type(v).__name__}")
        missing = sorted(set(decoders) - set(v))
        if missing:
            raise _fail(f"{path}.{missing[0]}", "missing")
        return cls(**{name: d(f"{path}.{name}", v[name]) for name, d in decoders.items()})
    return dec


SECONDS = _real(0.0, MAX_SECONDS)
SIGNED_SECONDS = _real(-MAX_SECONDS, MAX_SECONDS)  # a busy cloud's round overhead is net of the wait it priced
BYTES = _real(0.0, MAX_BYTES)
TOKENS = _real(0.0, 1.0e6)
KIND = _tuple(_text, _text)  # (protocol, kind of sampling)
TREE = _tuple(_shape, _text)  # (shape, kind of sampling)
ACCEPTANCE = _fields(Acceptance, {"accepted": _optional(TOKENS), "examined": _optional(TOKENS), "rounds": _count,
                                  "opening_accepted": _optional(TOKENS), "opening_examined": _optional(TOKENS),
                                  "opening_rounds": _count})


def _delay(path: str, v: Any) -> DelayModel:
    """A DelayModel: its moving averages' weight, μ and (bucket, mean tokens, mean seconds) rows."""
    if not isinstance(v, dict) or set(v) != {"alpha", "mu", "buckets"}:
        raise _fail(path, f"expected an object of alpha, mu and buckets, got {v!r}")
    rows = _table(_count, _tuple(TOKENS, SECONDS))(f"{path}.buckets", v["buckets"])
    model = DelayModel(alpha=_real(0.0, 0.999999)(f"{path}.alpha", v["alpha"]))
    model.mu = _optional(TOKENS)(f"{path}.mu", v["mu"])
    model.buckets = dict(rows)
    return model


def _figures(path: str, v: Any) -> Dict[str, Any]:
    """A power mode's device figures (AutoEstimates.by_mode): the catch-up curve, the draft step and the device
    alone's in seconds, and the device's round overheads (signed: a busy cloud's are net of the wait it priced)."""
    raw = _table(_text, lambda where, x: x)(path, v)
    out = {}
    for i, (name, value) in enumerate(raw.items()):
        where = f"{path}[{i}].value"
        if name == "catch_up":
            out[name] = _delay(where, value)
        elif name in DEVICE_TIMES:
            out[name] = SECONDS(where, value)
        elif device_overhead(name):
            out[name] = SIGNED_SECONDS(where, value)
        else:
            raise _fail(f"{path}[{i}].key", f"{name!r} is not a device figure")
    return out


def _marks(path: str, v: Any) -> List[Tuple[Tuple[int, bool, float], ...]]:
    """The census requests' reads (AutoEstimates.census_marks): each a list of [position, agreed, confidence]."""
    if not isinstance(v, list) or len(v) > CENSUS_KEPT:
        raise _fail(path, f"expected a list of at most {CENSUS_KEPT} reads, got {v!r:.80}")
    out = []
    for i, read in enumerate(v):
        if not isinstance(read, list):
            raise _fail(f"{path}[{i}]", f"expected a list of marks, got {read!r:.80}")
        marks = []
        for j, m in enumerate(read):
            if not (isinstance(m, list) and len(m) == 3 and isinstance(m[1], bool)):
                raise _fail(f"{path}[{i}][{j}]", f"expected [position, agreed (true/false), confidence], got {m!r:.80}")
            marks.append((_count(f"{path}[{i}][{j}][0]", m[0]), m[1], _real(0.0, 1.0)(f"{path}[{i}][{j}][2]", m[2])))
        out.append(tuple(marks))
    return out


RECORDED: Dict[str, Decode] = {  # the AutoEstimates fields a record keeps (module docstring), each with its check
    "acceptance": _table(KIND, ACCEPTANCE),
    "draft_step_s": _optional(SECONDS),
    "draft_step_busy_s": _optional(SECONDS),
    "local_step_s": _optional(SECONDS),
    "overhead_s": _table(_text, SIGNED_SECONDS),
    "overhead_rounds": _table(_text, _count),
    "up_round": _optional(BYTES),
    "up_per_row": _table(KIND, BYTES),
    "down_round": _optional(BYTES),
    "down_per_token": _optional(BYTES),
    "measured": _table(_text, _count),
    "catch_up": _delay,
    "power_mode": _optional(_text),
    "restart": _table(_text, _count),  # a set: its names, each with 1
    "by_mode": _table(_text, _figures),
    "mode_rounds": _table(_text, _table(_text, _count)),
    "tree_tokens": _table(TREE, TOKENS),
    "tree_draft_steps": _table(_shape, TOKENS),
    "tree_step_tokens": _table(_shape, TOKENS),
    "tree_up_per_node": _table(TREE, BYTES),
    "tree_rounds": _table(TREE, _count),
    "tree_sent": _table(TREE, TOKENS),
    "tree_opening": _table(TREE, _tuple(TOKENS, _count)),
    "eta_chain": _table(TREE, _tuple(TOKENS, TOKENS, _count)),
    "eta_opening": _table(TREE, _tuple(TOKENS, TOKENS, _count)),
    "census_marks": _marks,
}
ADDED: Dict[str, Callable[[], Any]] = {  # fields added to RECORDED since version 1, each with its value where a
    "overhead_rounds": dict,  # record written before lacks it: its overheads then count as established
    "mode_rounds": dict,
    "draft_step_busy_s": lambda: None,  # an older record's draft step was measured in either state
    "census_marks": list,
}

DROPPED = ("eta_tail",)  # fields a record no longer keeps: an older record's are passed over (the η-chain's own
# rounds past a rejected draft, priced from the reads since stop 94: AutoEstimates.eta_chain_read)


# ---- encoding ----

def _plain(v: Any) -> Any:
    """A field's value as JSON holds it: dicts as lists of [key, value], tuples as lists, dataclasses as objects."""
    if isinstance(v, DelayModel):
        return {"alpha": v.alpha, "mu": v.mu, "buckets": [[b, list(row)] for b, row in sorted(v.buckets.items())]}
    if isinstance(v, Acceptance):
        return {f.name: getattr(v, f.name) for f in dataclasses.fields(v) if not f.name.startswith("request_")}
    if isinstance(v, set):
        return [[name, 1] for name in sorted(v)]
    if isinstance(v, dict):
        return [[_plain(k), _plain(x)] for k, x in v.items()]
    if isinstance(v, tuple):
        return [_plain(x) for x in v]
    return v


def to_record(est: AutoEstimates) -> Dict[str, Any]:
    """The fields of `est` a record keeps (RECORDED), as plain JSON values."""
    return {name: _plain(getattr(est, name)) for name in RECORDED}


def restore(est: AutoEstimates, record: Any, path: str = "estimates") -> None:
    """`record` (`to_record`'s) into `est`, every field checked first: on a RecordError (the field named: malformed,
    missing, or not one a record keeps) `est` is untouched; a field it no longer keeps (DROPPED) is passed over."""
    if not isinstance(record, dict):
        raise _fail(path, f"expected an object, got {type(record).__name__}")
    missing = sorted(set(RECORDED) - set(record) - set(ADDED))
    if missing:
        raise _fail(f"{path}.{missing[0]}", "missing")
    unknown = sorted(set(record) - set(RECORDED) - set(DROPPED))
    if unknown:
        raise _fail(f"{path}.{unknown[0]}", "not a field a record keeps")
    values = {name: dec(f"{path}.{name}", record[name]) for name, dec in RECORDED.items() if name in record}
    values.update({name: empty() for name, empty in ADDED.items() if name not in record})
    values["restart"] = set(values["restart"])
    for name, value in values.items():
        setattr(est, name, value)


class RecordFile:
    """A record file (EdgeConfig.auto_record): `load` a pair's entry into fresh estimates, `save` them back."""

    def __init__(self, path: str, software: str = "") -> None:
        self.path = os.path.expanduser(path)
        self.software = software
        self.unwritable = ""  # why the file must not be written over (it could not be parsed), once found

    def _read(self) -> Dict[str, Any]:
        """The file's entries by pair key ({} when it does not exist); RecordError when it cannot be parsed."""
        try:
            with open(self.path, encoding="utf-8") as f:
                text = f.read()
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise RecordError(f"cannot read it: {exc}") from None
        try:
            data = strict_json.loads(text)
        except ValueError as exc:
            raise RecordError(f"not JSON: {exc}") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise RecordError(f"format: not a {FORMAT} file")
        if data.get("version") != VERSION:
            raise RecordError(f"version: {data.get('version')!r}, this device reads version {VERSION}")
        entries = data.get("pairs")
        if not isinstance(entries, dict):
            raise RecordError("pairs: expected an object")
        return entries

    def load(self, key: str, est: AutoEstimates) -> bool:
        """`key`'s entry into `est`; False (logged, `est` untouched) when the file has none or cannot be read."""
        try:
            entries = self._read()
        except RecordError as exc:
            self.unwritable = str(exc)
            log.warning("auto: the record %s was not read (%s); measuring afresh, and not writing over it", self.path,
                        exc)
            return False
        entry = entries.get(key)
        if entry is None:
            return False
        try:
            if not isinstance(entry, dict):
                raise _fail(key, "expected an object")
            restore(est, entry.get("estimates"), f"pairs[{key!r}].estimates")
        except RecordError as exc:
            log.warning("auto: the record %s has a bad entry (%s): measuring afresh", self.path, exc)
            return False
        log.info("auto: estimates of %s from the record %s (written %s)", key, self.path, entry.get("written", "?"))
        return True

    def save(self, key: str, est: AutoEstimates) -> bool:
        """`est` as `key`'s entry, the file's other entries kept; False (logged) when the file cannot be parsed (it
        is left as it is) or written."""
        try:
            entries = self._read()
        except RecordError as exc:
            if not self.unwritable:
                log.warning("auto: the record %s cannot be parsed (%s): not writing over it", self.path, exc)
            self.unwritable = str(exc)
            return False
        written = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        entries[key] = {"written": written, "software": self.software, "estimates": to_record(est)}
        try:
            folder = os.path.dirname(self.path)
            if folder:
                os.makedirs(folder, exist_ok=True)
            write_json(self.path, {"format": FORMAT, "version": VERSION, "pairs": entries}, indent=1)
        except OSError as exc:
            log.warning("auto: the record %s could not be written: %s", self.path, exc)
            return False
        return True
