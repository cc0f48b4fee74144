"""The (L, ℓ) policies: heuristic rule, double-DQN training in the trace environment, loading on the edge, and a
multi-process run where a policy file follows a rate change of the emulated link via the cloud's measurements."""
from __future__ import annotations

import math

import numpy as np
import pytest

from edge_runtime.policy.policies import HeuristicPolicy, QNetwork, RoundState, expected_new_tokens, make_policy
from edge_runtime.policy.env import PolicyEnv, Trace, TwoStateChannel, action_grid
from edge_runtime.policy.train import round_cost, train_dqn
from hat_split.net.security import LinkSecurity

VOCAB = 512
ELLS = (2, 1024)
LENGTHS = (1, 2, 4, 6)
LOW, HIGH = 5e3, 5e6  # bit/s: at the low rate a 1024-lattice row (~1400 bits) costs far more than it gains


def test_heuristic_grows_after_full_acceptance_and_shrinks_to_the_accepted_count():
    h = HeuristicPolicy(3, 100, max_len=5)
    h.observe(3, 3)
    assert h.act(RoundState()) == (4, 100)
    h.observe(4, 4), h.observe(5, 5)
    assert h.draft_len == 5  # capped
    h.observe(5, 2)
    assert h.draft_len == 2
    h.observe(2, 0)
    assert h.draft_len == 1


def test_expected_new_tokens_is_the_bernoulli_chain_mean():
    assert expected_new_tokens([]) == 1.0
    assert expected_new_tokens([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)


def _synthetic_traces(rng, rounds=60):
    """Acceptance 0.5 at ℓ = 2, 0.95 at ℓ = 1024, whatever the draft's confidence (low in some traces, high in
    others, so the network sees the whole range and learns to ignore it)."""
    out = []
    for scale in (0.02, 0.2, 0.6, 1.0):
        accept = np.empty((rounds, len(ELLS), max(LENGTHS)))
        accept[:, 0], accept[:, 1] = 0.5, 0.95
        out.append(Trace(accept, scale * rng.random((rounds, max(LENGTHS))), 0.002, 0.01))
    return out


@pytest.fixture(scope="module")
def trained_policy(tmp_path_factory):
    rng = np.random.default_rng(0)
    cost, _ = round_cost(VOCAB, ELLS, 0.005)
    actions = action_grid(LENGTHS, len(ELLS))
    env = PolicyEnv(_synthetic_traces(rng), actions, cost, TwoStateChannel(LOW, HIGH, 0.2, 0.2, 1.0), seed=1)
    net = train_dqn(env, 4000, 0.5, 32, seed=0, log=lambda *a: None)
    net.actions = np.array([(L, ELLS[e]) for L, e in actions], dtype=np.int64)
    net.meta = {"test": True}
    path = tmp_path_factory.mktemp("policy") / "policy.npz"
    net.save(path)
    return path


def _action(net: QNetwork, rate: float) -> tuple:
    return tuple(net.actions[int(np.argmax(net.q_values(np.array([0.5, 0.5, 0.5, math.log10(rate)]))))])


def test_dqn_learns_small_lattices_on_a_slow_uplink(trained_policy):
    net = QNetwork.load(trained_policy)
    assert _action(net, LOW)[1] == 2 and _action(net, HIGH)[1] == 1024
    policy = make_policy("dqn", 4, 100, 16, str(trained_policy))
    assert policy.act(RoundState(0.5, 0.5, 0.5, LOW)) == _action(net, LOW)


def test_bad_policy_files_are_refused(tmp_path, trained_policy):
    (tmp_path / "junk.npz").write_bytes(b"not a policy")
    with pytest.raises(ValueError, match="not a hat-train-policy file"):
        QNetwork.load(tmp_path / "junk.npz")
    net = QNetwork.load(trained_policy)
    net.actions = net.actions[:-1]
    with pytest.raises(ValueError, match="one .L >= 1, 1 <= ℓ"):
        net.check()
    with pytest.raises(ValueError, match="needs a file"):
        make_policy("dqn", 4, 100, 16)


def _rate_policy(path) -> str:
    """A policy file whose choice is the uplink rate's alone: ℓ = 1024 above 10^4.5 bit/s, ℓ = 2 below, L = 4. What
    a trained network makes of the confidences differs from one CPU's float arithmetic to another's (the training
    test above checks the training); with this file the run checks what the runtime feeds the policy, exactly."""
    actions = np.array([(L, ell) for L in LENGTHS for ell in ELLS], dtype=np.int64)
    w = np.zeros((4, len(actions)))
    w[3] = np.where(actions[:, 1] == 1024, 1.0, -1.0)  # Q = ±(log10 rate − 4.5) + a bonus for L = 4
    net = QNetwork([w], [-4.5 * w[3] + 0.1 * (actions[:, 0] == 4)], actions, np.zeros(4), np.ones(4), {"test": True})
    net.check()
    net.save(path)
    return str(path)


def test_policy_follows_the_rate_the_cloud_measures(tmp_path):
    """Device (this process) → link emulator → cloud process. The link drops from 5 Mbit/s to 5 kbit/s mid-answer;
    the cloud's measured rate follows, every round's (L, ℓ) is the policy's choice on the state the round logged (the
    rate in it the cloud's last measurement), and the policy switches from ℓ = 1024 to ℓ = 2."""
    from cloud_runtime.process import CloudProcess
    from edge_runtime.client import CloudClient
    from edge_runtime.config import EdgeConfig, LinkConfig, QSConfig
    from edge_runtime.drafter import Drafter
    from edge_runtime.protocols import new_session
    from edge_runtime.request import GenerationRequest
    from hat_split.wire import messages as P
    from hat_split.models.lm import CausalLM
    from hat_split.math.sampling import SamplingParams
    from testbed.link_emulator import LinkEmulator
    from testbed.links import LinkProfile
    from tests.test_registry import _tiny_model_and_tokenizer

    policy_file = _rate_policy(tmp_path / "rate_policy.npz")
    model, tok = _tiny_model_and_tokenizer(VOCAB)
    model.save_pretrained(tmp_path / "tiny")
    tok.save_pretrained(tmp_path / "tiny")
    fast = LinkProfile("fast", HIGH / 8, HIGH / 8, 0.002)
    slow = LinkProfile("slow", LOW / 8, HIGH / 8, 0.002)
    with CloudProcess(str(tmp_path / "tiny"), extra_args=["--dtype", "float32"], threads=1) as cloud:
        host, port = cloud.endpoint.rsplit("//", 1)[1].rsplit(":", 1)
        with LinkEmulator(fast, (host, int(port))) as link:
            edge_link = LinkConfig(link.address, security=LinkSecurity.plaintext())
            with CloudClient(edge_link, P.Hello("t", "tiny", VOCAB, "")) as client:
                config = EdgeConfig(link=edge_link, model="tiny", qs=QSConfig(policy="dqn", policy_file=policy_file))
                params = SamplingParams(1.0)
                switched = []

                def on_tokens(tokens, _logprobs):
                    if len(gen.generated) >= 30 and not switched:
                        link.set_profile(slow)
                        switched.append(gen.counters.rounds)

                gen = new_session(config, GenerationRequest([5, 6, 7, 8], "qs", params, 60, seed=7,
                                                            on_tokens=on_tokens),
                                  Drafter(CausalLM(model), params), client, frozenset(), 1)
                result = gen.run([5, 6, 7, 8], lambda t: "")
    log = result.round_log
    assert switched, "the link never switched"
    n = switched[0]
    fast_rounds, slow_rounds = log[1:n], log[n + 2:]
    assert slow_rounds, f"only {len(log)} rounds"
    rates_fast = [r["uplink_bps"] for r in fast_rounds]
    rates_slow = [r["uplink_bps"] for r in slow_rounds]
    print(f"measured uplink: fast {np.median(rates_fast):.0f} bit/s, slow {np.median(rates_slow):.0f} bit/s; "
          f"actions fast {[(r['L'], r['ell']) for r in fast_rounds]}, slow {[(r['L'], r['ell']) for r in slow_rounds]}")
    # the cloud reads a row of a few hundred bytes: on a loaded 2-core host its transfer time carries scheduling
    # delay, and the fast link read 0.75-3.4 Mbit/s of 5 (median 1.4) in one CI run; the bounds stay 60x apart
    assert np.median(rates_slow) < 3 * LOW < HIGH / 5 < np.median(rates_fast)
    policy = make_policy("dqn", 4, 100, 16, policy_file)
    for i, r in enumerate(log):
        length, ell = policy.act(RoundState(*r["state"][:3], 10 ** r["state"][3]))
        # the answer's last rounds draft no further than the tokens it has left
        assert ell == r["ell"] and 1 <= r["L"] <= length, f"round {i} did not act on its state {r['state']}"
        if i:  # after the first verdict, the state's rate is the cloud's measurement of the round before
            assert r["state"][3] == pytest.approx(np.log10(log[i - 1]["uplink_bps"]))
    assert all(r["ell"] == 1024 for r in fast_rounds) and all(r["ell"] == 2 for r in slow_rounds)
