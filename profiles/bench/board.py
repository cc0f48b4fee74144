"""A board whose power mode a bench can change (`hat-bench auto`'s power phases): the device's model stretched to the
mode's slowdown (hat_split.models.lm.board_time: the difference slept, so the cores stay free as a slower board's
would leave them), and `nvpmodel -q` answered with the mode's name by a stand-in script first on PATH, so the
device's monitor reads the mode as it would on a Jetson (hardware.jetson_control). On a Jetson none of this is
needed: the real nvpmodel reports, the real clocks slow the model.
"""
from __future__ import annotations

import os
import stat
import tempfile
from dataclasses import dataclass, field
from typing import Dict, Sequence

from hat_split.models.lm import board_time

MODES: Dict[str, int] = {"MAXN": 0, "MODE_15W": 1}  # the names and ids the stand-in reports (AGX Orin's)


@dataclass
class Board:
    """The mode now and its slowdown; every SlowedLM of the bench reads it."""

    slowdown: float = 1.0
    mode: str = "MAXN"
    _dir: str = field(default="", repr=False)

    def set(self, mode: str, slowdown: float) -> None:
        if mode not in MODES or not 1.0 <= slowdown <= 100.0:
            raise ValueError(f"a mode of {', '.join(MODES)} and a slowdown in [1, 100], got {mode!r}, {slowdown}")
        self.mode, self.slowdown = mode, slowdown
        if self._dir:
            with open(os.path.join(self._dir, "mode"), "w", encoding="utf-8") as f:
                f.write(f"NV Power Mode: {mode}\n{MODES[mode]}\n")

    def __enter__(self) -> "Board":
        """Put the stand-in nvpmodel first on this process's PATH (its children inherit it)."""
        self._dir = tempfile.mkdtemp(prefix="hatspec-board-")
        script = os.path.join(self._dir, "nvpmodel")
        with open(script, "w", encoding="utf-8") as f:
            f.write(f"#!/bin/sh\ncat '{os.path.join(self._dir, 'mode')}'\n")
        os.chmod(script, os.stat(script).st_mode | stat.S_IXUSR)
        self._path = os.environ.get("PATH", "")
        os.environ["PATH"] = self._dir + os.pathsep + self._path
        self.set(self.mode, self.slowdown)
        return self

    def __exit__(self, *exc) -> None:
        os.environ["PATH"] = self._path
        for name in ("nvpmodel", "mode"):
            try:
                os.remove(os.path.join(self._dir, name))
            except OSError:
                pass
        os.rmdir(self._dir)
        self._dir = ""


@dataclass
class SlowedLM:
    """Any model with the CausalLM interface, its forwards stretched to the board's slowdown."""

    inner: object
    board: Board

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    def __getattr__(self, name):  # warm_up, eog_ids, kv_bytes_per_position ... as the model has them
        if name in ("inner", "board"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    def new_state(self):
        return self.inner.new_state()

    def forward(self, state, tokens: Sequence[int], n_logits: int = 1):
        before = state.forward_s
        out = self.inner.forward(state, tokens, n_logits)
        took = state.forward_s - before
        state.forward_s = before + board_time(took, self.board.slowdown)
        return out

    def forward_tree(self, state, parents: Sequence[int], tokens: Sequence[int], start: int):
        """A draft tree's level (a model that drafts trees), stretched like a forward."""
        before = state.forward_s
        out = self.inner.forward_tree(state, parents, tokens, start)
        state.forward_s = before + board_time(state.forward_s - before, self.board.slowdown)
        return out

    def crop(self, state, length: int) -> None:
        self.inner.crop(state, length)
