"""The import contract (tests/layers.py): the tree holds it, and a planted violation of each kind is caught."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.layers import PACKAGES, check

REPO = Path(__file__).resolve().parents[1]


def test_the_layers_hold():
    assert check(REPO) == []


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    for pkg in PACKAGES:
        if (REPO / pkg).is_dir():
            shutil.copytree(REPO / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.gguf"))
    return tmp_path


def _plant(path: Path, line: str) -> None:
    path.write_text(path.read_text() + "\n" + line + "\n")


@pytest.mark.parametrize("where, line, expected", [
    ("hat_split/math/sampling.py", "import torch", "hat_split.math.sampling imports torch"),
    ("hat_split/wire/messages.py", "import zmq", "hat_split.wire.messages imports zmq"),
    ("hat_split/protocols.py", "import numpy", "hat_split.protocols imports numpy"),
    ("edge_runtime/runtime.py", "def f():\n    from cloud_runtime import config", "edge_runtime.runtime imports "
                                                                             "cloud_runtime.config"),
    ("edge_runtime/runtime.py", "import export.cli", "edge_runtime.runtime imports export.cli"),
    ("hat_split/models/lm.py", "from edge_runtime import drafter", "hat_split.models.lm imports edge_runtime"),
    ("testbed/links.py", "import cloud_runtime.process", "testbed.links imports cloud_runtime"),
    ("export/cli.py", "import scripts", "export.cli imports scripts"),
    (["cloud_runtime/scheduler.py", "hat_split/math/masks.py"], ["import hat_split.math.masks", "import torch"],
     "importing cloud_runtime.scheduler loads torch through cloud_runtime.scheduler -> hat_split.math.masks -> torch"),
    ("hat_split/math/sampling.py", "from hat_split.math import verify", "import circle: hat_split.math.sampling <-> "
                                                                         "hat_split.math.verify"),
])
def test_a_planted_violation_is_caught(tree: Path, where, line, expected: str):
    before = set(check(tree))
    for w, text in zip([where] if isinstance(where, str) else where, [line] if isinstance(line, str) else line):
        _plant(tree / w, text)
    found = set(check(tree)) - before
    assert any(expected in f for f in found), found
