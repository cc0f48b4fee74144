"""The split family's session (`ushape`, HAT's baseline, and `hat`, paper 004): the session opening with prompt
chunking (§3.3), the link estimates of state monitoring (§3.2), and the Hidden / Deep exchange its rounds use
(edge_runtime.rounds.hat: decoding and parallel drafting, §3.5).

Only hidden states cross the link: `OpenSplit` carries the model fingerprint, the layer range and the prompt's
*length*; `Hidden` carries shallow states; `Deep` brings deep states back; the device's own output part turns them
into target distributions and the device samples / verifies locally (edge_runtime.split_drafter).

Prefill: the prompt's shallow states go up in chunks — all chunks are sent back to back, the cloud computes chunk i
while chunk i + 1 is on the link, and the device runs its input part on chunk i + 1 and Λ on chunk i meanwhile. The
chunk size is `SplitConfig.chunk_tokens` if set, else the cloud's answer to eq. 3 (from its delay model and the
device's β_up), else the whole prompt. The first token comes from the target.

Decode: `ushape` sends the last token's shallow state and samples the next token from the target, one per round trip.
`hat` drafts until η (eq. 5), sends the L + 1 shallow states, and — with parallel drafting on — drafts continuations of
the top-k alternatives to the last draft until the reply arrives (at most λ steps, eq. 6).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence

import numpy as np

from edge_runtime.client import expect
from edge_runtime.monitor import DeviceMonitor
from edge_runtime.sessions.base import Session
from edge_runtime.split_drafter import SplitDrafter
from hat_split.math.chunking import RateEstimate, arrival_known, ema
from hat_split.math.draft_stop import AcceptanceByConfidence, DraftGate, RoundCosts
from hat_split.wire import messages as P
from hat_split.wire.hidden_codec import decode_hidden, encode_hidden


@dataclass
class LinkState:
    """The device's moving averages (α = 0.8) of what HAT's state monitoring needs from it. One per connection: the
    runtime keeps it from request to request, so a request starts from what the previous ones measured."""

    up: RateEstimate = field(default_factory=RateEstimate)  # β_up: the uploads' times the cloud measured
    down: RateEstimate = field(default_factory=RateEstimate)  # β_down: the replies' share of their round trips
    draft_s: float = 0.0  # γ: seconds per draft token
    g_mu: float = 0.0  # the cloud's last predicted step delay g(μ)
    input_s: float = 0.0  # prefill seconds per prompt position: the input layers (before a chunk can leave)
    adapter_s: float = 0.0  # and Λ (after it, before the next one); chunk_size weighs them
    acceptance: AcceptanceByConfidence = field(default_factory=AcceptanceByConfidence)  # hat's draft_stop "cost":
    round_costs: Optional[RoundCosts] = None  # what this connection's drafts were worth and what its rounds cost
    gate: DraftGate = field(default_factory=DraftGate)  # and whether its first draft steps pay

    @classmethod
    def configured(cls, up_bps: float, down_bps: float) -> "LinkState":
        """Starting from the configured rates (0: unknown) until the first transfers are measured."""
        return cls(RateEstimate(up_bps), RateEstimate(down_bps))

    @property
    def up_bps(self) -> float:
        return self.up.bps

    @property
    def down_bps(self) -> float:
        return self.down.bps

    def device(self, monitor: Optional[DeviceMonitor] = None) -> P.DeviceState:
        """This link's estimates with the device's own state when it has one."""
        if monitor is None:
            return P.DeviceState(self.up_bps, self.down_bps, self.draft_s, input_s=self.input_s,
                                 adapter_s=self.adapter_s)
        return monitor.state(self.up_bps, self.down_bps, self.draft_s, self.input_s, self.adapter_s)

    def observe_prefill(self, positions: int, input_s: float, adapter_s: float) -> None:
        """A prefill's device seconds over its positions (the adapter's 0 for U-shape leaves Λ's estimate as is)."""
        if positions > 0 and input_s > 0:
            self.input_s = ema(self.input_s or None, input_s / positions)
        if positions > 0 and adapter_s > 0:
            self.adapter_s = ema(self.adapter_s or None, adapter_s / positions)


@dataclass
class Upload:
    """One Hidden on the link, awaiting its Deep."""

    sent_at: float  # perf_counter() when it left
    up_bytes: int  # its frames' bytes
    position: int  # of its first shallow state
    want: int  # deep states asked for


def chunk_plan(n: int, chunk: int) -> List[int]:
    """Chunk end positions for a prompt of n positions in chunks of `chunk` (0: one chunk)."""
    if n < 1:
        raise ValueError("empty prompt")
    if chunk <= 0 or chunk >= n:
        return [n]
    return list(range(chunk, n, chunk)) + [n]


class SplitSession(Session):
    drafter: SplitDrafter

    def __init__(self, *args, link_state: LinkState, monitor: Optional[DeviceMonitor] = None, **kwargs):
        """Session's arguments; link_state: the connection's estimates (updated by every Deep); monitor: the device's
        state sent with the session opening (None: the link's estimates only)."""
        super().__init__(*args, **kwargs)
        self.link_state = link_state
        self.monitor = monitor
        self.step = 0  # Hidden messages of this cloud session
        self.tree_keep: Optional[List[int]] = None  # after a tree round: the rows the cloud keeps (next Hidden)
        self.cloud_position = 0  # positions the cloud's middle part holds
        self.drafter.pause = self.client.wait  # an emulated board's sleeps notice the replies that arrive meanwhile

    def open(self, prompt: List[int]) -> None:
        """OpenSplit, the chunked prefill, and the first token (from the target)."""
        c = self.config.split
        dev = self.drafter
        dev.start(prompt)
        split = dev.parts
        self.client.send(P.OpenSplit(self.session_id, self.name, split.fingerprint, split.m, split.stop,
                                     c.hidden_format, len(prompt), self.client.base_rtt_s,
                                     self.link_state.device(self.monitor)))
        opened = expect(self.client.receive(), P.SplitOpened, P.OpenSplit)
        if opened.hidden_size != split.hidden_size:
            raise RuntimeError(f"the cloud's hidden size {opened.hidden_size} is not the device's {split.hidden_size}")
        chunk = c.chunk_tokens if c.chunk_tokens > 0 else (opened.chunk_size if c.chunking == "auto" else 0)
        ends = chunk_plan(len(prompt), chunk)
        self.counters.prefill_chunks += len(ends)
        all_deep = split.tail > 0 or dev.features  # tail layers, and the feature drafter, need every position's
        uploads, start = [], 0
        input0, prefill0 = dev.input_s, dev.prefill_s
        for i, end in enumerate(ends):
            shallow = dev.prompt_states(end)
            want = end - start if all_deep else (1 if end == len(prompt) else 0)
            uploads.append(self.send_hidden(start, shallow, want, pipelined=i > 0))
            dev.lam_prefill(shallow)  # device work while the chunk is on the link
            start = end
        input_s = dev.input_s - input0
        self.link_state.observe_prefill(len(prompt), input_s, dev.prefill_s - prefill0 - input_s)
        deep = None
        for upload in uploads:
            deep = self.receive_deep(upload)
            if all_deep:
                logits = dev.target_logits(deep, upload.position, 1)
        if not all_deep:
            logits = dev.target_logits(deep, len(prompt) - 1, 1)
        self.counters.rounds += 1
        token = dev.sample_target(logits)
        self.commit([token], logprobs=self.token_logprobs(logits, [token]))

    def reopen(self, prompt: List[int]) -> None:
        """A new split session replaying the whole committed sequence's shallow states, recomputed by the device's
        input part, chunked like a prompt; the first token it yields is the next one of the answer. Nothing but
        hidden states crosses the link, as in the first open. Greedy, the answer is token for token the
        uninterrupted one; sampled, it stays a sample of the target (the first token after the drop is sampled from
        the target directly rather than through a verification)."""
        self.step = 0  # the new session counts its requests from 1
        self.tree_keep = None  # the new session holds no tree
        self.open(list(prompt) + self.generated)

    def close(self, prompt: List[int]) -> None:
        """Close the session; the cloud reports the positions it held (it has no tokens to compare)."""
        n = len(prompt) + len(self.generated)
        closed = expect(self.client.request(P.CloseSession(self.session_id, None, None, n)), P.Closed, P.CloseSession)
        if closed.n_tokens > n + max(self.config.split.draft_len, self.config.split.tree_nodes):
            raise RuntimeError(f"the cloud held {closed.n_tokens} positions for a {len(prompt)}+{len(self.generated)} "
                               "token sequence")

    # -- what rounds use -----------------------------------------------------------------------------------------
    def send_hidden(self, position: int, states: Any, want: int, pipelined: bool = False,
                    parents: Optional[Sequence[int]] = None) -> Upload:
        """Send one Hidden: shallow states `# [1, n, hidden]` (the drafter's backend) of positions position.. (parents:
        theirs when they are a draft tree). The accepted path of the last tree, if any, goes with it (`keep`)."""
        self.step += 1
        payload = encode_hidden(self.drafter.parts.to_wire(states), self.config.split.hidden_format)
        idle = -1.0 if pipelined else self._idle_s(8.0 * payload.values.nbytes)
        before = self.client.counters.up_bytes
        keep, self.tree_keep = self.tree_keep, None
        self.client.send(P.Hidden(self.session_id, self.step, position, payload, want, idle,
                                  parents=None if parents is None else np.asarray(parents, np.int16),
                                  keep=None if keep is None else np.asarray(keep, np.int16)))
        up = self.client.counters.up_bytes - before
        self.counters.round_up_bytes.append(up)
        return Upload(time.perf_counter(), up, position, want)

    def _idle_s(self, upload_bits: float) -> float:
        """What the cloud subtracts from the time between its last reply leaving and this upload arriving to get the
        upload's time on the link: the reply's own transfer (at β_down; its propagation is in the base round trip)
        and the device's time from the reply's arrival to now. -1 (measure nothing) when the arrival is not known
        well enough: the device was computing when the reply came and saw it only afterwards (parallel drafting)."""
        client, st = self.client, self.link_state
        if not arrival_known(client.arrival_uncertainty_s, upload_bits, st.up_bps):
            return -1.0
        transfer = 8.0 * client.last_reply_bytes / st.down_bps if st.down_bps > 0 else 0.0
        return transfer + max(0.0, time.perf_counter() - client.last_reply_at)

    def receive_deep(self, upload: Upload) -> Any:
        """The Deep reply to an upload: updates the link estimates; returns deep states `# [1, want, hidden]` of the
        drafter's backend (None when none were asked for)."""
        reply = expect(self.client.receive(), P.Deep, P.Hidden)
        st = self.link_state
        self.counters.cloud_compute_s += reply.compute_s
        self.cloud_position = reply.position
        st.g_mu = reply.cloud.step_s
        up_bits = 8.0 * upload.up_bytes
        if reply.uplink_bps > 0:
            st.up.observe(up_bits, up_bits / reply.uplink_bps)
        down_s = (self.client.last_reply_at - upload.sent_at - reply.compute_s - self.client.base_rtt_s
                  - (up_bits / st.up_bps if st.up_bps else 0.0))
        if down_s > 1e-3 and self.client.arrival_uncertainty_s <= 1e-3:
            st.down.observe(8.0 * self.client.last_reply_bytes, down_s)
        if upload.want == 0:
            return None
        parts = self.drafter.parts
        if reply.states is None:
            raise RuntimeError("the cloud sent no deep states")
        return parts.from_wire(decode_hidden(reply.states, upload.want, parts.hidden_size))
