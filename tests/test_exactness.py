"""Every protocol the README marks exact follows the target's law at T > 0, end to end through a real `hat-cloud
serve` process and a real `hat-edge generate` process on loopback, with a draft far from the target; and each of three
broken verifiers, planted into those processes, is caught.

The models are real checkpoints whose laws are known in closed form (tests/bigram_checkpoint.py: Llama models whose
next-token law after token x is row x of a table, V = 4): the target's rows put 0.70 on one token, the draft's 0.70 on
another, so TV(p, q) = 0.60 at T = 1 and 0.79 at the tests' T = 0.7. HAT's draft is the target cut at m = 1 with a
random Λ scaled far from the middle layers (TV ≈ 0.6). The test (tests/exactness.py, docs/TESTING.md) runs one long
generation per protocol and checks the token at every drafted position against the target's law given its prefix;
its power against each planted fault is computed on the run itself and asserted, so a run too short to catch a fault
fails instead of passing quietly. Measured here (2026-11-25; `pytest -s` prints them):

| protocol | tokens | drafted positions | Z | power: accept-all / resample-from-q / mix15 |
|---|---|---|---|---|
| sd (γ = 3) | 400 | 397 | +1.11 | 1.000 / 1.000 / 0.999 |
| hlm | 400 | 329 | +0.69 | 1.000 / 1.000 / 0.994 |
| qs / ksqs / csqs (ℓ = 8, K = 2) | 400 | 400 | +0.24 / +0.24 / −0.32 | 1.000 / 1.000 / 0.999 |
| hat (3 drafts, η = 0) | 800 | 760 | +0.37 | 1.000 / 1.000 / 0.999 |
| auto, a switch every round (sd γ 3, llm 2, ksqs γ 3, llm; 2026-11-27) | 800 | 300 | +1.07 | 1.000 / 1.000 / 0.993 |

(auto's ksqs rounds at ℓ = 8, K = 2; its 500 positions the cloud sampled alone, each llm round's first one right
after a switch: Z = −1.10 against the decoy one position behind, power 1.000.)

Planted (tests/planted.py) into the cloud for sd: accept-all Z = +30.5 (150 tokens), resample-from-q +31.4 (150),
mix15 +9.0 (400); into the device for hat: mix15 +6.6 (800). A correct verifier stays within ±4 with probability
1 − 6.3e-5. llm (the cloud sampling alone) and ushape (the device sampling from the cloud's states) have no draft:
every position against a sampler's decoys (the law a position behind, the untempered law).
"""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from tests.bigram_checkpoint import save_bigram, token_text
from tests.exactness import (FAULTS, MIN_TV, Z_CRIT, drafted_positions, drift, fault_law, power, power_of_law,
                             tv_rows)

V = 4
T = 0.7  # sampling temperature on both sides
TOKENS = 400  # generated per protocol
PROMPT = [0, 1, 2, 3, 0]
DRAFT_LEN = 3
_rows = np.full((V, V), 0.1)
TARGET = _rows.copy()
TARGET[np.arange(V), (np.arange(V) + 1) % V] = 0.7  # after x: x + 1
DRAFT = _rows.copy()
DRAFT[np.arange(V), (np.arange(V) + 2) % V] = 0.7  # after x: x + 2 (the target's 0.1)
TOKEN_PROTOCOLS = ("sd", "hlm", "qs", "ksqs", "csqs")
QS_ARGS = ["--ell", "8", "--k", "2", "--csqs-alpha", "0.1", "--csqs-eta", "0.2", "--csqs-beta", "0.2"]


def tempered(table: np.ndarray, temperature: float = T) -> np.ndarray:
    """The rows as both sides sample them: softmax(log row / T)."""
    w = np.exp(np.log(table) / temperature)
    return w / w.sum(-1, keepdims=True)


def laws_along(tokens, table: np.ndarray) -> np.ndarray:
    """table's tempered row for every generated position: after the prompt's last token, then after each token."""
    prev = np.asarray([PROMPT[-1], *tokens[:-1]], np.int64)
    return tempered(table)[prev]


@pytest.fixture(scope="module")
def bigrams(tmp_path_factory):
    root = tmp_path_factory.mktemp("bigram")
    return save_bigram(root / "target", TARGET), save_bigram(root / "draft", DRAFT)


def _cloud(target, fault=None):
    from cloud_runtime.process import CloudProcess

    cloud = CloudProcess(str(target), extra_args=["--dtype", "float32"], threads=1, ready_timeout_s=300)
    if fault:  # the same command, run through tests.planted with the fault in place
        cloud.args = [sys.executable, "-m", "tests.planted", fault, "cloud", *cloud.args[3:]]
    return cloud


def _generate(endpoint, model, protocols, tmp_path, extra=(), fault=None, seed=1, tokens=TOKENS):
    out = tmp_path / f"out-{fault or 'ok'}.json"
    args = ["generate", "--model", str(model), "--server", endpoint, "--protocol", ",".join(protocols),
            "--temperature", str(T), "--max-new-tokens", str(tokens), "--seed", str(seed), "--dtype", "float32",
            "--threads", "1", "--quiet", "--plaintext", "--json", str(out), *extra, token_text(PROMPT)]
    head = [sys.executable, "-m", "tests.planted", fault, "edge"] if fault else [sys.executable, "-m",
                                                                                  "edge_runtime.cli"]
    proc = subprocess.run(head + args, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert [r["protocol"] for r in results] == list(protocols)
    assert all(len(r["tokens"]) == tokens for r in results)
    return results


def _verifier_test(result, q_rows, first=0, draft_len=DRAFT_LEN):
    """(Drift over the drafted positions, {fault: power}) of one result; q_rows: the draft's law per position."""
    tokens = result["tokens"]
    p = laws_along(tokens, TARGET)
    at = drafted_positions(result, first)
    d = drift(np.asarray(tokens)[at], p[at], q_rows[at])
    return d, {f: power(p[at], q_rows[at], f, len(tokens) - first, draft_len) for f in FAULTS}


def _sampler_test(result, first=0):
    """A protocol without drafts (ushape: the device samples each token from the cloud's states; llm: the cloud
    samples alone): every position from `first` on against two decoys, the law one position behind (a state read off
    by one) and the untempered law (a sampler ignoring the temperature; TV 0.09 a position, so every position counts),
    each with power >= 0.99 over the run."""
    tokens = result["tokens"][first:]
    laws = laws_along(result["tokens"], TARGET)
    p, behind = laws[first:], laws[first - 1:-1] if first else np.vstack([tempered(TARGET)[PROMPT[-2]], laws[:-1]])
    flat = tempered(TARGET, 1.0)[[PROMPT[-1], *result["tokens"][:-1]][first:]]
    for name, decoy, min_tv in (("one position behind", behind, MIN_TV), ("untempered", flat, 0.0)):
        d = drift(tokens, p, decoy, min_tv)
        pw = power_of_law(p, decoy, decoy, min_tv=min_tv)
        print(f"{result['protocol']:6s} {d}; decoy {name}: power {pw:.3f}")
        assert abs(d.z) < Z_CRIT, (result["protocol"], name, str(d))
        assert pw >= 0.99, (result["protocol"], name, pw)


def test_every_exact_protocol_is_tested_here():
    """The protocol table's exact protocols that need the cloud are all run below (llm: the cloud samples alone)."""
    from hat_split.protocols import PROTOCOLS

    exact = {p.name for p in PROTOCOLS.values() if p.exact and p.needs_cloud}
    assert exact == set(TOKEN_PROTOCOLS) | {"llm", "hat", "ushape"}, exact


@pytest.mark.parametrize("protocols", [TOKEN_PROTOCOLS + ("llm",)])
def test_token_protocols_follow_the_target_at_every_drafted_position(bigrams, tmp_path, protocols):
    """sd, hlm and the quantize-then-sample protocols (ℓ = 8: the draft's rows move to lattice points off q) at
    T = 0.7: the drafted positions' tokens follow p given their prefixes (|Z| < 4), and the run had the power to catch
    each planted fault (≥ 0.99); llm, the cloud sampling alone, against the sampler decoys."""
    target, draft = bigrams
    with _cloud(target) as cloud:
        results = _generate(cloud.endpoint, draft, protocols, tmp_path, ["--draft-len", str(DRAFT_LEN), *QS_ARGS])
    _sampler_test(results.pop())  # llm
    for r in results:
        q = laws_along(r["tokens"], DRAFT)
        d, pw = _verifier_test(r, q, draft_len=1 if r["protocol"] == "hlm" else DRAFT_LEN)
        tv = tv_rows(laws_along(r["tokens"], TARGET), q).mean()
        powers = ", ".join(f"{k} {v:.3f}" for k, v in pw.items())
        print(f"{r['protocol']:5s} {d}; mean TV(p, q) {tv:.2f}; power {powers}")
        assert tv >= 0.3
        assert abs(d.z) < Z_CRIT, (r["protocol"], str(d))
        assert min(pw.values()) >= 0.99, (r["protocol"], pw)
    logs = {r["protocol"]: r["round_log"] for r in results}
    for name in ("qs", "ksqs", "csqs"):  # each round's rows on the lattice, within the bits the frame carried
        assert all(x["ell"] == 8 and sum(x["bits"]) <= x["payload_bits"] for x in logs[name]), name
    assert all(k == 2 for x in logs["ksqs"] for k in x["k"])
    assert len({k for x in logs["csqs"] for k in x["k"]}) > 1, "the conformal support never changed size"


def test_draft_trees_follow_the_target_at_every_position(bigrams, tmp_path):
    """`sd` with draft trees (issue 47: 12 nodes, 4 levels, 3 a level; children drawn without replacement, recursive
    rejection sampling in the cloud) through a cloud process and a device process at T = 0.7:
    every generated token follows p given its prefix (|Z| < 4; a tree round's bonus positions included, where the
    martingale holds as well), and the run had the power to catch a verifier that let the draft through (the
    faults' laws on every position but the last of each round, conservatively: ≥ 0.99; twice the chains' tokens,
    since a tree commits more of them per round as bonus positions)."""
    target, draft = bigrams
    trees = ["--tree-nodes", "12", "--tree-depth", "4", "--tree-width", "3"]
    with _cloud(target) as cloud:
        (r,) = _generate(cloud.endpoint, draft, ["sd"], tmp_path, trees, tokens=2 * TOKENS)  # power: see below
    tokens = r["tokens"]
    p, q = laws_along(tokens, TARGET), laws_along(tokens, DRAFT)
    d = drift(tokens, p, q)
    keep = 1.0 - r["rounds"] / len(tokens)  # the last token of a round may be a bonus: no fault there
    pw = {f: power_of_law(p, q, fault_law(p, q, f), keep) for f in ("accept-all", "mix15")}
    print(f"sd tree {d}; mean TV(p, q) {tv_rows(p, q).mean():.2f}; {len(tokens) / r['rounds']:.2f} tokens a round; "
          f"power {pw}")
    assert r["drafted"] > 2 * r["rounds"] and tv_rows(p, q).mean() >= 0.3
    assert abs(d.z) < Z_CRIT and min(pw.values()) >= 0.99, (str(d), pw)


def test_auto_switching_at_every_round_follows_the_target(bigrams, tmp_path):
    """Protocol auto made to switch at every round boundary (tests.planted auto-alternate: sd with γ = 3, llm for 2
    tokens, ksqs with γ = 3, llm, in turn): the positions sd's and ksqs's verifications decided follow p (|Z| < 4,
    with the power to catch each planted fault), and so do the positions the cloud sampled alone, each llm round's
    first one the token right after a switch."""
    target, draft = bigrams
    with _cloud(target) as cloud:
        (r,) = _generate(cloud.endpoint, draft, ["auto"], tmp_path, ["--ell", "8", "--k", "2"],
                         fault="auto-alternate", tokens=2 * TOKENS)
    segments = r["auto"]
    assert [s["protocol"] for s in segments[:4]] == ["sd", "llm", "ksqs", "llm"] and len(segments) > 100
    shapes, lattice, at, drafted, alone = iter(r["verify_log"]), iter(r["round_log"]), 0, [], []
    for seg in segments:  # one round each
        if seg["protocol"] == "sd":
            c, d, _ = next(shapes)
            drafted += range(at, at + min(seg["tokens"], c, d))
        elif seg["protocol"] == "ksqs":
            drafted += range(at, at + min(seg["tokens"], next(lattice)["L"]))
        else:
            alone += range(at, at + seg["tokens"])
        at += seg["tokens"]
    assert at == len(r["tokens"]) == 2 * TOKENS
    tokens = np.asarray(r["tokens"])
    p, q = laws_along(r["tokens"], TARGET), laws_along(r["tokens"], DRAFT)
    d = drift(tokens[drafted], p[drafted], q[drafted])
    pw = {f: power_of_law(p[drafted], q[drafted], fault_law(p[drafted], q[drafted], f)) for f in FAULTS}
    print(f"auto (sd) {d}; power " + ", ".join(f"{k} {v:.3f}" for k, v in pw.items()))
    assert abs(d.z) < Z_CRIT, str(d)
    assert min(pw.values()) >= 0.99, pw
    alone = np.asarray(alone)
    assert alone.min() > 0  # the first round is sd's
    behind = p[alone - 1]  # the law one position behind: a state read off by one
    d, pw = drift(tokens[alone], p[alone], behind), power_of_law(p[alone], behind, behind)
    print(f"auto (llm) {d}; decoy one position behind: power {pw:.3f}")
    assert abs(d.z) < Z_CRIT, str(d)
    assert pw >= 0.99, pw


PLANT_TOKENS = {"accept-all": 150, "resample-from-q": 150, "mix15": TOKENS}  # each with power >= 0.99 (asserted)


@pytest.mark.parametrize("fault", FAULTS)
def test_a_broken_cloud_verifier_is_caught(bigrams, tmp_path, fault):
    """The same sd run against a cloud whose verification has `fault` (tests.planted): Z beyond 4."""
    target, draft = bigrams
    with _cloud(target, fault) as cloud:
        (r,) = _generate(cloud.endpoint, draft, ["sd"], tmp_path, ["--draft-len", str(DRAFT_LEN)],
                         tokens=PLANT_TOKENS[fault])
    d, pw = _verifier_test(r, laws_along(r["tokens"], DRAFT))
    print(f"sd with {fault}: {d}; power {pw[fault]:.3f}")
    assert pw[fault] >= 0.99 and d.z > Z_CRIT, str(d)


# -- the split protocols: the device verifies with the cloud's deep states -------------------------------------------
SPLIT_TOKENS = 800  # Λ's q is nearer p than the token draft's: more positions for the same power
LAMBDA_SCALE = 30.0  # Λ random, its value and output projections scaled: TV(p, q) about 0.55 at T = 0.7
SPLIT_ARGS = ["--m", "1", "--hidden-format", "float32", "--hat-draft-stop-prob", "0", "--hat-draft-len", str(DRAFT_LEN)]


@pytest.fixture(scope="module")
def split_target(tmp_path_factory):
    """The target bigram checkpoint, a far Λ for it, its draft law along a sequence (AdapterLM: head ∘ Λ ∘ input, the
    device's draft), and a cloud process serving its middle layers."""
    import torch

    from hat_split.models.adapter import Adapter, save_adapter
    from hat_split.models.draft_lm import AdapterLM
    from hat_split.models.loading import load_model
    from hat_split.models.partition import SplitModel

    root = tmp_path_factory.mktemp("split")
    path = save_bigram(root / "target", TARGET)
    loaded = load_model(str(path), dtype="float32")
    split = SplitModel(loaded.model, 1)
    torch.manual_seed(0)
    adapter = Adapter(loaded.model, 1, init="random").eval().requires_grad_(False)
    with torch.no_grad():
        adapter.self_attn.o_proj.weight.mul_(LAMBDA_SCALE)
        adapter.self_attn.v_proj.weight.mul_(LAMBDA_SCALE)
    save_adapter(root / "adapter", adapter, split, loaded.name, {"steps": 0, "note": "random, scaled: a far draft"})
    lm = AdapterLM(split, adapter)

    def q_along(tokens):
        logits = lm.forward(lm.new_state(), PROMPT + list(tokens), n_logits=len(tokens))
        return tempered(np.exp(logits - logits.max(-1, keepdims=True)))

    with _cloud(path) as cloud:
        yield path, root / "adapter", q_along, cloud


def test_split_protocols_follow_the_target_at_every_position(split_target, tmp_path):
    """hat (Λ far from the model: every drafted position, the second generated token the first of them, given its
    prefix) and ushape (every position after the prefill's; decoy: the untempered law a sampler that ignored the
    temperature would follow) at T = 0.7, through a cloud process and a device process."""
    path, adapter, q_along, cloud = split_target
    hat, ushape = _generate(cloud.endpoint, path, ["hat", "ushape"], tmp_path, ["--adapter", str(adapter),
                                                                               *SPLIT_ARGS], tokens=SPLIT_TOKENS)
    q = q_along(hat["tokens"])
    tv = tv_rows(laws_along(hat["tokens"], TARGET), q)
    d, pw = _verifier_test(hat, q, first=1)
    print(f"hat    {d}; mean TV(p, q) {tv.mean():.2f}; power {', '.join(f'{k} {v:.3f}' for k, v in pw.items())}")
    assert tv.mean() >= 0.3 and hat["drafted"] > 0
    assert abs(d.z) < Z_CRIT and min(pw.values()) >= 0.99, (str(d), pw)
    _sampler_test(ushape, first=1)


def test_hat_draft_trees_follow_the_target_at_every_position(split_target, tmp_path):
    """hat with Λ drafting trees (9 nodes, 3 levels, 3 a level; the device verifies with position-keyed draws) at
    T = 0.7: every token after the first follows p given its prefix (|Z| < 4), with the power to catch a verifier
    that let the draft through (as for sd's trees)."""
    path, adapter, q_along, cloud = split_target
    (hat,) = _generate(cloud.endpoint, path, ["hat"], tmp_path, ["--adapter", str(adapter), *SPLIT_ARGS,
                                                                   "--hat-tree-nodes", "9", "--hat-tree-depth", "3",
                                                                   "--hat-tree-width", "3"],
                        tokens=3 * SPLIT_TOKENS // 2)
    tokens = hat["tokens"]
    p, q = laws_along(tokens, TARGET)[1:], q_along(tokens)[1:]
    d = drift(tokens[1:], p, q)
    keep = 1.0 - hat["rounds"] / len(tokens)
    pw = {f: power_of_law(p, q, fault_law(p, q, f), keep) for f in ("accept-all", "mix15")}
    print(f"hat tree {d}; mean TV(p, q) {tv_rows(p, q).mean():.2f}; power {pw}")
    assert hat["drafted"] > 2 * hat["rounds"] and tv_rows(p, q).mean() >= 0.3
    assert abs(d.z) < Z_CRIT and min(pw.values()) >= 0.99, (str(d), pw)


@pytest.mark.parametrize("fault", ["mix15"])
def test_a_broken_device_verifier_is_caught(split_target, tmp_path, fault):
    """hat with `fault` planted into the device's verification (tests.planted): Z beyond 4. The subtlest of the three
    faults; the same wrapper's other two are caught on the cloud's side above (the device calls the one function)."""
    path, adapter, q_along, cloud = split_target
    (r,) = _generate(cloud.endpoint, path, ["hat"], tmp_path, ["--adapter", str(adapter), *SPLIT_ARGS], fault=fault,
                     tokens=SPLIT_TOKENS)
    d, pw = _verifier_test(r, q_along(r["tokens"]), first=1)
    print(f"hat with {fault}: {d}; power {pw[fault]:.3f}")
    assert pw[fault] >= 0.99 and d.z > Z_CRIT, str(d)


# -- the split protocols with the feature drafter --------------------------------------------------------------------
# one draft a round: each drafted position's law is the drafter's on true features
FEATURE_ARGS = ["--m", "1", "--hidden-format", "float32", "--hat-draft-stop-prob", "0", "--hat-draft-len", "1",
                "--no-parallel-draft"]
FC_SCALE = 8.0  # the fusion layer's token half scaled: the draft far from the target
FEATURE_TOKENS = 2 * SPLIT_TOKENS  # one draft a round: twice the tokens for the drafted positions' power


@pytest.fixture(scope="module")
def feature_target(tmp_path_factory, split_target):
    """A far feature drafter for the target bigram checkpoint (saved as hat-distill writes one) and its first-draft
    law along a sequence: the drafter over the sequence's true features, the target's own (one pass)."""
    import torch

    from hat_split.models.distill import teacher
    from hat_split.models.feature_drafter import FeatureDrafter, draft_logits, save_feature_drafter, ttt_forward
    from hat_split.models.loading import load_model
    from hat_split.models.partition import SplitModel

    path, _, _, cloud = split_target
    root = tmp_path_factory.mktemp("feature")
    loaded = load_model(str(path), dtype="float32")
    split = SplitModel(loaded.model, 1)
    torch.manual_seed(0)
    drafter = FeatureDrafter(loaded.model).eval().requires_grad_(False)
    hidden = loaded.model.config.hidden_size
    with torch.no_grad():
        drafter.fc.weight[:, hidden:].normal_(0.0, FC_SCALE / hidden ** 0.5)
    save_feature_drafter(root / "drafter", drafter, split, loaded.name, {"steps": 0, "note": "random: a far draft"})

    def q_along(tokens):
        ids = PROMPT + list(tokens)
        t = teacher(split, torch.tensor([ids]))
        fhat = ttt_forward(drafter, drafter.stack(split), t.features, t.shallow, 1, train=False)[0]
        logits = draft_logits(loaded.model, fhat[0, len(PROMPT) - 1:len(ids) - 1]).numpy()
        return tempered(np.exp(logits - logits.max(-1, keepdims=True)))

    yield path, root / "drafter", q_along, cloud


def test_hat_with_the_feature_drafter_follows_the_target(feature_target, tmp_path):
    """hat with a far feature drafter at T = 0.7 through a cloud process and a device process: every drafted position,
    the second generated token the first of them, follows the target given its prefix; the drafter's law there is
    its own on the target's true features (the runtime's chunks and crops are checked against it: a wrong feature
    context would shift q, and the test would not know the law it is testing against)."""
    path, drafter, q_along, cloud = feature_target
    (hat,) = _generate(cloud.endpoint, path, ["hat"], tmp_path, ["--adapter", str(drafter), *FEATURE_ARGS],
                       tokens=FEATURE_TOKENS)
    q = q_along(hat["tokens"])
    tv = tv_rows(laws_along(hat["tokens"], TARGET), q)
    d, pw = _verifier_test(hat, q, first=1, draft_len=1)
    print(f"hat (feature drafter) {d}; mean TV(p, q) {tv.mean():.2f}; "
          f"power {', '.join(f'{k} {v:.3f}' for k, v in pw.items())}")
    assert tv.mean() >= 0.3 and hat["drafted"] > 0
    assert abs(d.z) < Z_CRIT and min(pw.values()) >= 0.99, (str(d), pw)
