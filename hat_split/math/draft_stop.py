"""Where a chain draft should end: the measured cost rule (HAT's `draft_stop = "cost"`). Pure numpy.

HAT eq. 5 ends a draft after the first token whose draft probability is below a fixed η. That η ignores two things
the device measures anyway: how often a draft of a given confidence is accepted (a short-trained drafter is often
overconfident), and what one more draft costs against a round (on a GPU cloud beside a fast link a draft is nearly
free; where device and cloud share two CPU cores it cost an eighth to a fifth of a round, docs/HAT.md). The cost rule
drafts only what lowers the expected time per token:

- a round with k drafts costs R(k) = base + k · per_draft seconds (`RoundCosts`), from parts measured apart, as a
  round's wall time is too noisy to fit a slope from a few rounds: per_draft = the device's draft step (the draft
  module, its head and the draft's input-part step, timed each round) + what one more position adds to the
  verification (the cloud's reported compute and the device's head, `RoundCostFit`: a least-squares line over the
  rounds measured so far, starting from "nothing" until rounds of different lengths have been seen) + the draft's
  shallow state on the uplink at the measured rate; base = the rest of a round (link, verification of the last
  token, bookkeeping), a moving average. A connection's rounds end by η until one has been measured (a request's
  first round is not: the feature drafter then also runs over the whole prompt);
- draft i is accepted, given every earlier one was, with probability a(c_i) for its draft probability c_i
  (`AcceptanceByConfidence`: per confidence bin, the accepted share of the drafts verified so far, starting from
  a(c) = c);
- the expected tokens of a round with k drafts are E(k) = 1 + Σ_{i ≤ k} P_i, with P_i = Π_{j ≤ i} a(c_j) (the
  bonus token counts one);
- draft k + 1 is kept iff R(k + 1) / E(k + 1) < R(k) / E(k), i.e. P_{k+1} / E(k) > per_draft / R(k) (`DraftStop`).

The rule reads only the draft's own probabilities and the outcomes of earlier rounds, never the target's answer for
this round's drafts, so the verified output keeps the target's law (any stopping rule of that kind does).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import zip_longest
from typing import List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from hat_split.math.verify import expected_tokens

CONFIDENCE_BINS = 10
PRIOR_WEIGHT = 2.0  # pseudo-drafts per bin at a(c) = c before any is verified
DECAY = 0.98  # old rounds fade: a change of prompt, link or load shows within a few dozen rounds
PRIOR_ROUNDS = 0.1  # the prior line weighs as much as this many rounds at k = 0 and at k = 1 (little: it only
# decides the slope until rounds of two lengths have been measured)
EMA_WEIGHT = 0.1  # RoundCosts: a new round's weight in the draft step's and the rest's moving averages
GATE_MIN_SEEN = 16.0  # DraftGate: first drafts seen (decayed) before it may skip a step: not on a handful
PROBE_EVERY = 8  # DraftGate: a round in this many runs the first draft step even when it seldom pays


def confidence_bin(confidence: float, bins: int) -> int:
    """The bin of a draft probability among `bins` equal ones (1.0 in the last); ValueError outside [0, 1] or NaN."""
    if not 0.0 <= confidence <= 1.0:
        raise ValueError(f"a draft probability must be in [0, 1], got {confidence}")
    return min(int(confidence * bins), bins - 1)


@dataclass
class AcceptanceByConfidence:
    """Accepted share of verified drafts per confidence bin (a Beta(2c, 2(1 - c)) prior per bin, decayed counts)."""

    bins: int = CONFIDENCE_BINS
    accepted: np.ndarray = field(default=None)  # `# [bins]` float64
    seen: np.ndarray = field(default=None)  # `# [bins]` float64

    def __post_init__(self) -> None:
        if self.bins < 1:
            raise ValueError(f"bins must be >= 1, got {self.bins}")
        if self.accepted is None:
            self.accepted = np.zeros(self.bins)
        if self.seen is None:
            self.seen = np.zeros(self.bins)

    def rate(self, confidence: float) -> float:
        """a(c): the estimated probability that a draft of probability c is accepted (its predecessors were)."""
        b = confidence_bin(confidence, self.bins)
        mid = (b + 0.5) / self.bins
        return float((PRIOR_WEIGHT * mid + self.accepted[b]) / (PRIOR_WEIGHT + self.seen[b]))

    def observe(self, confidences: Sequence[float], n_accepted: int) -> None:
        """A verified chain: its drafts' probabilities and how many were accepted. The first n_accepted count as
        accepted, the next one (if any) as rejected; the drafts after it were never put to the test."""
        if not 0 <= n_accepted <= len(confidences):
            raise ValueError(f"{n_accepted} accepted of {len(confidences)} drafts")
        tested = list(confidences[:n_accepted + 1])
        if not tested:
            return
        self.accepted *= DECAY
        self.seen *= DECAY
        for i, c in enumerate(tested):
            b = confidence_bin(float(c), self.bins)
            self.seen[b] += 1.0
            self.accepted[b] += float(i < n_accepted)


@dataclass
class RoundCostFit:
    """Seconds of a round with k drafts, R(k) = base + k · per_draft: weighted least squares over the measured rounds
    (decayed), with a prior line of PRIOR_ROUNDS rounds at k = 0 and at k = 1 so that it is defined from the start."""

    prior_base: float
    prior_per_draft: float
    _sw: float = 0.0
    _sk: float = 0.0
    _skk: float = 0.0
    _sy: float = 0.0
    _sky: float = 0.0

    def __post_init__(self) -> None:
        if not self.prior_base > 0 or self.prior_per_draft < 0:
            raise ValueError(f"a round's prior cost must be > 0 and a draft's >= 0, got {self.prior_base}, "
                             f"{self.prior_per_draft}")

    def observe(self, drafts: int, seconds: float) -> None:
        if drafts < 0 or not seconds >= 0 or seconds == float("inf"):
            raise ValueError(f"a round of {drafts} drafts in {seconds} s")
        for name in ("_sw", "_sk", "_skk", "_sy", "_sky"):
            setattr(self, name, getattr(self, name) * DECAY)
        self._sw += 1.0
        self._sk += drafts
        self._skk += drafts * drafts
        self._sy += seconds
        self._sky += drafts * seconds

    def line(self) -> tuple:
        """(base, per_draft) seconds: the fit, the prior's two points included; per_draft >= 0, base > 0."""
        p0, p1 = self.prior_base, self.prior_base + self.prior_per_draft
        w = self._sw + 2 * PRIOR_ROUNDS
        sk = self._sk + PRIOR_ROUNDS
        skk = self._skk + PRIOR_ROUNDS
        sy = self._sy + PRIOR_ROUNDS * (p0 + p1)
        sky = self._sky + PRIOR_ROUNDS * p1
        det = w * skk - sk * sk
        slope = (w * sky - sk * sy) / det
        slope = max(slope, 0.0)
        base = max((sy - slope * sk) / w, 1e-6)
        return base, slope

    def cost(self, drafts: int) -> float:
        base, per_draft = self.line()
        return base + drafts * per_draft


@dataclass
class RoundCosts:
    """R(k) = base + k · per_draft from its measured parts (see the module docstring); `line()` → (base, per_draft)."""

    verify: RoundCostFit  # seconds of the verification (cloud compute + device head) against the drafts sent
    draft_s: float  # the device's seconds per draft step
    rest_s: float  # the round's seconds outside drafting and verification
    wire_s: float = 0.0  # one draft's shallow state on the uplink

    @classmethod
    def first(cls, drafts: int, seconds: float, draft_s: float, verify_s: float, wire_s: float = 0.0
              ) -> "RoundCosts":
        """From a connection's first measured round: `seconds` in all, `draft_s` per draft step, `verify_s` of it
        verifying (the verification's line starts flat: one more position costs nothing until measured)."""
        verify = RoundCostFit(max(verify_s, 1e-6), 0.0)
        verify.observe(drafts, verify_s)
        return cls(verify, max(draft_s, 0.0), max(seconds - drafts * draft_s - verify_s, 0.0), max(wire_s, 0.0))

    def observe(self, drafts: int, seconds: float, draft_s: Optional[float], verify_s: float,
                wire_s: float = 0.0) -> None:
        """A round: `drafts` sent, `seconds` in all, `draft_s` per draft step (None: no step ran), `verify_s`."""
        if not seconds >= 0 or not verify_s >= 0 or seconds == float("inf"):
            raise ValueError(f"a round of {seconds} s with {verify_s} s verifying")
        self.verify.observe(drafts, verify_s)
        steps = 0.0
        if draft_s is not None:
            self.draft_s = (1 - EMA_WEIGHT) * self.draft_s + EMA_WEIGHT * max(draft_s, 0.0)
            steps = drafts * draft_s
        self.rest_s = (1 - EMA_WEIGHT) * self.rest_s + EMA_WEIGHT * max(seconds - steps - verify_s, 0.0)
        self.wire_s = max(wire_s, 0.0)

    def line(self) -> tuple:
        v0, v1 = self.verify.line()
        return max(self.rest_s + v0, 1e-6), self.draft_s + v1 + self.wire_s


@dataclass
class DraftStop:
    """One round's cost rule: `admit(c)` for each new draft's probability, in order; False ends the draft there
    (that draft is not sent)."""

    acceptance: AcceptanceByConfidence
    costs: "RoundCosts | RoundCostFit"  # anything with line() → (base, per_draft)
    drafts: int = 0
    path: float = 1.0  # P_k: the probability that every draft so far is accepted
    expected: float = 1.0  # E(k)
    offered: List[float] = field(default_factory=list)  # the probabilities it was asked about, in order
    probe: bool = False  # a probe round (DraftGate): its first draft is sent whatever it is worth, so that rounds
    # with a draft keep being measured (the cost line's slope, the acceptance) where drafting seldom pays

    def admit(self, confidence: float) -> bool:
        self.offered.append(confidence)
        p = self.path * self.acceptance.rate(confidence)
        base, per_draft = self.costs.line()
        forced = self.probe and self.drafts == 0
        if not forced and p * (base + self.drafts * per_draft) <= per_draft * self.expected:
            return False
        self.drafts += 1
        self.path = p
        self.expected += p
        return True


@dataclass
class DraftGate:
    """Whether a round should run its first draft step at all. A refused first draft still cost its step (the draft
    module and its head); where the drafter's first drafts are seldom worth sending, rounds skip the step and draft
    nothing (once GATE_MIN_SEEN first drafts have been seen), and one round in PROBE_EVERY is a probe (`probe()`: it
    sends its first draft whatever it is worth) so that the confidences, the acceptance and what a draft costs stay
    measured.

    The step runs iff the expected saving per token, Σ_b h_b · max(0, R0 − (R0 + c) / (1 + a_b)) over the first
    drafts' confidence histogram h (R0, c: `RoundCostFit.line()`, a_b: `AcceptanceByConfidence` at bin b), is at least
    the step's cost in the rounds where the draft is refused, step_s · Σ_{b refused} h_b."""

    bins: int = CONFIDENCE_BINS
    seen: np.ndarray = field(default=None)  # `# [bins]` decayed counts of first-draft confidences
    since_probe: int = 0

    def __post_init__(self) -> None:
        if self.seen is None:
            self.seen = np.zeros(self.bins)

    def observe(self, confidence: float) -> None:
        """The first draft's probability in a round that ran the step."""
        b = confidence_bin(confidence, self.bins)
        self.seen *= DECAY
        self.seen[b] += 1.0
        self.since_probe = 0

    def probe(self) -> bool:
        """This round is due to probe (nothing seen yet, or PROBE_EVERY - 1 rounds since the step last ran)."""
        return float(self.seen.sum()) <= 0 or self.since_probe >= PROBE_EVERY - 1

    def worth(self, acceptance: AcceptanceByConfidence, costs: "RoundCosts | RoundCostFit", step_s: float) -> bool:
        total = float(self.seen.sum())
        if self.probe() or total < GATE_MIN_SEEN:
            return True
        base, per_draft = costs.line()
        saving = refused = 0.0
        for b in range(self.bins):
            if self.seen[b] <= 0:
                continue
            h = self.seen[b] / total
            a = acceptance.rate((b + 0.5) / self.bins)
            gain = base - (base + per_draft) / (1.0 + a)
            if gain > 0:
                saving += h * gain
            else:
                refused += h
        if saving >= max(step_s, 0.0) * refused:
            return True
        self.since_probe += 1
        return False


class EtaReads(NamedTuple):
    """What greedy chains of up to `depth` drafts that η ends (HAT eq. 5) would do over texts the draft model read
    (`eta_chain_over_text`, `eta_chain_over_reads`); counts, summed over texts with `plus` (scaled with `times`)."""
    rounds: int  # whole rounds
    tokens: int  # tokens they commit (their accepted drafts and the target's next token each)
    sent: int  # drafts they send up to and with the first rejected one (a round with none: all it sends)
    rooms: Tuple[int, ...]  # rooms[m - 1]: rounds that went on past their first rejected draft with room for m more
    onward: int  # positions that follow one whose token the draft named (its own token ends their context) ...
    sure: int  # ... and of those, the ones whose confidence is at least η
    chain: float = 0.0  # an i.i.d. chain's tokens over as many rounds (`eta_chain_over_reads`' yardstick)
    cut: float = 0.0  # rounds the text's end cut off (one a stretch at most), all their drafts so far accepted and
    # sure: the tokens each will commit at least and the drafts it will send at least, its drafts and one more

    def plus(self, other: "EtaReads") -> "EtaReads":
        rooms = tuple(a + b for a, b in zip_longest(self.rooms, other.rooms, fillvalue=0))
        return EtaReads(self.rounds + other.rounds, self.tokens + other.tokens, self.sent + other.sent, rooms,
                        self.onward + other.onward, self.sure + other.sure, self.chain + other.chain,
                        self.cut + other.cut)

    def times(self, w: float) -> "EtaReads":
        return EtaReads(w * self.rounds, w * self.tokens, w * self.sent, tuple(w * r for r in self.rooms),
                        w * self.onward, w * self.sure, w * self.chain, w * self.cut)

    def went_on(self) -> float:
        """Rounds that went on past their first rejected draft."""
        return sum(self.rooms)

    def past(self, onward: Optional[float] = None) -> float:
        """Drafts sent past their first rejected draft by the rounds that went on: in each, the draft goes on along its
        own text, each draft there ending it below η. A context that ends with the draft's own token is what the
        positions after one it named have (`onward`, `sure`): each draft past the rejected one is taken to go on with
        the share c of those at least η (`onward` given: that share), so a round with room for m sends
        1 + c + ... + c^(m-1) there (a stated approximation: the drafts' confidences taken as independent)."""
        c = onward if onward is not None else (self.sure / self.onward if self.onward else 0.0)
        return sum(n * eta_tail(c, m) for m, n in enumerate(self.rooms, start=1))


def eta_tail(c: float, room: int) -> float:
    """Drafts a round sends past its rejected draft where it has room for `room` more and each goes on with
    probability c: 1 + c + ... + c^(room - 1) (the first is sent whatever it is)."""
    if not 0.0 <= c <= 1.0 or room < 0:
        raise ValueError(f"a tail needs c in [0, 1] and room >= 0, got {c}, {room}")
    return float(sum(c ** j for j in range(room)))


def eta_chain_over_text(agreed: Sequence[bool], confidence: Sequence[float], depth: int, eta: float) -> EtaReads:
    """Greedy chains of up to `depth` drafts that η ends (HAT eq. 5: after the first draft whose probability is below
    η, which is still sent) run over a text the draft model read: at position i, `agreed[i]` whether its argmax was
    the text's token and `confidence[i]` that argmax's plain softmax probability (sampling.softmax_prob). A round
    from position i drafts positions i, i + 1, ... while it agrees, its context then the text's own, so its
    confidences are the text's, up to and with its first rejected draft; it commits its accepted drafts and the
    target's next token. Whether it goes on past that draft is read exactly (that draft's own confidence is the
    one read, its context still the text): one that is below η, or at the depth, ends the round there. One that goes
    on drafts along its own text, which was not read: counted by the room it had (`EtaReads.rooms`) and priced by
    `EtaReads.past` from the positions that follow one the draft named (`onward`, `sure`), whose context ends as
    its own text's does. The text's own confidences past a rejection stood in for the draft's before: over the
    45 rounds of 16 prompts of the Qwen pair that went on, they said 183 drafts past the rejection where the draft
    sent 166 along its own text, and on the hardest prompt (α 0.56) 28 where it sent 17; priced from `onward`, 161
    and 22 (`hat-bench eta-tail`, docs/AUTO.md "What a chain sends along its own text"). Only whole rounds count;
    the last, where the text ends before its drafts do, is kept apart (`EtaReads.cut`: a round of k drafts so far,
    all accepted and sure, will commit and send at least k + 1): the whole rounds of a short text are its short
    ones, as a round that would have been long is the one its end cuts."""
    if len(agreed) != len(confidence):
        raise ValueError(f"{len(agreed)} agreements for {len(confidence)} confidences")
    if depth < 1 or not 0.0 <= eta < 1.0:
        raise ValueError(f"an η-chain needs depth >= 1 and η in [0, 1), got {depth}, {eta}")
    n, i = len(agreed), 0
    rounds = tokens = sent = 0
    rooms = [0] * (depth - 1)
    onward = sum(1 for j in range(n - 1) if agreed[j])
    sure = sum(1 for j in range(n - 1) if agreed[j] and confidence[j + 1] >= eta)
    while True:
        drafted, rejected = 0, False
        while not rejected:
            if i + drafted >= n:
                return EtaReads(rounds, tokens, sent, tuple(rooms), onward, sure, cut=drafted + 1 if drafted else 0)
            rejected = not agreed[i + drafted]
            drafted += 1
            if drafted == depth or confidence[i + drafted - 1] < eta:
                break
        else:  # the first rejected draft, confident and short of the depth: the round goes on past it
            rooms[depth - drafted - 1] += 1
        committed = drafted if rejected else drafted + 1
        rounds, tokens, sent = rounds + 1, tokens + committed, sent + drafted
        i += committed


def eta_chain_over_reads(reads: Sequence[Sequence[Tuple[int, bool, float]]], depth: int, eta: float) -> EtaReads:
    """`eta_chain_over_text`'s counts summed over reads, each a sequence of (position, agreed, confidence)
    marks, and within a read over each stretch of consecutive positions apart (a drafting round between two reads
    leaves a gap, and no chain runs across it); `chain`, the tokens a chain of `depth` drafts with i.i.d. acceptance
    (Leviathan et al. eq. 1, no η) commits over as many rounds, each stretch at the agreement of the positions its
    whole rounds covered: the yardstick that carries the reads to another text. Summed over texts of many prompts,
    tokens over rounds is a mean over rounds, which a hard prompt's many short rounds dominate, where a prompt's
    α is a mean over prompts: on the Qwen pair the census's reads, an i.i.d. chain at each read's own agreement,
    is 3.8 tokens a round over rounds and 4.9 over prompts; the reads commit 0.93-0.97 of their yardstick
    (docs/AUTO.md "The census's reads against their own α")."""
    total = EtaReads(0, 0, 0, (0,) * (depth - 1), 0, 0)
    for read in reads:
        start = 0
        for i in range(1, len(read) + 1):
            if i == len(read) or read[i][0] != read[i - 1][0] + 1:
                agreed = [m[1] for m in read[start:i]]
                counts = eta_chain_over_text(agreed, [m[2] for m in read[start:i]], depth, eta)
                covered = agreed[:min(counts.tokens, len(agreed))]  # the last round's target token may lie past it
                chain = counts.rounds * expected_tokens(sum(covered) / len(covered), depth) if covered else 0.0
                total, start = total.plus(counts._replace(chain=chain)), i
    return total


def read_agreement(read: Sequence[Tuple[int, bool, float]]) -> float:
    """A read text's agreement (marks of (position, agreed, confidence)) as the mean of its Beta(1 + agreed,
    1 + rejected): never 0 or 1, so that no request's evidence rules a short, all-agreed text out."""
    return (1.0 + sum(1 for m in read if m[1])) / (2.0 + len(read))


def evidence_weights(alphas: Sequence[float], accepted: float, rejected: float) -> List[float]:
    """Each of texts of agreement `alphas` (each in (0, 1)) weighed by how likely it makes a request's own
    `accepted` and `rejected` drafts: w_i ∝ α_i^accepted (1 − α_i)^rejected, scaled to a mean of 1 (all 1 where the
    request has no evidence of its own). Texts pooled with these weights are what is known of texts like the
    request's: its posterior over the prompts' texts, the prompts' own spread the prior."""
    if accepted < 0 or rejected < 0 or not (math.isfinite(accepted) and math.isfinite(rejected)):
        raise ValueError(f"evidence is counts >= 0, got {accepted}, {rejected}")
    if any(not 0.0 < a < 1.0 for a in alphas):
        raise ValueError(f"agreements must lie in (0, 1), got {list(alphas)}")
    if not alphas:
        return []
    logs = [accepted * math.log(a) + rejected * math.log1p(-a) for a in alphas]
    top = max(logs)
    w = [math.exp(v - top) for v in logs]
    scale = len(w) / sum(w)
    return [x * scale for x in w]


def eta_chain_pool(answers: Sequence[Tuple[EtaReads, float]], accepted: float, rejected: float,
                   depth: int) -> EtaReads:
    """The reads of texts (each its `eta_chain_over_reads` counts and its agreement, `read_agreement`) pooled for a
    request whose own drafts so far are `accepted` and `rejected`: each text weighed as `evidence_weights` says.
    On the Qwen pair a chain's send past its rejected draft follows its prompt's α (c 0.67 at α 0.56, 0.98 at
    0.96: `hat-bench eta-tail`), where the texts pooled alike priced a hard prompt's rounds at the prompts'
    mean."""
    total = EtaReads(0, 0, 0, (0,) * (depth - 1), 0, 0)
    for (reads, _), w in zip(answers, evidence_weights([a for _, a in answers], accepted, rejected)):
        total = total.plus(reads.times(w))
    return total
