"""`hat-bench eta-tail`: what an η-chain sends past its rejected draft, drafted for real against what auto prices.

Auto prices the greedy η-chain (a chain of up to `--depth` drafts that `--eta` ends, HAT eq. 5) from the draft
model's reads of llm's tokens (AutoEstimates.eta_chain_read over draft_stop.eta_chain_over_text): the reads say
exactly what a round commits and whether it goes on past its first rejected draft, but past it the chain drafts along
its own text, which no read sees. For each prompt this command

1. has the cloud (the target, `hat-cloud serve` on loopback) answer greedily with protocol llm: the text;
2. reads that text with the draft model in one forward, as a census reads it (each position: whether the draft's
   argmax named the token, that argmax's plain softmax probability);
3. runs the η-chain's rounds over it for real: from each round's start the draft model drafts along its own tokens,
   one forward a draft, until a draft below η or the depth, and the text says how many are accepted;

and compares, over the rounds that went on past their rejected draft (both runs agree on those within the reads'
numerics), the drafts they sent past it: drafted for real, the text's own confidences standing in for the draft's
(what auto priced before stop 94), and `EtaReads.past` (the geometric tail at the draft's confidence after its own
tokens, what it prices now). Then drafts sent a round, for real and as priced from the prompt's own reads. The last
round of a text, cut by its end, is left out of both. Temperature 0: the same text and drafts every run.

Last, each prompt priced as auto prices a request from the census's texts (AutoEstimates.eta_chain_read): the
other prompts' reads the census's, the prompts' α their mean agreement, and the request's own reads of its answer's
first `--own-reads` tokens (0: none; each value its own column), its tokens and drafts a round with the texts
weighed by the request's evidence and alike (before), against the drafted rounds'.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from edge_runtime.config import EdgeConfig, EngineConfig
from edge_runtime.request import GenerationRequest
from hat_split.math.draft_stop import eta_chain_over_text, eta_tail
from hat_split.math.sampling import SamplingParams, softmax_prob
from hat_split.prompt_sets import calibration_prompts, demo_prompts
from profiles.bench.provenance import write_report
from profiles.bench.rig import Rig


def add_parser(sub) -> None:
    s = sub.add_parser("eta-tail", help="an η-chain's drafts past its rejected draft: drafted for real vs priced")
    s.add_argument("--draft", default="qwen2.5-coder-0.5b")
    s.add_argument("--target", default="qwen2.5-coder-1.5b")
    s.add_argument("--engine", default="llamacpp", choices=("llamacpp", "torch"))
    s.add_argument("--demo-prompts", type=int, default=8, help="the demo's prompts (hat_split.prompt_sets)")
    s.add_argument("--calibration-prompts", type=int, default=8, help="and the calibration set's")
    s.add_argument("--max-new-tokens", type=int, default=48)
    s.add_argument("--depth", type=int, default=8)
    s.add_argument("--eta", type=float, default=0.4)
    s.add_argument("--threads", type=int, default=1)
    s.add_argument("--own-reads", default="0,8,16,32,48",
                   help="the request's own reads priced with, in tokens (comma list)")
    s.add_argument("--out", default="results/auto/eta_tail.json")


def text_tail(agreed: Sequence[bool], confidence: Sequence[float], at: int, room: int, eta: float) -> int:
    """Drafts past a rejected draft at `at - 1` with room for `room` more, were the draft's confidences along its own
    text the read text's (each sent; the first below η ends them; the text's end too)."""
    sent = 0
    while sent < room and at + sent < len(agreed):
        sent += 1
        if confidence[at + sent - 1] < eta:
            break
    return sent


def drafted_rounds(lm, prompt: List[int], text: List[int], depth: int, eta: float) -> List[Dict[str, int]]:
    """The η-chain's rounds over `text` for real: each drafts along its own tokens from the committed text, one
    forward a draft (greedy), until a draft below η (still sent) or `depth`; it commits its accepted drafts and the
    text's next token. Each round: where it started, drafts sent, accepted."""
    state = lm.new_state()
    lm.forward(state, prompt[:-1], n_logits=0)
    committed, i, rounds = list(prompt), 0, []
    while i < len(text):
        base, feed, drafts = state.length, committed[state.length:], []
        for _ in range(depth):
            logits = np.asarray(lm.forward(state, feed, n_logits=1))
            token = int(logits[0].argmax())
            drafts.append(token)
            feed = [token]
            if softmax_prob(logits, np.array([token]))[0] < eta:
                break
        accepted = 0
        while accepted < len(drafts) and i + accepted < len(text) and drafts[accepted] == text[i + accepted]:
            accepted += 1
        rounds.append({"at": i, "sent": len(drafts), "accepted": accepted})
        lm.crop(state, base)
        committed += text[i:i + accepted + 1]
        i += accepted + 1
    return rounds


def compare(agreed: Sequence[bool], confidence: Sequence[float], rounds: Sequence[Dict[str, int]], depth: int,
            eta: float) -> Dict[str, float]:
    """One prompt's figures: over the drafted rounds whole in the text, those that went on past their rejected draft
    (`went_on`) and their drafts past it for real (`past_drafted`), with the text's confidences (`past_text`) and as
    priced (`past_priced`, `EtaReads.past` at this text's own reads); drafts sent a round, for real over those whole
    rounds and as priced from the reads (`sent_drafted`, `sent_priced`)."""
    n = len(agreed)
    reads = eta_chain_over_text(agreed, confidence, depth, eta)
    whole = [r for r in rounds if r["at"] + r["sent"] <= n and r["at"] + r["accepted"] < n]
    went = [r for r in whole if r["accepted"] < r["sent"] - 1]
    onward = reads.sure / reads.onward if reads.onward else 0.0
    priced = sum(eta_tail(onward, depth - r["accepted"] - 1) for r in went)
    text = sum(text_tail(agreed, confidence, r["at"] + r["accepted"] + 1, depth - r["accepted"] - 1, eta)
               for r in went)
    return {"tokens": n, "alpha_read": float(np.mean(agreed)) if n else 0.0, "onward": onward,
            "tokens_drafted": sum(r["accepted"] + 1 for r in whole) / len(whole) if whole else 0.0,
            "rounds_drafted": len(whole), "rounds_read": reads.rounds, "went_on": len(went),
            "went_on_read": reads.went_on(), "past_drafted": sum(r["sent"] - r["accepted"] - 1 for r in went),
            "past_text": text, "past_priced": priced,
            "sent_drafted": sum(r["sent"] for r in whole) / len(whole) if whole else 0.0,
            "sent_priced": (reads.sent + reads.past()) / reads.rounds if reads.rounds else 0.0}


def census_priced(marks: Sequence[Sequence[Tuple[int, bool, float]]], j: int, own: int, depth: int, eta: float,
                  weigh: bool) -> Optional[Tuple[float, float]]:
    """Prompt j's η-chain (tokens, drafts sent) a round as auto prices a request from the census's texts
    (AutoEstimates.eta_chain_read): the other prompts' reads the census's, the prompts' α their mean agreement
    (long measured), the request past its opening with its own reads of its first `own` tokens; `weigh`: the texts
    weighed by the request's evidence, else alike."""
    from edge_runtime.acceptance import Acceptance
    from edge_runtime.auto_estimates import GREEDY, AutoEstimates

    others = [tuple(m) for i, m in enumerate(marks) if i != j and m]
    agreed = sum(sum(1 for x in m if x[1]) for m in others) / max(1, sum(len(m) for m in others))
    est = AutoEstimates()
    est.acceptance[("sd", GREEDY)] = Acceptance(accepted=agreed, examined=1.0, rounds=10 ** 9)
    est.census_marks = others
    est.begin_request(GREEDY)
    est.opening = False
    read = list(marks[j][:own])
    if read:
        est.observe_agreement(sum(1 for x in read if x[1]), len(read), read)
    return est.eta_chain_read(depth, eta, weigh=weigh)


def run(args) -> int:
    if args.depth < 2 or not 0.0 < args.eta < 1.0 or args.max_new_tokens < 2:
        raise ValueError(f"needs --depth >= 2, --eta in (0, 1) and --max-new-tokens >= 2, got {args.depth}, "
                         f"{args.eta}, {args.max_new_tokens}")
    try:
        owns = [int(x) for x in str(args.own_reads).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--own-reads: token counts separated by commas, got {args.own_reads!r}") from None
    if not owns or any(n < 0 for n in owns):
        raise ValueError(f"--own-reads: at least one token count, each >= 0, got {args.own_reads!r}")
    prompts = demo_prompts(args.demo_prompts) + calibration_prompts(args.calibration_prompts)
    if not prompts:
        raise ValueError("no prompts: --demo-prompts and --calibration-prompts are both 0")
    rows = []
    with Rig(args.target, cloud_args=["--engine", args.engine], threads=args.threads, link="loopback") as rig:
        config = EdgeConfig(model=args.draft, link=rig.link_config(link_policy="wait"),
                            engine=EngineConfig(backend=args.engine, threads=args.threads))
        rt = rig.runtime(config)
        lm = rt.engine.token_lm(config)
        for p in prompts:
            prompt = rt.encode_prompt(p.text, p.chat)
            text = rt.run(GenerationRequest(p.text, "llm", SamplingParams(0.0), args.max_new_tokens, seed=0,
                                            chat=p.chat)).tokens
            state = lm.new_state()
            lm.forward(state, prompt[:-1], n_logits=0)
            logits = np.asarray(lm.forward(state, [prompt[-1]] + text[:-1], n_logits=len(text)))
            named = logits.argmax(-1)
            agreed, confidence = list(named == np.asarray(text)), list(softmax_prob(logits, named))
            row = compare(agreed, confidence, drafted_rounds(lm, prompt, text, args.depth, args.eta), args.depth,
                          args.eta)
            rows.append({"prompt": p.source, **row, "marks": [[i, bool(a), float(c)] for i, (a, c)
                                                              in enumerate(zip(agreed, confidence))]})
            print(f"{p.source[:32]:32s} α {row['alpha_read']:.2f} went on {row['went_on']:2d} past it: drafted "
                  f"{row['past_drafted']:3d} text {row['past_text']:3d} priced {row['past_priced']:5.1f} | sent a "
                  f"round {row['sent_drafted']:.2f} priced {row['sent_priced']:.2f}", flush=True)
    total = {k: sum(r[k] for r in rows) for k in ("went_on", "past_drafted", "past_text", "past_priced")}
    print(f"all {len(rows)} prompts: {total['went_on']} rounds went on; past their rejected draft drafted "
          f"{total['past_drafted']}, the text's confidences {total['past_text']}, priced {total['past_priced']:.1f}")
    total["census"] = census_table(rows, owns, args.depth, args.eta)
    write_report(args.out, {"args": vars(args), "rows": rows, "total": total})
    return 0


def census_table(rows: List[dict], owns: Sequence[int], depth: int, eta: float) -> Dict[str, dict]:
    """Each prompt priced from the others' texts (`census_priced`) beside its drafted rounds, for each count of its
    own reads, weighed and alike; into each row (`census`) and, per count and way, the mean absolute error over the
    prompts of tokens and of drafts sent a round (in %, relative to the drafted) and the error of their sums over
    the prompts (a bias: `tokens_summed`, `sent_summed`), printed."""
    marks = [[tuple(m) for m in r["marks"]] for r in rows]
    out: Dict[str, dict] = {}
    for own in owns:
        for way in ("weighed", "alike"):
            errs: Dict[str, List[float]] = {"tokens": [], "sent": []}
            sums = np.zeros(4)  # priced tokens, priced sent, drafted tokens, drafted sent
            for j, r in enumerate(rows):
                got = census_priced(marks, j, own, depth, eta, way == "weighed")
                r.setdefault("census", {})[f"{way}_{own}"] = list(got) if got else None
                if got and r["tokens_drafted"] and r["sent_drafted"]:
                    errs["tokens"].append(abs(got[0] / r["tokens_drafted"] - 1))
                    errs["sent"].append(abs(got[1] / r["sent_drafted"] - 1))
                    sums += (got[0], got[1], r["tokens_drafted"], r["sent_drafted"])
            key = f"{way}_{own}"
            out[key] = {k: 100 * float(np.mean(v)) if v else None for k, v in errs.items()}
            out[key].update(n=len(errs["sent"]), tokens_summed=100 * (sums[0] / sums[2] - 1) if sums[2] else None,
                            sent_summed=100 * (sums[1] / sums[3] - 1) if sums[3] else None)
        w, a = out[f"weighed_{own}"], out[f"alike_{own}"]
        if not w["n"]:  # the others' texts held fewer whole rounds than auto prices from (ALPHA_BASE_ROUNDS)
            print(f"own reads {own:3d}: not priced (the other prompts' texts hold too few whole rounds)")
            continue
        print(f"own reads {own:3d}: tokens / sent a round, mean |error| (summed): weighed {w['tokens']:.1f} "
              f"({w['tokens_summed']:+.1f}) / {w['sent']:.1f} ({w['sent_summed']:+.1f}) %, alike {a['tokens']:.1f} "
              f"({a['tokens_summed']:+.1f}) / {a['sent']:.1f} ({a['sent_summed']:+.1f}) % (n = {w['n']} prompts)")
    return out
