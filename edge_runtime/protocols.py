"""The device's side of every protocol in hat_split.protocols: a record's `round` names its round function here, and
its family picks the session class. `new_session` is the one way a request becomes a session."""
from __future__ import annotations

from typing import Callable, Dict, Optional

from edge_runtime.client import CloudClient
from edge_runtime.config import EdgeConfig
from edge_runtime.monitor import DeviceMonitor
from edge_runtime.request import GenerationRequest
from edge_runtime.rounds.hat import round_hat, round_ushape
from edge_runtime.rounds.local import round_slm
from edge_runtime.rounds.qs import round_qs
from edge_runtime.rounds.token import round_hlm, round_llm, round_sd
from edge_runtime.rounds.uhlm import round_cuhlm, round_randhlm, round_uhlm
from edge_runtime.sessions.base import Session
from edge_runtime.sessions.local import LocalSession
from edge_runtime.sessions.split import LinkState, SplitSession
from edge_runtime.sessions.token import TokenSession
from hat_split import protocols
from hat_split.math.skip_budget import SkipPolicy

ROUNDS: Dict[str, Callable] = {  # keyed by hat_split.protocols.Protocol.round
    "sd": round_sd,
    "hlm": round_hlm,
    "llm": round_llm,
    "slm": round_slm,
    "uhlm": round_uhlm,
    "randhlm": round_randhlm,
    "cuhlm": round_cuhlm,
    "qs": round_qs,  # qs, ksqs, csqs, sq: the support rule and sampling order differ (edge_runtime.rounds.qs)
    "ushape": round_ushape,
    "hat": round_hat,
}
assert {p.round for p in protocols.PROTOCOLS.values()} == set(ROUNDS), "a protocol's round is missing on the device"


def new_session(config: EdgeConfig, request: GenerationRequest, drafter, client: Optional[CloudClient],
                eos_ids: frozenset = frozenset(), session_id: int = 1, monitor: Optional[DeviceMonitor] = None,
                link_state: Optional[LinkState] = None, skip_policy: Optional[SkipPolicy] = None) -> Session:
    """The session of one request under its protocol: a LocalSession, a TokenSession or a SplitSession by the
    protocol's family, stepped by its round function.

    request: the generation, whole (edge_runtime.request); drafter: edge_runtime.drafter.Drafter, or
    edge_runtime.split_drafter.SplitDrafter for the split family; client: the connection (unused by the local
    family); monitor: the device state sent with session openings; link_state: the connection's estimates kept across
    requests (split family; default: fresh ones from config.split); skip_policy: uhlm / cuhlm's skip decision kept
    across requests (token family; default: a new one from config.uncertainty)."""
    record = protocols.get(request.protocol)
    common = dict(round_fn=ROUNDS[record.round], eos_ids=eos_ids, session_id=session_id)
    if record.family == "local":
        return LocalSession(config, request, drafter, None, **common)
    if record.family == "token":
        return TokenSession(config, request, drafter, client, **common, monitor=monitor, skip_policy=skip_policy)
    if link_state is None:
        link_state = LinkState.configured(config.split.up_bps, config.split.down_bps)
    return SplitSession(config, request, drafter, client, **common, link_state=link_state, monitor=monitor)
