"""What `--protocol auto` measures: `AutoEstimates`, one per runtime, kept from request to request, which the
controller (edge_runtime.auto) prices the protocols from. No torch, no I/O: the session (edge_runtime.sessions.auto)
hands it each round's figures.

  * the drafting protocols' acceptance α (sd's, and ksqs's: its drafts sampled from the lattice quantization of sd's
    rows), per kind of sampling (greedy, or the temperature and truncation: `sampling_kind`): accepted over examined
    draft positions, each a moving average over rounds, the request's own drafts moving the prompts' average
    (edge_runtime.acceptance), and both protocols' rounds one estimate of the prompt (`AutoEstimates.alpha_of`);
    the draft step t_d (the draft model's seconds per draft) and the per-round overhead o per protocol and per
    draft tree shape (a round's wall time less its draft, cloud and link parts and the wait the model prices);
  * the cloud's step seconds by positions: its own rounds' compute (the verdict's `compute_s`, which includes the other
    sessions of the same steps) as a hat_split.math.chunking.DelayModel, over the cloud's reported curve
    (SessionOpened's CloudCost) where the device has no point of its own, every point moved by each step observed as
    the cloud's speed drifts (hat_split.math.chunking.SpeedDrift: one protocol's rounds price the others at the speed
    they see); while the cloud reports other sessions' work waiting, every step of this device is priced with the
    others' μ positions in it (x own positions cost g(x + μ): continuous batching), plus the wait for the step in
    progress — in phase with steps that run back to back, blurred by how much its own verify steps wander about the
    curve (`step_jitter`: costmodel.phase_wait);
  * the bytes of its rounds (request without drafts, reply; per draft row per drafting protocol and kind of
    sampling: a greedy row is one-hot, a sampled one the whole vocabulary, a ksqs row a lattice code);
  * the link's round trip (the client's probe) and the uplink rate the cloud measured on a request large enough.
"""
from __future__ import annotations

import copy
import logging
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from edge_runtime.acceptance import (ALPHA_BASE_ROUNDS, ALPHA_PRIOR_DRAFTS, Acceptance, examined_of, population_ema,
                                     pulled)
from hat_split.math.chunking import DelayModel, SpeedDrift, ema, piecewise
from hat_split.math.costmodel import CloudCosts, CostCurve, DeviceCosts, Link, WireSizes, cadence_s, phase_wait
from hat_split.math.draft_stop import eta_chain_over_reads, eta_chain_pool, read_agreement
from hat_split.math.sampling import SamplingParams
from hat_split.math.verify import alpha_for_tokens, expected_tokens_beta
from hat_split.wire import messages as P

log = logging.getLogger("hatspec.edge")

Shape = Tuple[int, int, int]  # a draft tree's nodes, depth, width
DRAFTING = ("sd", "ksqs")  # those whose rounds the draft model drafts (the same model, the same catch-up)
GREEDY = "greedy"  # the kind of sampling of a temperature-0 request (`sampling_kind`)
STALE_S = 20.0  # s: the device's own points of the cloud's curve older than this give way to the cloud's latest
# report (a load that ended, a link that changed)
DEVICE_TIMES = ("draft_step_s", "draft_step_busy_s", "catch_up", "local_step_s")  # what a new power mode makes
DEVICE_OVERHEADS = ("sd", "sd:busy", "ksqs", "ksqs:busy")  # another board's: these estimates, and the drafting
# protocols' round overheads (keys of overhead_s; a draft tree's own, `tree_key`, as well: `device_overhead`)
DEVICE_FIGURES = frozenset(DEVICE_TIMES + DEVICE_OVERHEADS)
TREE_KEY = "sd_tree "  # a draft tree's idle counter and round overhead: TREE_KEY + its shape (`tree_key`)
MODE_RATIO_BOUNDS = (0.1, 10.0)  # the most one read may rescale the last mode's device times by (a forward that
# another process on the device's cores stretched is not a board ten times slower)
CENSUS_KEPT = 32  # census requests whose reads' marks are kept (AutoEstimates.census_marks): the prompts' answers
READ_HOPE_Z = 1.2816  # standard deviations above the mean of the belief of the prompt's α (its 90th percentile, the
# belief taken as a normal) at which sd is priced to decide whether llm's tokens are worth reading (`alpha_hopeful`,
# AutoController.worth_reading): at its mean only, a population of other prompts (α 0.69 against these prompts'
# 0.76-0.85) kept sd out of reach, nothing was read and no request learned its own α (docs/AUTO.md "Reads while the
# prompt may be easy")
TREE_PRIOR_ROUNDS = 2.0  # rounds the prompts' tokens a round of a draft tree count as against a request's own (as
# ALPHA_PRIOR_DRAFTS, some two rounds of drafts, for a chain's α): a prompt whose tree commits 2 a round where the
# prompts' committed 5 ran it for 14 rounds over lte at 0.66 × llm, its moving average too slow to leave
RATIO_PRIOR_ROUNDS = 4.0  # rounds of a drafting protocol's own against the prior that its acceptance is sd's
# (`AutoEstimates.alpha_of`: ksqs drafts from the lattice's quantization of sd's rows and loses a little)
LINK_CHANGE_RATIO = 2.0  # a round trip this many times another (and LINK_CHANGE_S apart) is another link: the
LINK_CHANGE_S = 0.002  # uplink rate measured on the first does not price the second
OVERHEAD_PRIOR_ROUNDS = 4.0  # rounds a busy cloud's round overhead counts its prior as against those measured: the
# protocol's idle overhead (a busy one is kept net of the wait the cloud reported, so the idle one is its mean where
# the wait model holds). One warm-up round under load made sd:busy 0.57 s against an idle 0.03 s and priced sd 29-39 %
# slow for a whole trace, never run again to correct it (docs/AUTO.md "A busy overhead from one round")
STEP_VAR_KEEP = 0.9  # weight of the history in the busy cloud's step spread (a squared deviation is a noisy reading:
# some ten rounds)
STEP_PROBE_ROUNDS = 4  # llm rounds after which, the draft step in the cloud's state unmeasured since, the device
# times one forward of one token before the next llm round (`step_probe_due`, edge_runtime.sessions.auto's
# `_step_probe`): where llm wins nothing drafts, and the idle step stood at the warm-up's first few drafting rounds
# for whole traces (0.031 s on one, 0.042 on another of the same commit: easy prompts' η-chain rounds priced 0.92 s
# where they took 0.68)
PRIOR_UP_ROUND = 96.0  # bytes of a round's request without drafts before one is measured (a Generate frame)
PRIOR_DOWN_PER_TOKEN = 4.0  # bytes per token of a reply (an int32 id) before one is measured


def _ratio_of(measured: Optional[Tuple[float, float, int]], prior: float) -> float:
    """Tokens over their expectation (`AutoEstimates.eta_chain`'s moving averages and rounds), pulled toward `prior`
    as ALPHA_BASE_ROUNDS rounds; `prior` before any."""
    if measured is None or not measured[1] > 0:
        return prior
    done, priced, rounds = measured
    return pulled(done / priced, rounds, prior)


@dataclass
class AutoEstimates:
    """What the device measured for the cost model (module docstring)."""

    kind: str = GREEDY  # how the request running samples (`sampling_kind`): acceptance and a draft row's bytes
    # depend on it (a greedy row is one-hot, a sampled one spread over thousands of tokens), so both are kept per kind
    acceptance: Dict[Tuple[str, str], Acceptance] = field(default_factory=dict)  # per (drafting protocol, kind):
    # ksqs's drafts are sampled from the lattice's quantization of sd's rows
    draft_step_s: Optional[float] = None  # t_d, measured while the cloud reported itself idle ...
    draft_step_busy_s: Optional[float] = None  # ... and while it reported itself busy (`draft_step`: where the device
    # shares a host with the cloud, as here, a busy cloud slows its step: 0.046-0.059 s against 0.037-0.040 idle)
    local_step_s: Optional[float] = None  # a token of the device's model alone (degraded stretches, slm)
    overhead_s: Dict[str, float] = field(default_factory=dict)  # o, per protocol (sd's rounds warp, sample and
    # pack drafts; llm's do none of it) and per the cloud's state (`_overhead_key`: a busy cloud's queueing shows
    # here, and must not follow the device once the load ends)
    overhead_rounds: Dict[str, int] = field(default_factory=dict)  # rounds each overhead_s key was measured on since
    # it (re)started; a key without a count (an older record, one restored with its power mode) is established
    up_round: Optional[float] = None  # bytes of a round's request without drafts (Generate)
    up_per_row: Dict[Tuple[str, str], float] = field(default_factory=dict)  # bytes per draft row (its id and its
    # distribution: sd's float rows, ksqs's lattice codes) per (protocol, kind)
    down_round: Optional[float] = None  # bytes of a reply
    down_per_token: Optional[float] = None
    observed: DelayModel = field(default_factory=DelayModel)  # cloud seconds by positions, this device's rounds
    reported: Tuple[Tuple[float, float], ...] = ()  # the cloud's last good curve
    reported_wait_s: float = 0.0  # half a step of the others' positions (g(reported_others)) when the cloud was busy as
    # it reported (other devices using it or work waiting: CloudCost.others, queued; a request arrives, on average,
    # half-way through a step in progress), times the share of its time not in steps (1 − duty), else 0 ...
    reported_step_s: float = 0.0  # ... and the rest: g(reported_others), a step of the others' work, when busy ...
    reported_duty: float = 0.0  # ... with the share of its time in steps (CloudCost.duty): a round's request waits
    # duty × phase_wait(x, step) (costmodel.phase_wait: in phase with steps back to back); see `wait_s`
    step_var: Optional[float] = None  # the squared relative deviation of this device's verify steps from the curve
    # while the cloud is busy (a moving average, STEP_VAR_KEEP; `step_jitter`): how far the busy cloud's steps, and so
    # a round's phase against them, wander (costmodel.phase_wait's jitter)
    reported_others: float = 0.0  # the other devices' positions per step then (each of this device's steps joins
    # them: CloudCost.others_positions; μ from an older cloud), else 0
    measured: Dict[str, int] = field(default_factory=dict)  # rounds observed per protocol
    step_unmeasured: Dict[str, int] = field(default_factory=dict)  # llm rounds since the draft step in each state
    # (draft_step_s, draft_step_busy_s) was last measured, this runtime (`step_probe_due`)
    idle: Dict[str, int] = field(default_factory=dict)  # rounds since each protocol last ran (this runtime)
    observed_at: Dict[int, float] = field(default_factory=dict)  # when each bucket of `observed` was last fed
    speed: SpeedDrift = field(default_factory=SpeedDrift)  # the cloud's speed drifting against the curve: every
    # step observed moves every point (`_cloud`), so a protocol not run is priced at the speed the others see
    catch_up: DelayModel = field(default_factory=DelayModel)  # the draft model's seconds for one forward reading n
    # committed tokens without drafting (sd's first round after llm, a read while waiting), by n: a forward of 60
    # tokens costs a few forwards of one, so a rate per token measured on small reads would overprice a large one
    cloud_busy: Optional[bool] = None  # the cloud's last good report had other devices using it or work waiting
    fleet_pace: float = 0.0  # tokens/s: the fleet pace the cloud's last good report asked of a request without an SLA
    # of its own (CloudCost.pace) while it had other devices using it; else 0
    power_mode: Optional[str] = None  # the board's power mode the device's own figures were measured in
    restart: set = field(default_factory=set)  # figures whose next observation replaces them (a new power mode)
    by_mode: Dict[str, Dict[str, object]] = field(default_factory=dict)  # the device figures of each mode left
    mode_rounds: Dict[str, Dict[str, int]] = field(default_factory=dict)  # ... and the rounds each of its round
    # overheads was measured on (overhead_rounds), which come back with them
    uplink_bps: float = 0.0  # the cloud's latest measurement of this device's uploads on a request large enough to
    # measure (edge_runtime.sessions.auto.MIN_RATE_FRAME; 0: none yet), kept across requests ...
    uplink_rtt_s: float = 0.0  # ... with the round trip of the link it was measured on (`uplink_at`)
    bad_reports: int = 0  # malformed cost reports refused
    last_bad_report: str = ""
    tree_tokens: Dict[Tuple[Shape, str], float] = field(default_factory=dict)  # tokens a round of each draft tree
    # shape per kind of sampling (moving averages; like a chain's acceptance, a tree's depends on it) ...
    tree_draft_steps: Dict[Shape, float] = field(default_factory=dict)  # ... the draft model's time a round in
    # draft steps (per shape: drafting a tree costs the same however the request samples; in steps, so a new power
    # mode prices it with that mode's step, draft_step_s) ...
    tree_step_tokens: Dict[Shape, float] = field(default_factory=dict)  # ... the tokens those same rounds committed
    # (a moving average of the same weight: a draft that η ends drafts in proportion to what it commits,
    # `tree_steps_at`) ...
    tree_up_per_node: Dict[Tuple[Shape, str], float] = field(default_factory=dict)  # ... uplink bytes a node per
    # kind (a greedy tree sends no rows, a sampled one a row per node with children) ...
    tree_rounds: Dict[Tuple[Shape, str], int] = field(default_factory=dict)  # ... its rounds observed per kind ...
    tree_sent: Dict[Tuple[Shape, str], float] = field(default_factory=dict)  # ... and the nodes a round sent (fewer
    # than the shape's when η ends it early: a chain of width 1 that ends on its draft's confidence)
    tree_request: Dict[Tuple[Shape, str], Tuple[float, int, float]] = field(default_factory=dict)  # the request's
    # own tree rounds: (tokens committed, rounds, nodes sent), per shape and kind
    tree_opening: Dict[Tuple[Shape, str], Tuple[float, int]] = field(default_factory=dict)  # tokens a request's first
    # round of each shape committed (a moving average as `tree_tokens`), and how many such rounds, per kind
    eta_chain: Dict[Tuple[Shape, str], Tuple[float, float, int]] = field(default_factory=dict)  # a chain-shaped
    # tree's (width 1: the η-chain) rounds: the tokens they committed and its chain's expectation at the α each was
    # priced at (moving averages as `tree_tokens`), and how many, per kind (`tree_tokens_per_round`), requests' first
    # rounds aside ...
    eta_opening: Dict[Tuple[Shape, str], Tuple[float, float, int]] = field(default_factory=dict)  # ... and the same
    # over those (priced at the openings' α)
    census_marks: List[Tuple[Tuple[int, bool, float], ...]] = field(default_factory=list)  # the last CENSUS_KEPT
    # census requests' reads at temperature 0, each its Drafter.marks: what an η-ended chain would have done over the
    # prompts' answers (`eta_chain_read`)
    request_marks: List[Tuple[int, bool, float]] = field(default_factory=list)  # the request's own reads, so marked
    _census_read: Dict[Tuple[int, float], tuple] = field(default_factory=dict, repr=False)  # eta_chain_read's pool
    # figures per (depth, η), with what the pool held when they were computed
    census: bool = False  # the request running is a census (EdgeConfig.auto_census: drawn at random, whatever its
    # prompt): its draft model reads llm's tokens whether or not sd could win, and what it reads moves the prompts'
    # acceptance as well as the request's (`observe_agreement`)
    opening: bool = False  # a request began (`begin_request`) and has committed nothing yet: its next round drafts
    # the answer's first tokens, priced at the openings' acceptance (`Acceptance.opening`, `tree_tokens_per_round`)

    @property
    def alpha(self) -> Optional[float]:
        """sd's acceptance for the request running (`alpha_of`, its kind of sampling)."""
        return self.alpha_of("sd")

    def alpha_of(self, protocol: str) -> Optional[float]:
        """`protocol`'s acceptance for the request running (its kind of sampling): the mean of its belief
        (`belief`); before any drafting round, None."""
        belief = self.belief(protocol)
        if belief is None:
            return None
        a, b, ratio = belief
        return min(1.0, a / (a + b)) * ratio

    def belief(self, protocol: str, own: bool = True) -> Optional[Tuple[float, float, float]]:
        """What the device believes of `protocol`'s acceptance on the request running: α = ρ x, x ~ Beta(a, b) on
        sd's scale; (a, b, ρ), None before any drafting round. The drafting protocols draft with the same model on
        the same prompt, so they share what they learn: the prompt's acceptance on sd's scale is one belief from
        every drafting protocol's rounds, the population's and the request's, each protocol's taken to sd's scale by
        its ratio ρ to sd. ρ (at most 1: ksqs drafts from a quantization of sd's rows) is the ratio of the two
        populations, shrunk toward 1 by RATIO_PRIOR_ROUNDS: a few rounds of easy prompts read ksqs 1.00 against sd's
        0.91, which was the prompts, not ksqs.

        The prior is the prompts' acceptance m (at a request's first round the openings': Acceptance.opening) worth
        ALPHA_PRIOR_DRAFTS drafts, Beta(P m, P (1 − m)), moved by the request's own accepted and rejected drafts
        (its mean is `posterior`). Its spread is the prompts': a prompt's α is its own, and on the Qwen pair the
        requests' α spread as a Beta of P ≈ 6.5 about their mean (98 requests of two traces, docs/AUTO.md "A chain
        priced over what its prompt may be"), so a chain is priced over that spread (`chain_tokens`), not at its
        mean. own False: the prior alone, what is believed of any prompt before its own drafts and reads."""
        mine = [(p, a) for p in DRAFTING if (a := self.acceptance.get((p, self.kind))) is not None
                and a.population is not None]
        if not mine:
            return None
        sd = self.acceptance.get(("sd", self.kind))
        ratios = {p: self._ratio(a, sd) for p, a in mine}
        weight = sum(a.weight for _, a in mine)
        prompts = {p: a.opening if self.opening else a.population for p, a in mine}  # the request's first round: the
        # openings' (Acceptance.opening)
        prior = min(1.0, sum(a.weight * prompts[p] / ratios[p] for p, a in mine) / weight)
        accepted = sum(a.request_accepted / ratios[p] for p, a in mine) if own else 0.0
        examined = sum(a.request_examined for _, a in mine) if own else 0.0
        a = ALPHA_PRIOR_DRAFTS * prior + accepted
        return a, max(0.0, ALPHA_PRIOR_DRAFTS + examined - a), ratios.get(protocol, 1.0)  # not drafted yet: sd's

    def alpha_hopeful(self, protocol: str) -> Optional[float]:
        """`protocol`'s acceptance on the request running were its prompt easier than believed: READ_HOPE_Z standard
        deviations of its belief (`belief`) above the mean, at most 1, on `protocol`'s scale; None before any drafting
        round. Where the belief is wide (a request that has read or drafted little) it is well above the mean; as the
        request's own drafts and reads narrow it, it comes to the mean."""
        belief = self.belief(protocol)
        if belief is None:
            return None
        a, b, ratio = belief
        if not a + b > 0:
            return None
        mean = min(1.0, a / (a + b))
        spread = math.sqrt(mean * (1.0 - mean) / (a + b + 1.0))
        return min(1.0, mean + READ_HOPE_Z * spread) * ratio

    def chain_tokens(self, protocol: str, gamma: int, own: bool = True) -> Optional[float]:
        """Tokens a round of `protocol`'s chain of γ commits on the request running: Leviathan et al.'s eq. 1 in
        expectation over the belief of its acceptance (`belief`, verify.expected_tokens_beta); None before α is
        known. At the prompts' mean α a chain of 8 was priced 14 % below what the requests' own α gave it on
        average (a chain of 4: 4 %), and 4 % below over the belief. own False: on any prompt (the prior alone)."""
        belief = self.belief(protocol, own)
        return None if belief is None else expected_tokens_beta(belief[0], belief[1], gamma, belief[2])

    def alpha_priced(self, protocol: str, gamma: int) -> Optional[float]:
        """The α at which the cost model's chain of γ (`costmodel.predict`, eq. 1 at one α) commits `chain_tokens`:
        what a drafting protocol is priced at; None before α is known."""
        tokens = self.chain_tokens(protocol, gamma)
        return None if tokens is None else alpha_for_tokens(min(float(gamma + 1), max(1.0, tokens)), gamma)

    @staticmethod
    def _ratio(own: Acceptance, sd: Optional[Acceptance]) -> float:
        """A drafting protocol's acceptance over sd's (1 for sd, and without sd's population), shrunk toward 1."""
        if own is sd or sd is None or not sd.population:
            return 1.0
        measured = own.population / sd.population
        return max(0.05, min(1.0, (own.weight * measured + RATIO_PRIOR_ROUNDS) / (own.weight + RATIO_PRIOR_ROUNDS)))

    def up_per_draft(self, protocol: str = "sd") -> Optional[float]:
        """Bytes of one of `protocol`'s draft rows for the request running (its kind of sampling); None before one
        was measured."""
        return self.up_per_row.get((protocol, self.kind))

    def observe_agreement(self, agreed: float, compared: int,
                          marks: Sequence[Tuple[int, bool, float]] = ()) -> None:
        """Of `compared` target tokens the draft model read while llm ran (Drafter.catch_up with compare), sd's
        drafts would have had `agreed` accepted there (at temperature 0 those its argmax named; above, an unbiased
        estimate from the probability each was drawn with). They move the request's acceptance as sd's own drafts
        do, so a prompt that auto left for llm on a few unlucky rounds, or never drafted on, can win sd back. On a
        census request (`census`: drawn whatever its prompt) they move the prompts' acceptance as well; elsewhere
        only where reading is worth it are tokens read (AutoController.worth_reading), the promising prompts, a
        biased sample of them. marks: at temperature 0, each token's (Drafter.marks), for `eta_chain_read`."""
        if compared < 1 or not 0 <= agreed <= compared * (1 + 1e-9):  # NaN too
            return
        agreed = min(agreed, float(compared))  # a read's agreed is a difference of running sums: 1 + 1e-16 for 1
        if marks and self.kind == GREEDY:
            self.request_marks.extend(marks)
            if self.census and self.census_marks:
                self.census_marks[-1] = self.census_marks[-1] + tuple(marks)
        own = self.acceptance.setdefault(("sd", self.kind), Acceptance())
        if self.census:
            own.observe_read(agreed, compared)
        else:
            own.inform(agreed, compared)

    def take_uplink(self, bps: float, rtt_s: float) -> None:
        """The cloud measured `bps` on an upload large enough to tell, with the link's round trip at `rtt_s`."""
        self.uplink_bps, self.uplink_rtt_s = bps, rtt_s

    def uplink_at(self, rtt_s: float) -> float:
        """The uplink rate for a link whose round trip is now `rtt_s`: the last measured one while the round trip is
        the one it was measured with (within LINK_CHANGE_RATIO and LINK_CHANGE_S); 0 once the round trip says the link
        is another (unknown: taken as free, so the next drafting round uploads and measures it). Only a large upload
        measures the rate, and at T = 0 or under llm none comes; the round trip is measured from every small exchange,
        so it is what shows that a reading went stale (LTE's 5 Mbit/s priced loopback's sd rows otherwise)."""
        if self.uplink_bps <= 0:
            return 0.0
        lo, hi = sorted((max(0.0, rtt_s), self.uplink_rtt_s))
        if hi - lo > LINK_CHANGE_S and hi > LINK_CHANGE_RATIO * lo:
            return 0.0
        return self.uplink_bps

    def rounds_of(self, protocol: str) -> int:
        """Rounds of a drafting `protocol` observed under the request's kind of sampling."""
        own = self.acceptance.get((protocol, self.kind))
        return own.rounds if own is not None else 0

    def census_chance(self, kind: str, share: float) -> float:
        """The chance that a request beginning now, sampling as `kind`, is a census (EdgeConfig.auto_census =
        `share`; 0: none ever). At temperature 0 the census's reads also price the η-chain (`eta_chain_read`) from
        the pool of the last CENSUS_KEPT census answers: while that pool is not full, the share of it still empty when
        that is larger (a device's first requests are all a census, a full pool is read at `share`). A pool of 6-7
        answers of four prompts priced the η-chain 3-19 % fast a phase on one trace and 9-30 % slow on the next (docs/
        AUTO.md "Three repetitions on `4417cc5`", "A larger census while the pool is small"). Above temperature 0
        the reads move the prompts' α alone: `share`."""
        if share <= 0 or kind != GREEDY:
            return max(0.0, share)
        held = sum(1 for m in self.census_marks if m)
        return max(share, 1.0 - held / CENSUS_KEPT)

    def begin_request(self, kind: str = GREEDY, census: bool = False) -> None:
        """A new request sampling as `kind` (`sampling_kind`): its own acceptance starts from the prompts' prior;
        census: its reads of llm's tokens measure the prompts' acceptance (`census`)."""
        self.kind, self.census = kind, census
        for a in self.acceptance.values():
            a.begin()
        self.tree_request.clear()
        self.request_marks = []
        if census and kind == GREEDY:  # its reads are the prompts' newest (an empty census left no trace)
            self.census_marks = [m for m in self.census_marks if m][-(CENSUS_KEPT - 1):] + [()]
        self.opening = True

    def take_report(self, cost: Optional[P.CloudCost], now: Optional[float] = None) -> bool:
        """The cloud's cost report, checked: kept when good; refused (logged, counted, the last good one kept) when
        malformed. None (an older cloud) changes nothing. A busy cloud's curve is its steps of the last moments
        (other devices' work runs through them back to back): at `now` (the caller's monotonic clock) the speed's
        clock starts from it, so the next step moves the curve by its share of the time since (SpeedDrift), not all
        the way — one step of a busy cloud strays from the curve by its batch's make-up (docs/AUTO.md "A busy cloud's
        report is fresh"). An idle cloud's points may be minutes old: the next step moves them all the way."""
        if cost is None:
            return False
        try:
            points = P.cost_curve(cost)
        except ValueError as exc:
            self.bad_reports += 1
            self.last_bad_report = str(exc)
            log.warning("the cloud's cost report was refused (%s): keeping the last good one", exc)
            return False
        busy = cost.queued > 0 or cost.others > 0
        # the others' positions per step where the cloud counts them (an older cloud: every session's, μ)
        others = cost.others_positions if cost.others else cost.batch_tokens
        if points:
            self.reported = points
            self.reported_others = others if busy else 0.0
            step = CostCurve(points).step_s(max(1.0, others)) if busy else 0.0
            self.reported_step_s, self.reported_duty = step, float(cost.duty) if busy else 0.0
            self.reported_wait_s = 0.5 * step * (1.0 - self.reported_duty)
        if self.cloud_busy is not None and busy != self.cloud_busy:
            self.observed, self.observed_at = DelayModel(), {}  # measured under another load: the report stands
            self.speed = SpeedDrift()  # ... and the next step measures its speed afresh
            self.step_var = None
        self.cloud_busy = busy
        if busy and points and now is not None:
            self.speed.at = now if self.speed.at is None else max(self.speed.at, now)
        self.fleet_pace = float(cost.pace) if cost.others > 0 else 0.0  # alone, its compute saved serves no one
        return True

    def take_mode(self, mode: str) -> bool:
        """The device's power mode as the board reports it ("" off a Jetson). After a change the device's own
        figures (draft step, catch-up, the device alone, sd's round overheads) are another board's: those measured
        in that mode before come back; the others are replaced by their next observation rather than averaged with
        it (α is the two models', kept). True on a change."""
        if self.power_mode is None or mode == self.power_mode:
            self.power_mode = mode
            return False
        log.info("auto: the power mode changed from %r to %r: the device's figures are that mode's", self.power_mode,
                 mode)
        left = self.by_mode[self.power_mode] = self._device_figures()
        self.mode_rounds[self.power_mode] = {n: c for n, c in self.overhead_rounds.items() if n in left}
        self.power_mode = mode
        known, rounds = self.by_mode.get(mode, {}), self.mode_rounds.get(mode, {})
        for name, value in known.items():
            self._set_figure(name, value, rounds.get(name))
        self.restart = (set(DEVICE_FIGURES) | {n for n in self.overhead_s if device_overhead(n)}) - set(known)
        return True

    def _device_figures(self) -> Dict[str, object]:
        """The device figures measured in this mode (those not awaiting their first observation)."""
        values = {n: copy.deepcopy(getattr(self, n)) for n in DEVICE_TIMES}
        values.update({n: v for n, v in self.overhead_s.items() if device_overhead(n)})
        return {n: v for n, v in values.items()
                if v is not None and n not in self.restart and getattr(v, "known", True)}

    def _set_figure(self, name: str, value, rounds: Optional[int] = None) -> None:
        """A figure of a mode measured before, back; an overhead with the rounds it was measured on (None: unknown,
        established)."""
        if name in DEVICE_TIMES:
            setattr(self, name, copy.deepcopy(value))
            return
        self.overhead_s[name] = value
        if rounds is None:
            self.overhead_rounds.pop(name, None)
        else:
            self.overhead_rounds[name] = rounds

    def _restarts(self, name: str) -> bool:
        """True once for a device figure after a new power mode: its next observation replaces it."""
        if name in self.restart:
            self.restart.discard(name)
            return True
        return False

    def curve(self, now: Optional[float] = None) -> Optional[CostCurve]:
        """Seconds of a cloud step of x positions as this device sees it: its own rounds' points (the other sessions'
        work in the same steps included; at `now`, those fed within STALE_S), the cloud's report for the sizes it has
        none of. None before either exists."""
        points = {_bucket(x): (x, y) for x, y in _joined(self.reported, self.reported_others)}
        for x, y in self.observed.points():
            b = _bucket(x)
            if now is None or now - self.observed_at.get(b, now) <= STALE_S:
                points[b] = (x, y)
        if not points:
            return None
        return CostCurve(tuple(sorted(points.values())))

    def observe_sd(self, drafted: int, accepted: int, draft_s: float, cloud_s: float, up_bytes: int,
                   down_bytes: int, wall_s: float, link: Link, now: float, caught_up: int = 0,
                   protocol: str = "sd") -> None:
        """One round of a drafting `protocol` (sd, ksqs) at `now`: γ drafts, a of them accepted, the draft model's and
        the cloud's seconds, its frames' bytes, its wall time; caught_up > 0: the draft model first fed that many
        committed tokens it had not seen (after llm), so its seconds say nothing of a draft step. The draft step is
        the draft model's, whichever protocol drafted (ksqs's quantization is outside it, in its round overhead)."""
        if drafted < 1:
            return
        self._ran(protocol)
        key = (protocol, self.kind)
        self.acceptance.setdefault(key, Acceptance()).observe(drafted, accepted, self.opening)
        self.opening = False
        step = self.draft_step()
        if not caught_up:
            self._draft_step(draft_s / drafted)
        elif step is not None and self._step_name() not in self.restart:
            self.observe_catch_up(caught_up, draft_s - drafted * step)
        per_draft = self._verify_round(drafted, draft_s, cloud_s, up_bytes, down_bytes, wall_s, link, now, protocol)
        self.up_per_row[key] = ema(self.up_per_row.get(key), per_draft)

    def draft_step(self) -> Optional[float]:
        """t_d as the cloud's state prices it now: measured in that state (`draft_step_busy_s` while the cloud reports
        itself busy), else in the other; None before either. On a Jetson beside a GPU server the two agree; where
        the device shares a host with the cloud they do not, and one figure carried the loaded cloud's step into
        the idle link phases after it, pricing sd there up to 20 % slow (docs/AUTO.md "The draft step in the cloud's
        state")."""
        mine, other = ((self.draft_step_busy_s, self.draft_step_s) if self.cloud_busy
                       else (self.draft_step_s, self.draft_step_busy_s))
        return mine if mine is not None else other

    def _step_name(self) -> str:
        return "draft_step_busy_s" if self.cloud_busy else "draft_step_s"

    def step_probe_due(self) -> bool:
        """Whether the draft step in the cloud's state now went STEP_PROBE_ROUNDS llm rounds unmeasured (or was never
        measured by this runtime): the device then times one forward of one token before llm's next round
        (`observe_step_read`)."""
        return self.step_unmeasured.get(self._step_name(), STEP_PROBE_ROUNDS) >= STEP_PROBE_ROUNDS

    def observe_step_read(self, seconds: float) -> None:
        """The draft model read one committed token in one forward of `seconds` between llm's rounds (the cloud
        idle, as while a round drafts): a draft step's forward, in the cloud's state now."""
        if seconds > 0 and math.isfinite(seconds):
            self._draft_step(seconds)

    def _draft_step(self, seconds: float) -> None:
        """A draft step of a chain's round took `seconds`, in the cloud's state now (`draft_step`; the device alone's
        step until one is measured)."""
        name = self._step_name()
        self.step_unmeasured[name] = 0
        setattr(self, name, ema(None if self._restarts(name) else getattr(self, name), seconds))
        if self._restarts("local_step_s") or self.local_step_s is None:
            self.local_step_s = getattr(self, name)

    def _verify_round(self, drafted: int, draft_s: float, cloud_s: float, up_bytes: int, down_bytes: int,
                      wall_s: float, link: Link, now: float, protocol: str = "sd") -> float:
        """What a drafting round teaches whatever its drafts' shape (a chain, a tree of `drafted` nodes): the cloud's
        step of drafted + 1 positions, the reply's bytes, `protocol`'s overhead (a tree's: `tree_key`); returns its
        uplink bytes per draft."""
        if cloud_s > 0:
            self._cloud(drafted + 1, cloud_s, now, verify=True)
        self.down_round = ema(self.down_round, float(down_bytes))
        link_s = link.transfer_s(up_bytes, down_bytes)
        self._overhead(protocol, wall_s - draft_s - cloud_s - link_s, draft_s + link_s, cloud_s)
        base = self.up_round if self.up_round is not None else PRIOR_UP_ROUND
        return max(0.0, up_bytes - base) / drafted

    def observe_tree(self, shape: Shape, tokens: int, draft_s: float, cloud_s: float, up_bytes: int, down_bytes: int,
                     wall_s: float, link: Link, now: float, caught_up: int = 0, sent: Optional[int] = None,
                     accepted: Optional[int] = None) -> None:
        """One sd round with a draft tree of `shape` at `now`: `tokens` committed, the draft model's and the cloud's
        seconds, its frames' bytes, its wall time; caught_up > 0: the draft model first fed that many committed
        tokens, so its seconds say nothing of the tree's drafting; sent: the nodes it sent (None: the shape's);
        accepted: the nodes of the path the cloud accepted (None: not known; a chain-shaped tree's, tokens − 1). A
        chain-shaped tree's (width 1: the η-chain) accepted drafts are a chain's: they move the request's acceptance
        of sd (`Acceptance.inform`; not the prompts', which stay the chains' own), so a prompt auto runs on the
        η-chain prices sd's chains at its own α rather than the prompts' (docs/AUTO.md, "The η-chain's drafts teach
        the chains"), and the η-chain itself (`tree_tokens_per_round`)."""
        if tokens < 1:
            return
        nodes = shape[0] if sent is None else sent
        if not 1 <= nodes <= shape[0]:
            raise ValueError(f"a round of the tree {tree_text(shape)} sends 1..{shape[0]} nodes, got {sent}")
        if accepted is not None and not 0 <= accepted <= nodes:
            raise ValueError(f"a round of {nodes} nodes accepts 0..{nodes} of them, got {accepted}")
        key = (shape, self.kind)
        if shape[2] == 1:
            self._observe_eta_chain(key, tokens, nodes, accepted)
        n = self.tree_rounds[key] = self.tree_rounds.get(key, 0) + 1
        self.tree_tokens[key] = population_ema(self.tree_tokens.get(key), float(tokens), n)
        if self.opening:
            mean, rounds = self.tree_opening.get(key, (None, 0))
            self.tree_opening[key] = (population_ema(mean, float(tokens), rounds + 1), rounds + 1)
            self.opening = False
        mine, rounds, sent = self.tree_request.get(key, (0.0, 0, 0.0))
        self.tree_request[key] = (mine + tokens, rounds + 1, sent + nodes)
        self.tree_sent[key] = population_ema(self.tree_sent.get(key), float(nodes), n)
        if not caught_up:
            steps = None
            if shape[2] == 1:  # a chain (η may end it early): a forward a draft sent, each one of sd's draft steps
                self._draft_step(draft_s / nodes)
                steps = float(nodes)
            elif self.draft_step():
                steps = draft_s / self.draft_step()
            if steps is not None:
                self.tree_draft_steps[shape] = ema(self.tree_draft_steps.get(shape), steps)
                self.tree_step_tokens[shape] = ema(self.tree_step_tokens.get(shape), float(tokens))
        self.tree_up_per_node[key] = ema(self.tree_up_per_node.get(key), self._verify_round(
            nodes, draft_s, cloud_s, up_bytes, down_bytes, wall_s, link, now, tree_key(shape)))

    def _observe_eta_chain(self, key: Tuple[Shape, str], tokens: int, nodes: int, accepted: Optional[int]) -> None:
        """A chain-shaped tree's round (`observe_tree`): its tokens against its chain's expectation at the α it was
        priced at (before this round moves it), then its drafts to the request's acceptance (a chain commits its
        accepted drafts and the target's next token: `accepted` None is taken as tokens − 1)."""
        chain = self.chain_tokens("sd", key[0][1])
        if chain is not None:
            ratios = self.eta_opening if self.opening else self.eta_chain
            done, priced, rounds = ratios.get(key, (None, None, 0))
            ratios[key] = (population_ema(done, float(tokens), rounds + 1), population_ema(priced, chain, rounds + 1),
                           rounds + 1)
        if accepted is None:
            accepted = min(nodes, tokens - 1)
        self.acceptance.setdefault(("sd", self.kind), Acceptance()).inform(accepted, examined_of(nodes, accepted))

    def tree_steps_at(self, shape: Shape, tokens: float) -> Optional[float]:
        """Draft steps a round of `shape`, a draft that η ends early, takes where it commits `tokens` a round: its
        measured steps per token committed (over the same rounds) times `tokens`, within 1..depth; None before
        measured. Such a draft ends near where its acceptance ends, so it drafts about what it commits (the η-chain
        of 8 on the Qwen pair: 2.6 drafts a round where it committed 2.25, 7.0 where 8.0), and a prompt it commits
        little on costs it few steps: priced at the prompts' mean steps, its rounds on such a prompt were 1.55-1.7 s
        where they took 1.2 s, and chains of 3 ran in its place (docs/AUTO.md, "Steps in proportion to tokens")."""
        steps, done = self.tree_draft_steps.get(shape), self.tree_step_tokens.get(shape)
        if steps is None or not done:
            return steps
        return min(float(shape[1]), max(1.0, tokens * steps / done))

    def tree_rounds_of(self, shape: Shape) -> int:
        """Rounds of the tree `shape` observed under the request's kind of sampling."""
        return self.tree_rounds.get((shape, self.kind), 0)

    def tree_up_per_node_of(self, shape: Shape) -> Optional[float]:
        """Uplink bytes a node of the tree `shape` under the request's kind of sampling; None before measured."""
        return self.tree_up_per_node.get((shape, self.kind))

    def tree_sent_of(self, shape: Shape) -> Optional[float]:
        """Nodes a round of the tree `shape` sends under the request's kind of sampling; None before measured."""
        return self.tree_sent.get((shape, self.kind))

    def tree_tokens_per_round(self, shape: Shape, eta: float = 0.0) -> Optional[float]:
        """Tokens a round of the tree `shape` commits under the request's kind of sampling; None before α is known (or,
        for a tree wider than 1, before it ran).

        A chain-shaped tree (width 1: a chain that η ends on its draft's confidence): its chain's expectation at the
        request's α — the prompt's, as a chain's own rounds and the tree's drafts (`observe_tree`) move it, at an
        opening the openings' (`Acceptance.opening`) — times the ratio its rounds' tokens bore to that expectation at
        the α each was priced at (moving averages; 1, the chain's own, as a prior worth ALPHA_BASE_ROUNDS rounds); at
        an opening its first rounds' ratio (against the openings' α), pulled as much toward that. The Qwen pair's
        η-chain of 8 committed 0.84 (± 0.08, 56 requests) of its chain's expectation at each request's α, whose
        tokens a round went from 2.1 to 8. Priced apart from α, one round of one token cut its price by a third
        where it moved the chains' α by one draft of nine, and at low power under load chains ran in its place
        (docs/AUTO.md, "The η-chain priced at the prompt's α").

        A wider tree: as measured — the prompts' moving average worth TREE_PRIOR_ROUNDS rounds against the request's
        own rounds (a prompt's is its own) — else the chain of its depth's expectation at the request's α (a tree
        holds that chain: the least it commits). The prompts' average is pulled towards that chain's, worth
        ALPHA_BASE_ROUNDS rounds against the tree's measured ones, as the chains' α is towards ALPHA_BASE: two
        rounds of one easy prompt (7 tokens each) opened the next two prompts on the tree, priced 1.1-1.3× llm, which
        then ran at 0.7-0.8× it (the trace on `b4d7ebf`, loopback). A request's first round (`opening`) is priced at
        the chain's opening α, and at the tree's own first rounds where measured, pulled toward its rounds' as much.

        eta > 0: the η that ends a chain-shaped tree's drafts; at temperature 0, once the census has read enough,
        its tokens a round are what the reads say such a chain commits (`eta_chain_read`)."""
        key = (shape, self.kind)
        read = self.eta_chain_read(shape[1], eta) if shape[2] == 1 and eta > 0 else None
        if read is not None:
            return min(float(shape[1] + 1), max(1.0, read[0]))
        chain = self.chain_tokens("sd", shape[1])
        if shape[2] == 1 and chain is not None:
            return min(float(shape[1] + 1), max(1.0, self.eta_ratio(shape) * chain))
        if key in self.tree_tokens:
            n = self.tree_rounds_of(shape)
            prompts = self.tree_tokens[key] if chain is None else pulled(self.tree_tokens[key], n, chain)
            first, openings = self.tree_opening.get(key, (None, 0))
            if self.opening and first is not None:
                prompts = pulled(first, openings, prompts)
            mine, rounds, _ = self.tree_request.get(key, (0.0, 0, 0.0))
            return max(1.0, (TREE_PRIOR_ROUNDS * prompts + mine) / (TREE_PRIOR_ROUNDS + rounds))
        return chain

    def eta_chain_read(self, depth: int, eta: float, weigh: bool = True) -> Optional[Tuple[float, float]]:
        """(tokens committed, drafts sent) a round of the greedy chain of up to `depth` drafts that `eta` ends, on the
        request running, from what the draft model read of llm's tokens (draft_stop.eta_chain_over_text over the
        reads' marks): the prompts' (the census requests' of `census_marks`) pulled toward by the request's own
        reads and its own rounds of that chain as if ALPHA_BASE_ROUNDS rounds had read them. None above temperature
        0 (a draft's probability of its own token is then not read) or before the census requests gave
        ALPHA_BASE_ROUNDS rounds. Priced from the chain's own rounds on other prompts instead, an η-chain of 8 over
        the links was 18-22 % slow a phase on average; from the reads, 3-19 % fast (docs/AUTO.md "The η-chain priced
        from the census's reads"). Whether a round goes on past its first rejected draft the reads say exactly (that
        draft's own confidence is read); what one that goes on sends past it, along its own text, no read saw: it is
        priced from the positions the reads found after a token the draft named, whose context ends as its own
        text's does (`EtaReads.past`), the prompts' and the request's pooled as their rounds are. Priced at the
        chain's own rounds past a rejection (a mean over the prompts auto drafted on, the easy ones: 6.0 drafts a
        round that went on), a hard prompt's rounds were priced at 3.4-5.2 drafts sent where they sent 2.5-2.9
        (docs/AUTO.md "What a chain sends along its own text").

        The prompts' reads are other texts than this prompt's: what they commit and send up to a rejection is
        carried to it as their share of an i.i.d. chain's tokens at their own agreement (`eta_chain_over_reads`'
        yardstick) times that chain's tokens at the request's belief of α (`chain_tokens`). Their tokens a round
        as they were (2.6-3.4 on the Qwen pair whatever the prompt) priced a drafting request under load where the
        rows committed 2.1-8.0; scaled by its chain's tokens at its α over any prompt's, at 0.65-0.79 of its chain
        (the rows 0.70-0.89), and the η-chain was priced 24-27 % slow a phase under load: the reads' tokens a round are
        a mean over rounds, which a hard prompt's many short ones dominate (the pool's i.i.d. chain at each read's
        own agreement: 3.8 a round as a mean over rounds, 4.9 over its prompts), the prior's α a mean over requests
        (docs/AUTO.md "The census's reads against their own α").

        The prompts' texts are weighed by how likely each text's agreement makes the request's own evidence (its
        drafts and reads: draft_stop.eta_chain_pool), so a request whose reads say its prompt is hard is priced from
        the hard texts' rounds, what they send past a rejection with them: pooled alike, a hard prompt's rounds were
        priced to send 3.5-4.8 drafts where they sent 2.5-2.9, the pool's rounds going on past a rejection as an
        easy text's do (docs/AUTO.md "The census's texts weighed by the request's evidence"); weigh False: alike,
        as before (`hat-bench eta-tail` compares the two). The request's own reads are short (its opening, or the
        stretches between drafting rounds), and the whole rounds a short text holds are its short ones: a round its
        end cut off counts what it will commit and send at least (`EtaReads.cut`), no round more. Without it a
        request that had read its first 16 tokens was priced 13 % below the tokens a round its chain commits, summed
        over 16 prompts each priced from the other 15 (1 % above with it; 8 tokens: 19 % and 10 % below)."""
        if self.kind != GREEDY:
            return None
        census = [m for m in (self.census_marks[:-1] if self.census else self.census_marks) if m]
        seen = (tuple(len(m) for m in census), census[0][:1] if census else ())  # what the pool holds now
        if self._census_read.get((depth, eta), (None,))[0] != seen:
            answers = [(eta_chain_over_reads([m], depth, eta), read_agreement(m)) for m in census]
            self._census_read[(depth, eta)] = (seen, [a for a in answers if a[0].rounds])  # a text no round fits
            # in prices nothing (and weighed alone would leave the pool no rounds)
        answers = self._census_read[(depth, eta)][1]
        if sum(reads.rounds for reads, _ in answers) < ALPHA_BASE_ROUNDS:
            return None
        prior, own = self.belief("sd", own=False), self.belief("sd")  # the request's own evidence: what its
        accepted, rejected = ((own[0] - prior[0], own[1] - prior[1]) if own is not None and prior is not None
                              and weigh else (0.0, 0.0))  # own drafts and reads moved its belief by
        pool = eta_chain_pool(answers, max(0.0, accepted), max(0.0, rejected), depth)
        chain = self.chain_tokens("sd", depth)  # the reads carried to this prompt: their share of the i.i.d. chain
        share = pool.rounds * chain / pool.chain if chain else 1.0  # at their own α, times this one's at its α
        carried = pool._replace(tokens=min((depth + 1) * pool.rounds, share * pool.tokens),
                                sent=min(depth * pool.rounds, share * pool.sent))
        mine = eta_chain_over_reads([self.request_marks], depth, eta)
        both = carried.times(ALPHA_BASE_ROUNDS / pool.rounds).plus(mine)
        done, ran, sent = self.tree_request.get(((depth, depth, 1), self.kind), (0.0, 0, 0.0))
        rounds = both.rounds + ran
        return (min(depth + 1.0, (both.tokens + mine.cut + done) / rounds),  # no round commits more than its
                min(float(depth), (both.sent + both.past() + mine.cut + sent) / rounds))  # drafts and one, sends more

    def eta_ratio(self, shape: Shape) -> float:
        """A chain-shaped tree's tokens a round over its chain's expectation (`tree_tokens_per_round`) under the
        request's kind of sampling: its rounds' moving averages, at an opening its first rounds', each pulled toward
        the one before (1, the chain's own, first)."""
        key = (shape, self.kind)
        ratio = _ratio_of(self.eta_chain.get(key), 1.0)
        return _ratio_of(self.eta_opening.get(key), ratio) if self.opening else ratio

    def observe_llm(self, tokens: int, cloud_s: float, up_bytes: int, down_bytes: int, wall_s: float,
                    link: Link, now: float) -> None:
        """One llm round at `now`: the cloud decoded `tokens` alone in cloud_s."""
        if tokens < 1:
            return
        self.opening = False
        self._ran("llm")
        name = self._step_name()
        self.step_unmeasured[name] = self.step_unmeasured.get(name, STEP_PROBE_ROUNDS) + 1
        if cloud_s > 0:
            self._cloud(1, cloud_s / tokens, now)
        self.up_round = ema(self.up_round, float(up_bytes))
        base = self.down_round if self.down_round is not None else 0.0
        self.down_per_token = ema(self.down_per_token, max(0.0, down_bytes - base) / tokens)
        link_s = link.transfer_s(up_bytes, down_bytes)
        self._overhead("llm", wall_s - cloud_s - link_s, link_s, cloud_s / tokens)

    def observe_catch_up(self, tokens: int, seconds: float) -> None:
        """The draft model read `tokens` committed tokens (no drafts) in one forward of `seconds`. The first such
        forward in a new power mode also says how much slower (or faster) the board now runs the model than in the
        last mode (the ratio to what that mode's forwards of this size took, within MODE_RATIO_BOUNDS): the draft
        step and the device alone, while they await their first observation in this mode, are the last mode's times
        that ratio (a read comes at every opening, drafting only when chosen: priced with the last mode's step, a
        board three times slower had sd at γ 7 chosen and one slow round run before llm)."""
        if tokens > 0 and seconds > 0 and math.isfinite(seconds):
            if self._restarts("catch_up"):
                if self.catch_up.known:
                    lo, hi = MODE_RATIO_BOUNDS
                    ratio = min(hi, max(lo, seconds / self.catch_up.g(tokens)))
                    for name in ("draft_step_s", "draft_step_busy_s", "local_step_s"):
                        if name in self.restart and getattr(self, name) is not None:
                            setattr(self, name, getattr(self, name) * ratio)
                self.catch_up = DelayModel()
            self.catch_up.observe(tokens, seconds)

    def catch_up_cost(self, tokens: int) -> float:
        """Seconds the draft model needs to read `tokens` in one forward before it can draft: the measured forwards
        (linear between sizes, the last slope past the largest), a draft step per token before any was measured.
        Below the smallest forward measured, the line from one draft step (a forward of one token, which every
        drafting round measures) to it, when that step is the smaller: the reader's forwards are of up to 64 tokens, and
        flat below them a catch-up of a few tokens was priced as a 64-token forward."""
        if tokens <= 0:
            return 0.0
        step = self.draft_step() or 0.0
        if not self.catch_up.known:
            return tokens * step
        points = self.catch_up.points()
        if 0.0 < step < points[0][1] and points[0][0] > 1.0:
            points = ((1.0, step),) + points
        return piecewise(points, tokens)

    def observe_local(self, tokens: int, seconds: float) -> None:
        """Tokens the device made alone (a degraded stretch) in `seconds` of its model."""
        if tokens > 0:
            self.opening = False
        if tokens > 0 and seconds > 0:
            self.local_step_s = ema(None if self._restarts("local_step_s") else self.local_step_s, seconds / tokens)

    def _step_spread(self, seconds: float, expected: float) -> None:
        """A verify step took `seconds` where the curve said `expected`: while the cloud is busy, its deviation,
        relative, squared, into `step_var` (one step a round: llm's rounds of several steps average theirs away)."""
        if expected > 0 and self.cloud_busy:
            self.step_var = ema(self.step_var, ((seconds - expected) / expected) ** 2, STEP_VAR_KEEP)

    @property
    def step_jitter(self) -> float:
        """The busy cloud's steps' relative standard deviation as this device's verify steps showed it (0 before any
        or while the cloud is idle): costmodel.phase_wait's jitter."""
        return math.sqrt(self.step_var) if self.step_var is not None and self.cloud_busy else 0.0

    def _ran(self, protocol: str) -> None:
        self.measured[protocol] = self.measured.get(protocol, 0) + 1

    def _cloud(self, positions: int, seconds: float, now: float, verify: bool = False) -> None:
        """A step of `positions` took `seconds`: a verify step's spread about the curve (`_step_spread`), the cloud's
        speed against the curve (`SpeedDrift`: every point, the report's and the device's own, moves by a share of the
        step's ratio to the curve, so a drift one protocol's rounds see prices the others too), then its bucket's
        moving average. A bucket whose last observation is older than STALE_S is not averaged with (a single probe
        after a loaded stretch must not be): it restarts from the curve's price at its size — the fresh points' and
        the report's, just moved by the speed — and the step is averaged into that, so one slow step moves its own
        size as it would any other (it once replaced the point: one slow llm chunk a few seconds after a verify
        priced llm by that chunk alone); with no curve, from the step alone."""
        curve = self.curve(now)
        expected = None
        if curve is not None:
            expected = curve.step_s(positions)
            if verify:
                self._step_spread(seconds, expected)
            factor = self.speed.move(expected, seconds, now)
            self._rescale(factor)
            expected *= factor
        b = _bucket(positions)
        if now - self.observed_at.get(b, now) > STALE_S:
            self.observed.restart(positions, expected)
        self.observed.observe(positions, seconds)
        self.observed_at[b] = now

    def _rescale(self, factor: float) -> None:
        """The cloud steps `factor` times as long as its curve said: every point of it, the device's own and the
        report's. (The report's wait for a busy cloud's step in progress is left as reported: what a busy round's
        overhead holds is kept net of it, and the next report states it again.)"""
        if factor == 1.0:
            return
        self.observed.scale(factor)
        self.reported = tuple((x, y * factor) for x, y in self.reported)

    def _overhead(self, protocol: str, residual_s: float, ahead_s: float, step_s: float) -> None:
        """A round's wall time beyond its parts; ahead_s: its time from the last reply's leaving to its request's
        arrival (drafting and the link); step_s: its own step's seconds. Under load it holds the wait for the step in
        progress: kept net of the wait the cloud's report stated then — half a step where its steps leave gaps, the
        phase wait of `ahead_s` where they run back to back (costmodel.phase_wait, its steps as long as the round's
        own: costmodel.cadence_s) — signed, so that the next report's wait, a load that grew or eased, prices the next
        round at once."""
        busy = bool(self.cloud_busy)
        key = self._overhead_key(protocol, busy)
        if busy:
            wait = phase_wait(max(0.0, ahead_s), cadence_s(self.reported_step_s, max(0.0, step_s)), self.step_jitter)
            value = residual_s - self.reported_wait_s - self.reported_duty * wait
        else:
            value = max(0.0, residual_s)
        restarts = self._restarts(key)
        if restarts or key not in self.overhead_s:
            self.overhead_rounds[key] = 0
        if key in self.overhead_rounds:
            self.overhead_rounds[key] += 1
        self.overhead_s[key] = ema(None if restarts else self.overhead_s.get(key), value)

    @staticmethod
    def _overhead_key(protocol: str, busy: bool) -> str:
        return f"{protocol}:busy" if busy else protocol

    def _overhead_entry(self, protocol: str) -> Optional[str]:
        """The key of overhead_s that prices `protocol`'s rounds: its own measured while the cloud was in the state it
        last reported (busy or idle), else — for a draft tree (`tree_key`) — sd's in that state, else its own or
        sd's in the other state; None before any. A tree's (the η-chain's) own, apart from the chains': what the
        phase-wait model (`_overhead`) misses of a busy cloud's wait depends on how long a round drafts, so pooled,
        the η-chain's rounds and the chains' priced each other wrong (docs/AUTO.md "Each shape its own overhead").
        An idle one as measured from its first round: the η-chain's were 0.050-0.059 s against sd's 0.015-0.018 in
        three traces (1-4 rounds each); pulled toward sd's, it priced the η-chain 4-5 % fast over the links."""
        busy = bool(self.cloud_busy)
        mine = (protocol, "sd") if protocol.startswith(TREE_KEY) else (protocol,)
        for state in (busy, not busy):
            for name in mine:
                if self._overhead_key(name, state) in self.overhead_s:
                    return self._overhead_key(name, state)
        return None

    def overhead(self, protocol: str) -> float:
        """o of `protocol` (`_overhead_entry`); 0 before one is measured. One measured busy is net of the wait reported
        then (`_overhead`): the wait the cloud reports now is added (0 when idle), and over its first rounds it is
        pulled toward the idle one (`_busy_overhead`)."""
        key = self._overhead_entry(protocol)
        return 0.0 if key is None else max(0.0, self._signed_overhead(key))

    def _signed_overhead(self, key: str) -> float:
        """The overhead `key` as measured, signed: one measured busy pulled (`_busy_overhead`) with the wait the
        cloud reports now added; below 0, what `overhead` does not price comes off the phase wait (`wait_credit`)."""
        if not key.endswith(":busy"):
            return self.overhead_s[key]
        return self._busy_overhead(key) + self.reported_wait_s

    def wait_credit(self, protocol: str) -> float:
        """Seconds of the busy cloud's phase wait `protocol`'s rounds did not wait: its busy overhead (`overhead`)
        below 0 — its rounds measured shorter than their parts and the waits priced then, the phase wait's model
        the more (a round overhead outside the waits is not below 0) — taken off the phase wait it prices
        (CloudCosts.wait_credit_s); 0 idle or at an overhead of 0 or more. Under load here every busy overhead was
        −0.03 to −0.20 s and priced at 0, sd 14–15 % below its rows (docs/AUTO.md "A wait the rounds did not
        wait")."""
        key = self._overhead_entry(protocol)
        if not self.cloud_busy or key is None or not key.endswith(":busy"):
            return 0.0
        return max(0.0, -self._signed_overhead(key))

    def _busy_overhead(self, key: str) -> float:
        """The busy overhead `key`, net of the wait, pulled toward the same protocol's idle one (a tree without its
        own, sd's) as if OVERHEAD_PRIOR_ROUNDS rounds had measured it: a busy round's residual holds how its request
        met the others' steps, a wide spread the wait model prices only on average, so a few rounds say little. As
        measured once its count is unknown (established) or no idle one is measured."""
        measured, rounds = self.overhead_s[key], self.overhead_rounds.get(key)
        idle = key[:-len(":busy")]
        prior = self.overhead_s.get(idle, self.overhead_s.get("sd") if idle.startswith(TREE_KEY) else None)
        if rounds is None or prior is None:
            return measured
        return pulled(measured, rounds, max(0.0, prior), OVERHEAD_PRIOR_ROUNDS)

    def wait_s(self, protocol: str) -> float:
        """The wait for a busy cloud's step in progress, as `protocol` should be priced with it: the report's half a
        step until the overhead that prices the protocol was measured under load, which then holds the wait (the
        cloud's compute seconds count only the steps a request is in; `overhead` adds the report's wait to what it
        measured beyond the wait reported then), so it is not counted twice."""
        key = self._overhead_entry(protocol)
        return 0.0 if key is not None and key.endswith(":busy") else self.reported_wait_s

    def cloud(self, curve: CostCurve, protocol: str) -> CloudCosts:
        """The cloud as `protocol`'s rounds should be priced: `curve`, the wait (`wait_s`) and, when busy, its
        others' step, duty and the steps' jitter (the phase wait), less what its rounds did not wait (`wait_credit`)."""
        return CloudCosts(curve, self.wait_s(protocol), step_s=self.reported_step_s, duty=self.reported_duty,
                          jitter=self.step_jitter, wait_credit_s=self.wait_credit(protocol))

    def wire(self, protocol: str = "sd") -> WireSizes:
        """The frames' bytes as measured; a draft row's those of `protocol`'s rounds (ksqs: its lattice codes) under
        the request's kind of sampling."""
        return WireSizes(self.up_round if self.up_round is not None else PRIOR_UP_ROUND,
                         self.up_per_draft(protocol) or 0.0,
                         self.down_round or 0.0,
                         self.down_per_token if self.down_per_token is not None else PRIOR_DOWN_PER_TOKEN)

    def device(self, shares_host: bool, protocol: str) -> DeviceCosts:
        """The device's costs as `protocol`'s rounds measured them."""
        return DeviceCosts(draft_step_s=self.draft_step() or 0.0, local_step_s=self.local_step_s or 0.0,
                           round_s=self.overhead(protocol), shares_host=shares_host)


def sampling_kind(params: SamplingParams) -> str:
    """How a request samples, as far as a draft's acceptance and its rows' bytes go: "greedy" at temperature 0,
    else its temperature and truncation ("T=0.7", "T=1 top-k=40")."""
    if params.temperature == 0:
        return GREEDY
    return (f"T={params.temperature:g}" + (f" top-k={params.top_k}" if params.top_k else "")
            + (f" top-p={params.top_p:g}" if params.top_p < 1 else ""))


def _joined(points: Tuple[Tuple[float, float], ...], others: float) -> Tuple[Tuple[float, float], ...]:
    """The cloud's curve (a step of x positions in all) as one session sees it when every step it joins also holds
    `others` positions of other sessions (continuous batching): x own positions cost g(x + others)."""
    if not points or others <= 0:
        return points
    g = CostCurve(points).step_s
    return ((1.0, g(1.0 + others)),) + tuple((x - others, y) for x, y in points if x - others > 1.0)


def _bucket(x: float) -> int:
    return max(0, int(x).bit_length() - 1)


def tree_key(shape: Shape) -> str:
    """The idle counter and the round overhead of sd with the draft tree `shape`."""
    return TREE_KEY + tree_text(shape)


def device_overhead(key: str) -> bool:
    """Whether the round overhead `key` of overhead_s is the device's (a power mode's own): a drafting protocol's or
    a draft tree's, not llm's."""
    return key in DEVICE_OVERHEADS or key.startswith(TREE_KEY)


def tree_text(shape: Shape) -> str:
    return "{}x{}x{}".format(*shape)
