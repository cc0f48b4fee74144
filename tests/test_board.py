"""The board a bench puts in a low-power mode (profiles.bench.board): `nvpmodel -q` answers with the mode the bench
set, as the device's monitor reads it on a Jetson, and the device's model is stretched to the mode's slowdown; PATH
is as before once the board is gone."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import pytest

from hardware.jetson_control import query_mode
from profiles.bench.board import Board, SlowedLM


@dataclass
class _State:
    forward_s: float = 0.0
    length: int = 0


class _Model:
    vocab_size = 7

    def new_state(self):
        return _State()

    def forward(self, state, tokens, n_logits=1):
        time.sleep(0.02)
        state.forward_s += 0.02
        state.length += len(tokens)
        return [len(tokens)]

    def crop(self, state, length):
        state.length = length

    def eog_ids(self):
        return [3]


def test_the_board_reports_its_mode_and_slows_the_model():
    from edge_runtime.monitor import DeviceMonitor

    path = os.environ.get("PATH", "")
    with Board() as board:
        assert query_mode() == ("MAXN", 0)
        monitor = DeviceMonitor()
        assert monitor.refresh_mode(max_age_s=0.0) == "MAXN"
        lm = SlowedLM(_Model(), board)
        state = lm.new_state()
        board.set("MODE_15W", 3.0)
        assert query_mode() == ("MODE_15W", 1) and monitor.refresh_mode(max_age_s=0.0) == "MODE_15W"
        t0 = time.perf_counter()
        assert lm.forward(state, [1, 2]) == [2]
        assert time.perf_counter() - t0 >= 0.055 and state.forward_s == pytest.approx(0.06)
        assert lm.vocab_size == 7 and lm.eog_ids() == [3] and state.length == 2
        lm.crop(state, 1)
        assert state.length == 1
        with pytest.raises(ValueError, match="a mode of MAXN, MODE_15W"):
            board.set("TURBO", 2.0)
        with pytest.raises(ValueError, match="slowdown in"):
            board.set("MAXN", 0.5)
    assert os.environ.get("PATH", "") == path
