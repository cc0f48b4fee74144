"""The split protocols on the device: `ushape` (HAT's baseline) and `hat` (paper 004), with prompt chunking (§3.3),
state monitoring (§3.2) and parallel drafting (§3.5).

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
from dataclasses import dataclass
from typing import List


from edge_runtime.generation import Generation
from edge_runtime.split_drafter import SplitDrafter
from hat_split.wire import messages as P
from hat_split.math.chunking import ema, parallel_steps
from hat_split.wire.hidden_codec import bytes_per_position, decode_hidden, encode_hidden


@dataclass
class LinkState:
    """The device's moving averages (α = 0.8) of what HAT's state monitoring needs from it."""

    up_bps: float = 0.0  # β_up: the cloud's measurements of this device's uploads
    down_bps: float = 0.0  # β_down: reply bytes over the reply's share of the round trip
    draft_s: float = 0.0  # γ: seconds per draft token
    g_mu: float = 0.0  # the cloud's last predicted step delay g(μ)

    def device(self, monitor=None) -> P.DeviceState:
        """This link's estimates with the device's own state (edge_runtime.monitor.DeviceMonitor) when it has one."""
        if monitor is None:
            return P.DeviceState(self.up_bps, self.down_bps, self.draft_s)
        return monitor.state(self.up_bps, self.down_bps, self.draft_s)


def _state(gen: Generation) -> LinkState:
    """The link's estimates: kept on the client (one per link), seeded from the configuration's guesses."""
    if gen.client.link_state is None:
        c = gen.config.split
        gen.client.link_state = LinkState(c.up_bps, c.down_bps)
    return gen.client.link_state


def _send(gen: Generation, position: int, states, want: int, pipelined: bool = False) -> float:
    """Send one Hidden (shallow states `# [1, n, hidden]` of the drafter's backend); returns the send time."""
    gen.step += 1
    payload = encode_hidden(gen.drafter.parts.to_wire(states), gen.config.split.hidden_format)
    idle = -1.0 if pipelined else max(0.0, time.perf_counter() - gen.client.last_reply_at)
    before = gen.client.counters.up_bytes
    gen.client.send(P.Hidden(gen.session_id, gen.step, position, payload, want, idle))
    gen.round_up_bytes.append(gen.client.counters.up_bytes - before)
    return time.perf_counter()


def _receive(gen: Generation, sent_at: float, up_bytes: int, want: int):
    """The Deep reply to a Hidden: updates the link estimates; returns deep states `# [1, want, hidden]` of the drafter's backend."""
    down0 = gen.client.counters.down_bytes
    reply = gen.client.receive()
    if not isinstance(reply, P.Deep):
        raise RuntimeError(f"unexpected answer to Hidden: {reply!r}")
    st = _state(gen)
    gen.cloud_compute_s += reply.compute_s
    gen.cloud_position = reply.position
    st.g_mu = reply.cloud.step_s
    if reply.uplink_bps > 0:
        st.up_bps = ema(st.up_bps or None, reply.uplink_bps)
        gen.uplink_bps = st.up_bps
    down_s = (gen.client.last_reply_at - sent_at - reply.compute_s - gen.client.base_rtt_s
              - (8.0 * up_bytes / st.up_bps if st.up_bps else 0.0))
    if down_s > 1e-3:
        st.down_bps = ema(st.down_bps or None, 8.0 * (gen.client.counters.down_bytes - down0) / down_s)
    if want == 0:
        return None
    parts = gen.drafter.parts
    if reply.states is None:
        raise RuntimeError("the cloud sent no deep states")
    return parts.from_wire(decode_hidden(reply.states, want, parts.hidden_size))


def chunk_plan(n: int, chunk: int) -> List[int]:
    """Chunk end positions for a prompt of n positions in chunks of `chunk` (0: one chunk)."""
    if n < 1:
        raise ValueError("empty prompt")
    if chunk <= 0 or chunk >= n:
        return [n]
    return list(range(chunk, n, chunk)) + [n]


def open_split(gen: Generation, prompt: List[int]) -> None:
    """OpenSplit, the chunked prefill, and the first token (from the target)."""
    c = gen.config.split
    dev: SplitDrafter = gen.drafter
    dev.start(prompt)
    st = _state(gen)
    split = dev.parts
    gen.client.send(P.OpenSplit(gen.session_id, gen.protocol, split.fingerprint, split.m, split.stop, c.hidden_format,
                                len(prompt), gen.client.base_rtt_s, st.device(gen.client.monitor)))
    opened = gen.client.receive()
    if not isinstance(opened, P.SplitOpened):
        raise RuntimeError(f"unexpected answer to OpenSplit: {opened!r}")
    if opened.hidden_size != split.hidden_size:
        raise RuntimeError(f"the cloud's hidden size {opened.hidden_size} is not the device's {split.hidden_size}")
    chunk = c.chunk_tokens if c.chunk_tokens > 0 else (opened.chunk_size if c.chunking == "auto" else 0)
    ends = chunk_plan(len(prompt), chunk)
    gen.prefill_chunks += len(ends)
    all_deep = split.tail > 0  # tail layers on the device need every position's deep state
    sent, start = [], 0
    for i, end in enumerate(ends):
        shallow = dev.prompt_states(end)
        want = end - start if all_deep else (1 if end == len(prompt) else 0)
        before = gen.client.counters.up_bytes
        t = _send(gen, start, shallow, want, pipelined=i > 0)
        sent.append((t, gen.client.counters.up_bytes - before, want, start))
        dev.lam_prefill(shallow)  # device work while the chunk is on the link
        start = end
    deep = None
    for t, up, want, position in sent:
        deep = _receive(gen, t, up, want)
        if all_deep:
            logits = dev.target_logits(deep, position, 1)
    if not all_deep:
        logits = dev.target_logits(deep, len(prompt) - 1, 1)
    gen.rounds += 1
    gen.commit([dev.sample_target(logits)])


def reopen_split(gen: Generation, prompt: List[int]) -> None:
    """After a link drop (generation.resume): a new split session replaying the whole committed sequence's shallow
    states, recomputed by the device's input part, chunked like a prompt; the first token it yields is the next one of
    the answer. Nothing but hidden states crosses the link, as in the first open. Greedy, the answer is token for token
    the uninterrupted one; sampled, it stays a sample of the target (the first token after the drop is sampled from
    the target directly rather than through a verification)."""
    gen.step = 0  # the new session counts its requests from 1
    open_split(gen, list(prompt) + gen.generated)


def round_ushape(gen: Generation) -> None:
    """One token per round trip: the last token's shallow state up, its deep state down, sample on the device."""
    dev: SplitDrafter = gen.drafter
    position = len(dev.tokens) - 1
    shallow = dev.last_state()
    before = gen.client.counters.up_bytes
    t = _send(gen, position, shallow, 1)
    deep = _receive(gen, t, gen.client.counters.up_bytes - before, 1)
    gen.rounds += 1
    gen.commit([dev.sample_target(dev.target_logits(deep, position, 1))])


def round_hat(gen: Generation) -> None:
    """Draft until η, verify with the cloud's deep states on the device; parallel drafting while waiting."""
    c = gen.config.split
    dev: SplitDrafter = gen.drafter
    st = _state(gen)
    limit = max(1, min(c.max_draft, gen.remaining - 1))
    t0 = time.perf_counter()
    state = dev.draft(limit, c.eta)
    L = len(state.drafts)
    st.draft_s = ema(st.draft_s or None, (time.perf_counter() - t0) / max(L, 1))
    before = gen.client.counters.up_bytes
    t = _send(gen, state.base, dev.upload_states(state), L + 1)
    up = gen.client.counters.up_bytes - before
    cands = []
    if c.parallel_draft and c.pd_topk > 0:
        cands = dev.candidates(state, c.pd_topk)
        a = bytes_per_position(c.hidden_format, dev.parts.hidden_size)
        steps = parallel_steps(L + 1, a, st.up_bps or 1e9, st.down_bps or 1e9, st.g_mu, st.draft_s,
                               gen.client.base_rtt_s) if st.draft_s > 0 else c.max_draft
        gen.pd_steps += _draft_candidates(dev, cands, steps, c, gen.client.ready)
    deep = _receive(gen, t, up, L + 1)
    n, token = dev.verify(state, dev.target_logits(deep, state.base, L + 1))
    if cands and dev.adopt(cands, token, n, L):
        gen.pd_hits += 1
    gen.rounds += 1
    gen.drafted += L
    gen.accepted += n
    gen.rejected += n < L
    gen.commit(state.drafts[:n] + [token], n)


def _draft_candidates(dev: SplitDrafter, cands, steps: int, c, stop) -> int:
    """Round-robin one draft step per candidate (most probable first) until `steps` or the reply is waiting."""
    done = 0
    limit = c.max_draft
    while done < steps and not stop():
        progressed = False
        for cand in cands:
            if done >= steps or stop():
                break
            if cand.stopped or len(cand.drafts) >= limit:
                continue
            dev.extend(cand, limit, c.eta, steps=1)
            done += 1
            progressed = True
        if not progressed:
            break
    return done


def close_split(gen: Generation, prompt: List[int]) -> None:
    """Close the session; the cloud reports the positions it held (it has no tokens to compare)."""
    closed = gen.client.request(P.CloseSession(gen.session_id, None, None, len(prompt) + len(gen.generated)))
    if not isinstance(closed, P.Closed):
        raise RuntimeError(f"unexpected answer to CloseSession: {closed!r}")
    if closed.n_tokens > len(prompt) + len(gen.generated) + gen.config.split.max_draft:
        raise RuntimeError(f"the cloud held {closed.n_tokens} positions for a {len(prompt)}+{len(gen.generated)} "
                           "token sequence")
