"""The emulated slower board (hat_split.models.lm.board_time, `split.slowdown`): a slowed device stretches its compute
by sleeping, and the sleep leaves the cores to the cloud beside it — its torch OpenMP workers wait passively
(`wait_passively`, before torch loads) instead of spinning through every sleep. Measured in fresh processes: the
device process's CPU time against its wall time."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DEVICE = r'''
import json, sys, time
from hat_split.models.lm import wait_passively
how = wait_passively(float(sys.argv[1]))
import torch
torch.set_num_threads(2)
from hat_split.models.adapter import Adapter
from hat_split.models.draft_lm import AdapterLM
from hat_split.models.partition import SplitModel
from tests.conftest import tiny_model

model = tiny_model(7, layers=4).requires_grad_(False)
split, adapter = SplitModel(model, 1, 1), Adapter(model, 1)

def drafting(lm, steps=60):
    state = lm.new_state()
    lm.forward(state, [1, 2, 3])
    state.forward_s = 0.0
    wall, cpu = time.perf_counter(), time.process_time()
    for t in range(steps):
        lm.forward(state, [t % 50])
    return time.perf_counter() - wall, time.process_time() - cpu, state.forward_s

fast = drafting(AdapterLM(split, adapter))
slow = drafting(AdapterLM(split, adapter, slowdown=float(sys.argv[1])))
print(json.dumps({"how": how, "fast": fast, "slow": slow}))
'''


def _device(slowdown: float, env_extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env.update(env_extra or {})
    out = subprocess.run([sys.executable, "-c", DEVICE, str(slowdown)], capture_output=True, text=True, cwd=ROOT,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_slowed_board_waits_instead_of_burning_the_cores():
    r = _device(6.0)
    assert r["how"] == "passive"
    (fast_wall, fast_cpu, fast_reported), (slow_wall, slow_cpu, slow_reported) = r["fast"], r["slow"]
    assert slow_wall > 3.0 * fast_wall  # the board is slower ...
    assert slow_reported > 3.0 * fast_reported and abs(slow_reported - slow_wall) < 0.35 * slow_wall  # ... says so
    extra_wall, extra_cpu = slow_wall - fast_wall, slow_cpu - fast_cpu
    assert extra_cpu < 0.25 * extra_wall, r  # ... by waiting, not computing


@pytest.mark.parametrize("slowdown,env,how", [
    (1.0, {}, "not slowed"),
    (6.0, {"OMP_WAIT_POLICY": "ACTIVE"}, "OMP_WAIT_POLICY=ACTIVE (set by the user)"),
])
def test_the_wait_policy_is_left_alone_when_not_slowed_or_set_by_the_user(slowdown, env, how):
    code = ("import json, os, sys\nfrom hat_split.models.lm import wait_passively\n"
            f"print(json.dumps([wait_passively({slowdown}), os.environ.get('OMP_WAIT_POLICY')]))")
    clean = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**clean, **env}, timeout=120)
    assert json.loads(out.stdout) == [how, env.get("OMP_WAIT_POLICY")]


def test_the_policy_does_not_leak_to_processes_started_later():
    code = ("import json, os\nfrom hat_split.models.lm import wait_passively\n"
            "how = wait_passively(4.0)\nimport torch\n"
            "print(json.dumps([how, os.environ.get('OMP_WAIT_POLICY'), wait_passively(4.0)]))")
    clean = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=clean,
                         timeout=120)
    how, left, again = json.loads(out.stdout)
    assert how == "passive" and left is None and "torch was loaded" in again
