"""qs / ksqs / csqs / sq through the real device and cloud code: sample-then-quantize's bias, the conformal threshold's
guarantees, the bit budget and the lattice payload on the wire. (The quantize-then-sample protocols' exactness at
T > 0 with a far draft, and a broken verifier caught: tests/test_exactness.py.)"""
from __future__ import annotations

import threading

import numpy as np
import pytest

from cloud_runtime.config import CloudConfig
from cloud_runtime.server import CloudServer
from edge_runtime.client import CloudClient
from edge_runtime.config import EdgeConfig, LinkConfig, QSConfig
from edge_runtime.drafter import Drafter
from edge_runtime.protocols import new_session
from edge_runtime.request import GenerationRequest
from hat_split.wire import dist_codec
from hat_split.math import enumerative
from hat_split.wire import messages as P
from hat_split.math.sampling import SamplingParams
from hat_split.wire.sqs import ConformalThreshold, LatticeWire, force_token, quantize_row
from tests.markov_lm import MarkovLM
from tests.test_sampling import SEED, empirical
from hat_split.net.security import LinkSecurity

V = 4
START = 0
# Target and draft bigram chains (rows: next-token distribution after each token). The draft is far from the target
# and spread over several tokens, so a coarse lattice (ℓ = 2) moves its mass a lot.
TARGET = np.array([[0.10, 0.20, 0.30, 0.40], [0.40, 0.10, 0.25, 0.25], [0.25, 0.25, 0.25, 0.25], [0.5, 0.3, 0.1, 0.1]])
DRAFT = np.array([[0.45, 0.30, 0.15, 0.10], [0.20, 0.45, 0.05, 0.30], [0.60, 0.10, 0.20, 0.10], [0.1, 0.2, 0.3, 0.4]])


@pytest.fixture(scope="module")
def markov_server():
    cfg = CloudConfig(model="markov", bind="tcp://127.0.0.1:0", poll_ms=20, max_context=4096,
                      security=LinkSecurity.plaintext())
    stop = threading.Event()
    with CloudServer(cfg, MarkovLM(TARGET), "markov-target", "markov-vocab") as server:
        thread = threading.Thread(target=server.serve_forever, kwargs={"until": stop.is_set}, daemon=True)
        thread.start()
        yield server
        stop.set()
        thread.join(timeout=10)


def _generate(server, protocol, n_seqs, T, qs=QSConfig(ell=2, k=2, alpha=0.1, eta=0.2, beta=0.2), draft_len=2,
              params=SamplingParams(1.0), seed=0):
    """n_seqs sequences of T tokens, each its own request (own seed) on one connection."""
    out = np.empty((n_seqs, T), dtype=np.int64)
    config = EdgeConfig(link=LinkConfig(server.endpoint, security=LinkSecurity.plaintext()), model="markov",
                        draft_len=draft_len, qs=qs)
    results = []
    with CloudClient(config.link, P.Hello("t", "markov", V, "markov-vocab")) as client:
        draft = MarkovLM(DRAFT)
        for i in range(n_seqs):
            gen = new_session(config, GenerationRequest([START], protocol, params, T, seed=seed * 1_000_003 + i),
                              Drafter(draft, params), client, frozenset(), i + 1)
            result = gen.run([START], lambda toks: "")
            out[i] = result.tokens
            results.append((result, gen))
    return out, results


def _sq_first_token_law(q: np.ndarray, p: np.ndarray, ell: int) -> np.ndarray:
    """Closed form of what `sq` outputs for one token: x ~ q, verified against the forced lattice row of q."""
    out = np.zeros_like(p)
    row = quantize_row(q, ell, np.arange(q.size))
    for x in range(q.size):
        q_hat = force_token(row, x).dense(q.size, ell)
        accept = min(1.0, p[x] / q_hat[x])
        residual = np.maximum(p - q_hat, 0.0)
        out[x] += q[x] * accept
        out += q[x] * (1 - accept) * residual / residual.sum()
    return out


def test_sample_then_quantize_is_biased(markov_server):
    """`sq` draws from q and verifies against the quantized q̂: its first token follows the closed-form biased law
    (token 1: 0.12 instead of the target's 0.20), many standard deviations off; `qs` on the same lattice is not."""
    n = 2500
    sq, _ = _generate(markov_server, "sq", n, 1, seed=1)
    qs, _ = _generate(markov_server, "qs", n, 1, seed=2)
    biased = _sq_first_token_law(DRAFT[START], TARGET[START], 2)
    sd = np.sqrt(TARGET[START] * (1 - TARGET[START]) / n)  # [V] binomial deviation of each cell
    z_sq = (empirical(sq[:, 0], V) - TARGET[START]) / sd
    z_qs = (empirical(qs[:, 0], V) - TARGET[START]) / sd
    z_law = (empirical(sq[:, 0], V) - biased) / np.sqrt(biased * (1 - biased) / n)
    print(f"sq law {biased.round(3)}; z vs target: sq {z_sq.round(1)}, qs {z_qs.round(1)}; "
          f"sq vs its law {z_law.round(1)}")
    assert np.abs(z_qs).max() < 5 and np.abs(z_law).max() < 5
    assert np.abs(z_sq).max() > 7


def test_bit_budget_keeps_the_longest_draft_that_fits(markov_server):
    """With B bits per round, a round's rows fit in B (or it is a single draft) and one more row would not."""
    wire = LatticeWire(V, 2, "full")
    row_bits = wire.bits(wire.quantize(DRAFT[0]))  # every full-support row at ℓ = 2 costs the same
    budget = 3 * row_bits + 1
    _, results = _generate(markov_server, "qs", 4, 12, qs=QSConfig(ell=2, budget_bits=budget), draft_len=8)
    logs = [r for res, _ in results for r in res.round_log]
    assert logs and all(sum(r["bits"]) <= budget for r in logs)
    assert max(r["L"] for r in logs) == 3  # the budget, not draft_len = 8, limited the draft


def test_conformal_threshold_bounds_on_a_long_random_stream():
    """SQS Lemma 4 (β stays in [−η(1−α), 1+ηα]) and eq. 9 (mean dropped mass ≤ α + (|β1|+1+ηα)/(ηT)) hold along
    50,000 random draft distributions with random verdicts and rollbacks."""
    rng = np.random.default_rng([SEED, 9])
    th = ConformalThreshold(alpha=0.02, eta=0.05, beta=0.5)
    lo, hi = th.bounds()
    betas = []
    for _ in range(12_500):
        L = int(rng.integers(1, 7))
        for _ in range(L):
            q = rng.dirichlet(np.full(50, 0.1))
            support = th.support(q)
            th.observe(quantize_row(q, 100, support).dropped)
            betas.append(th.beta)
        th.settle(int(rng.integers(0, L + 1)), L)
        betas.append(th.beta)
    betas = np.array(betas)
    assert lo <= betas.min() and betas.max() <= hi
    mean = float(np.mean(th.kept_dropped))
    print(f"T={len(th.kept_dropped)} mean dropped {mean:.5f} bound {th.mean_dropped_bound():.5f} α={th.alpha}")
    assert mean <= th.mean_dropped_bound()
    assert abs(mean - th.alpha) < 0.01  # and it settles near the target


def test_conformal_settle_rolls_back_rejected_drafts():
    th = ConformalThreshold(alpha=0.1, eta=1.0, beta=0.5)
    for dropped in (0.3, 0.2, 0.4):
        th.observe(dropped)
    th.settle(1, 3)  # first accepted, second resampled by the cloud, third discarded
    assert th.beta == pytest.approx(0.5 - (0.3 - 0.1) - (0.2 - 0.1))
    assert th.kept_dropped == [0.3, 0.2]
    th.observe(0.0)
    th.settle(1, 1)  # all accepted: nothing rolled back
    assert th.beta == pytest.approx(0.2 + 0.1)
    with pytest.raises(ValueError, match="does not match"):
        th.settle(0, 2)
    with pytest.raises(ValueError, match="initial threshold"):
        ConformalThreshold(beta=1.5)


def test_sample_then_quantize_forces_the_token_in():
    row = quantize_row(np.array([0.45, 0.3, 0.15, 0.1]), 2, np.arange(4))
    assert row.counts.tolist() == [1, 1, 0, 0]
    forced = force_token(row, 3)
    assert forced.counts.tolist() == [0, 1, 0, 1] and forced.counts.sum() == 2


@pytest.mark.parametrize("k", [0, 8, 151_936])
def test_lattice_payload_round_trip_on_the_real_vocabulary(k):
    vocab, ell = 151_936, 100
    rng = np.random.default_rng([SEED, k])
    rule = {0: "conformal", 8: "topk", vocab: "full"}[k]
    wire = LatticeWire(vocab, ell, rule, k if rule == "topk" else 16,
                       ConformalThreshold(beta=0.001) if rule == "conformal" else None)
    rows = []
    for _ in range(3):
        logits = rng.standard_normal(vocab) * 4
        q = np.exp(logits - logits.max())
        q /= q.sum()
        rows.append(wire.sample(wire.quantize(q), q, float(rng.random()))[1])
    payload = wire.pack(rows)
    assert payload.bits == sum(wire.bits(r) for r in rows) and payload.k == k
    frames = P.encode(P.Verify(1, 1, 0, np.zeros(0, np.int32), np.zeros(3, np.int32), payload))
    decoded = dist_codec.decode_dist(P.decode(frames).dist, 3, vocab)
    for i, r in enumerate(rows):
        np.testing.assert_array_equal(decoded[i], r.dense(vocab, ell))


def _payload(**changes):
    rows = [quantize_row(np.array([0.5, 0.25, 0.25, 0.0]), 8, np.arange(4))]
    good = dist_codec.pack_lattice(rows, 4, 8, 4)
    return P.DistPayload(**{**{f: getattr(good, f) for f in good.__struct_fields__}, **changes})


@pytest.mark.parametrize("changes,match", [
    ({"ell": 0}, "resolution"),
    ({"ell": 1 << 20}, "resolution"),
    ({"bits": 9, "values": np.zeros(2, np.uint8)}, "bits left"),
    ({"bits": 7, "values": np.zeros(1, np.uint8)}, "ends early"),
    ({"values": np.full(1, 255, np.uint8)}, "rank"),
    ({"k": 5}, "support"),
    ({"bits": 17}, "announced"),
    ({"values": np.zeros(3, np.uint8)}, "announced"),
    ({"values": np.zeros((1, 1), np.uint8)}, "1-D uint8"),
])
def test_bad_lattice_payloads_are_refused(changes, match):
    dist_codec.decode_dist(_payload(), 1, 4)  # the unchanged payload decodes
    with pytest.raises(ValueError, match=match):
        dist_codec.decode_dist(_payload(**changes), 1, 4)


def test_an_oversized_per_row_support_is_refused_before_decoding():
    writer = enumerative.BitWriter()
    writer.write(dist_codec.MAX_SPARSE_K, enumerative.field_bits(151_936))  # K = MAX_SPARSE_K + 1
    data = writer.to_bytes()
    payload = P.DistPayload("lattice", np.frombuffer(data, np.uint8), bits=writer.n_bits, ell=100, k=0)
    with pytest.raises(ValueError, match="neither"):
        dist_codec.decode_dist(payload, 1, 151_936)


def test_server_answers_a_broken_lattice_payload_with_an_error(markov_server):
    with CloudClient(LinkConfig(markov_server.endpoint, security=LinkSecurity.plaintext()),
                     P.Hello("t", "markov", V, "markov-vocab")) as client:
        client.request(P.OpenSession(1, "qs", np.array([0, 1], np.int32), P.Sampling(1.0), 0))
        bad = _payload(bits=3)
        with pytest.raises(Exception, match="dist"):
            client.request(P.Verify(1, 1, 2, np.zeros(0, np.int32), np.array([0], np.int32), bad))
        good = dist_codec.pack_lattice([quantize_row(DRAFT[1], 2, np.arange(V))], V, 2, V)
        verdict = client.request(P.Verify(1, 1, 2, np.zeros(0, np.int32), np.array([1], np.int32), good))
        assert isinstance(verdict, P.Verdict)  # the session survived the bad frame
