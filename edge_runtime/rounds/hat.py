"""Rounds of the split protocols over a SplitSession: `ushape` (one token per round trip) and `hat` (Λ or the feature
drafter drafts until η, or a tree; the cloud's middle part computes the deep states, the device verifies; parallel
drafting while it waits, §3.5)."""
from __future__ import annotations

import time
from typing import Callable, List, Optional, Tuple

import numpy as np

from edge_runtime.config import SplitConfig
from edge_runtime.sessions.split import LinkState, SplitSession
from edge_runtime.split_drafter import DraftState, SplitDrafter
from hat_split.math.chunking import ema, parallel_steps
from hat_split.math.draft_stop import DraftStop, RoundCosts
from hat_split.math.tree import below_chain, check_tree
from hat_split.wire.hidden_codec import bytes_per_position


def round_ushape(session: SplitSession) -> None:
    """The last token's shallow state up, its deep state down, sample the next token on the device."""
    dev = session.drafter
    position = len(dev.tokens) - 1
    deep = session.receive_deep(session.send_hidden(position, dev.last_state(), 1))
    session.counters.rounds += 1
    logits = dev.target_logits(deep, position, 1)
    token = dev.sample_target(logits)
    session.commit([token], logprobs=session.token_logprobs(logits, [token]))


def tree_round_hat(session: SplitSession) -> None:
    """Λ or the feature drafter drafts a tree (SplitDrafter.draft_tree), its 1 + N shallow states go up with their
    parents, the middle layers run them with the tree's mask and send 1 + N deep states back, the device's output
    part turns them into the target's logits and verifies the tree; the next upload tells the cloud which path to
    keep."""
    c = session.config.split
    dev = session.drafter
    welcome = session.client.welcome
    if not welcome.max_tree_nodes:
        raise ValueError("this cloud verifies no draft trees (an older cloud, or max_tree_nodes 0): set "
                         "split.tree_nodes = 0 for chains")
    depth = max(1, min(c.tree_depth, welcome.max_tree_depth, session.remaining - 1))
    t0 = time.perf_counter()
    draft = dev.draft_tree(min(c.tree_nodes, welcome.max_tree_nodes), depth, c.tree_width, c.draft_stop_prob)
    t = draft.tree
    N = len(t.tokens)
    session.link_state.draft_s = ema(session.link_state.draft_s or None, (time.perf_counter() - t0) / depth)
    parents = below_chain(1, t.parents)  # the root, then the tree below it
    deep = session.receive_deep(session.send_hidden(draft.base, draft.shallow, N + 1, parents=parents))
    logits = dev.target_logits(deep, draft.base, N + 1, tree=parents)  # rows on demand
    verdict = dev.verify_tree(draft, logits)
    path = verdict.path
    dev.keep_tree_path(draft, path, logits)
    session.tree_keep = [0] + [n + 1 for n in path]
    counters = session.counters
    counters.rounds += 1
    counters.drafted += N
    counters.accepted += len(path)
    counters.rejected += not path or bool(np.any(t.parents == path[-1]))  # the path stopped above a leaf
    committed = [int(t.tokens[n]) for n in path] + [verdict.token]
    before = len(session.generated)
    session.commit(committed, len(path), session.token_logprobs(logits.take(session.tree_keep), committed))
    levels = int(check_tree(t.parents, t.tokens, N, depth).max())  # Λ's forwards this round
    counters.verify_log.append([len(session.generated) - before, levels, time.perf_counter() - t0])


def round_hat(session: SplitSession) -> None:
    """Draft until η, verify with the cloud's deep states on the device; parallel drafting while waiting (a draft
    tree instead when split.tree_nodes > 0)."""
    c = session.config.split
    if c.tree_nodes:
        return tree_round_hat(session)
    dev = session.drafter
    st = session.link_state
    limit = max(1, min(c.draft_len, session.remaining - 1))
    t0 = time.perf_counter()
    stop = None  # the measured cost rule; a connection's first rounds end by η until a round has been measured
    if c.draft_stop == "cost" and st.round_costs is not None:
        stop = DraftStop(st.acceptance, st.round_costs, probe=st.gate.probe())
        if not st.gate.worth(st.acceptance, st.round_costs, st.draft_s):
            limit = 0  # first drafts seldom repay their step here: this round sends the last token alone
    state = dev.draft(limit, c.draft_stop_prob, admit=stop.admit if stop else None)
    L = len(state.drafts)
    drafting = time.perf_counter() - t0
    draft_steps = len(stop.offered) if stop is not None else L  # steps run (a refused draft's included)
    if L:
        st.draft_s = ema(st.draft_s or None, drafting / L)
    upload = session.send_hidden(state.base, dev.upload_states(state), L + 1)
    cands = []
    if c.parallel_draft and c.pd_topk > 0:
        cands = dev.candidates(state, c.pd_topk)
        a = bytes_per_position(c.hidden_format, dev.parts.hidden_size)
        steps = parallel_steps(L + 1, a, st.up_bps or 1e9, st.down_bps or 1e9, st.g_mu, st.draft_s,
                               session.client.base_rtt_s) if st.draft_s > 0 else c.draft_len
        session.counters.pd_steps += _draft_candidates(dev, cands, steps, c, session.client.ready)
    counters = session.counters
    cloud0 = counters.cloud_compute_s
    deep = session.receive_deep(upload)
    t_head = time.perf_counter()
    logits = dev.target_logits(deep, state.base, L + 1)  # [L + 1, vocab]
    verify_s = counters.cloud_compute_s - cloud0 + time.perf_counter() - t_head
    n, token = dev.verify(state, logits)
    if cands and dev.adopt(cands, token, n, L):
        counters.pd_hits += 1
    counters.rounds += 1
    counters.drafted += L
    counters.accepted += n
    counters.rejected += n < L
    committed = state.drafts[:n] + [token]
    before = len(session.generated)
    session.commit(committed, n, session.token_logprobs(logits[:n + 1], committed))
    seconds = time.perf_counter() - t0
    counters.verify_log.append([len(session.generated) - before, L, seconds])
    if c.draft_stop == "cost":
        offered = stop.offered if stop is not None else state.conf
        wire_s = 8 * bytes_per_position(c.hidden_format, dev.parts.hidden_size) / st.up_bps if st.up_bps else 0.0
        # a request's first round also runs the feature drafter over the whole prompt: not a round's cost
        typical = len(counters.verify_log) > 1 or not dev.features
        timing = (L, seconds, drafting / draft_steps if draft_steps else None, verify_s, wire_s)
        _measure_round(st, state.conf, offered[0] if offered else None, n, timing if typical else None)


def _measure_round(st: LinkState, confidences: List[float], first: Optional[float], accepted: int,
                   timing: Optional[Tuple[int, float, Optional[float], float, float]]) -> None:
    """What the cost rule learns from a verified round: its drafts' outcomes by confidence, the first draft's
    probability when the step ran, and its timing (drafts sent, seconds, seconds per draft step or None when none
    ran, seconds verifying, a draft's seconds on the uplink; None: not a typical round's)."""
    st.acceptance.observe(confidences, accepted)
    if first is not None:
        st.gate.observe(first)
    if timing is None:
        return
    drafts, seconds, draft_s, verify_s, wire_s = timing
    if st.round_costs is None:
        st.round_costs = RoundCosts.first(drafts, seconds, draft_s or 0.0, verify_s, wire_s)
    else:
        st.round_costs.observe(drafts, seconds, draft_s, verify_s, wire_s)


def _draft_candidates(dev: SplitDrafter, cands: List[DraftState], steps: int, c: SplitConfig,
                      stop: Callable[[], bool]) -> int:
    """Round-robin one draft step per candidate (most probable first) until `steps` or the reply is waiting."""
    done = 0
    limit = c.draft_len
    while done < steps and not stop():
        progressed = False
        for cand in cands:
            if done >= steps or stop():
                break
            if cand.stopped or len(cand.drafts) >= limit:
                continue
            dev.extend(cand, limit, c.draft_stop_prob, steps=1)
            done += 1
            progressed = True
        if not progressed:
            break
    return done
