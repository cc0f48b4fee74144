"""Operating points of the skipping protocols for `hat-bench tasks`: names like `uhlm@answer:0.5`, and the
accuracy-vs-skip-rate curve they make with each point matched to the random-skip point of the nearest skip rate.

A name is a protocol of the bench (`uhlm`, `cuhlm_online`, `randhlm`, …) alone, or one of the skipping ones with an
operating point after `@`:

| point | meaning (edge_runtime.config.UncertaintyConfig) |
|---|---|
| `u:T` | skip when u <= T (U-HLM's rule, a fixed threshold) |
| `answer:E` | at most E expected would-be-rejected skips per answer, on the calibrated line (skip_rule answer) |
| `answer-refit:E` | the same on the line refitted online from the uploads' verdicts (refit, explore 5 %) |
| `token-refit:R` | a risk R per token on the refitted line (skip_rule threshold with refit) |
| `p:P` | randhlm: skip with probability P (U-HLM's random baseline) |
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Iterable, List, Mapping, Optional, Tuple

from edge_runtime.config import UncertaintyConfig

SKIPPING = ("uhlm", "cuhlm", "randhlm")  # protocols (not bench names) that skip uploads
POINTS = {  # kind: (the protocols it applies to, overrides from the value)
    "u": (("uhlm", "cuhlm"), lambda v: {"u_threshold": v}),
    "answer": (("uhlm", "cuhlm"), lambda v: {"skip_rule": "answer", "answer_risk": v}),
    "answer-refit": (("uhlm", "cuhlm"), lambda v: {"skip_rule": "answer", "answer_risk": v, "refit": True}),
    "token-refit": (("uhlm", "cuhlm"), lambda v: {"refit": True, "token_risk": v}),
    "p": (("randhlm",), lambda v: {"random_skip_prob": v}),
}
# fields of UncertaintyConfig added after records were first written: left out of a record's config at their defaults,
# so that records written before them still match a run with the same settings
LATER_FIELDS = ("skip_rule", "answer_risk", "refit", "token_risk", "explore", "refit_memory")


def resolve(name: str, protocols: Mapping[str, Tuple[str, dict]]) -> Tuple[str, dict]:
    """(protocol, UncertaintyConfig overrides) of a bench name with or without an operating point; ValueError that
    says what is wrong with it."""
    if name in protocols:
        return protocols[name]
    base, at, point = name.partition("@")
    if not at or base not in protocols:
        raise ValueError(f"unknown protocol {name!r}; choose from {', '.join(protocols)}, or one of the skipping ones "
                         f"with an operating point (e.g. uhlm@answer:0.5; kinds: {', '.join(POINTS)})")
    protocol, overrides = protocols[base]
    kind, _, value = point.partition(":")
    if kind not in POINTS:
        raise ValueError(f"{name!r}: unknown operating point {kind!r}; choose from {', '.join(POINTS)}")
    applies, make = POINTS[kind]
    if protocol not in applies:
        raise ValueError(f"{name!r}: the point {kind!r} applies to {', '.join(applies)}, not {protocol}")
    try:
        v = float(value)
    except ValueError:
        raise ValueError(f"{name!r}: the point needs a number after {kind}:, got {value!r}") from None
    overrides = {**overrides, **make(v)}
    try:
        UncertaintyConfig(**overrides)
    except ValueError as exc:
        raise ValueError(f"{name!r}: {exc}") from None
    return protocol, overrides


def resolve_all(text: str, protocols: Mapping[str, Tuple[str, dict]]) -> List[str]:
    """The comma-separated names in `text`, each checked by `resolve`."""
    out = [x.strip() for x in text.split(",") if x.strip()]
    for name in out:
        resolve(name, protocols)
    return out


def record_config(unc: UncertaintyConfig) -> dict:
    """The uncertainty settings a record carries (LATER_FIELDS left out at their defaults)."""
    d = dataclasses.asdict(unc)
    default = UncertaintyConfig()
    for f in LATER_FIELDS:
        if d[f] == getattr(default, f):
            del d[f]
    return d


def rank(name: str, protocols: Mapping[str, Tuple[str, dict]]) -> Tuple[int, str]:
    """Sort key: the bench's protocol order, then the name."""
    order = list(protocols)
    base = name.partition("@")[0]
    return (order.index(base) if base in order else len(order), name)


def curve(summary: Dict[str, Dict[str, dict]], protocols: Mapping[str, Tuple[str, dict]],
          baseline: str = "llm") -> Dict[str, List[dict]]:
    """{task: points} of every skipping name in a summary (profiles.bench.task_scoring.summarise), ordered by skip
    rate: name, protocol, skip rate, score, n and the paired difference vs the baseline."""
    out: Dict[str, List[dict]] = {}
    for task, entries in summary.items():
        points = []
        for name, e in entries.items():
            protocol = resolve(name, protocols)[0]
            if protocol in SKIPPING and e.get("skip_rate") is not None:
                points.append({"name": name, "protocol": protocol, "skip_rate": e["skip_rate"], "n": e["n"],
                               "score": e["score"]["mean"], "diff_vs_" + baseline: e.get("diff_vs_" + baseline)})
        out[task] = sorted(points, key=lambda p: p["skip_rate"])
    return out


def nearest_random(points: Iterable[dict], skip_rate: float) -> Optional[dict]:
    """The randhlm point whose skip rate is closest to skip_rate (None without one)."""
    randoms = [p for p in points if p["protocol"] == "randhlm"]
    return min(randoms, key=lambda p: abs(p["skip_rate"] - skip_rate)) if randoms else None
