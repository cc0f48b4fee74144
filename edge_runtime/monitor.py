"""The device's view of itself for HAT's state monitoring (§3.2): its profile, its power mode as the board reports
it, and its drafting delay γ measured from its own requests; sent to the cloud with every OpenSession / OpenSplit
and in `Report` messages (EdgeRuntime.report). The runtime holds one and hands it to every session it opens."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

from hat_split import protocols
from hat_split.math.chunking import ema
from hat_split.wire import messages as P
from hardware.jetson_control import JetsonControlError, query_mode


@dataclass
class DeviceMonitor:
    profile: str = ""  # hardware/devices name, "" when not configured
    power_mode: str = ""  # the mode the board reports; "" off a Jetson (nothing is invented)
    draft_s: float = 0.0  # γ: moving average (α as HAT's) of seconds per draft token
    mode_error: str = ""  # why the mode could not be read, when it could not
    mode_read_at: float = 0.0

    def refresh_mode(self, max_age_s: float = 5.0) -> str:
        """Read the power mode from nvpmodel (at most every max_age_s); keeps the reason when it cannot."""
        if time.monotonic() - self.mode_read_at < max_age_s and self.mode_read_at:
            return self.power_mode
        self.mode_read_at = time.monotonic()
        try:
            self.power_mode, self.mode_error = query_mode()[0], ""
        except JetsonControlError as exc:
            self.power_mode, self.mode_error = "", str(exc)
        return self.power_mode

    def observe(self, result, split_draft_s: Optional[float] = None) -> None:
        """Fold one finished request's drafting delay into γ: the split protocols measure it per draft (their
        edge_runtime.sessions.split.LinkState); the others from the decode-phase draft compute over the tokens drafted
        (or made, for the local family)."""
        gamma = split_draft_s
        if gamma is None:
            decode_s = result.device_compute_s - result.device_prefill_s
            record = protocols.PROTOCOLS.get(result.protocol)  # None for auto (a token session)
            local = record is not None and record.family == "local"
            steps = result.drafted or (result.n if local else 0)
            gamma = decode_s / steps if steps and decode_s > 0 else None
        if gamma:
            self.draft_s = ema(self.draft_s or None, gamma)

    def state(self, up_bps: float = 0.0, down_bps: float = 0.0, draft_s: float = 0.0, input_s: float = 0.0,
              adapter_s: float = 0.0) -> P.DeviceState:
        return P.DeviceState(up_bps, down_bps, draft_s or self.draft_s, self.power_mode, self.profile, input_s,
                             adapter_s)
