"""HAT's state monitoring and planning math (paper 004, §3.2-3.5), pure Python: no torch, no I/O.

- `DelayModel`: the cloud's predictive function g(x) of a step's compute delay for a batch of x tokens (eq. 2) and the
  moving average μ of its batch size (eq. 1), both with α = 0.8. g is kept as a moving average per batch-size bucket
  (powers of two), updated at the *observed* batch size (the paper writes the update at μ^t; attributing a delay to
  the size that produced it is what makes g usable for other sizes), and read by interpolating between buckets.
- `chunk_size`: eq. 3, X · A / β_up = (g(μ) + g(μ + X)) / P, solved for the integer X by bisection when the link is
  the bottleneck; when it is not (no crossing: the cloud processes a position slower than it uploads, as on a CPU
  cloud) the X whose predicted pipelined prefill (`prefill_finish`) ends first — eq. 3 would send one chunk there and
  lose the overlap of uploading with computing. Given the device's own prefill time per position (a board slower
  than the cloud is a third pipeline stage, which eq. 3 leaves out) the X whose predicted prefill ends first.
- `RateEstimate`, `arrival_known`: the device's link rates as moving averages of bits and seconds per transfer, and
  which replies' arrival times are known well enough to measure the next upload.
- `RoundTripFilter`: the link's round trip as the least of its recent samples (a windowed minimum), so that it follows
  a link that changes under an open connection.
- `SpeedDrift`: how much slower or faster than its curve the cloud steps now (its speed drifts with what else its host
  runs): each observed step moves every point of the curve by a share of its ratio to the curve's prediction, the
  share growing with the time since the last, so a drift seen at one size prices every size.
- `parallel_steps`: eq. 6, λ = ⌊(μ_i A / β_up + g(μ) + μ_i A / β_down) / γ⌋ (plus the propagation round trip).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from collections import deque
from typing import Deque, Dict, Optional, Sequence, Tuple

ALPHA = 0.8  # HAT §3.2: weight of the history in the moving averages


def ema(old: Optional[float], new: float, alpha: float = ALPHA) -> float:
    """α · old + (1 − α) · new; the first observation is taken as is."""
    return new if old is None else alpha * old + (1.0 - alpha) * new


@dataclass
class RateEstimate:
    """A link direction's rate from moving averages (α) of the bits and the seconds of its transfers: their ratio
    weighs each transfer by its size. An average of per-transfer rates would be ruled by the small transfers (a
    decoding round's few kilobytes), whose time is mostly clock and scheduling noise and whose rate is its inverse.
    `bps` is the configured guess until the first transfer is observed, then the measurement alone."""

    bps: float = 0.0
    bits: Optional[float] = None
    seconds: Optional[float] = None

    def observe(self, bits: float, seconds: float) -> float:
        if bits <= 0 or seconds <= 0:
            raise ValueError(f"a transfer needs bits > 0 and seconds > 0, got {bits} bits in {seconds} s")
        self.bits, self.seconds = ema(self.bits, bits), ema(self.seconds, seconds)
        self.bps = self.bits / self.seconds
        return self.bps


@dataclass
class RoundTripFilter:
    """The link's round trip: the least of the samples of the last `max_age_s` seconds, at most `window` of them.

    A sample is one exchange's time on the wire (its wall time less what the cloud reports it spent): queueing,
    scheduling and a device that read the reply late can only lengthen it, never shorten it, so the least is the
    estimate. A window, not the least ever seen, lets it rise when the link slows (after the window's samples age
    out); it falls at the first faster sample. The newest sample is always kept, so the filter is never empty once it
    has seen one. `value` is 0 before any."""

    window: int = 16
    max_age_s: float = 30.0
    samples: Deque[Tuple[float, float]] = field(default_factory=deque)  # (when, seconds), oldest first

    def __post_init__(self) -> None:
        if self.window < 1 or not self.max_age_s > 0:
            raise ValueError(f"a round-trip filter needs window >= 1 and max_age_s > 0, got {self.window}, "
                             f"{self.max_age_s}")

    def observe(self, seconds: float, now: float) -> float:
        if not (math.isfinite(seconds) and seconds > 0 and math.isfinite(now)):
            raise ValueError(f"a round-trip sample needs finite seconds > 0 and a finite time, got {seconds}, {now}")
        self.samples.append((now, seconds))
        while len(self.samples) > self.window or now - self.samples[0][0] > self.max_age_s:
            self.samples.popleft()
        return self.value

    @property
    def value(self) -> float:
        return min(s for _, s in self.samples) if self.samples else 0.0

    def clear(self) -> None:
        """A new connection: its path may be another."""
        self.samples.clear()


def arrival_known(uncertainty_s: float, upload_bits: float, up_bps: float, resolution_s: float = 1e-3) -> bool:
    """Whether a reply's arrival time is known well enough for the next upload to measure the uplink: the device saw
    the reply somewhere in a window of `uncertainty_s` (it was computing, not watching the socket); that window must
    be within a quarter of the upload's expected time on the link (or `resolution_s`, the clocks' resolution, for a
    transfer quicker than that). Without a rate yet, only an exactly seen arrival counts."""
    expected = upload_bits / up_bps if up_bps > 0 else 0.0
    return uncertainty_s <= max(resolution_s, 0.25 * expected)


def piecewise(points: Sequence[Tuple[float, float]], x: float) -> float:
    """The value at x of the curve through `points` ((x, y) in increasing x, at least one): linear between points;
    beyond the last, the last segment's slope (never negative; proportional to x through one point); below the first,
    flat."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / max(x1 - x0, 1e-9)
    xl, yl = points[-1]
    if len(points) == 1:
        return yl * x / xl
    xp, yp = points[-2]
    slope = max(0.0, (yl - yp) / max(xl - xp, 1e-9))
    return yl + slope * (x - xl)


@dataclass
class DelayModel:
    """μ (eq. 1) and g(·) (eq. 2) from observed (batch tokens, compute seconds) pairs."""

    alpha: float = ALPHA
    mu: Optional[float] = None  # moving average of tokens per step
    buckets: Dict[int, Tuple[float, float]] = field(default_factory=dict)  # bucket → (mean tokens, mean seconds)

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha < 1.0:
            raise ValueError(f"alpha must be in [0, 1), got {self.alpha}")

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens < 1 or not seconds >= 0 or math.isinf(seconds):
            raise ValueError(f"an observation needs tokens >= 1 and finite seconds >= 0, got {tokens}, {seconds}")
        self.mu = ema(self.mu, float(tokens), self.alpha)
        b = max(0, int(tokens).bit_length() - 1)
        old = self.buckets.get(b)
        self.buckets[b] = (float(tokens), float(seconds)) if old is None else (
            ema(old[0], float(tokens), self.alpha), ema(old[1], float(seconds), self.alpha))

    def restart(self, tokens: int, seconds: Optional[float]) -> None:
        """The bucket of steps of `tokens` tokens starts again at `seconds` (its next observation averaged in); None:
        dropped, its next observation starts it. μ is not moved (nothing was observed)."""
        b = max(0, int(tokens).bit_length() - 1)
        if seconds is None:
            self.buckets.pop(b, None)
        elif not (seconds >= 0 and math.isfinite(seconds)):
            raise ValueError(f"a bucket restarts at finite seconds >= 0, got {seconds}")
        else:
            self.buckets[b] = (float(tokens), float(seconds))

    @property
    def known(self) -> bool:
        return bool(self.buckets)

    def g(self, x: float) -> float:
        """Predicted seconds for a step of x tokens: linear between observed buckets; beyond the largest, the same
        per-token slope as its last segment (or proportional to x with one bucket); below the smallest, flat."""
        if not self.buckets:
            raise ValueError("no compute delay observed yet")
        return piecewise(sorted(self.buckets.values()), x)

    def points(self) -> Tuple[Tuple[float, float], ...]:
        """g's points, (mean tokens, mean seconds) per bucket in increasing tokens: what the cloud tells devices."""
        return tuple(sorted(self.buckets.values()))

    def g_mu(self) -> float:
        return self.g(self.mu) if self.known and self.mu is not None else 0.0

    def scale(self, factor: float) -> None:
        """Every bucket's seconds times `factor` (the cloud's speed moved: `SpeedDrift`)."""
        self.buckets = {b: (x, y * factor) for b, (x, y) in self.buckets.items()}


DRIFT_TAU_S = 10.0  # s: the time over which the cloud's speed is taken to move (here it drifted by up to 1.75x
# within tens of seconds: docs/AUTO.md "One speed over the curve")
DRIFT_BOUND = 4.0  # one step moves the curve by at most this factor either way (a stalled step is not a speed)


@dataclass
class SpeedDrift:
    """The cloud's speed against the curve that prices its steps. Its host's load drifts (here the same step took
    1.75x as long minutes apart), and the drift slows every size of step alike, where a curve kept per size bucket
    follows it only at the sizes being run: a protocol not run keeps the pace it last read. So each observed step —
    `seconds` where the curve predicted `predicted` — moves the whole curve by the factor (seconds / predicted)^w,
    w = 1 − exp(−Δt / τ) and Δt the time since the last observation: a step right after another moves it little (the
    steps' own noise, averaged over many), the first after a pause moves it all the way (nothing recent speaks
    against it). The ratio is bounded to 1/DRIFT_BOUND .. DRIFT_BOUND. `move` returns the factor; the caller
    multiplies its points (and keeps each size's own moving average on top, which learns the curve's shape)."""

    tau_s: float = DRIFT_TAU_S
    at: Optional[float] = None  # the time of the last observation (None: none yet, the next moves all the way)

    def __post_init__(self) -> None:
        if not self.tau_s > 0:
            raise ValueError(f"tau_s must be > 0, got {self.tau_s}")

    def move(self, predicted: float, seconds: float, now: float) -> float:
        """The factor by which every point of the curve moves for a step of `seconds` predicted at `predicted`
        observed at `now` (1 for a step that says nothing: non-positive or not finite)."""
        if not (predicted > 0 and seconds > 0 and math.isfinite(predicted) and math.isfinite(seconds)
                and math.isfinite(now)):
            return 1.0
        w = 1.0 if self.at is None else 1.0 - math.exp(-max(0.0, now - self.at) / self.tau_s)
        self.at = now if self.at is None else max(self.at, now)
        ratio = min(DRIFT_BOUND, max(1.0 / DRIFT_BOUND, seconds / predicted))
        return ratio ** w


MAX_CHUNKS = 128  # chunk counts tried in the compute-bound case


def prefill_finish(model: DelayModel, hidden_bytes: float, up_bps: float, pipeline: int, prompt_tokens: int,
                   chunk: int, input_s: float = 0.0, adapter_s: float = 0.0) -> float:
    """Predicted seconds from the start of the device's prefill until the cloud has processed the last chunk, for a
    prompt sent in chunks of `chunk` positions back to back. The device computes chunk k's shallow states (input_s
    seconds per position) and sends them, then runs Λ over them (adapter_s per position) before the next chunk's
    states; chunk k is on the cloud once its bytes and those before it are through the link; it waits g(μ) / P for
    the step in progress (eq. 3's waiting term), then passes the P pipeline stages, g(μ + x) / P each, each stage
    taking one chunk at a time. With input_s = adapter_s = 0 the clock starts at the first upload (eq. 3's setting)."""
    if not hidden_bytes > 0 or not up_bps > 0 or pipeline < 1 or prompt_tokens < 1 or chunk < 1:
        raise ValueError("prefill_finish needs hidden_bytes > 0, up_bps > 0, pipeline >= 1, positive sizes")
    if not (input_s >= 0 and adapter_s >= 0):
        raise ValueError(f"device seconds per position must be >= 0, got {input_s}, {adapter_s}")
    per_token = hidden_bytes * 8.0 / up_bps
    mu = model.mu or 0.0
    wait = model.g(mu) / pipeline
    stages = [0.0] * pipeline
    sent = 0.0
    for start in range(0, prompt_tokens, chunk):
        x = min(chunk, prompt_tokens - start)
        computed = input_s * (start + x) + adapter_s * start
        sent = max(sent, computed) + x * per_token
        t = sent + wait
        step = model.g(mu + x) / pipeline
        for s, free in enumerate(stages):
            t = max(t, free) + step
            stages[s] = t
    return stages[-1]


def chunk_size(model: DelayModel, hidden_bytes: float, up_bps: float, pipeline: int, prompt_tokens: int,
               input_s: float = 0.0, adapter_s: float = 0.0) -> int:
    """HAT eq. 3: the X in [1, prompt_tokens] where uploading X positions takes as long as the cloud's (wait + compute
    of X) divided by the pipeline length. X · A / β_up grows from 0, the right side from (2 g(μ)) / P. When the upload
    of the whole prompt is still quicker than its processing there is no crossing (the cloud is the bottleneck): then
    the chunk size, among ⌈N / k⌉ for k = 1..MAX_CHUNKS, with the earliest `prefill_finish` (ties: fewer chunks).

    Eq. 3 leaves out the device's own prefill, which a board slower than the cloud makes a third stage of the
    pipeline: given the device's seconds per position (input_s: its input layers, before a chunk can leave;
    adapter_s: Λ, after), the chunk size is the earliest `prefill_finish` among those sizes and eq. 3's X.

    hidden_bytes: A, bytes of one position's hidden state on the wire; up_bps: β_up in bit/s.
    """
    if prompt_tokens < 1:
        raise ValueError("prompt_tokens must be >= 1")
    if not hidden_bytes > 0 or not up_bps > 0 or pipeline < 1:
        raise ValueError("chunk_size needs hidden_bytes > 0, up_bps > 0 and pipeline >= 1")
    mu = model.mu or 0.0

    def gap(x: int) -> float:  # upload minus processing: increasing in x when the link is the bottleneck
        return x * hidden_bytes * 8.0 / up_bps - (model.g(mu) + model.g(mu + x)) / pipeline

    crossing = []
    if gap(prompt_tokens) > 0:  # the link is the bottleneck: eq. 3's crossing
        lo, hi = 1, prompt_tokens  # gap(hi) > 0
        if gap(lo) >= 0:
            hi = lo
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if gap(mid) < 0:
                lo = mid
            else:
                hi = mid
        if input_s == 0 and adapter_s == 0:
            return hi
        crossing = [hi]
    sizes = sorted({-(-prompt_tokens // k) for k in range(1, min(prompt_tokens, MAX_CHUNKS) + 1)}, reverse=True)
    return min(sizes + crossing, key=lambda x: prefill_finish(model, hidden_bytes, up_bps, pipeline, prompt_tokens, x,
                                                   input_s, adapter_s))


def parallel_steps(positions: int, hidden_bytes: float, up_bps: float, down_bps: float, g_mu: float,
                   draft_s: float, rtt_s: float = 0.0) -> int:
    """HAT eq. 6: draft steps that fit while `positions` hidden states go up, the cloud computes (g(μ)) and the deep
    states come down, at draft_s (γ) seconds per step. 0 when the device has no drafting delay estimate yet.

    rtt_s adds the link's propagation round trip, which eq. 6 leaves out (negligible on the paper's WiFi, not on a
    cellular or satellite link); 0 gives the paper's formula."""
    if positions < 0 or hidden_bytes <= 0 or up_bps <= 0 or down_bps <= 0 or g_mu < 0:
        raise ValueError("parallel_steps needs positions >= 0, positive sizes and rates, g_mu >= 0")
    if not draft_s > 0:
        return 0
    wait = positions * hidden_bytes * 8.0 / up_bps + g_mu + positions * hidden_bytes * 8.0 / down_bps + max(rtt_s, 0.0)
    return int(math.floor(wait / draft_s))
