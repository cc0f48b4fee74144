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
"""
from __future__ import annotations

from typing import Dict, List, Sequence

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
            "rounds_drafted": len(whole), "rounds_read": reads.rounds, "went_on": len(went),
            "went_on_read": reads.went_on(), "past_drafted": sum(r["sent"] - r["accepted"] - 1 for r in went),
            "past_text": text, "past_priced": priced,
            "sent_drafted": sum(r["sent"] for r in whole) / len(whole) if whole else 0.0,
            "sent_priced": (reads.sent + reads.past()) / reads.rounds if reads.rounds else 0.0}


def run(args) -> int:
    if args.depth < 2 or not 0.0 < args.eta < 1.0 or args.max_new_tokens < 2:
        raise ValueError(f"needs --depth >= 2, --eta in (0, 1) and --max-new-tokens >= 2, got {args.depth}, "
                         f"{args.eta}, {args.max_new_tokens}")
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
            rows.append({"prompt": p.source, **row})
            print(f"{p.source[:32]:32s} α {row['alpha_read']:.2f} went on {row['went_on']:2d} past it: drafted "
                  f"{row['past_drafted']:3d} text {row['past_text']:3d} priced {row['past_priced']:5.1f} | sent a "
                  f"round {row['sent_drafted']:.2f} priced {row['sent_priced']:.2f}", flush=True)
    total = {k: sum(r[k] for r in rows) for k in ("went_on", "past_drafted", "past_text", "past_priced")}
    print(f"all {len(rows)} prompts: {total['went_on']} rounds went on; past their rejected draft drafted "
          f"{total['past_drafted']}, the text's confidences {total['past_text']}, priced {total['past_priced']:.1f}")
    write_report(args.out, {"args": vars(args), "rows": rows, "total": total})
    return 0
