"""The cost model of the protocols `auto` chooses among (and `hat-plan` prices on hardware we do not have): for one
protocol and its knob, the predicted tokens per second, time to first token, link bytes per token, cloud step seconds
per token and device seconds (and joules) per token. Pure Python, no torch, no clock: the device feeds it what it
measured (edge_runtime.auto), the planner what profiles state.

Terms (the round is Leviathan et al. 2023's; QS-SD eq. 7-10 add the link; HAT eq. 3/6 the split):
  * a round: the device drafts γ tokens (t_d each), sends them (up bytes), the cloud verifies γ + 1 positions in one
    step (g(γ + 1) seconds on its cost curve, after waiting w for the step in progress), the verdict comes back (down
    bytes); with i.i.d. acceptance α it commits E(α, γ) = (1 − α^(γ+1)) / (1 − α) tokens (Leviathan eq. 1).
  * a busy cloud (other devices' work keeps it stepping back to back, `CloudCosts.step_s` > 0): a round's request
    waits for the step in progress to end (`phase_wait`), the steps as long as the round's own step or the others'
    step the cloud reports, whichever is longer (`cadence_s`); less what the device measured its rounds not to wait
    of it (`CloudCosts.wait_credit_s`), down to none.
  * the link: a transfer of u bytes up and d down takes 8u / β_up + 8d / β_down + RTT.
  * tokens/s = E / round seconds; cloud seconds per token = g(positions of the round) / E: the step time an operator
    pays for one token, at the load the curve was measured under. On a cloud whose steps already hold μ positions of
    other devices' work (continuous batching), a round's k steps of x own positions each cost g(x + μ), of which
    g(μ) the others' step would take anyway: what the round adds is k (g(x + μ) − g(μ)), the marginal cloud seconds
    per token (`marginal_cloud_s`: the figure a fleet's capacity turns on; at μ = 0 all of g(x)).

Protocols:
  * `sd` (γ): round = γ t_d + o + link(u₀ + γ u₁, d₀ + E d₁) + w + g(γ + 1); E(α, γ) tokens.
  * `ksqs` (γ, K-SQS): sd's round, each draft sampled from its row's lattice quantization on the top-K support and
    sent as that row's enumerative code (QS-SD eq. 7-10: the round's latency is the drafting, the uplink of
    γ rows of b bits, the verification and the reply): u₁ is the code's bytes per row (a few dozen, against sd's
    float16 row over the draft's support at T > 0: tens of kilobytes on the Qwen pair) and α the acceptance of the
    quantized draft (its own; within 0.02 of sd's at K = 16, ℓ = 100 there).
  * `llm` (chunk c): the cloud decodes c tokens alone: round = o + link(u₀, d₀ + c d₁) + w + c g(1); c tokens.
  * `sd` with a draft tree of N nodes, D levels (`predict_tree`): round = D t_d + o + link(u₀ + N u₁, d₀ + τ d₁) + w +
    g(N + 1); τ tokens, measured (a tree's acceptance has no closed form here).
  * `slm`: t_local per token, nothing on the link, no cloud.
  * `ushape`: each token's shallow state goes up and its deep state comes back: round = t_s + o + link(A + u₀,
    A + d₀) + w + φ g(1); 1 token (φ: the middle part's share of a whole step; A: one state's bytes).
  * `hat` (γ): γ draft steps t_h, then γ + 1 states up and back, the middle part over γ + 1 positions and the device's
    output part over them in one pass (t_v: the head's weights read once): round = γ t_h + o + link((γ + 1) A + u₀,
    (γ + 1) A + d₀) + w + φ g(γ + 1) + t_v; E(α, γ) tokens.
  * `hat` with a draft tree of N nodes, D levels (`predict_hat_tree`): the drafter runs a level per forward (D t_h),
    the root's and the nodes' states go up and come back ((N + 1) A each way), the middle part verifies N + 1
    positions, and the device's head computes the rows the walk reads one at a time (τ of them: the path's and the one
    after it): round = D t_h + τ t_v + o + link((N + 1) A + u₀, (N + 1) A + d₀) + w + φ g(N + 1); τ tokens, measured.
  * time to first token: the prompt's n positions up (u per position: 4 bytes of token id, A for the split family),
    the cloud's prefill g(n), the device's own prefill n t_p when it cannot overlap the cloud's (a shared host), then
    the first round. `slm`: n t_p + t_local.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Dict, Iterable, List, Optional, Tuple

from hat_split.math.chunking import piecewise
from hat_split.math.verify import expected_tokens

__all__ = ["Link", "CostCurve", "DeviceCosts", "CloudCosts", "WireSizes", "Prediction", "predict", "predict_tree",
           "predict_hat_tree", "best_knob", "marginal_cloud_s", "cadence_s", "over_horizon",
           "KNOBBED", "PROMPT_ID_BYTES"]

KNOBBED = ("sd", "ksqs", "hat")  # protocols whose knob is the draft length γ (llm's: its chunk, the device's)
PROMPT_ID_BYTES = 4  # a prompt token id on the wire (int32)


def _check(obj) -> None:
    """Every field a finite real >= 0 (bools refused), named in the error."""
    for f in fields(obj):
        v = getattr(obj, f.name)
        if f.type in ("bool", bool):
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{type(obj).__name__}.{f.name} must be a finite number >= 0, got {v!r}")


@dataclass(frozen=True)
class Link:
    """The link as the device measured it: round trip of a tiny message (s) and the two rates (bit/s; 0 = not
    measured, taken as free: a loopback or a link whose transfers are lost in its round trip)."""

    rtt_s: float = 0.0
    up_bps: float = 0.0
    down_bps: float = 0.0

    def __post_init__(self) -> None:
        _check(self)

    def transfer_s(self, up_bytes: float, down_bytes: float) -> float:
        up = 8.0 * up_bytes / self.up_bps if self.up_bps > 0 else 0.0
        down = 8.0 * down_bytes / self.down_bps if self.down_bps > 0 else 0.0
        return self.rtt_s + up + down


@dataclass(frozen=True)
class CostCurve:
    """Seconds of one cloud step of x positions: linear through `points` ((positions, seconds), increasing
    positions), the slope of the last segment beyond them (hat_split.math.chunking.piecewise)."""

    points: Tuple[Tuple[float, float], ...]

    def __post_init__(self) -> None:
        pts = tuple((float(x), float(y)) for x, y in self.points)
        if not pts:
            raise ValueError("CostCurve.points: at least one (positions, seconds) point")
        for x, y in pts:
            if not (math.isfinite(x) and math.isfinite(y)) or x < 1 or y < 0:
                raise ValueError(f"CostCurve.points: positions >= 1 and seconds >= 0, finite, got ({x}, {y})")
        if any(b[0] <= a[0] for a, b in zip(pts, pts[1:])):
            raise ValueError("CostCurve.points: positions must increase")
        object.__setattr__(self, "points", pts)

    def step_s(self, positions: float) -> float:
        return piecewise(self.points, positions)


@dataclass(frozen=True)
class DeviceCosts:
    """The device's measured (or profiled) seconds. 0 where a protocol's part is absent (no split parts: ushape and
    hat are not predicted)."""

    draft_step_s: float = 0.0  # t_d: one token-draft step with its overheads (sd)
    local_step_s: float = 0.0  # t_local: one token of the device's model alone (slm)
    prefill_s: float = 0.0  # t_p: the device's prefill, per prompt position
    round_s: float = 0.0  # o: per round, outside the models (warp, rounding, packing, verification)
    split_step_s: float = 0.0  # t_s: ushape's device work per token (input part + head)
    hat_draft_s: float = 0.0  # t_h: one hat draft step (input part, drafter, draft head)
    hat_verify_s: float = 0.0  # t_v: the device's output part over one round's verified positions
    watts: float = 0.0  # the device's power while it computes (0: unknown, no joules predicted)
    shares_host: bool = False  # the device's prefill cannot overlap the cloud's (one machine)

    def __post_init__(self) -> None:
        _check(self)


@dataclass(frozen=True)
class CloudCosts:
    """The cloud as it reports itself: its cost curve, the wait for a step in progress, the middle part's share."""

    curve: CostCurve
    wait_s: float = 0.0  # w: expected wait before a request's step starts (load), beyond the phase wait below
    middle_share: float = 1.0  # φ: the split protocols' middle part over a whole step (layers L − 2m of L)
    step_s: float = 0.0  # s: a step of the other devices' work, when the cloud is busy with it ...
    duty: float = 0.0  # ... and the share of its time the cloud spends in steps (1: back to back): a round's request
    # then waits for the step in progress to end, duty × phase_wait(x, s, jitter) ...
    jitter: float = 0.0  # ... the steps' relative standard deviation (0: steady steps, the wait in phase with them)
    wait_credit_s: float = 0.0  # ... less this, as far as it goes: seconds a round waited less than the waits priced
    # here, as the device measured its rounds (a busy round overhead below 0: AutoEstimates.wait_credit)

    def __post_init__(self) -> None:
        if not isinstance(self.curve, CostCurve):
            raise ValueError("CloudCosts.curve must be a CostCurve")
        for name in ("wait_s", "middle_share", "step_s", "duty", "jitter", "wait_credit_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"CloudCosts.{name} must be a finite number >= 0, got {v!r}")
        if self.duty > 1.0:
            raise ValueError(f"CloudCosts.duty must be a share in [0, 1], got {self.duty!r}")


def phase_wait(x: float, step_s: float, jitter: float = 0.0) -> float:
    """The wait of a request that reaches a cloud stepping back to back (steps of step_s) x seconds after the step
    that carried its last reply ended: until the step in progress ends, s⌈x/s⌉ − x (0 for s = 0). A device's rounds
    are in phase with such a cloud's steps: a round whose drafting and link time x stays within one step waits the
    rest of it, and one that passes it waits most of another — so a round costs s⌈x/s⌉ plus its own step, and
    drafting up to the step's end is free. (A request at a random time would wait s/2 on average: the wait of a
    cloud busy only at times.)

    jitter: the steps' relative standard deviation σ (the others' batches differ step to step). The k-th step's end
    is then k·s give or take σ·s·√k, so a request x seconds on meets the steps' grid with a phase known to about
    σ·s·√max(1, x/s): the wait is the mean of s⌈t/s⌉ − t over t uniform on the window of that standard deviation
    (width √12 of it) around x — in phase for a short x and steady steps, s/2 once the window spans a step."""
    if not (math.isfinite(x) and x >= 0 and math.isfinite(step_s) and step_s >= 0 and math.isfinite(jitter)
            and jitter >= 0):
        raise ValueError(f"phase_wait needs finite x >= 0, step_s >= 0 and jitter >= 0, got {x}, {step_s}, {jitter}")
    if step_s <= 0:
        return 0.0
    half = 0.5 * math.sqrt(12.0) * jitter * step_s * math.sqrt(max(1.0, x / step_s))
    lo, hi = max(0.0, x - half), x + half
    if hi - lo < 1e-9 * step_s:
        return max(0.0, step_s * math.ceil(x / step_s - 1e-9) - x)  # a step's end within 1e-9 of x: no wait
    return (_waited(hi, step_s) - _waited(lo, step_s)) / (hi - lo)


def cadence_s(others_step_s: float, own_step_s: float) -> float:
    """The steps a round's request meets on a cloud busy with other devices' work (`phase_wait`'s s): as long as the
    step the round joins — its own, g(x + μ) on the curve its rounds measured, the others' work in it — and never
    shorter than the others' step the cloud reports, g(μ); 0 when the cloud reports no such work (others_step_s 0).
    Here the report's g(μ) was 0.40 s where the device's verify steps took 0.55-0.64 s, and its rounds' times at γ
    1-4 fit steps of its own step's length within 3 % (at low power under load, docs/AUTO.md "The steps a round
    meets")."""
    if not (math.isfinite(others_step_s) and others_step_s >= 0 and math.isfinite(own_step_s) and own_step_s >= 0):
        raise ValueError(f"cadence_s needs finite steps >= 0, got {others_step_s!r}, {own_step_s!r}")
    return max(others_step_s, own_step_s) if others_step_s > 0 else 0.0


def _waited(t: float, s: float) -> float:
    """∫₀ᵗ (s⌈u/s⌉ − u) du: s²/2 a whole step, s·r − r²/2 for the r into the last one."""
    k = math.floor(t / s)
    r = t - k * s
    return k * s * s / 2.0 + s * r - r * r / 2.0


@dataclass(frozen=True)
class WireSizes:
    """Bytes on the link per round (frames as measured: headers included)."""

    up_round: float = 0.0  # u₀: a round's request without drafts
    up_per_draft: float = 0.0  # u₁: per draft (its id and its distribution's row)
    down_round: float = 0.0  # d₀: a reply without tokens
    down_per_token: float = 0.0  # d₁: per committed token in the reply
    hidden: float = 0.0  # A: one position's hidden state (split family)

    def __post_init__(self) -> None:
        _check(self)


@dataclass(frozen=True)
class Prediction:
    protocol: str
    knob: int  # γ (sd, ksqs, hat), the chunk (llm), 0 (slm, ushape)
    tokens_per_round: float
    round_s: float
    ttft_s: float
    up_bytes_per_token: float
    down_bytes_per_token: float
    cloud_s_per_token: float
    device_s_per_token: float
    joules_per_token: Optional[float]  # None where the device's watts are unknown
    cloud_steps_per_token: float = 0.0  # cloud steps a token's round runs, per token (llm: 1; a verify: 1 / E; the
    # split family: its middle layers' share of each)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_round / self.round_s if self.round_s > 0 else math.inf

    def as_dict(self) -> Dict[str, object]:
        return {"protocol": self.protocol, "knob": self.knob, "tokens_per_s": self.tokens_per_s,
                "ttft_s": self.ttft_s, "tokens_per_round": self.tokens_per_round, "round_s": self.round_s,
                "up_bytes_per_token": self.up_bytes_per_token, "down_bytes_per_token": self.down_bytes_per_token,
                "cloud_s_per_token": self.cloud_s_per_token, "device_s_per_token": self.device_s_per_token,
                "joules_per_token": self.joules_per_token, "cloud_steps_per_token": self.cloud_steps_per_token}


def predict(protocol: str, knob: int, prompt_tokens: int, link: Link, device: DeviceCosts,
            cloud: Optional[CloudCosts], wire: WireSizes, alpha: float = 0.0) -> Prediction:
    """The module docstring's formulas for one protocol at one knob (γ for sd, ksqs and hat, the chunk for llm;
    ignored otherwise), a prompt of `prompt_tokens` positions, acceptance α (sd, ksqs, hat; `wire` holds the
    protocol's own bytes per draft). `cloud` may be None for slm only."""
    if prompt_tokens < 1:
        raise ValueError(f"prompt_tokens must be >= 1, got {prompt_tokens}")
    if protocol != "slm" and cloud is None:
        raise ValueError(f"{protocol}: the cloud's costs are needed")
    watts = device.watts
    if protocol == "slm":
        if not device.local_step_s > 0:
            raise ValueError("slm: the device's local step time is not known")
        t = device.local_step_s
        return Prediction("slm", 0, 1.0, t, prompt_tokens * device.prefill_s + t, 0.0, 0.0, 0.0, t,
                          watts * t if watts else None)
    g = cloud.curve.step_s
    if protocol in KNOBBED and (isinstance(knob, bool) or not isinstance(knob, int) or knob < 1):
        raise ValueError(f"{protocol}: the draft length must be an integer >= 1, got {knob!r}")
    split = protocol in ("ushape", "hat")
    if split and not wire.hidden > 0:
        raise ValueError(f"{protocol}: the size of a hidden state on the wire is not known")
    steps = 1.0  # cloud steps a round (llm's chunk: one a token)
    if protocol in ("sd", "ksqs"):  # the same round; ksqs's u₁ and α are its own (`wire`, `alpha`)
        n = expected_tokens(alpha, knob)
        device_s = knob * device.draft_step_s
        up, down = wire.up_round + knob * wire.up_per_draft, wire.down_round + n * wire.down_per_token
        cloud_s = g(knob + 1)
    elif protocol == "llm":
        if isinstance(knob, bool) or not isinstance(knob, int) or knob < 1:
            raise ValueError(f"llm: the chunk must be an integer >= 1, got {knob!r}")
        n = float(knob)
        device_s = 0.0
        up, down = wire.up_round, wire.down_round + knob * wire.down_per_token
        cloud_s = knob * g(1)
        steps = float(knob)
    elif protocol == "ushape":
        n, knob = 1.0, 0
        device_s = device.split_step_s
        up, down = wire.hidden + wire.up_round, wire.hidden + wire.down_round
        cloud_s = cloud.middle_share * g(1)
        steps = cloud.middle_share  # a share of a step: the middle layers' (of the others' too)
    elif protocol == "hat":
        n = expected_tokens(alpha, knob)
        device_s = knob * device.hat_draft_s + device.hat_verify_s
        up, down = (knob + 1) * wire.hidden + wire.up_round, (knob + 1) * wire.hidden + wire.down_round
        cloud_s = cloud.middle_share * g(knob + 1)
        steps = cloud.middle_share
    else:
        raise ValueError(f"no cost model for protocol {protocol!r}; it has: sd, ksqs, llm, slm, ushape, hat")
    return _round(protocol, knob, n, device_s, up, down, cloud_s, prompt_tokens, link, device, cloud, wire, steps)


def predict_tree(nodes: int, depth: int, tokens_per_round: float, prompt_tokens: int, link: Link,
                 device: DeviceCosts, cloud: CloudCosts, wire: WireSizes, sent: Optional[float] = None) -> Prediction:
    """`sd` with a draft tree of `nodes` nodes and `depth` levels (hat_split.math.tree), committing
    `tokens_per_round` tokens a round (measured: a tree's acceptance has no closed form here): the device drafts a
    level per forward (depth t_d: a level's few nodes cost one draft step, the weights read once — a stated
    assumption for a bandwidth-bound board), every node goes up (u₁ each), the cloud verifies nodes + 1 positions in
    one step. A chain of γ is the tree of γ nodes and depth γ. sent: the nodes a round sends on average when fewer
    than the shape's (a tree or chain that η ends early, as measured: its uploads and the cloud's positions; its
    drafting is the caller's device.draft_step_s)."""
    if nodes < 1 or not 1 <= depth <= nodes or not tokens_per_round >= 1:
        raise ValueError(f"a tree needs nodes >= depth >= 1 and >= 1 token a round, got {nodes}, {depth}, "
                         f"{tokens_per_round}")
    if sent is not None and not 1.0 <= sent <= nodes:
        raise ValueError(f"a tree of {nodes} nodes sends 1..{nodes} of them a round, got {sent}")
    n, m = float(tokens_per_round), float(nodes if sent is None else sent)
    up, down = wire.up_round + m * wire.up_per_draft, wire.down_round + n * wire.down_per_token
    return _round("sd_tree", nodes, n, depth * device.draft_step_s, up, down, cloud.curve.step_s(m + 1),
                  prompt_tokens, link, device, cloud, wire)


def predict_hat_tree(nodes: int, depth: int, tokens_per_round: float, prompt_tokens: int, link: Link,
                     device: DeviceCosts, cloud: CloudCosts, wire: WireSizes) -> Prediction:
    """`hat` with a draft tree of `nodes` nodes and `depth` levels committing `tokens_per_round` tokens a round
    (measured): a level per draft forward (its few nodes cost one draft step, the weights read once: the assumption
    predict_tree states), every node's state up and back, the middle part over nodes + 1 positions, and the head
    over the rows the walk reads, one call each (edge_runtime.split_drafter.TreeLogits)."""
    if nodes < 1 or not 1 <= depth <= nodes or not tokens_per_round >= 1:
        raise ValueError(f"a tree needs nodes >= depth >= 1 and >= 1 token a round, got {nodes}, {depth}, "
                         f"{tokens_per_round}")
    if not wire.hidden > 0:
        raise ValueError("hat: the size of a hidden state on the wire is not known")
    n = float(tokens_per_round)
    states = (nodes + 1) * wire.hidden
    return _round("hat_tree", nodes, n, depth * device.hat_draft_s + n * device.hat_verify_s,
                  states + wire.up_round, states + wire.down_round, cloud.middle_share * cloud.curve.step_s(nodes + 1),
                  prompt_tokens, link, device, cloud, wire, cloud.middle_share)


def _round(protocol: str, knob: int, n: float, device_s: float, up: float, down: float, cloud_s: float,
           prompt_tokens: int, link: Link, device: DeviceCosts, cloud: CloudCosts, wire: WireSizes,
           steps: float = 1.0) -> Prediction:
    """A round of n tokens from its parts (device seconds before the per-round overhead, bytes up and down, cloud
    step seconds in `steps` steps), and the time to first token before it."""
    split = protocol in ("ushape", "hat", "hat_tree")
    watts = device.watts
    device_s += device.round_s
    ahead = max(0.0, device_s + link.transfer_s(up, down))  # from the reply's leaving to the next request's arrival
    own_step = cloud_s / steps if steps > 0 else 0.0  # one of its steps (a middle part of no layers: none)
    phase = cloud.duty * phase_wait(ahead, cadence_s(cloud.step_s, own_step), cloud.jitter)
    round_s = ahead + cloud.wait_s + max(0.0, phase - cloud.wait_credit_s) + cloud_s
    prompt_s = link.transfer_s(prompt_tokens * (wire.hidden if split else PROMPT_ID_BYTES) + wire.up_round,
                               wire.down_round + (wire.hidden if split else 0.0)) + cloud.wait_s
    prompt_s += 0.5 * cloud.duty * cloud.step_s  # the prompt comes at no step's end: half a step on average
    prompt_s += (cloud.middle_share if split else 1.0) * cloud.curve.step_s(prompt_tokens)
    if device.shares_host or split:  # the split family's input part must run before its states can leave
        prompt_s += prompt_tokens * device.prefill_s
    return Prediction(protocol, knob, n, round_s, prompt_s + round_s, up / n, down / n, cloud_s / n, device_s / n,
                      watts * device_s / n if watts else None, steps / n)


def marginal_cloud_s(pred: Prediction, others_step_s: float) -> float:
    """The cloud seconds a token of `pred` adds (module docstring): its steps' seconds less, per step, the
    `others_step_s` (g(μ)) the other devices' work in the same steps would take alone; 0 others: its whole step
    time. `pred` priced on the curve as this device's steps join the others' (g(x + μ))."""
    if not (math.isfinite(others_step_s) and others_step_s >= 0):
        raise ValueError(f"marginal_cloud_s needs a finite others_step_s >= 0, got {others_step_s!r}")
    return max(0.0, pred.cloud_s_per_token - pred.cloud_steps_per_token * others_step_s)


def over_horizon(first: Prediction, tokens: float, then_tokens_per_s: float) -> Prediction:
    """`first`, a round that binds only itself, priced over the first `tokens` tokens of a request: its round, then
    what it leaves of them at `then_tokens_per_s` (whatever runs after it: the same for every candidate). Candidates
    whose rounds commit unlike numbers of tokens are compared over one stretch: a round of τ tokens in r seconds is
    worth r − τ / S seconds against the pace S after it, whatever the stretch T ≥ τ (T / (r + (T − τ) / S) falls as
    r − τ / S grows). At a request's opening an llm chunk of 8 binds 8 tokens at llm's pace and a draft round 1–3 at
    the opening's lower acceptance: compared a round each, a loaded cloud's llm chunk won at openings where sd's
    stretch was 1.3× as fast (docs/AUTO.md "An opening priced over one stretch")."""
    if not (math.isfinite(tokens) and tokens >= first.tokens_per_round > 0):
        raise ValueError(f"over_horizon needs tokens >= the round's {first.tokens_per_round!r} > 0, got {tokens!r}")
    if not (math.isfinite(then_tokens_per_s) and then_tokens_per_s > 0):
        raise ValueError(f"over_horizon needs a finite then_tokens_per_s > 0, got {then_tokens_per_s!r}")
    rest_s = (tokens - first.tokens_per_round) / then_tokens_per_s
    return replace(first, tokens_per_round=tokens, round_s=first.round_s + rest_s)


def best_knob(protocol: str, knobs: Iterable[int], prompt_tokens: int, link: Link, device: DeviceCosts,
              cloud: Optional[CloudCosts], wire: WireSizes, alpha: float = 0.0) -> Prediction:
    """The knob among `knobs` with the most predicted tokens/s (ties: the smaller knob)."""
    preds: List[Prediction] = [predict(protocol, k, prompt_tokens, link, device, cloud, wire, alpha) for k in knobs]
    if not preds:
        raise ValueError(f"{protocol}: no knob to choose from")
    return max(preds, key=lambda p: (p.tokens_per_s, -p.knob))

