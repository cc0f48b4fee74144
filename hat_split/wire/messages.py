"""Every message that crosses the device-cloud link, and how it is framed.

A message is one ZeroMQ multipart message:

    frame 0   b"HSP" + one byte protocol version + msgpack(header)
    frame 1.. raw tensor buffers, referenced from the header by index

The header is a tagged msgspec struct (`type` field). Array fields are sent as `Tensor` references
(dtype, shape, frame index) and decoded zero-copy with `np.frombuffer` over the received frame. Nothing is pickled.
Unknown fields from a newer peer are ignored; unknown message types, wrong versions, malformed or oversized frames
raise `ProtocolError`, which the server answers with an `Error` reply and then carries on.

Conversation (one device, token protocols):

    device                      cloud
    Hello          ───────────►
                   ◄─────────── Welcome           (versions, model, vocabulary fingerprint, limits)
    OpenSession    ───────────►                   (prompt tokens, protocol, sampling, seed)
                   ◄─────────── SessionOpened
    Verify         ───────────►                   (new committed tokens, L drafts, their distributions)
                   ◄─────────── Verdict           (accepted count, the resampled or bonus token)
    Generate       ───────────►                   (cloud-only decoding of n tokens, protocol `llm`)
                   ◄─────────── Generated
    CloseSession   ───────────►
                   ◄─────────── Closed

Split protocols (`hat`, `ushape`; HAT paper 004): no token, text or distribution ever crosses the link. The device
opens with `OpenSplit` (the model fingerprint and the layer range the cloud should run, its own link and drafting
state), then sends shallow hidden states in `Hidden` messages (prompt chunks, possibly several in flight, or a
round's drafts) and gets deep hidden states back in `Deep`; `position` is where the new states start, so the cloud
crops its cache there first (rejected drafts). `CloseSession` ends it as for token protocols.

    OpenSplit      ───────────►                   (fingerprint, layers [start, stop), hidden format, device state)
                   ◄─────────── SplitOpened       (hidden size, the chunk size of HAT eq. 3)
    Hidden         ───────────►                   (position, n shallow states, how many deep states to return)
                   ◄─────────── Deep              (the last `want` deep states, compute time, the cloud's load)

Send changes, not state: after `OpenSession`, a message carries only what the other side does not have yet (new
tokens, drafts and their distributions) and the position it applies at; the position lets the receiver detect a
desynchronised peer instead of silently diverging.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union
import zlib

import msgspec
import numpy as np

if sys.version_info >= (3, 9):
    from typing import Annotated
else:  # Python 3.8 (JetPack 5)
    from typing_extensions import Annotated

PROTOCOL_VERSION = 1  # bump on any incompatible change; the handshake refuses mismatches
MAGIC = b"HSP"
PREAMBLE_LEN = len(MAGIC) + 1
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20  # 64 MiB: 100 dense fp32 distributions over a 152k vocabulary fit
ALLOWED_DTYPES = ("int32", "int64", "float16", "float32", "float64", "uint8", "int8", "int16")
MAX_TENSOR_DIMS = 4


NonNeg = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[int, msgspec.Meta(ge=1)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0)]  # NaN is refused by the bound; ±inf is the receiver's to refuse
Ratio = Annotated[float, msgspec.Meta(ge=0, le=1)]
Label = Annotated[str, msgspec.Meta(max_length=256)]  # a name shown to operators (state, model, bundle)


class ProtocolError(Exception):
    """A frame that cannot be accepted. `code` is sent back in the Error reply."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class Tensor(msgspec.Struct, frozen=True):
    """Reference to a raw buffer frame: the header says how to view it."""

    dtype: str
    shape: List[int]
    frame: int


class Sampling(msgspec.Struct, frozen=True):
    """Sampling settings applied identically to draft and target (see hat_split.math.sampling)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0


class DistPayload(msgspec.Struct, frozen=True):
    """Draft distributions of L positions: dense, CSR-sparse or top-k bit-packed (see hat_split.wire.dist_codec)."""

    format: str  # "dense" | "sparse" | "topk" | "lattice"
    values: Any  # dense: [L, vocab] float16/32; sparse: [nnz] float16/32; topk, lattice: uint8 bytes of packed bits
    indices: Any = None  # sparse: [nnz] int32 token ids, ascending per row; topk: uint8 bytes of packed ids
    indptr: Any = None  # sparse and topk: [L + 1] int64 row offsets (topk: kept tokens per row, cumulated)
    bits: int = 0  # topk: bits per probability level (hat_split.math.topk_codec); lattice: bits in the stream
    ell: int = 0  # lattice: resolution ℓ of every row (hat_split.wire.sqs)
    k: int = 0  # lattice: support size of every row (V: the whole vocabulary); 0: each row states its own


class HiddenPayload(msgspec.Struct, frozen=True):
    """Hidden states of n positions (see hat_split.wire.hidden_codec)."""

    format: str  # "float16" | "float32" | "int8"
    values: Any  # [n, hidden] in that dtype
    scales: Any = None  # int8: [n] float32 per-row scale
    outlier_idx: Any = None  # int8: [n, k] int32 positions of the values sent exactly
    outliers: Any = None  # int8: [n, k] float16 those values


class TokenLogprobs(msgspec.Struct, frozen=True):
    """Log-probabilities of the tokens a reply commits (hat_split.math.logprobs), when the session asked for them."""

    values: Any  # [n] float32: each committed token's log-probability under the target
    top_ids: Any  # [n, k] int32: the k most probable tokens at each position, most probable first
    top_values: Any  # [n, k] float32: their log-probabilities


class DeviceState(msgspec.Struct, frozen=True, omit_defaults=True):
    """What the device measures about itself (HAT §3.2): moving averages, 0 where not known yet."""

    up_bps: float = 0.0  # uplink bandwidth β_up, bits per second
    down_bps: float = 0.0  # downlink bandwidth β_down
    draft_s: float = 0.0  # drafting delay γ: seconds per draft token
    power_mode: str = ""  # the device's nvpmodel mode as the board reports it ("" where it has none)
    profile: str = ""  # its device profile (hardware/devices), "" when not given
    input_s: float = 0.0  # prefill: seconds per prompt position of the device's input layers (before an upload)
    adapter_s: float = 0.0  # prefill: seconds per prompt position of its Λ (after each upload, before the next)


class CloudState(msgspec.Struct, frozen=True):
    """The cloud's load as HAT's state monitoring sees it (§3.2, eq. 1-2)."""

    batch_tokens: float = 0.0  # μ: moving average of tokens per model step
    step_s: float = 0.0  # g(μ): predicted compute delay of a step of μ tokens
    pipeline: int = 1  # P: pipeline stages of the middle part


class CloudCost(msgspec.Struct, frozen=True, omit_defaults=True):
    """What a step costs the cloud now, for the devices' cost models (hat_split.math.costmodel; `--protocol auto`):
    its cost curve — (positions, seconds) of its recent steps, one point per batch-size bucket (HAT eq. 2's g) — the
    moving average of positions per step, the sessions with work waiting, the KV positions still free, the other
    devices using the cloud (heard from in the last seconds or with work waiting; the asking device not counted) and
    their positions per step (the mean over the cloud's last steps: what each step of the asker's holds besides its
    own work; μ also counts the asker's own prompt, a large step just before its session opened). Sent
    with every SessionOpened and Reported; a device checks it (`cost_curve`) and keeps its last good one when it is
    malformed. `duty`: the share of the cloud's last seconds spent in steps (cloud_runtime.batching.StepStats.duty):
    near 1 its steps run back to back, and a request waits for the one in progress to end."""

    points: List[Tuple[float, float]] = []
    batch_tokens: float = 0.0
    queued: int = 0
    kv_free: int = 0
    others: int = 0
    others_positions: float = 0.0
    duty: float = 0.0  # the share of its last seconds the cloud spent computing steps (1: back to back; 0: an older
    # cloud, not stated)
    pace: float = 0.0  # tokens/s: the fleet pace its operator set (CloudConfig.fleet_pace_tokens_per_s) — what it asks
    # of each device whose request names no SLA of its own while other devices use it; 0: none


MAX_STEP_S = 3600.0  # a cloud step reported slower than an hour is absurd: refused
MAX_POSITIONS = 1 << 24  # as a step of more positions
MAX_PACE = 1e4  # tokens/s: a pace above this (a request's SLA, a cloud's fleet pace) is a typo, not a service level


def cost_curve(cost: CloudCost) -> Tuple[Tuple[float, float], ...]:
    """The report's points, checked (ValueError naming the field): finite, positions in 1..2^24 and increasing,
    seconds in [0, 3600]; batch_tokens, queued, kv_free, others and others_positions finite and >= 0; duty in [0, 1];
    pace in [0, 10^4] tokens/s.
    Empty when the cloud has run no step."""
    for name in ("batch_tokens", "queued", "kv_free", "others", "others_positions"):
        v = getattr(cost, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 \
                or v > MAX_POSITIONS:
            raise ValueError(f"CloudCost.{name} must be a number in [0, {MAX_POSITIONS}], got {v!r}")
    d = cost.duty
    if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0.0 <= d <= 1.0:  # NaN fails the bounds
        raise ValueError(f"CloudCost.duty must be a share in [0, 1], got {d!r}")
    v = cost.pace
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= MAX_PACE:
        raise ValueError(f"CloudCost.pace must be tokens/s in [0, {MAX_PACE:g}], got {v!r}")
    pts = []
    for i, pt in enumerate(cost.points):
        try:
            x, y = (float(v) for v in pt)
        except (TypeError, ValueError):
            raise ValueError(f"CloudCost.points[{i}] must be a (positions, seconds) pair, got {pt!r}") from None
        if not (math.isfinite(x) and 1 <= x <= MAX_POSITIONS):
            raise ValueError(f"CloudCost.points[{i}]: positions must be in [1, {MAX_POSITIONS}], got {x!r}")
        if not (math.isfinite(y) and 0 <= y <= MAX_STEP_S):
            raise ValueError(f"CloudCost.points[{i}]: seconds must be in [0, {MAX_STEP_S:.0f}], got {y!r}")
        if pts and x <= pts[-1][0]:
            raise ValueError(f"CloudCost.points[{i}]: positions must increase ({x} after {pts[-1][0]})")
        pts.append((x, y))
    return tuple(pts)


class Hello(msgspec.Struct, tag=True):
    device_id: str
    model: str  # the device's draft model, for logs and pairing checks
    vocab_size: NonNeg
    vocab_fingerprint: str  # hat_split.models.loading.vocab_fingerprint of the device tokenizer
    software: str = ""


class Welcome(msgspec.Struct, tag=True):
    protocol_version: int
    model: str
    vocab_size: NonNeg
    vocab_fingerprint: str
    session_timeout_s: float
    max_draft_len: NonNeg
    max_context: NonNeg
    protocols: List[str]
    software: str = ""
    max_tree_nodes: NonNeg = 0  # nodes of a draft tree one Verify may carry; 0: this cloud verifies chains only
    max_tree_depth: NonNeg = 0  # levels of such a tree
    held_s: float = 0.0  # as SessionOpened.held_s
    unseen_s: float = 0.0  # as SessionOpened.unseen_s


class OpenSession(msgspec.Struct, tag=True):
    session_id: NonNeg
    protocol: str
    prompt: Any  # [n] int32 token ids
    sampling: Sampling = Sampling()
    seed: Optional[NonNeg] = None  # the session's random streams (numpy SeedSequence entropy: never negative)
    link_rtt_s: float = 0.0  # the device's measured round trip of a tiny message: the cloud's uplink-rate baseline
    device: DeviceState = DeviceState()
    logprobs: Optional[NonNeg] = None  # k: the replies carry the committed tokens' log-probabilities and k alternatives


class SessionOpened(msgspec.Struct, tag=True):
    session_id: NonNeg
    position: NonNeg  # committed tokens the cloud holds (the prompt length)
    compute_s: float
    cost: Optional[CloudCost] = None  # the cloud's step costs now (None from older clouds)
    held_s: float = 0.0  # seconds from the cloud reading the request to sending this reply, queueing included
    # (0: an older cloud); the device takes it off an exchange's wall time to time the link (edge_runtime.client) ...
    unseen_s: float = 0.0  # ... when the request was read within this long of arriving (the cloud, busy computing,
    # did not look at its socket for that long before it read it: the request may have waited there unseen)


class Verify(msgspec.Struct, tag=True):
    session_id: NonNeg
    step: NonNeg  # increases by one per request of this session
    position: NonNeg  # committed length the device believes the cloud holds before new_tokens
    new_tokens: Any  # [m] int32 tokens committed on the device since the last message (m may be 0)
    draft: Any  # [L] int32 draft tokens, L >= 1
    dist: DistPayload  # the L distributions the drafts were sampled from (a tree: see parents)
    idle_s: float = 0.0  # device time between its previous reply arriving and this request leaving (rate estimate)
    # a draft tree (hat_split.math.tree): [L] int16 parent of each draft (-1: the last committed token; else an
    # earlier draft); then dist holds the distribution after the root and after each draft with children, in that
    # order (none at temperature 0). None: the drafts are a chain
    parents: Any = None


class Verdict(msgspec.Struct, tag=True):
    session_id: NonNeg
    step: NonNeg
    n_accepted: NonNeg
    token: NonNeg  # resampled token at the first rejection, or the bonus token if all were accepted
    position: NonNeg  # committed length after this step
    compute_s: float
    uplink_bps: float = 0.0  # the uplink rate the cloud measured on this request (0: not measurable)
    logprobs: Optional[TokenLogprobs] = None  # of the n_accepted + 1 committed tokens, if the session asked
    path: Any = None  # a tree's verdict: [n_accepted] int16 the accepted drafts' indices, the root's child first
    held_s: float = 0.0  # as SessionOpened.held_s
    unseen_s: float = 0.0  # as SessionOpened.unseen_s


class Generate(msgspec.Struct, tag=True):
    session_id: NonNeg
    step: NonNeg
    position: NonNeg
    new_tokens: Any  # [m] int32
    n: Positive  # tokens the cloud should decode on its own
    probs: bool = False  # the reply carries each token's probability under the distribution it was drawn from (a
    # device measuring its draft's acceptance on the target's tokens above temperature 0: protocol auto)


class Generated(msgspec.Struct, tag=True):
    session_id: NonNeg
    step: NonNeg
    tokens: Any  # [n] int32
    position: NonNeg
    compute_s: float
    logprobs: Optional[TokenLogprobs] = None  # of the n tokens, if the session asked
    held_s: float = 0.0  # as SessionOpened.held_s
    unseen_s: float = 0.0  # as SessionOpened.unseen_s
    probs: Any = None  # [n] float32 p(x) of each token as drawn (after temperature, top-k, top-p), if Generate asked


class CloseSession(msgspec.Struct, tag=True):
    session_id: NonNeg
    position: Optional[NonNeg] = None  # with new_tokens: the device's view before them, checked like a request's
    new_tokens: Any = None  # [m] int32 tokens committed on the device that the cloud has not seen (skipped ones)
    length: Optional[NonNeg] = None  # the device's final sequence length: the digest covers that prefix (the cloud
    # may hold one more token, a bonus the device cut at EOS or the length limit)


class Closed(msgspec.Struct, tag=True):
    session_id: NonNeg
    steps: NonNeg
    compute_s: float
    n_tokens: NonNeg = 0  # committed sequence length (prompt + generated) the cloud ended with
    digest: NonNeg = 0  # sequence_digest of its first CloseSession.length tokens (all if no length was given)
    held_s: float = 0.0  # as SessionOpened.held_s
    unseen_s: float = 0.0  # as SessionOpened.unseen_s


class OpenSplit(msgspec.Struct, tag=True):
    session_id: NonNeg
    protocol: str  # "hat" | "ushape"
    fingerprint: str  # hat_split.models.partition.model_fingerprint of the device's model: the cloud must hold the same
    start: NonNeg  # first middle layer (the device's input part has layers [0, start))
    stop: NonNeg  # end of the middle part (the device's output part holds layers [stop, n))
    hidden_format: str = "float16"  # the format of the deep states the device wants back (hat_split.wire.hidden_codec)
    prompt_tokens: NonNeg = 0  # the prompt's length (a size, not its content), for the chunk size of eq. 3
    link_rtt_s: float = 0.0
    device: DeviceState = DeviceState()


class SplitOpened(msgspec.Struct, tag=True):
    session_id: NonNeg
    hidden_size: NonNeg
    chunk_size: NonNeg  # prompt chunk size from HAT eq. 3 (0: the cloud has no estimate; the device decides)
    cloud: CloudState = CloudState()
    held_s: float = 0.0  # as SessionOpened.held_s
    unseen_s: float = 0.0  # as SessionOpened.unseen_s


class Hidden(msgspec.Struct, tag=True):
    session_id: NonNeg
    step: NonNeg
    position: NonNeg  # the cloud keeps this many positions of its cache, then appends `states`
    states: HiddenPayload  # [n, hidden] shallow states
    want: NonNeg  # deep states to return: the last `want` of the n (0 for a prompt chunk that is not the last)
    idle_s: float = 0.0
    device: Optional[DeviceState] = None  # updated measurements, when the device has new ones
    # a draft tree (hat_split.math.tree): [n] int16 parent of each state (-1: the position before the first; else an
    # earlier state); the n deep states come back. None: a chain
    parents: Any = None
    # after a tree: [k] int16 the rows, counted from the last tree's `position`, the cloud keeps (its accepted path)
    # before it crops to `position` and appends
    keep: Any = None


class Deep(msgspec.Struct, tag=True):
    session_id: NonNeg
    step: NonNeg
    position: NonNeg  # positions the cloud holds after this step
    states: Optional[HiddenPayload]  # [want, hidden] deep states (None when want was 0)
    compute_s: float
    uplink_bps: float = 0.0
    cloud: CloudState = CloudState()
    held_s: float = 0.0  # as SessionOpened.held_s
    unseen_s: float = 0.0  # as SessionOpened.unseen_s


class Error(msgspec.Struct, tag=True):
    code: str  # "version" | "malformed" | "oversized" | "invalid" | "no_session" | "desync" | "busy" | "internal" | ...
    message: str
    session_id: Optional[NonNeg] = None
    step: Optional[NonNeg] = None


class DeviceStats(msgspec.Struct, frozen=True, omit_defaults=True):
    """What a device agent served lately, for the cloud's fleet view (cloud_runtime.fleet): its requests of the window
    (edge_runtime.api.metrics: the last STATS_REQUESTS requests that ran, none older than STATS_WINDOW_S; refused
    ones, 429, never ran and are not counted). A figure with nothing to measure it from is None (absent)."""

    state: Label = ""  # the agent's state (edge_runtime.api.agent): "ready" (a report that arrives found the cloud
    # reachable), "stopped" (sent while stopping)
    bundle: Label = ""  # what runs its draft: the hat-export bundle directory's name, else the backend (torch, ...)
    model: Label = ""  # its draft model
    requests: NonNeg = 0  # requests of the window (completed or failed)
    protocols: Annotated[Dict[Label, NonNeg], msgspec.Meta(max_length=64)] = {}  # requests per protocol; sum = requests
    tokens_per_s: Optional[NonNegFloat] = None  # generated tokens / the generations' wall time (queue excluded)
    ttft_p50_s: Optional[NonNegFloat] = None  # median time to first token (queue wait included)
    tbt_p50_s: Optional[NonNegFloat] = None  # median of each request's mean time between tokens (>= 2 tokens)
    acceptance: Optional[Ratio] = None  # accepted / drafted tokens (None: nothing drafted)
    link_drops: NonNeg = 0  # link drops: survived (resumed) plus requests failed with the cloud unreachable
    watts: Optional[NonNegFloat] = None  # the module's power now (None: no power monitor on the board)


class Report(msgspec.Struct, tag=True):
    """HAT §3.2 state monitoring outside a request: the device's current state (a power-mode switch, a new drafting
    delay); answered with the cloud's. An agent adds what it served lately (None from peers that send none)."""

    device: DeviceState
    stats: Optional[DeviceStats] = None


class Reported(msgspec.Struct, tag=True):
    cloud: CloudState
    cost: Optional[CloudCost] = None  # the cloud's step costs now (None from older clouds)
    held_s: float = 0.0  # as SessionOpened.held_s
    unseen_s: float = 0.0  # as SessionOpened.unseen_s


Message = Union[
    Hello, Welcome, OpenSession, SessionOpened, Verify, Verdict, Generate, Generated, CloseSession, Closed,
    OpenSplit, SplitOpened, Hidden, Deep, Report, Reported, Error
]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> List[Any]:
    """Message → list of frames (bytes / zero-copy memoryviews) for `socket.send_multipart(copy=False)`."""
    buffers: List[Any] = []
    header = _encoder.encode(_with_tensor_refs(msg, buffers))
    return [MAGIC + bytes([PROTOCOL_VERSION]) + header] + buffers


def _with_tensor_refs(msg: Any, buffers: List[Any]) -> Any:
    """Replace ndarray fields (also inside DistPayload) by Tensor references, appending their buffers."""
    updates = {}
    for name in msg.__struct_fields__:
        value = getattr(msg, name)
        if isinstance(value, np.ndarray):
            if value.dtype.name not in ALLOWED_DTYPES:
                raise TypeError(f"field {name}: dtype {value.dtype} cannot be sent")
            arr = np.ascontiguousarray(value)
            buffers.append(memoryview(arr).cast("B") if arr.size else b"")
            updates[name] = Tensor(arr.dtype.name, list(arr.shape), len(buffers))
        elif isinstance(value, (DistPayload, HiddenPayload, TokenLogprobs)):
            updates[name] = _with_tensor_refs(value, buffers)
    return msgspec.structs.replace(msg, **updates) if updates else msg


def decode(frames: Sequence[Any], max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Message:
    """Frames → validated message with numpy arrays in place of Tensor references. Raises ProtocolError."""
    if not frames:
        raise ProtocolError("malformed", "empty message")
    total = sum(len(f) for f in frames)
    if total > max_bytes:
        raise ProtocolError("oversized", f"message of {total} bytes exceeds the limit of {max_bytes}")
    head = bytes(frames[0])
    if len(head) < PREAMBLE_LEN or head[:3] != MAGIC:
        raise ProtocolError("malformed", "frame 0 does not start with the hatspec magic b'HSP'")
    version = head[3]
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            "version", f"peer speaks hatspec protocol v{version}, this side speaks v{PROTOCOL_VERSION}"
        )
    try:
        msg = _decoder.decode(head[PREAMBLE_LEN:])
    except msgspec.ValidationError as exc:
        raise ProtocolError("malformed", f"invalid header: {exc}") from None
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:  # a string field that is not UTF-8 raises the latter
        raise ProtocolError("malformed", f"undecodable header: {exc}") from None
    used: set = set()
    return _resolve(msg, frames, used)


def _resolve(msg: Any, frames: Sequence[Any], used: set) -> Any:
    updates = {}
    for name in msg.__struct_fields__:
        value = getattr(msg, name)
        if isinstance(value, dict) and "frame" in value:
            updates[name] = _tensor_from_frame(value, frames, used, name)
        elif isinstance(value, (DistPayload, HiddenPayload, TokenLogprobs)):
            updates[name] = _resolve(value, frames, used)
    return msgspec.structs.replace(msg, **updates) if updates else msg


def _tensor_from_frame(ref: dict, frames: Sequence[Any], used: set, field_name: str) -> np.ndarray:
    try:
        t = msgspec.convert(ref, Tensor)
    except msgspec.ValidationError as exc:
        raise ProtocolError("malformed", f"field {field_name}: bad tensor reference: {exc}") from None
    if t.dtype not in ALLOWED_DTYPES:
        raise ProtocolError("malformed", f"field {field_name}: dtype {t.dtype!r} not allowed")
    if not 1 <= len(t.shape) <= MAX_TENSOR_DIMS or any(d < 0 for d in t.shape):
        raise ProtocolError("malformed", f"field {field_name}: bad shape {t.shape}")
    if not 1 <= t.frame < len(frames) or t.frame in used:
        raise ProtocolError("malformed", f"field {field_name}: frame {t.frame} missing or already used")
    used.add(t.frame)
    dtype = np.dtype(t.dtype)
    count = int(np.prod(t.shape, dtype=np.int64))
    buf = frames[t.frame]
    if len(buf) != count * dtype.itemsize:
        raise ProtocolError(
            "malformed",
            f"field {field_name}: frame {t.frame} has {len(buf)} bytes, shape {t.shape} {t.dtype} needs "
            f"{count * dtype.itemsize} (truncated?)",
        )
    if count == 0:
        return np.zeros(t.shape, dtype=dtype)
    return np.frombuffer(buf, dtype=dtype).reshape(t.shape)


def frame_bytes(frames: Sequence[Any]) -> int:
    """Bytes a message occupies on the wire before ZeroMQ's own framing (a few bytes per frame)."""
    return sum(len(f) for f in frames)


def split_envelope(frames: Sequence[Any]) -> Tuple[bytes, List[Any]]:
    """ROUTER side: [identity, frame0, ...] from a DEALER peer → (identity, message frames)."""
    return bytes(frames[0]), list(frames[1:])


@dataclass(frozen=True)
class Limits:
    """What a receiver accepts; checked on every request before any compute."""

    vocab_size: int  # token ids must be < this (the model's logits width)
    max_draft_len: int = 16  # drafts longer than this are refused (bounds verify memory and latency)
    max_context: int = 32768  # prompt + generated tokens per session
    max_generate: int = 256  # tokens one Generate may ask for


def sequence_digest(tokens: Sequence[int]) -> int:
    """CRC-32 of a token sequence (int32 little-endian): device and cloud compare sequences without sending them."""
    return zlib.crc32(np.asarray(tokens, dtype="<i4").tobytes())


def check_tokens(arr: Any, name: str, vocab_size: int, min_len: int = 0, max_len: int = 1 << 30) -> np.ndarray:
    """A 1-D int32 array of token ids in [0, vocab_size) with min_len <= len <= max_len, or ProtocolError."""
    if not isinstance(arr, np.ndarray) or arr.ndim != 1 or arr.dtype != np.int32:
        raise ProtocolError("invalid", f"{name} must be a 1-D int32 tensor")
    if not min_len <= arr.shape[0] <= max_len:
        raise ProtocolError("invalid", f"{name} has {arr.shape[0]} tokens, allowed {min_len}..{max_len}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= vocab_size):
        raise ProtocolError("invalid", f"{name} holds token ids outside [0, {vocab_size})")
    return arr


def check_index(arr: Any, name: str, length: Optional[int] = None) -> np.ndarray:
    """A 1-D int16 array of indices (of `length` when given: a draft tree's parents) as int64, or ProtocolError;
    what the indices must satisfy is the caller's (hat_split.math.tree.check_tree)."""
    if not isinstance(arr, np.ndarray) or arr.ndim != 1 or arr.dtype != np.int16:
        raise ProtocolError("invalid", f"{name} must be a 1-D int16 tensor")
    if length is not None and arr.shape[0] != length:
        raise ProtocolError("invalid", f"{name} has {arr.shape[0]} entries, {length} were due")
    return arr.astype(np.int64)
