"""`--protocol auto`: the device chooses, per request and at every round boundary, among the exact protocols it can
run, by the cost model (hat_split.math.costmodel) fed with what it measured. No torch, no I/O: the session
(edge_runtime.sessions.auto) hands it each round's figures and asks it what to run next.

What it measures: edge_runtime.auto_estimates (`AutoEstimates`, one per runtime, kept from request to request).

How it chooses (`AutoController.decide`): a protocol not yet measured (a drafting one: under the request's kind of
sampling) runs `MEASURE_ROUNDS` rounds first (all are exact, so exploring costs only time; a runtime with a record,
EdgeConfig.auto_record, starts from what an earlier one measured: edge_runtime.auto_record); then the one with the most
predicted tokens/s, its draft length γ among 1 .. max_draft_len the best for sd and ksqs; the protocol running now
is kept unless another promises `SWITCH_GAIN` more, and a switch to a drafting protocol must also repay, over the
tokens the request has left, the draft model's catch-up on the tokens it has not read (`behind`: the prompt at the
opening when the device cannot prefill while the cloud does, the tokens llm made since). Where the device has cores
of its own (`overlap_prefill`) and reading is worth it (`worth_reading`: drafting within reach, `sd_within_reach`, or
within reach were the prompt as easy as its belief allows), the session reads those tokens into the draft model
while it waits for llm's replies, on a thread of its own (edge_runtime.read_ahead: no reply waits for a forward), so
the draft is ready when drafting comes back, and the request learns its own α. After a new power mode the device's
own figures are that mode's as measured before, or restart from their next observations; until then the draft step
and the device alone are the last mode's scaled by the board's slowdown as the first read in the new mode measured it
(the opening reads the prompt whatever auto runs next: `observe_catch_up`). A protocol that has not run for
`PROBE_EVERY` rounds of this runtime (across requests) runs one round so its acceptance and step costs stay
current, never as a request's first round, only while its price is within reach of the best (`_reaches`:
READ_AHEAD_REACH of it; below, a probe could switch only were the model 25 % off, more than its error here: on
loopback each probe of sd cost 7-15 % of a 32-token request where only llm ran, and under load a probe of llm, at
0.67× the η-tree, cost a round in 6 of 16 requests) and, for a drafting protocol, when its catch-up is one round's
tokens at most; llm's probe decodes one token (its round overhead and a step are what it measures,
and a chunk of c at llm's rate is c tokens at the slower protocol's: under load, where a step costs a second here, a
probe of 8 cost some 5 s of a 32-token request). What changes fast (the cloud's load, the link) needs no probe: the
cloud reports its cost curve and its queue with every session opening, the device's own points of that curve older than
`STALE_S`, or measured while the cloud's queue was in another state than it now reports (busy / idle), give way to
the report. Every switch is logged with its reason, and the segments (protocol, γ, tokens, rounds, reason) go into
the request's result.

A request with an SLA (`sla_tps`: GenerationRequest.sla_tokens_per_s) is chosen for the cloud instead: of every
protocol, knob and draft tree predicted at SLA_MARGIN times its pace or more, the one whose token adds the least cloud
compute (costmodel.marginal_cloud_s: its steps less the others' work they carry, from the cloud's report; `_keeping`),
kept unless another saves SWITCH_GAIN; the fastest when none keeps the pace. A request without an SLA is chosen the
same way for the cloud's fleet pace while the cloud asks for one (its operator's CloudConfig.fleet_pace_tokens_per_s,
in the report while other devices use it: `pace`).

Draft trees: when the device is configured for them (EdgeConfig.tree_nodes > 0, within the cloud's Welcome), sd's
candidates are the chains of γ and that tree (nodes N, depth D, width W), priced by `predict_tree` with the tokens
per round its own rounds committed (a moving average; a tree's acceptance has no closed form here) — before any,
with the chain of depth D's (1 − α^(D+1)) / (1 − α), the least a tree holding that chain commits — its drafting
time per round in draft steps, its round overhead, and its uplink bytes per node as measured. Once sd is measured
the tree runs MEASURE_ROUNDS rounds to be measured, and again after PROBE_EVERY rounds without it, each only while
it could win (`_could_win`): a tree not measured yet priced at the most it commits (its depth + 1 a round), a
measured one at its own rounds', within reach of the best.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from edge_runtime.auto_estimates import DRAFTING, GREEDY, AutoEstimates, Shape, tree_key, tree_text
from hat_split.math.costmodel import (CostCurve, Link, Prediction, marginal_cloud_s, over_horizon, predict,
                                      predict_tree)
from hat_split.math.sampling import SamplingParams

log = logging.getLogger("hatspec.edge")
DECISIONS = logging.getLogger("hatspec.auto.decisions")  # one DEBUG record a choice (its `auto_decision`: the
# choice, every candidate's price, the estimates it read) and one a round's tokens (`auto_tokens`); off unless a
# handler turns it on (`hat-bench auto --decisions`), so a request pays nothing for it

Candidates = Dict[str, List[Tuple[Optional[Shape], Prediction]]]  # per protocol: (tree shape or None, prediction)
AUTO_TOKEN = ("sd", "ksqs", "llm")  # the token protocols auto runs in one session (the exact ones the cost model
# prices; ksqs only when the request samples: at temperature 0 sd's rows are one-hot and as small)
AUTO_MAX_DRAFT = 8  # γ at most (and at most the cloud's max_draft_len)
SWITCH_GAIN = 1.10  # a switch must promise 10 % more tokens/s than the protocol last chosen (a measuring or probing
# round since binds nothing: `AutoController._chosen`; under a request's SLA: 10 % less cloud compute a token)
SLA_REASON = "at the least cloud compute a token"  # what a choice under a request's SLA says (metrics count it)
SLA_MARGIN = 1.15  # a protocol keeps a request's pace (sla_tokens_per_s) when predicted at this many times it: the
# model's error against what ran is within 15-20 % per phase here (docs/AUTO.md)
PREDICTED = "predicted"  # how the reason of a prediction's choice begins (`_why`; a measuring or probing round's
# does not) ...
OPENING = "opening"  # ... except at a request's opening, priced at the openings' acceptance (AutoEstimates.opening),
# whose reason begins "opening: predicted": a choice for the first round only, which binds nothing after it (`_chosen`)
LLM_EXPLORE_TOKENS = 1  # what llm's measuring and probing rounds decode: its round overhead and a step are all the
# model reads of llm, which one token measures as well as a chunk (a chunk under load costs seconds)
PROBE_EVERY = 24  # rounds (of this runtime, across requests) after which a protocol not run since gets one round
MEASURE_ROUNDS = 3  # rounds a protocol runs before its estimates are trusted (one round's acceptance is a coin)
READ_AHEAD_REACH = 0.8  # the draft model reads while the device waits only while sd's prediction is at least this
# share of the best protocol's: else the reading costs the device energy (and, where device and cloud share a memory
# bus, the cloud time) for a switch that is not coming


def auto_max_draft(max_draft_len: int) -> int:
    """The longest γ auto drafts (and its η-chain's length) under a cloud whose Welcome allows max_draft_len."""
    return min(max_draft_len, AUTO_MAX_DRAFT)


def auto_eligible(offered: Sequence[str], sampling: SamplingParams) -> List[str]:
    """The token protocols auto may run for a request sampling with `sampling` on a cloud offering `offered`: sd
    and llm; ksqs (exact, its drafts' rows as lattice codes) only when the request samples (at temperature 0 sd's
    rows are one-hot and as small as a code)."""
    return [p for p in AUTO_TOKEN if p in offered and (p != "ksqs" or sampling.temperature > 0)]


@dataclass(frozen=True)
class Choice:
    protocol: str
    knob: int  # γ for sd (a tree's nodes), the chunk for llm
    reason: str
    predicted: Dict[str, float]  # tokens/s predicted per protocol at its best knob (empty while exploring)
    tree: Optional[Shape] = None  # sd drafts this tree (nodes, depth, width) instead of a chain of γ
    eta: float = 0.0  # > 0: the tree is auto's η-chain, a chain of up to `knob` that η ends (AutoController.eta)


@dataclass
class Segment:
    """A stretch of one request under one protocol and knob."""

    protocol: str
    knob: int
    reason: str
    tokens: int = 0
    rounds: int = 0
    tree: Optional[Shape] = None
    eta: float = 0.0

    def as_dict(self) -> dict:
        out = {"protocol": self.protocol, "knob": self.knob, "tokens": self.tokens, "rounds": self.rounds,
               "reason": self.reason}
        if self.tree is not None:
            out["tree"] = list(self.tree)
        if self.eta:
            out["eta"] = self.eta
        return out


def _best(preds: List[Tuple[Optional[Shape], Prediction]]) -> Tuple[Optional[Shape], Prediction]:
    """The fastest of a protocol's candidates (tree shape or None, prediction); of equals, the shorter knob."""
    return max(preds, key=lambda sp: (sp[1].tokens_per_s, -sp[1].knob))


@dataclass
class AutoController:
    """One request's choices (module docstring) over the runtime's estimates."""

    estimates: AutoEstimates
    eligible: Sequence[str]  # the token protocols it may run (of AUTO_TOKEN)
    max_draft: int  # γ at most (the cloud's Welcome, the device's own limit)
    chunk: int  # llm's tokens per round
    prompt_tokens: int
    shares_host: bool = False
    trees: Sequence[Shape] = ()  # the draft trees sd may run (nodes, depth, width; within the cloud's limits)
    eta: float = 0.0  # > 0: the η-chain is a candidate (`eta_chain`)
    tree_eta: float = 0.0  # the device's draft_stop_prob, with which the configured `trees` run (> 0: η ends them)
    sla_tps: float = 0.0  # > 0: the request's pace (GenerationRequest.sla_tokens_per_s), kept at the least marginal
    # cloud compute a token (`_keeping`); 0: the fastest, or the cloud's fleet pace while it asks for one (`pace`)
    segments: List[Segment] = field(default_factory=list)

    def __post_init__(self) -> None:
        unknown = set(self.eligible) - set(AUTO_TOKEN)
        if unknown or not self.eligible:
            raise ValueError(f"auto chooses among {', '.join(AUTO_TOKEN)} in a token session, got "
                             f"{sorted(self.eligible)}")
        if self.max_draft < 1 or self.chunk < 1:
            raise ValueError(f"max_draft and chunk must be >= 1, got {self.max_draft}, {self.chunk}")
        if not 0.0 <= self.eta < 1.0:
            raise ValueError(f"η must be in [0, 1), got {self.eta}")
        if not (math.isfinite(self.sla_tps) and self.sla_tps >= 0):
            raise ValueError(f"the SLA's pace must be a finite number of tokens/s >= 0, got {self.sla_tps}")

    @property
    def pace(self) -> float:
        """The pace kept at the least cloud compute a token: the request's SLA; without one, the fleet pace the cloud
        asks of such requests while other devices use it (AutoEstimates.fleet_pace); 0: none, the fastest."""
        return self.sla_tps if self.sla_tps > 0 else self.estimates.fleet_pace

    def _pace_text(self) -> str:
        """The pace in words, and whose it is."""
        return f"{self.pace:g} tok/s" + ("" if self.sla_tps > 0 else " (the cloud's fleet pace)")

    @property
    def eta_chain(self) -> Optional[Shape]:
        """sd's η-chain: a chain of up to max_draft drafts that ends after a draft token whose probability is below
        `eta` (HAT eq. 5), measured as the tree max_draft × max_draft × 1 whose rounds send the nodes η left (a chain
        drafted whole is sd's γ = max_draft). None without η, or when that shape is a configured tree, which then
        runs with the device's draft_stop_prob."""
        shape = (self.max_draft, self.max_draft, 1)
        return shape if self.eta > 0 and "sd" in self.eligible and shape not in self.trees else None

    def at(self, name: str, knob: int, link: Link, now: Optional[float] = None) -> Optional[Prediction]:
        """The cost model's prediction of `name` at `knob` from the estimates (as they stand at `now`: STALE_S);
        None while it cannot be priced."""
        return self._at(name, knob, link, self.estimates.curve(now))

    def _at(self, name: str, knob: int, link: Link, curve: Optional[CostCurve],
            alpha: Optional[float] = None) -> Optional[Prediction]:
        """`name` at `knob`; a drafting protocol over the belief of its α (AutoEstimates.alpha_priced), or at `alpha`
        when given."""
        est = self.estimates
        drafting = name in DRAFTING
        if curve is None or not est.measured.get(name) or (drafting and (est.alpha_of(name) is None
                                                                         or est.up_per_draft(name) is None)):
            return None  # a drafting protocol is priced from its rounds under the request's kind of sampling
        if drafting and alpha is None:
            alpha = est.alpha_priced(name, knob) or 0.0
        return predict(name, knob, self.prompt_tokens, link, est.device(self.shares_host, name),
                       est.cloud(curve, name), est.wire(name), alpha if drafting else 0.0)

    def at_tree(self, shape: Shape, link: Link, now: Optional[float] = None) -> Optional[Prediction]:
        """The cost model's prediction of sd with the draft tree `shape` (as `at` for a chain)."""
        return self._at_tree(shape, link, self.estimates.curve(now))

    def _at_tree(self, shape: Shape, link: Link, curve: Optional[CostCurve],
                 tokens: Optional[float] = None) -> Optional[Prediction]:
        """sd with the draft tree `shape` (protocol "sd_tree", knob = its nodes); None while it cannot be priced.
        tokens: a round's tokens to price it at (default: as estimated, AutoEstimates.tree_tokens_per_round)."""
        est = self.estimates
        eta = self.stop_eta(shape)
        tokens = est.tree_tokens_per_round(shape, eta) if tokens is None else tokens
        if curve is None or not est.measured.get("sd") or tokens is None:
            return None
        nodes, depth, _ = shape
        key = tree_key(shape)
        device = est.device(self.shares_host, key)
        steps, sent = est.tree_draft_steps.get(shape), est.tree_sent_of(shape)
        read = est.eta_chain_read(depth, eta) if shape[2] == 1 and eta > 0 else None
        if read is not None:  # an η-chain as the census read it: a forward for each draft it sends
            steps = sent = min(float(depth), max(1.0, read[1]))
        elif steps and eta > 0:  # η's draft: its steps and nodes sent in proportion to its tokens
            scaled = est.tree_steps_at(shape, tokens)
            sent = None if sent is None else min(float(nodes), max(1.0, sent * scaled / steps))
            steps = scaled
        if steps is not None and device.draft_step_s:  # the tree's own drafting time, a level at a time
            device = dataclasses.replace(device, draft_step_s=device.draft_step_s * steps / depth)
        wire = est.wire()
        if est.tree_up_per_node_of(shape) is not None:
            wire = dataclasses.replace(wire, up_per_draft=est.tree_up_per_node_of(shape))
        return predict_tree(nodes, depth, tokens, self.prompt_tokens, link, device, est.cloud(curve, key), wire,
                            sent)

    def stop_eta(self, shape: Shape) -> float:
        """The η that ends `shape`'s drafts early (0: none): auto's η-chain's, or the device's for a configured tree."""
        return self._eta_of(shape) or (self.tree_eta if shape in self.trees else 0.0)

    def predictions(self, link: Link, now: Optional[float] = None) -> Dict[str, Prediction]:
        """The best knob's prediction of every eligible protocol the estimates can price (none while unmeasured)."""
        return self._priced(link, now)[0]

    def _priced(self, link: Link, now: Optional[float]) -> Tuple[Dict[str, Prediction], Optional[Shape], Candidates]:
        """`predictions`, the tree shape of sd's when a draft tree is its best, and every knob's and shape's
        prediction (`_candidates`)."""
        cands = self._candidates(link, self.estimates.curve(now))
        out: Dict[str, Prediction] = {}
        tree = None
        for name, preds in cands.items():
            shape, out[name] = _best(preds)
            tree = shape if name == "sd" else tree
        return out, tree, cands

    def _candidates(self, link: Link, curve: Optional[CostCurve]) -> Candidates:
        """Per eligible protocol the estimates can price: (tree shape or None, prediction) at every knob (sd: its
        chains of γ and its draft trees). At a request's opening each is priced over one stretch (`_stretch`)."""
        cands = self._rounds(link, curve)
        stretch = self._stretch(cands, link, curve)
        if stretch is None:
            return cands
        tokens, pace = stretch
        return {name: [(s, over_horizon(p, tokens, pace)) for s, p in preds] for name, preds in cands.items()}

    def _stretch(self, cands: Candidates, link: Link, curve: Optional[CostCurve]) -> Optional[Tuple[float, float]]:
        """At a request's opening (AutoEstimates.opening), the stretch its first round is priced over: the most tokens
        any candidate's first round commits (llm's chunk), and the pace after that round, the fastest candidate's at
        the request's α (its rounds past the opening); None past the opening. The opening's choice binds one round
        (`_chosen`), and a round of 8 tokens at llm's pace against a round of 1-3 at the openings' α, compared a round
        each, opened loaded requests on llm where sd's stretch of 8 was 1.3× as fast (costmodel.over_horizon)."""
        est = self.estimates
        if not est.opening or not cands:
            return None
        est.opening = False  # priced as the rounds after the opening are
        try:
            after = self._rounds(link, curve)
        finally:
            est.opening = True
        pace = max((p.tokens_per_s for preds in after.values() for _, p in preds), default=0.0)
        if not (0 < pace < math.inf):
            return None
        return max(p.tokens_per_round for preds in cands.values() for _, p in preds), pace

    def _rounds(self, link: Link, curve: Optional[CostCurve]) -> Candidates:
        """`_candidates`, each priced a round."""
        out: Candidates = {}
        for name in self.eligible:
            knobs = range(1, self.max_draft + 1) if name in DRAFTING else (self.chunk,)
            preds = [(None, p) for p in (self._at(name, k, link, curve) for k in knobs) if p is not None]
            if name == "sd" and preds:
                preds += [(s, p) for s, p in ((s, self._at_tree(s, link, curve)) for s in self._shapes())
                          if p is not None]
            if preds:
                out[name] = preds
        return out

    def cloud_cost(self, pred: Prediction) -> float:
        """The cloud seconds a token of `pred` adds, the others' work in the same steps aside
        (costmodel.marginal_cloud_s; the cloud's last report states the others' step)."""
        return marginal_cloud_s(pred, self.estimates.reported_step_s)

    def _keeping(self, cands: Candidates, name: Optional[str] = None) -> Optional[Tuple[Optional[Shape], Prediction]]:
        """Under the request's SLA: of the candidates (of protocol `name` only, when given) predicted to keep its
        pace (SLA_MARGIN over it), the one that adds the least cloud compute a token (ties: the faster); None when none
        is predicted to keep it."""
        floor = SLA_MARGIN * self.pace
        keep = [sp for n, preds in cands.items() if name in (None, n) for sp in preds if sp[1].tokens_per_s >= floor]
        return min(keep, key=lambda sp: (self.cloud_cost(sp[1]), -sp[1].tokens_per_s)) if keep else None

    def _could_win(self, shape: Shape, measuring: bool, link: Link, now: Optional[float],
                   preds: Dict[str, Prediction]) -> bool:
        """Whether a round of sd's draft tree `shape` could change auto's choice: its price within reach of the best
        (`_reaches`) — a tree not measured yet at the most it can commit, its depth + 1 tokens a round (its prior,
        the chain of its depth, is the least: a tree that commits 6 a round over a GPU cloud was priced below llm by
        it), a measured one at its own rounds' (a probe of a tree out of reach cost 7-15 % of a 32-token request
        on loopback, where only llm ran)."""
        curve = self.estimates.curve(now)
        pred = self._at_tree(shape, link, curve, float(shape[1] + 1) if measuring else None)
        return pred is not None and self._reaches(pred, preds)

    def _shapes(self) -> List[Shape]:
        """The draft trees sd's best is chosen among: the configured ones, and the η-chain once measured."""
        eta = self.eta_chain
        measured = eta is not None and self.estimates.tree_rounds_of(eta) >= MEASURE_ROUNDS
        return list(self.trees) + ([eta] if measured else [])

    def _eta_turn(self, best: Prediction, current: Optional[Segment], behind: int) -> str:
        """Why the η-chain runs this round in place of sd's best (a chain of γ or a tree), or "": it is measured
        (MEASURE_ROUNDS rounds) and probed (after PROBE_EVERY rounds without it) only where sd runs anyway, so
        measuring it costs no more than its difference from sd's best; its catch-up, if any, sd's would have been."""
        eta, est = self.eta_chain, self.estimates
        if eta is None or best.protocol not in ("sd", "sd_tree"):
            return ""
        name = f"sd's {_shape_text(eta, self.eta)}"
        if est.tree_rounds_of(eta) < MEASURE_ROUNDS:
            return f"measuring {name} in place of sd's best: {est.tree_rounds_of(eta)} of {MEASURE_ROUNDS} rounds"
        if current is not None and est.idle.get(tree_key(eta), 0) >= PROBE_EVERY and behind <= 1:
            return f"probing {name}: not run for {PROBE_EVERY} rounds"
        return ""

    def decide(self, link: Link, now: Optional[float] = None, behind: int = 0, remaining: int = 0) -> Choice:
        """What the next round runs, at `now` (the caller's monotonic clock; None: nothing goes stale); behind: the
        committed tokens the draft model would read before sd's first draft; remaining: the tokens the request has
        left (0: unknown, no switch is priced). With DECISIONS at DEBUG, the choice and what it read go there."""
        choice = self._decide(link, now, behind, remaining)
        if DECISIONS.isEnabledFor(logging.DEBUG):
            DECISIONS.debug("auto: %s", choice.reason, extra={"auto_decision": self._decision(choice, link, now,
                                                                                                behind, remaining)})
        return choice

    def _decision(self, choice: Choice, link: Link, now: Optional[float], behind: int, remaining: int) -> dict:
        """A choice as DECISIONS records it: the choice, every candidate's price (protocol, tree shape or None, knob,
        tokens/s, tokens a round, seconds a round; at an opening over its stretch, which `stretch` states: tokens,
        then tokens/s), the estimates it read, and `now` (at)."""
        est = self.estimates
        cands = self._candidates(link, est.curve(now))
        stretch = self._stretch(cands, link, est.curve(now))
        return {"request": id(self), "choice": {"protocol": choice.protocol, "knob": choice.knob,
                                                "tree": list(choice.tree) if choice.tree else None,
                                                "eta": choice.eta, "reason": choice.reason},
                "at": now, "behind": behind, "remaining": remaining, "alpha": est.alpha, "opening": est.opening,
                "draft_step_s": est.draft_step(), "rtt_s": link.rtt_s, "stretch": list(stretch) if stretch else None,
                "candidates": [[name, list(shape) if shape else None, p.knob, p.tokens_per_s, p.tokens_per_round,
                                p.round_s] for name, preds in cands.items() for shape, p in preds]}

    def _decide(self, link: Link, now: Optional[float], behind: int, remaining: int) -> Choice:
        """`decide`'s choice."""
        current = self.segments[-1] if self.segments else None
        chosen = self._chosen()
        preds, best_tree, cands = self._priced(link, now)
        rates = {name: p.tokens_per_s for name, p in preds.items()}
        est = self.estimates
        ran = {name: est.rounds_of(name) if name in DRAFTING else est.measured.get(name, 0) for name in self.eligible}
        unmeasured = [name for name in self.eligible if name not in preds or ran[name] < MEASURE_ROUNDS]
        if unmeasured:
            name = unmeasured[0]
            if name == "llm":  # LLM_EXPLORE_TOKENS: three chunks of 8 under load cost a fresh runtime's first
                # request 11.7 s for 24 tokens
                return Choice("llm", LLM_EXPLORE_TOKENS, f"measuring llm (one token a round): {ran[name]} of "
                              f"{MEASURE_ROUNDS} rounds", rates)
            kind = f" ({est.kind})" if name in DRAFTING and est.kind != GREEDY else ""
            return Choice(name, min(4, self.max_draft), f"measuring {name}{kind}: {ran[name]} of {MEASURE_ROUNDS} "
                          "rounds", rates)
        if self.trees and "sd" in preds:
            for shape in self.trees:  # each shape measured in turn, then probed when it has not run for a while:
                measuring = est.tree_rounds_of(shape) < MEASURE_ROUNDS  # both only while it could win (`_could_win`)
                if (measuring or (current is not None and est.idle.get(tree_key(shape), 0) >= PROBE_EVERY
                                  and behind <= 1)) and self._could_win(shape, measuring, link, now, preds):
                    what = (f"measuring sd's tree {tree_text(shape)}: {est.tree_rounds_of(shape)} of "
                            f"{MEASURE_ROUNDS} rounds" if measuring else
                            f"probing sd's tree {tree_text(shape)}: not run for {PROBE_EVERY} rounds")
                    return Choice("sd", shape[0], what, rates, shape)
        text = _shape_text(best_tree, self._eta_of(best_tree)) if best_tree else ""  # sd's fastest tree, named
        kept = self._keeping(cands) if self.pace > 0 else None
        if kept is not None:
            best_tree, best, why = self._within_sla(kept, cands, chosen)
        else:
            best = max(preds.values(), key=lambda p: p.tokens_per_s)
            held = preds.get(chosen.protocol) if chosen is not None else None
            why = f"; none predicted to keep {self._pace_text()}: the fastest" if self.pace > 0 else ""
            if held is not None and best.protocol != held.protocol and \
                    best.tokens_per_s < SWITCH_GAIN * held.tokens_per_s:
                why += f"; {chosen.protocol} kept: {best.protocol} is within {SWITCH_GAIN:.2f}× of it"  # not worth it
                best = held
            same = self._running(cands, chosen)
            if same is not None and _eligible_name(same[1]) == _eligible_name(best) and same[1] is not best and \
                    best.tokens_per_s < SWITCH_GAIN * same[1].tokens_per_s:
                faster = _label(best, text if best.protocol == "sd_tree" else "")
                best_tree, best = same
                mine = _label(best, _shape_text(best_tree, self._eta_of(best_tree)) if best_tree else "")
                why += f"; {mine} kept: {faster} is within {SWITCH_GAIN:.2f}× of it"
        # one token behind is no catch-up: the last draft of a round wholly accepted, which the next round's first
        # draft step feeds with its own token (observe_sd does not count it either); priced as one (a 64-token
        # forward, when the catch-up model was flat below its smallest size) it drove auto off sd after its best rounds
        if best.protocol in DRAFTING and behind > 1 and "llm" in preds:
            cost = est.catch_up_cost(behind)
            if kept is not None:  # under the SLA the catch-up must not break the pace
                pace = remaining / (remaining / best.tokens_per_s + cost) if remaining > 0 else math.inf
                if pace < SLA_MARGIN * self.pace:
                    why += (f"; {best.protocol} would first read {behind} tokens ({cost:.2f} s), keeping "
                            f"{pace:.2f} tok/s")
                    best = preds["llm"]
            else:
                saved = _saved_s(remaining, preds["llm"], best)
                if saved < cost:
                    why += f"; {best.protocol} would first read {behind} tokens ({cost:.2f} s) to save {saved:.2f} s"
                    best = preds["llm"]
        turn = self._eta_turn(best, current, behind)
        if turn:
            return Choice("sd", self.max_draft, turn, rates, self.eta_chain, self.eta)
        stale = [p for p in preds.values() if p.protocol != best.protocol and current is not None
                 and est.idle.get(p.protocol, 0) >= PROBE_EVERY and self._reaches(p, preds)
                 and (p.protocol not in DRAFTING or behind <= self.chunk)]
        if stale:
            alt = max(stale, key=lambda p: p.tokens_per_s)
            if alt.protocol == "llm":  # LLM_EXPLORE_TOKENS: measured at 1/chunk of the cost
                return Choice("llm", LLM_EXPLORE_TOKENS, f"probing llm (one token): not run for {PROBE_EVERY} rounds",
                              rates)
            return Choice(alt.protocol, alt.knob, f"probing {alt.protocol}: not run for {PROBE_EVERY} rounds", rates)
        tree = best_tree if best.protocol == "sd_tree" else None
        reason = _why(best, preds, self.estimates, text) + why
        if est.opening:
            stretch = self._stretch(cands, link, est.curve(now))
            over = f"; over its first {stretch[0]:.0f} tokens, then {stretch[1]:.2f} tok/s" if stretch else ""
            reason = f"{OPENING}: {reason}{over}"
        return Choice("sd" if tree else best.protocol, best.knob, reason, rates, tree, self._eta_of(tree))

    def _chosen(self) -> Optional[Segment]:
        """The request's last segment that a prediction chose (`_why`), None before one: what SWITCH_GAIN keeps. A
        measuring or probing round in between binds nothing: a one-token probe of llm between two rounds of a tree
        once became the protocol kept, and llm, within 1.10× below the tree, ran 16 of 32 tokens at 0.57× the tree's
        row (docs/AUTO.md "A probe is not a choice"). Nor does the opening's choice (OPENING), priced at the
        openings' acceptance for the first round only: kept, a chain of 3 or 4 chosen there ran whole requests at low
        power under load where the η-tree row ran 1.1-1.2× as fast ("The opening's own acceptance")."""
        return next((s for s in reversed(self.segments) if s.reason.startswith(PREDICTED)), None)

    @staticmethod
    def _running(cands: Candidates, chosen: Optional[Segment]) -> Optional[Tuple[Optional[Shape], Prediction]]:
        """The candidate (tree shape or None, prediction) of the knob or draft tree last chosen (`_chosen`); else
        None. sd's chains and trees are one protocol to SWITCH_GAIN, yet their predictions differ by less than the
        estimates' own noise on a loaded cloud: choosing afresh every round flipped a request among γ 5, 6, 7 and the
        η-chain eight times in 32 tokens (docs/AUTO.md "A shape is kept as a protocol is")."""
        if chosen is None:
            return None
        for shape, pred in cands.get(chosen.protocol, ()):
            if shape == chosen.tree and (shape is not None or pred.knob == chosen.knob):
                return shape, pred
        return None

    def _within_sla(self, kept: Tuple[Optional[Shape], Prediction], cands: Candidates,
                    chosen: Optional[Segment]) -> Tuple[Optional[Shape], Prediction, str]:
        """Under the request's SLA: `kept` (`_keeping`: its tree shape or None, its prediction), unless the protocol
        last chosen keeps the pace too at no more than SWITCH_GAIN times kept's cloud compute a token (no flapping);
        and the reason's tail: each protocol's least cloud compute a token at the pace, or that it misses it."""
        shape, best = kept
        note = ""
        held = self._keeping(cands, chosen.protocol) if chosen is not None else None
        if held is not None and _eligible_name(held[1]) != _eligible_name(best) and \
                self.cloud_cost(held[1]) <= SWITCH_GAIN * self.cloud_cost(best):
            note = (f"; {chosen.protocol} kept: {_eligible_name(best)} saves less than {SWITCH_GAIN:.2f}× its cloud "
                    "compute")
            shape, best = held
        others = []
        for name in sorted(set(cands) - {_eligible_name(best)}):
            mine = self._keeping(cands, name)
            others.append(f"{name} {1e3 * self.cloud_cost(mine[1]):.0f} ms" if mine else f"{name} misses it")
        label = _label(best, _shape_text(shape, self._eta_of(shape)) if shape else "")
        return shape, best, (f"; {label} keeps {self._pace_text()} ({best.tokens_per_s:.2f}) {SLA_REASON}: "
                             f"{1e3 * self.cloud_cost(best):.0f} ms"
                             + (f" ({', '.join(others)})" if others else "") + note)

    def _eta_of(self, shape: Optional[Shape]) -> float:
        """η of sd's draft tree `shape`: auto's when it is the η-chain, else 0 (a configured tree's is the device's
        draft_stop_prob, which the session applies)."""
        return self.eta if shape is not None and shape == self.eta_chain else 0.0

    def sd_within_reach(self, preds: Dict[str, Prediction]) -> bool:
        """Whether a drafting protocol (sd, ksqs) may run soon, by `predictions`: one not priced yet, or predicted at
        READ_AHEAD_REACH of the best protocol or more — under the request's SLA, of its pace (SLA_MARGIN over it)
        when the best keeps it — (what decides whether the draft model reads the tokens it lacks while the device
        waits)."""
        drafting = [name for name in DRAFTING if name in self.eligible]
        if not drafting:
            return False
        if any(name not in preds for name in drafting):
            return True
        return any(self._reaches(preds[name], preds) for name in drafting)

    def worth_reading(self, link: Link, now: Optional[float] = None) -> bool:
        """Whether the draft model should read llm's tokens while the device waits (the session's reads, which move
        the request's acceptance: AutoEstimates.observe_agreement): sd within reach (`sd_within_reach`, at the
        request's price), or a drafting protocol's best chain within reach priced at the prompt's hopeful α
        (AutoEstimates.alpha_hopeful), each priced a round. A prompt easier than the prompts believed is found only by
        reading it: at the mean alone a population of other prompts kept sd out of reach for whole traces and no
        request learned its own α; the hope narrows as the request's reads come in, so a hard prompt stops them. A
        census request (AutoEstimates.census) reads whatever the prices: its reads measure the prompts'."""
        if self.estimates.census and any(n in self.eligible for n in DRAFTING):
            return True
        preds = self.predictions(link, now)
        if self.sd_within_reach(preds):
            return True
        curve = self.estimates.curve(now)
        if self.estimates.opening:  # priced over the opening's stretch: the hope is priced a round, as are these
            preds = {name: _best(c)[1] for name, c in self._rounds(link, curve).items()}
        for name in (n for n in DRAFTING if n in self.eligible):
            alpha = self.estimates.alpha_hopeful(name)
            hopeful = [] if alpha is None else [(None, p) for p in (self._at(name, k, link, curve, alpha)
                                                                    for k in range(1, self.max_draft + 1)) if p]
            if hopeful and self._reaches(_best(hopeful)[1], preds):
                return True
        return False

    def census_reads_to_the_end(self, link: Link, now: Optional[float], behind: int, in_flight: int) -> bool:
        """Whether a census request's draft model reads while the llm round that ends the request is in flight: the
        `behind` tokens it lacks, priced (AutoEstimates.catch_up_cost), are read within the round's predicted time
        (llm's round of its `in_flight` tokens), so the request's end, which waits for the forward in
        progress (ReadAhead.settle), is not held. Elsewhere the reads stop a round before the end (nothing drafts
        after it); a census that stopped there read only the answer's first half over 32 tokens, its opening, which
        agrees less (docs/AUTO.md "The census reads to the end")."""
        if not self.estimates.census or behind < 1 or in_flight < 1:
            return False
        if not any(n in self.eligible for n in DRAFTING):
            return False
        llm = self.at("llm", in_flight, link, now)  # the round in flight alone, not every protocol's prices
        return llm is not None and self.estimates.catch_up_cost(behind) <= llm.round_s

    def _reaches(self, pred: Prediction, preds: Dict[str, Prediction]) -> bool:
        """Whether `pred` is within reach of the best of `preds`: READ_AHEAD_REACH of its tokens/s or more (under
        the request's SLA, of the pace with its margin when the best keeps it). Below that, the model would have to
        be 1 / READ_AHEAD_REACH - 1 = 25 % off for it to win: more than its error against what ran here."""
        best = max(p.tokens_per_s for p in preds.values())
        if self.pace > 0 and best >= SLA_MARGIN * self.pace:  # under an SLA: whether it keeps the pace
            best = SLA_MARGIN * self.pace
        return pred.tokens_per_s >= READ_AHEAD_REACH * best

    def local_wins(self, rtt_s: float) -> str:
        """Why slm (the device alone) is predicted faster than the best exact protocol by SWITCH_GAIN — under the
        request's SLA, predicted to keep its pace (no cloud compute at all) — or "" when it is not, or not measured
        yet (allow_lossy requests)."""
        est, preds = self.estimates, self.predictions(Link(rtt_s))
        if est.local_step_s is None or not preds:
            return ""
        local = 1.0 / est.local_step_s
        if self.pace > 0 and local >= SLA_MARGIN * self.pace:
            return f"lossy allowed: slm predicted {local:.2f} tok/s keeps {self._pace_text()} with no cloud compute"
        best = max(preds.values(), key=lambda p: p.tokens_per_s)
        if local < SWITCH_GAIN * best.tokens_per_s:
            return ""
        return f"lossy allowed: slm predicted {local:.2f} tok/s against {best.protocol} {best.tokens_per_s:.2f}"

    def record(self, choice: Choice, tokens: int) -> None:
        """A round ran under `choice` and committed `tokens`."""
        if DECISIONS.isEnabledFor(logging.DEBUG):
            DECISIONS.debug("auto: %d tokens", tokens, extra={"auto_tokens": {"request": id(self), "tokens": tokens}})
        idle = self.estimates.idle
        for name in self.eligible:
            idle[name] = 0 if name == choice.protocol else idle.get(name, 0) + 1
        for shape in list(self.trees) + ([self.eta_chain] if self.eta_chain else []):
            idle[tree_key(shape)] = 0 if choice.tree == shape else idle.get(tree_key(shape), 0) + 1
        seg = self.segments[-1] if self.segments else None
        kind = lambda reason: reason.split()[0]  # noqa: E731  measuring / probing / predicted
        if seg is None or (seg.protocol, seg.knob, seg.tree, kind(seg.reason)) != (
                choice.protocol, choice.knob, choice.tree, kind(choice.reason)):
            if seg is not None:
                log.info("auto: %s %s %d after %d tokens: %s", choice.protocol, "tree of" if choice.tree else
                         "γ/chunk", choice.knob, sum(s.tokens for s in self.segments), choice.reason)
            seg = Segment(choice.protocol, choice.knob, choice.reason, tree=choice.tree, eta=choice.eta)
            self.segments.append(seg)
        seg.tokens += tokens
        seg.rounds += 1


def choice_text(segment: dict) -> str:
    """A segment of a response's `auto` list (Segment.as_dict) by its choice: "llm", "sd γ=4", "sd tree 8x8x1",
    "sd η-chain γ≤8 η=0.4"; llm's chunk is not a choice of the device's and is left out."""
    if segment.get("tree") is not None:
        eta = segment.get("eta", 0.0)
        return f"{segment['protocol']} {'' if eta else 'tree '}{_shape_text(tuple(segment['tree']), eta)}"
    if segment["protocol"] in DRAFTING and segment.get("knob"):
        return f"{segment['protocol']} γ={segment['knob']}"
    return segment["protocol"]


def tokens_by_choice(segments: Sequence[dict]) -> Dict[str, int]:
    """The tokens each choice produced over responses' `auto` segments (`choice_text`), most first."""
    out: Dict[str, int] = {}
    for seg in segments:
        name = choice_text(seg)
        out[name] = out.get(name, 0) + int(seg["tokens"])
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _eligible_name(pred: Prediction) -> str:
    """The eligible protocol a prediction is of (sd's draft trees are sd's)."""
    return "sd" if pred.protocol == "sd_tree" else pred.protocol


def _shape_text(shape: Shape, eta: float) -> str:
    """A tree by its shape; the η-chain (eta > 0) as the longest chain and its η."""
    return f"η-chain γ≤{shape[1]} η={eta:g}" if eta else tree_text(shape)


def _saved_s(tokens: int, slow: Prediction, fast: Prediction) -> float:
    """Seconds `fast` saves over `slow` on `tokens` tokens (0 when either rate is 0)."""
    if tokens < 1 or slow.tokens_per_s <= 0 or fast.tokens_per_s <= 0:
        return 0.0
    return max(0.0, tokens / slow.tokens_per_s - tokens / fast.tokens_per_s)


def _label(pred: Prediction, tree: str = "") -> str:
    """A prediction's protocol and knob in words (sd's draft tree by `tree`, `_shape_text`, when given)."""
    if pred.protocol in DRAFTING:
        return f"{pred.protocol} γ={pred.knob}"
    if pred.protocol == "sd_tree":
        return f"sd_tree {tree}" if tree else f"sd_tree ({pred.knob} nodes)"
    return pred.protocol


def _why(best: Prediction, preds: Dict[str, Prediction], est: AutoEstimates, tree: str = "") -> str:
    """The predictions in words; sd's draft tree, when it is sd's best, named by `tree` (`_shape_text`)."""
    parts = [f"{_label(p, tree)} {p.tokens_per_s:.2f} tok/s"
             for p in sorted(preds.values(), key=lambda p: -p.tokens_per_s)]
    alpha = f", α {est.alpha:.2f}" if est.alpha is not None else ""
    return f"{PREDICTED} {', '.join(parts)}{alpha}"
