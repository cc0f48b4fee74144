"""The cloud's answer to each request, dispatched by job; plain Python and numpy (no torch): the model is the work
runner's (cloud_runtime.work.ModelWork: cloud_runtime.batching over cloud_runtime.runner, or
cloud_runtime.cache_runner).

`Handlers.handle` checks that the request is one the cloud accepts and that its connection said Hello first, then
routes it by type: Hello and Report to the device registry (cloud_runtime.devices), OpenSession / Verify / Generate
to the token protocols (cloud_runtime.token_handlers), OpenSplit / Hidden to the split protocols
(cloud_runtime.split_handlers), CloseSession to the family of the session it closes. Every request is checked before
anything changes (hat_split.wire.messages: ids in range, lengths, positions, steps); anything wrong raises
`ProtocolError`, which the server (cloud_runtime.server) answers with an `Error` naming the problem. A request that
needs the model is queued as work and answered later: the server's step hands back each finished work with the numpy
rows it asked for, and `finish` gives them to the finisher of the request's type, which builds the reply.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, Optional

import numpy as np

from cloud_runtime.config import CloudConfig
from cloud_runtime.quotas import Admission
from cloud_runtime.sessions import Arrival, MiddleSession
from cloud_runtime.split_handlers import SplitHandlers
from cloud_runtime.state import CloudTables
from cloud_runtime.token_handlers import TokenHandlers
from cloud_runtime.work import ModelFacts, ModelWork, Pending, cloud_cost, cloud_state
from hat_split.wire import messages as P


class Handlers:
    """The dispatcher: one handler per request type, one finisher per request type that queues model work."""

    def __init__(self, config: CloudConfig, model: ModelFacts, work: ModelWork, tables: CloudTables,
                 admission: Admission):
        self.config = config
        self.work = work
        self.tables = tables
        self.registry = tables.registry
        self.admission = admission
        self.arrival = Arrival()  # the request being handled, for the uplink estimate of Verify and Hidden
        self.token = TokenHandlers(config, model, work, tables, admission, self.arrival)
        self.split = SplitHandlers(config, model, work, tables, admission, self.arrival)
        self._handlers: Dict[type, Callable[[bytes, Any], Optional[P.Message]]] = {
            P.Hello: self.registry.hello,
            P.OpenSession: self.token.open,
            P.Verify: self.token.verify,
            P.Generate: self.token.generate,
            P.CloseSession: self._close,
            P.OpenSplit: self.split.open,
            P.Hidden: self.split.hidden,
            P.Report: self._report,
        }
        self._finishers: Dict[type, Callable[[Pending, Optional[np.ndarray]], Optional[P.Message]]] = {
            P.OpenSession: self.token.opened,
            P.Verify: self.token.verdict,
            P.Generate: self.token.next_token,
            P.Hidden: self.split.deep,
        }

    def handle(self, identity: bytes, msg: Any, received_at: float, request_bytes: int,
               user: str = "", unseen_s: float = 0.0) -> Optional[P.Message]:
        """The reply to one decoded request, or None when it is answered once its work is computed. `user`: the
        allow-list name the connection authenticated with (CurveZMQ), "" on a plaintext link; unseen_s: how long
        before `received_at` it may have arrived (the server was computing, not reading its socket)."""
        handler = self._handlers.get(type(msg))
        if handler is None:
            raise P.ProtocolError("unexpected", f"{type(msg).__name__} is not a request the cloud accepts")
        if type(msg) is not P.Hello and not self.registry.knows(identity):
            raise P.ProtocolError("no_handshake", "send Hello before any other request")
        if user:
            self.registry.authenticated(identity, user)
        self.arrival.at, self.arrival.size, self.arrival.unseen_s = received_at, request_bytes, unseen_s
        reply = handler(identity, msg)
        self.registry.heard(identity)  # after the handler: a refused Hello is no handshake
        return reply

    def finish(self, pending: Pending, rows: Optional[np.ndarray]) -> Optional[P.Message]:
        """The reply to a request whose work came back with `rows`, or None after queueing more work for it."""
        pending.session.last_active = time.monotonic()  # the device's silence counts from its answer
        return self._finishers[type(pending.msg)](pending, rows)

    def _report(self, identity: bytes, msg: P.Report) -> P.Message:
        self.registry.report(identity, msg)
        device = self.admission.device_of(identity)
        return P.Reported(cloud_state(self.work), cloud_cost(self.work, device,
                                                             self.tables.sessions.others_active(device),
                                                             self.config.fleet_pace_tokens_per_s))

    def _close(self, identity: bytes, msg: P.CloseSession) -> P.Message:
        """Everything is checked before anything changes: a refused CloseSession leaves the session intact."""
        session = self.tables.sessions.get((identity, msg.session_id))
        if session is None:
            raise P.ProtocolError("no_session", f"no open session {msg.session_id}")
        if isinstance(session, MiddleSession):  # no tokens to digest: report the positions held
            return self.split.close(identity, msg, session)
        return self.token.close(identity, msg, session)
