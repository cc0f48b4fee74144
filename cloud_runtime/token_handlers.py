"""The token protocols' requests (hat_split.protocols family "token": sd, hlm, llm, qs, ...), plain Python and numpy
(no torch): OpenSession, Verify, Generate and the close of a token session.

Each request is checked before anything changes (`ProtocolError` otherwise), charged to its device
(cloud_runtime.quotas.Admission) and queued as model work through every layer (`ModelWork.submit_tokens` with a
`Pending`); its finisher gets the logits of the work's last positions back and verifies the drafts
(hat_split.math.target_state.TargetState.accept) or samples the next token with the session's own `TargetState`.
"""
from __future__ import annotations

from typing import List, Optional

import numpy as np

from cloud_runtime.config import CloudConfig
from cloud_runtime.family import FamilyHandlers
from cloud_runtime.quotas import Admission
from cloud_runtime.sessions import Arrival, TargetSession
from cloud_runtime.state import CloudTables
from cloud_runtime.work import ModelFacts, ModelWork, Pending, cloud_cost
from hat_split.math.logprobs import MAX_TOP_LOGPROBS, Logprobs, concat, token_logprobs
from hat_split.math.sampling import SamplingParams
from hat_split.math.target_state import TargetState
from hat_split.math.tree import below_chain, check_tree
from hat_split.protocols import of_family
from hat_split.wire import messages as P
from hat_split.wire.dist_codec import decode_dist

TOKEN_PROTOCOLS = of_family("token")  # verified by the full target


class TokenHandlers(FamilyHandlers):
    """One method per token-protocol request, and a finisher per request that queues work."""

    def __init__(self, config: CloudConfig, model: ModelFacts, work: ModelWork, tables: CloudTables,
                 admission: Admission, arrival: Arrival):
        super().__init__(config, model, work, tables, admission, arrival)
        self.limits = P.Limits(model.vocab_size, config.max_draft_len, config.max_context, config.max_generate)

    def open(self, identity: bytes, msg: P.OpenSession) -> Optional[P.Message]:
        if msg.protocol not in TOKEN_PROTOCOLS:
            raise P.ProtocolError("invalid", f"protocol {msg.protocol!r} is not served here; known: {TOKEN_PROTOCOLS}")
        prompt = P.check_tokens(msg.prompt, "prompt", self.limits.vocab_size, 1, self.limits.max_context)
        if msg.logprobs is not None and msg.logprobs > MAX_TOP_LOGPROBS:
            raise P.ProtocolError("invalid", f"logprobs asks for {msg.logprobs} alternatives per token; at most "
                                             f"{MAX_TOP_LOGPROBS}")
        try:
            params = SamplingParams(msg.sampling.temperature, msg.sampling.top_k, msg.sampling.top_p)
        except ValueError as exc:
            raise P.ProtocolError("invalid", f"sampling: {exc}") from None
        key, admission = (identity, msg.session_id), self.admission
        self.sessions.not_computing(key)
        self.tables.registry.observe(identity, msg.device)
        cost = self.work.kv_cost(0, self.model.layers)
        device = admission.charge(identity, key, cost, len(prompt) - 1, key not in self.sessions, len(prompt))
        admission.admit(identity, key)
        self.sessions.forget(key)  # reopening an id replaces the old session (which may have been a split one)
        admission.with_room(identity, key, lambda: self.work.open(key, 0, self.model.layers, device))
        session = TargetSession(msg.session_id, msg.protocol, TargetState(params, msg.seed, prompt.tolist()),
                               device)
        session.link_rtt_s = max(0.0, float(msg.link_rtt_s))
        session.logprobs = msg.logprobs
        self.sessions.put(key, session)
        self.tables.stats.sessions_opened += 1
        if len(session.tokens) == 1:  # the last prompt token is fed with the first drafts: nothing to prefill
            return P.SessionOpened(msg.session_id, 1, 0.0, self._cost(session))
        pending = Pending(identity, msg, session, **self.arrival.stamp())  # (now: the lambda may run later)
        admission.with_room(identity, key, lambda: self.work.submit_tokens(key, session.tokens[:-1], 0, pending))
        admission.spend(device, len(prompt))
        return None

    def opened(self, p: Pending, _: None) -> P.Message:
        return P.SessionOpened(p.msg.session_id, len(p.session.tokens), p.compute_s, self._cost(p.session))

    def _cost(self, session: TargetSession) -> P.CloudCost:
        """The cost report for a session's device: the others using the cloud counted without it."""
        return cloud_cost(self.work, session.device, self.sessions.others_active(session.device),
                          self.config.fleet_pace_tokens_per_s)

    def verify(self, identity: bytes, msg: P.Verify) -> Optional[P.Message]:
        session = self.sessions.continuing(identity, msg)
        lim = self.limits
        new = P.check_tokens(msg.new_tokens, "new_tokens", lim.vocab_size)
        tree = msg.parents is not None
        if tree:
            self.check_trees_taken()
        draft = P.check_tokens(msg.draft, "draft", lim.vocab_size, 1,
                               self.tree_nodes if tree else lim.max_draft_len)
        L = draft.shape[0]
        parents = self._tree(draft, msg.parents) if tree else None
        if len(session.tokens) + new.shape[0] + L + 1 > lim.max_context:
            raise P.ProtocolError("context", f"session would exceed max_context={lim.max_context} tokens")
        q = self._q(msg.dist, draft, parents, session.target.params.temperature == 0)
        key, drafts = (identity, msg.session_id), draft.tolist()
        feed = session.tokens[self.work.held(key)[0]:] + new.tolist() + drafts
        self.admission.charge(identity, key, self.work.kv_cost(0, self.model.layers), len(feed))
        pending = Pending(identity, msg, session, self.arrival.uplink_bps(session, msg.idle_s), draft=drafts, q=q,
                          parents=parents, **self.arrival.stamp())
        chain = None if not tree else below_chain(len(feed) - L, parents)
        self.admission.with_room(identity, key, lambda: self.work.submit_tokens(key, feed, L + 1, pending, chain))
        session.tokens.extend(new.tolist())  # committed once the work is queued (a refusal changes nothing)
        session.step = msg.step
        return None

    def _tree(self, draft: np.ndarray, parents_wire) -> np.ndarray:
        """A Verify's draft tree checked (ProtocolError naming what is wrong); its parents `# [L]` int64."""
        parents = P.check_index(parents_wire, "parents", draft.shape[0])
        try:
            check_tree(parents, draft, self.tree_nodes, self.config.max_tree_depth)
        except ValueError as exc:
            raise P.ProtocolError("invalid", f"draft tree: {exc}") from None
        return parents

    def _q(self, dist: P.DistPayload, draft: np.ndarray, parents: Optional[np.ndarray], greedy: bool) -> np.ndarray:
        """The draft distributions a Verify sent `# [rows, vocab]`: one per draft of a chain; for a tree, after the
        root and after each draft with children (none at temperature 0), spread to `# [L + 1, vocab]` (rows of
        leaves zero). ProtocolError when they do not decode or give a draft no probability."""
        L, vocab = draft.shape[0], self.limits.vocab_size
        if parents is None:
            holders, rows = np.arange(L), L
        else:
            holders = np.concatenate([[-1], np.unique(parents[parents >= 0])])
            rows = 0 if greedy else holders.size
        try:
            q = decode_dist(dist, rows, vocab)
        except ValueError as exc:
            raise P.ProtocolError("invalid", f"dist: {exc}") from None
        if parents is None:
            if np.any(q[np.arange(L), draft] <= 0):
                raise P.ProtocolError("invalid", "a draft token has zero probability under the distribution sent "
                                                 "with it")
            return q
        full = np.zeros((L + 1, vocab), dtype=np.float32)
        if rows:
            full[holders + 1] = q
            if np.any(full[parents + 1, draft] <= 0):
                raise P.ProtocolError("invalid", "a draft has zero probability under its parent's distribution")
        return full

    def verdict(self, p: Pending, logits: np.ndarray) -> P.Message:
        """Verify the drafts against the target's logits `# [L + 1, vocab]` (after the root, then after each draft);
        the cache keeps the accepted ones: a chain's prefix, a tree's accepted path (the other branches dropped)."""
        session, msg = p.session, p.msg
        key = (p.identity, msg.session_id)
        if p.parents is not None:
            start = self.work.held(key)[0] - len(p.draft)  # where the tree's nodes begin in the cache
            verdict = session.target.accept_tree(p.parents, p.draft, p.q, logits)
            self.work.keep(key, start, verdict.path)
            n, token, rows = len(verdict.path), verdict.token, [0] + [i + 1 for i in verdict.path]
            path = np.asarray(verdict.path, np.int16)
        else:
            n, token, keep = session.target.accept(p.draft, p.q, logits)
            self.work.crop(key, keep)  # drop the rejected tail
            rows, path = list(range(n + 1)), None
        committed = session.tokens[len(session.tokens) - n - 1:]
        lp = None if session.logprobs is None else token_logprobs(logits[rows], committed, session.logprobs)
        return P.Verdict(msg.session_id, msg.step, n, token, len(session.tokens), p.compute_s, p.uplink_bps,
                         _wire(lp), path)

    def generate(self, identity: bytes, msg: P.Generate) -> Optional[P.Message]:
        session = self.sessions.continuing(identity, msg)
        lim = self.limits
        new = P.check_tokens(msg.new_tokens, "new_tokens", lim.vocab_size)
        if msg.n > lim.max_generate:
            raise P.ProtocolError("invalid", f"n={msg.n} exceeds max_generate={lim.max_generate}")
        if len(session.tokens) + new.shape[0] + msg.n > lim.max_context:
            raise P.ProtocolError("context", f"session would exceed max_context={lim.max_context} tokens")
        if msg.n < 1:  # nothing to compute: commit and answer
            session.tokens.extend(new.tolist())
            session.step = msg.step
            return P.Generated(msg.session_id, msg.step, np.zeros(0, np.int32), len(session.tokens), 0.0)
        key = (identity, msg.session_id)
        feed = session.tokens[self.work.held(key)[0]:] + new.tolist()
        self.admission.charge(identity, key, self.work.kv_cost(0, self.model.layers), len(feed) + msg.n)
        pending = Pending(identity, msg, session, **self.arrival.stamp())
        self.admission.with_room(identity, key, lambda: self.work.submit_tokens(key, feed, 1, pending))
        session.tokens.extend(new.tolist())
        session.step = msg.step
        return None

    def next_token(self, p: Pending, logits: np.ndarray) -> Optional[P.Message]:
        """Sample the next token from logits `# [1, vocab]`; one token per step, like any decoding device."""
        p.generated.append(p.session.target.sample_next(logits))
        if p.msg.probs:
            p.probs.append(p.session.target.drawn_p)
        if p.session.logprobs is not None:
            p.logprobs.append(token_logprobs(logits[-1:], p.generated[-1:], p.session.logprobs))
        msg = p.msg
        if len(p.generated) < msg.n:  # the request's next position (its quota was charged for all n at once)
            key = (p.identity, msg.session_id)
            self.admission.with_room(p.identity, key, lambda: self.work.submit_tokens(key, p.generated[-1:], 1, p))
            return None
        return P.Generated(msg.session_id, msg.step, np.asarray(p.generated, np.int32), len(p.session.tokens),
                           p.compute_s, _wire(concat(p.logprobs) if p.logprobs else None),
                           probs=np.asarray(p.probs, np.float32) if msg.probs else None)

    def close(self, identity: bytes, msg: P.CloseSession, session: TargetSession) -> P.Message:
        """Close `session` (the one msg names) and report the digest of the tokens the device holds. Everything is
        checked before anything changes: a refused CloseSession leaves the session intact."""
        key = (identity, msg.session_id)
        self.sessions.not_computing(key)
        new: List[int] = []
        if msg.new_tokens is not None:  # the device's last skipped tokens: append (no compute) before the digest
            new = P.check_tokens(msg.new_tokens, "new_tokens", self.limits.vocab_size).tolist()
            if msg.position != len(session.tokens):
                raise P.ProtocolError(
                    "desync", f"device assumes position {msg.position}, the cloud holds {len(session.tokens)} tokens")
        tokens = session.tokens + new
        length = len(tokens) if msg.length is None else msg.length
        if length > len(tokens):
            raise P.ProtocolError("desync", f"device holds {length} tokens, the cloud only {len(tokens)}")
        session.target.tokens = tokens
        self.sessions.free(key)
        return P.Closed(msg.session_id, session.step, session.compute_s, len(tokens),
                        P.sequence_digest(tokens[:length]))


def _wire(lp: Optional[Logprobs]) -> Optional[P.TokenLogprobs]:
    """Committed tokens' log-probabilities as a reply carries them (None: the session did not ask)."""
    return None if lp is None else P.TokenLogprobs(lp.values, lp.top_ids, lp.top_values)
