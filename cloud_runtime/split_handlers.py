"""The split protocols' requests (hat_split.protocols family "split": hat, ushape), plain Python and numpy (no torch):
OpenSplit, Hidden and the close of a split session.

The cloud runs the model's middle layers [start, stop) over hidden states and never sees a token. Each request is
checked before anything changes (`ProtocolError` otherwise), charged to its device (cloud_runtime.quotas.Admission)
and its shallow states queued as model work (`ModelWork.submit_states` with a `Pending`); its finisher encodes the
last deep states that come back (hat_split.wire.hidden_codec). OpenSplit also tells the device HAT's prompt chunk
size for the cloud's load now (hat_split.math.chunking.chunk_size).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from cloud_runtime.family import FamilyHandlers
from cloud_runtime.sessions import MiddleSession
from cloud_runtime.work import Pending, cloud_state
from hat_split.math.chunking import chunk_size
from hat_split.math.tree import check_tree
from hat_split.protocols import of_family
from hat_split.wire import messages as P
from hat_split.wire.hidden_codec import HIDDEN_FORMATS, bytes_per_position, decode_hidden, encode_hidden

SPLIT_PROTOCOLS = of_family("split")  # the cloud runs middle layers over hidden states (HAT)


class SplitHandlers(FamilyHandlers):
    """One method per split-protocol request, and the finisher of Hidden."""

    def open(self, identity: bytes, msg: P.OpenSplit) -> P.Message:
        if msg.protocol not in SPLIT_PROTOCOLS:
            raise P.ProtocolError("invalid", f"OpenSplit is for {SPLIT_PROTOCOLS}, not {msg.protocol!r}")
        model = self.model
        if model.split_refusal:
            raise P.ProtocolError("invalid", model.split_refusal)
        if msg.fingerprint != model.fingerprint:
            raise P.ProtocolError("model_mismatch", f"the device's parts come from another model (fingerprint "
                                  f"{msg.fingerprint[:12]}) than the cloud's {model.name!r} "
                                  f"({model.fingerprint[:12]})")
        if not 1 <= msg.start < msg.stop <= model.layers:
            raise P.ProtocolError("invalid", f"middle layers [{msg.start}, {msg.stop}) must satisfy 1 <= start < stop "
                                  f"<= {model.layers}: the device keeps at least one layer (embeddings alone reveal "
                                  "the tokens)")
        if msg.hidden_format not in HIDDEN_FORMATS:
            raise P.ProtocolError("invalid", f"hidden_format must be one of {HIDDEN_FORMATS}")
        key, admission = (identity, msg.session_id), self.admission
        self.sessions.not_computing(key)
        self.tables.registry.observe(identity, msg.device)
        device = admission.charge(identity, key, 0, 0, key not in self.sessions)
        admission.admit(identity, key)
        session = MiddleSession(msg.session_id, msg.protocol, msg.hidden_format, msg.start, msg.stop, device)
        session.link_rtt_s = max(0.0, float(msg.link_rtt_s))
        admission.with_room(identity, key, lambda: self.work.open(key, msg.start, msg.stop, device))
        self.sessions.put(key, session)
        self.tables.stats.sessions_opened += 1
        chunk, load = 0, self.work.load
        if load.known and msg.device.up_bps > 0 and msg.prompt_tokens > 0:
            chunk = chunk_size(load, bytes_per_position(msg.hidden_format, model.hidden_size),
                               msg.device.up_bps, 1, msg.prompt_tokens, msg.device.input_s, msg.device.adapter_s)
        return P.SplitOpened(msg.session_id, model.hidden_size, chunk, cloud_state(self.work))

    def hidden(self, identity: bytes, msg: P.Hidden) -> Optional[P.Message]:
        session = self.sessions.continuing(identity, msg, MiddleSession)
        states = msg.states.values
        if not isinstance(states, np.ndarray) or states.ndim != 2 or states.shape[0] < 1:
            raise P.ProtocolError("invalid", "states must hold [n >= 1, hidden] values")
        n = states.shape[0]
        try:
            x = decode_hidden(msg.states, n, self.model.hidden_size)  # [n, hidden] float32
        except ValueError as exc:
            raise P.ProtocolError("invalid", f"states: {exc}") from None
        if msg.want > n:
            raise P.ProtocolError("invalid", f"want={msg.want} exceeds the {n} states sent")
        max_context = self.config.max_context
        if msg.position + n > max_context:
            raise P.ProtocolError("context", f"session would exceed max_context={max_context} positions")
        key = (identity, msg.session_id)
        tree = self._tree(msg.parents, n, msg.want) if msg.parents is not None else None
        keep = self._keep(session, msg.keep, key) if msg.keep is not None else None
        done, queued = self.work.held(key)
        if keep is not None:  # the last tree's accepted path, in place (nothing is queued: its Deep came back)
            self.work.keep(key, session.tree_at, keep)
            session.tree_at, done = None, session.tree_at + len(keep)
            session.position = done
        if msg.position < done + queued:  # the device rolled back (rejected drafts): only with nothing queued
            if queued:
                raise P.ProtocolError("desync", f"position {msg.position} would roll back while {queued} positions "
                                      "are still queued")
            self.work.crop(key, msg.position)
            session.position = msg.position
        prompt = n if n > self.config.max_draft_len + 1 and tree is None else 0  # a prompt chunk, not a verify
        device = self.admission.charge(identity, key, self.work.kv_cost(session.start, session.stop), n,
                                       prompt=prompt)
        pending = Pending(identity, msg, session, self.arrival.uplink_bps(session, msg.idle_s),
                          **self.arrival.stamp())
        self.admission.with_room(identity, key, lambda: self.work.submit_states(key, x, msg.want, pending, tree))
        if tree is not None:
            session.tree_at = msg.position
        self.admission.spend(device, prompt)
        session.step = msg.step
        return None

    def _tree(self, parents_wire, n: int, want: int) -> list:
        """A Hidden's draft tree checked (ProtocolError naming what is wrong): the parents of its n states."""
        self.check_trees_taken()
        parents = P.check_index(parents_wire, "parents", n)
        if want != n:
            raise P.ProtocolError("invalid", f"a draft tree's {n} states all come back: want={want}")
        try:  # the root (and any chain before it) plus at most max_tree_nodes nodes, one level more
            check_tree(parents, np.arange(n), self.tree_nodes + 1, self.config.max_tree_depth + 1)
        except ValueError as exc:
            raise P.ProtocolError("invalid", f"draft tree: {exc}") from None
        return parents.tolist()

    def _keep(self, session: MiddleSession, keep_wire, key) -> list:
        """A Hidden's `keep`: rows of the last tree to keep, checked against what the cloud holds of it."""
        if session.tree_at is None:
            raise P.ProtocolError("invalid", "keep names rows of a draft tree, and this session holds none")
        held = self.work.held(key)
        rows = P.check_index(keep_wire, "keep").tolist()
        if held[1] or not rows or rows != sorted(set(rows)) or rows[-1] >= held[0] - session.tree_at:
            raise P.ProtocolError("invalid", f"keep {rows} is not a list of rows of the draft tree held "
                                             f"({held[0] - session.tree_at} positions from {session.tree_at})")
        return rows

    def deep(self, p: Pending, deep: Optional[np.ndarray]) -> P.Message:
        """Deep states `# [want, hidden]` (None: none wanted) back to the device."""
        session, msg = p.session, p.msg
        out = encode_hidden(deep, session.hidden_format) if deep is not None else None
        session.position = self.work.held((p.identity, msg.session_id))[0]
        return P.Deep(msg.session_id, msg.step, session.position, out, p.compute_s, p.uplink_bps,
                      cloud_state(self.work))

    def close(self, identity: bytes, msg: P.CloseSession, session: MiddleSession) -> P.Message:
        """Close `session` (the one msg names): no tokens to digest, the positions it held are reported."""
        key = (identity, msg.session_id)
        self.sessions.not_computing(key)
        self.sessions.free(key)
        return P.Closed(msg.session_id, session.step, session.compute_s, session.position, 0)
