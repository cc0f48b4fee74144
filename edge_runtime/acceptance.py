"""The drafting protocols' acceptance α as `--protocol auto` keeps it (edge_runtime.auto_estimates holds one per
drafting protocol and kind of sampling): the prompts' — accepted over examined draft positions a round, moving
averages over recent requests' rounds, pulled toward a base while few — and the request's own, which moves a
prompt's α from the prompts' as its drafts are examined (a prompt's α is its own: 0.6 to 1.0 on the Qwen pair). Pure
Python, no torch, no I/O."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from hat_split.math.chunking import ema

ALPHA_POPULATION = 0.98  # per drafting round: weight of the history in the prompts' acceptance (some 50 rounds,
# six to ten requests: a prompt's α is its own, 0.6 to 1.0 here, and the prior of the next one is their mean; at 0.95
# two easy prompts made it 1.00 and the next prompt, of α 0.76, drafted γ = 8)
ALPHA_PRIOR_DRAFTS = 8.0  # drafts the prompts' acceptance counts as against a request's own
ALPHA_BASE = 0.75  # the prompts' acceptance before any round, in the middle of the prompts' own here (0.55 to 1.00 on
# the Qwen pair at T = 0, results/auto/trace_T0_lte_load_load-power.json) ...
ALPHA_BASE_ROUNDS = 4.0  # ... worth this many rounds against those measured: three all-accepted rounds of one easy
# prompt on a fresh runtime read the prompts' α 1.00 without it, and the next prompt opened at γ 8 (0.86 with it);
# a tree's tokens a round are pulled as much towards its chain's (`tree_tokens_per_round`)
OPENING_RATIO = 0.85  # a request's first round (the answer's first tokens, hardest to draft) against its later ones:
# the prior of the openings' acceptance, the prompts' times this, worth ALPHA_BASE_ROUNDS rounds against the openings
# measured (`Acceptance.opening`). The Qwen pair's sd γ = 4 rows, T = 0: 0.67 on first rounds against 0.79-0.80 on
# the rest, 0.83-0.85 of it in each of twelve traces in results/auto (bench_auto_6588b75.json: 56 requests)


def population_ema(old: Optional[float], new: float, rounds: int) -> float:
    """The prompts' moving average (ALPHA_POPULATION) with its `rounds`-th round `new`: a plain mean over the first
    1 / (1 − ALPHA_POPULATION) rounds, so that the first round is not most of the estimate for twenty rounds (a
    tree's first round committing all 9 of its tokens held its tokens a round at 8–9 for requests whose rounds
    committed 2–5: docs/AUTO.md "A tree's first round is not most of its average")."""
    return ema(old, new, min(ALPHA_POPULATION, 1.0 - 1.0 / max(1, rounds)))


def pulled(measured: float, rounds: float, prior: float, weight: Optional[float] = None) -> float:
    """`measured` over `rounds` rounds, pulled toward `prior` as if `weight` rounds had read it (the prompts' α toward
    ALPHA_BASE, the openings' toward OPENING_RATIO × the prompts', a tree's tokens a round toward its chain's and, at
    an opening, its first rounds' toward its others'; a busy round overhead toward the idle one); `weight` None:
    ALPHA_BASE_ROUNDS."""
    weight = ALPHA_BASE_ROUNDS if weight is None else weight
    return (rounds * measured + weight * prior) / (rounds + weight)


@dataclass
class Acceptance:
    """A drafting protocol's acceptance: accepted and examined draft positions per round as moving averages
    (ALPHA_POPULATION) over the prompts of recent requests — plain means over the first rounds, until there are
    1 / (1 − ALPHA_POPULATION) of them, so the first round is not most of the estimate for twenty rounds — and the
    request's own totals (`begin`)."""

    accepted: Optional[float] = None
    examined: Optional[float] = None
    request_accepted: float = 0.0  # fractional: llm's tokens read above temperature 0 (observe_agreement)
    request_examined: int = 0
    rounds: int = 0
    opening_accepted: Optional[float] = None  # the same averages over requests' first rounds only (`opening`)
    opening_examined: Optional[float] = None
    opening_rounds: int = 0

    @property
    def population(self) -> Optional[float]:
        """The prompts' acceptance (the rounds of recent requests), pulled toward ALPHA_BASE as if ALPHA_BASE_ROUNDS
        rounds had read it, against every round observed (the pull fades as the pair's rounds accumulate: 2 % after
        200): a few rounds of one prompt are one prompt's, not the prompts'; None before a round."""
        if self.examined is None or not self.examined > 0:
            return None
        measured = min(1.0, (self.accepted or 0.0) / self.examined)
        return pulled(measured, self.rounds, ALPHA_BASE)

    @property
    def opening(self) -> Optional[float]:
        """The prompts' acceptance on a request's first round, which drafts the answer's first tokens: the openings
        measured (moving averages as the population's), pulled toward OPENING_RATIO times the prompts' acceptance as if
        ALPHA_BASE_ROUNDS openings had read it; None before a round. A first round on these prompts accepts less
        than the rest (half of them reject the first draft): priced at the prompts' α, a chain of 8 opened half the
        requests under load where η's chain drafts one or two (a fixed chain of 8's first token came 0.19-0.97 s
        after the η-chain row's there: docs/AUTO.md "The opening's own acceptance")."""
        prompts = self.population
        if prompts is None:
            return None
        prior = OPENING_RATIO * prompts
        if not self.opening_examined:
            return prior
        measured = min(1.0, (self.opening_accepted or 0.0) / self.opening_examined)
        return pulled(measured, self.opening_rounds, prior)

    @property
    def weight(self) -> float:
        """Rounds the population's average stands for (its memory at most)."""
        return min(float(self.rounds), 1.0 / (1.0 - ALPHA_POPULATION))

    @property
    def alpha(self) -> Optional[float]:
        """The acceptance for the request running: the prompts' as a prior worth ALPHA_PRIOR_DRAFTS drafts, moved by
        this request's own drafts (a prompt's α is its own: 0.6 to 1.0 here)."""
        prior = self.population
        if prior is None:
            return None
        return posterior(prior, self.request_accepted, self.request_examined)

    def begin(self) -> None:
        self.request_accepted = self.request_examined = 0

    def observe(self, drafted: int, accepted: int, opening: bool = False) -> None:
        """A round's drafts (`examined_of`); opening: the request's first round (`opening` as well)."""
        examined = examined_of(drafted, accepted)
        self.rounds += 1
        self.accepted = population_ema(self.accepted, float(accepted), self.rounds)
        self.examined = population_ema(self.examined, float(examined), self.rounds)
        if opening:
            self.opening_rounds += 1
            self.opening_accepted = population_ema(self.opening_accepted, float(accepted), self.opening_rounds)
            self.opening_examined = population_ema(self.opening_examined, float(examined), self.opening_rounds)
        self.inform(accepted, examined)

    def observe_read(self, accepted: float, examined: int) -> None:
        """Tokens the draft model read on a census request (AutoEstimates.census): `examined` of llm's tokens, of which
        its drafts would have had `accepted` accepted. They move the prompts' acceptance as a round's drafts do (each
        read one round of the averages: a read of many tokens weighs as many drafts in their ratio), and the
        request's; not the openings' (a read is not a first round)."""
        self.rounds += 1
        self.accepted = population_ema(self.accepted, float(accepted), self.rounds)
        self.examined = population_ema(self.examined, float(examined), self.rounds)
        self.inform(accepted, examined)

    def inform(self, accepted: float, examined: float) -> None:
        """Drafts of the request's prompt examined: they move the request's acceptance. A chain round of this
        protocol (`observe`) moves the prompts' as well; llm's tokens read and a chain-shaped tree's rounds only
        this."""
        self.request_accepted += accepted
        self.request_examined += examined


def examined_of(drafted: int, accepted: int) -> int:
    """A chain's draft positions examined in a round: the accepted ones and the first rejected, if any."""
    return accepted + (accepted < drafted)


def posterior(prior: float, accepted: float, examined: float) -> float:
    """A request's acceptance: `prior` worth ALPHA_PRIOR_DRAFTS drafts, moved by the request's own drafts."""
    return min(1.0, (ALPHA_PRIOR_DRAFTS * prior + accepted) / (ALPHA_PRIOR_DRAFTS + examined))
