"""The feature drafter (hat_split.models.feature_drafter): its incremental steps equal one pass over the same pairs,
each unrolled training step equals the inference-time draft step it stands for, and training really learns (tiny
random models, float32)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hat_split.models.distill import teacher
from hat_split.models.feature_drafter import (FeatureDrafter, load_feature_drafter, save_feature_drafter,
                                              shift_features, ttt_forward, ttt_loss)
from hat_split.models.partition import PartCache, SplitModel
from tests.conftest import tiny_model, tiny_model_dir


@pytest.fixture(scope="module")
def split():
    return SplitModel(tiny_model(2, layers=3), 1)


def _window(split, n=12, seed=0, token_input="shallow", tokens=None):
    """A window's true features and what stands for its tokens (shallow states, or embeddings): random tokens, or
    `tokens # [1, n]`."""
    if tokens is None:
        tokens = torch.randint(0, split.model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))
    t = teacher(split, tokens)
    if token_input == "embedding":
        with torch.no_grad():
            return t.features, split.model.model.embed_tokens(tokens)
    return t.features, t.shallow


def _perturbed(split, seed=5, token_input="shallow"):
    torch.manual_seed(seed)
    d = FeatureDrafter(split.model, token_input)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return d.eval()


def test_incremental_steps_equal_one_pass(split):
    feats, shallow = _window(split)
    d = _perturbed(split)
    stack = d.stack(split)
    whole = ttt_forward(d, stack, feats, shallow, 1, train=False)[0]
    cache, pairs = PartCache(), shift_features(feats)
    steps = [d.step(stack, cache, pairs[:, :3], shallow[:, :3])]  # a chunk, then one pair at a time
    for p in range(3, feats.shape[1]):
        steps.append(d.step(stack, cache, pairs[:, p:p + 1], shallow[:, p:p + 1]))
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, rtol=1e-5, atol=1e-5)
    assert cache.length == feats.shape[1]


@pytest.mark.parametrize("j", [1, 2, 3])
def test_each_unrolled_step_is_the_draft_step_it_stands_for(split, j):
    """Row p of unroll step j = inference: the true pairs up to p − j as a chunk, then j draft steps on the drafter's
    own predicted features (the window's tokens as the drafts)."""
    feats, shallow = _window(split, n=10, seed=1)
    d = _perturbed(split, seed=6)
    stack = d.stack(split)
    unrolled = ttt_forward(d, stack, feats, shallow, j + 1, train=False)
    pairs = shift_features(feats)
    for p in (j, 6, 9):
        cache = PartCache()
        fhat = d.step(stack, cache, pairs[:, :p - j + 1], shallow[:, :p - j + 1])[:, -1:]
        for k in range(1, j + 1):
            q = p - j + k
            fhat = d.step(stack, cache, fhat, shallow[:, q:q + 1])
        torch.testing.assert_close(fhat[0, 0], unrolled[j][0, p], rtol=1e-4, atol=1e-5)


PROMPT = [5, 17, 99, 3, 250, 7, 41, 8]


def _train(split, token_input="shallow", steps=50):
    """The drafter after `steps` of the training-time test on the tiny model's own features (four random windows of
    32 and the model's greedy continuation of PROMPT, so that drafts of that text are accepted), with the top-1
    agreement before and after, and the windows."""
    torch.manual_seed(0)
    d = FeatureDrafter(split.model, token_input).float()
    stack = d.stack(split)
    batches = [_window(split, n=32, seed=s, token_input=token_input) for s in range(4)]
    greedy = split.model.generate(torch.tensor([PROMPT]), max_new_tokens=32 - len(PROMPT), do_sample=False,
                                  pad_token_id=0, eos_token_id=None)
    batches.append(_window(split, token_input=token_input, tokens=greedy))
    feats = torch.cat([b[0] for b in batches])
    shallow = torch.cat([b[1] for b in batches])

    def top1():
        with torch.no_grad():
            return ttt_loss(split, d, stack, feats, shallow, 2, 0.1, train=False)["top1"]
    before = top1()
    opt = torch.optim.AdamW(d.parameters(), lr=3e-3)
    for _ in range(steps):
        r = ttt_loss(split, d, stack, feats, shallow, 2, 0.1)
        opt.zero_grad()
        r["loss"].backward()
        opt.step()
    return d.eval(), before, top1(), feats, shallow


@pytest.fixture(scope="module")
def trained(split):
    return _train(split)


@pytest.fixture(scope="module")
def trained_embedding(split):
    return _train(split, "embedding")


def test_training_learns_and_the_artifact_round_trips(split, trained, tmp_path):
    """Fifty steps of the training-time test on the tiny model's own features reach a top-1 agreement the untrained
    drafter does not; saved and loaded, the drafter computes the same; another cut is refused in one line."""
    d, before, after, feats, shallow = trained
    stack = d.stack(split)
    assert after > before + 0.3, (before, after)
    save_feature_drafter(tmp_path / "fd", d, split, "tiny", {"steps": 50})
    loaded = load_feature_drafter(tmp_path / "fd", split)
    a = ttt_forward(d.eval(), stack, feats[:1], shallow[:1], 1, train=False)[0]
    b = ttt_forward(loaded, loaded.stack(split), feats[:1], shallow[:1], 1, train=False)[0]
    torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="trained for the cut m=1, tail=0; this split is m=2, tail=0"):
        load_feature_drafter(tmp_path / "fd", SplitModel(split.model, 2))


def _reference_first_draft(split, d, tokens):
    """The drafter's first draft after committed `tokens`, computed from nothing: the full model's features and the
    input part's shallow states (or the embeddings) of the whole sequence, one pass of the drafter, the head's
    argmax."""
    from hat_split.models.feature_drafter import draft_logits, token_states

    ids = torch.tensor([tokens])
    t = teacher(split, ids)
    fhat = ttt_forward(d, d.stack(split), t.features, token_states(split, d, t.shallow, ids), 1, train=False)[0]
    return int(draft_logits(split.model, fhat[:, -1]).argmax(-1))


@pytest.mark.parametrize("token_input,parallel", [("shallow", False), ("embedding", False), ("shallow", True),
                                                   ("embedding", True)])
def test_each_rounds_first_draft_equals_the_drafter_run_from_nothing(split, token_input, parallel):
    """Greedy HAT with the middle part in this process: every fresh round's first draft is what the drafter computes
    from the committed sequence's true features alone (the runtime's chunks, crops and kept pairs lose nothing; with
    embeddings, the drafts' shallow states computed at the upload; with parallel drafting, also after rounds that
    adopted a continuation drafted on predicted features), and the tokens are the full model's."""
    from edge_runtime.backends.split_parts import TorchSplitParts
    from edge_runtime.split_drafter import SplitDrafter
    from hat_split.math.sampling import SamplingParams

    d = _perturbed(split, seed=8, token_input=token_input)
    dev = SplitDrafter(TorchSplitParts(split, d), SamplingParams(0.0), seed=0)
    prompt = [5, 17, 99, 3, 250, 7, 41, 8]
    dev.start(prompt)
    middle = PartCache()
    deep = split.middle.forward(middle, dev.prompt_states(len(prompt)))
    dev.commit([dev.sample_target(dev.target_logits(deep, 0, 1))])
    rounds = adopted = fresh_after_adoption = 0
    while len(dev.tokens) < len(prompt) + 40:
        fresh = dev.adopted is None
        state = dev.draft(3, 0.3 if parallel else 0.0)
        if fresh:
            assert state.drafts[0] == _reference_first_draft(split, d, dev.tokens), rounds
            fresh_after_adoption += adopted > 0
        middle.crop(state.base)
        deep = split.middle.forward(middle, dev.upload_states(state))
        cands = dev.candidates(state, 8) if parallel else []
        for c in cands:
            dev.extend(c, 3, 0.0, steps=2)
        n, token = dev.verify(state, dev.target_logits(deep, state.base, len(state.drafts) + 1))
        adopted += dev.adopt(cands, token, n, len(state.drafts)) if cands else 0
        dev.commit(state.drafts[:n] + [token], n)
        rounds += 1
    if parallel:
        assert adopted > 0 and fresh_after_adoption > 0, (adopted, fresh_after_adoption)
    full = split.model.generate(torch.tensor([prompt]), max_new_tokens=len(dev.tokens) - len(prompt),
                                do_sample=False, pad_token_id=0, eos_token_id=None)[0].tolist()
    assert dev.tokens == full
    assert max(dev.lam.length, 0) <= len(dev.tokens) and set(dev.feats) <= set(range(-1, len(dev.tokens)))


def _reference_q(split, d, tokens, path):
    """The drafter's distribution after `path` drafted below committed `tokens`, computed from nothing: the full
    model's features of the whole sequence, unroll step len(path) at its last position (true pairs up to the last
    committed token, the drafter's own predictions along the path; the path's true features are never read)."""
    from hat_split.models.feature_drafter import draft_logits, token_states

    ids = torch.tensor([list(tokens) + list(path)])
    t = teacher(split, ids)
    k = len(path)
    fhat = ttt_forward(d, d.stack(split), t.features, token_states(split, d, t.shallow, ids), k + 1, train=False)[k]
    return torch.softmax(draft_logits(split.model, fhat[:, -1]), dim=-1)[0].numpy()


@pytest.mark.parametrize("token_input,temperature", [("shallow", 0.0), ("embedding", 0.0), ("shallow", 1.0)])
def test_every_tree_nodes_draft_equals_the_drafter_run_from_nothing_on_its_path(request, split, token_input,
                                                                               temperature):
    """Feature-drafter trees with the middle part in this process: in every round the root's and every drafted-from
    node's distribution is what the drafter computes from the committed sequence and the node's path alone (its
    parent's predicted feature in each pair, the tree's mask hiding the other branches; the kept path and the
    features the device keeps for the next round lose nothing), and at temperature 0 the tokens are the full
    model's. The drafter is the briefly trained one (so that paths are accepted and kept)."""
    from edge_runtime.backends.split_parts import TorchSplitParts
    from edge_runtime.split_drafter import SplitDrafter
    from edge_runtime.training.common import local_tree_round
    from hat_split.math.sampling import SamplingParams
    from hat_split.math.tree import path_to

    d = request.getfixturevalue("trained" if token_input == "shallow" else "trained_embedding")[0]
    dev = SplitDrafter(TorchSplitParts(split, d), SamplingParams(temperature), seed=0)
    prompt = PROMPT
    dev.start(prompt)
    middle = PartCache()
    deep = split.middle.forward(middle, dev.prompt_states(len(prompt)))
    dev.commit([dev.sample_target(dev.target_logits(deep, 0, 1))])
    rows = accepted = 0
    while len(dev.tokens) < len(prompt) + 24:
        draft = dev.draft_tree(9, 3, 3)
        t = draft.tree
        for i in range(len(t.tokens) + 1):
            if i == 0 or t.q[i].any():  # the last level's nodes were drafted from by no one
                path = [int(t.tokens[n]) for n in path_to(t.parents, i - 1)] if i else []
                np.testing.assert_allclose(t.q[i], _reference_q(split, d, dev.tokens, path), rtol=1e-4, atol=1e-6)
                rows += 1
        accepted += len(local_tree_round(dev, split, middle, draft).path)
    assert rows > 20 and accepted > 0, (rows, accepted)
    if temperature == 0:
        full = split.model.generate(torch.tensor([prompt]), max_new_tokens=len(dev.tokens) - len(prompt),
                                    do_sample=False, pad_token_id=0, eos_token_id=None)[0].tolist()
        assert dev.tokens == full


@pytest.mark.parametrize("nodes,depth,width,token_input", [(8, 4, 2, "shallow"), (12, 4, 3, "embedding")])
def test_hat_feature_drafter_trees_give_the_full_models_tokens(tiny_server, tiny_pair, nodes, depth, width,
                                                                token_input):
    """Through a cloud (the middle layers verify the tree in one masked forward): greedy tokens are the full
    model's."""
    from hat_split.math.sampling import SamplingParams
    from tests.test_hat import _greedy, _run_split

    model = tiny_pair[1].model
    d = _perturbed(SplitModel(model, 1), seed=9, token_input=token_input)
    res = _run_split(tiny_server, model, "hat", SamplingParams(0.0), n=24, adapter=d, tree_nodes=nodes,
                     tree_depth=depth, tree_width=width, parallel_draft=False)
    assert res.tokens == _greedy(model, 24)
    assert res.drafted > res.rounds and res.finish_reason == "length"


@pytest.mark.parametrize("chunk,token_input", [(0, "shallow"), (3, "shallow"), (3, "embedding")])
@pytest.mark.parametrize("parallel", [False, True])
def test_hat_with_the_feature_drafter_gives_the_full_models_tokens(tiny_server, tiny_pair, chunk, token_input,
                                                                  parallel, pd_driven):
    """Through a cloud: sequential and parallel drafting (driven: every round drafts candidates), chunked and
    whole prefill, tokens as shallow states or embeddings; greedy tokens are the full model's."""
    from hat_split.math.sampling import SamplingParams
    from tests.test_hat import _greedy, _run_split

    model = tiny_pair[1].model
    d = _perturbed(SplitModel(model, 1), seed=9, token_input=token_input)
    res = _run_split(tiny_server, model, "hat", SamplingParams(0.0), adapter=d, draft_stop_prob=0.0, draft_len=4,
                     chunk_tokens=chunk, parallel_draft=parallel, pd_topk=2)
    assert res.tokens == _greedy(model, 20)
    assert res.drafted > 0


@pytest.mark.parametrize("drafter", ["feature", "lambda"])
@pytest.mark.parametrize("per_draft", [0.0, 1.0])
@pytest.mark.parametrize("parallel", [False, True])
def test_the_measured_cost_rule_keeps_the_full_models_tokens(tiny_server, tiny_pair, drafter, per_draft, parallel):
    """`draft_stop = "cost"` (hat_split.math.draft_stop), the feature drafter and Λ, with and without parallel
    drafting (its forks start before a refused draft's step): greedy tokens are the full model's whatever the rule
    sends. A connection whose draft steps took a second against 10 ms rounds sends only its
    probes' drafts (one round in PROBE_EVERY); one whose drafts are free sends more."""
    from edge_runtime.sessions.split import LinkState
    from hat_split.math.draft_stop import PROBE_EVERY, RoundCostFit, RoundCosts
    from hat_split.math.sampling import SamplingParams
    from hat_split.models.adapter import Adapter
    from tests.test_hat import _greedy, _run_split

    model = tiny_pair[1].model
    torch.manual_seed(3)
    d = _perturbed(SplitModel(model, 1), seed=9) if drafter == "feature" else Adapter(model, 1).eval()
    state = LinkState.configured(0.0, 0.0)
    state.round_costs = RoundCosts(RoundCostFit(0.005, 0.0), draft_s=per_draft, rest_s=0.005)
    res = _run_split(tiny_server, model, "hat", SamplingParams(0.0), n=24, adapter=d, draft_stop="cost", draft_len=4,
                     parallel_draft=parallel, pd_topk=2, link_state=state)
    assert res.tokens == _greedy(model, 24) and res.finish_reason == "length"
    probes = -(-23 // PROBE_EVERY)  # 23 decode rounds: a probe sends its first draft whatever it costs
    assert (0 < res.drafted <= probes) if per_draft else (res.drafted > probes)


@pytest.mark.real_models
def test_hat_with_the_feature_drafter_across_processes_on_the_real_smollm2_cut(smollm2, tmp_path):
    """`hat-cloud serve` and `hat-edge generate --adapter DIR` (a feature drafter's directory) as processes: hat's
    greedy tokens are the full model's on the real SmolLM2-135M cut at m = 2, float32, chunked prefill."""
    from tests.test_hat import _split_across_processes

    _split_across_processes(smollm2, tmp_path, [], ("ushape", "hat"), drafter="feature")


def test_a_feature_drafter_is_refused_where_it_cannot_run(split, tmp_path):
    """Λ's loader (the token protocols' adapter draft) refuses a feature drafter's directory in one line, saying what
    it is (a bundle's refusals: tests/test_feature_export.py)."""
    from hat_split.models.adapter import load_adapter

    save_feature_drafter(tmp_path / "fd", FeatureDrafter(split.model), split, "tiny", {"steps": 0})
    with pytest.raises(ValueError, match="holds a feature drafter, not HAT's adapter"):
        load_adapter(tmp_path / "fd", split)


@pytest.mark.parametrize("token_input", ["shallow", "embedding"])
def test_parallel_drafting_with_the_feature_drafter_changes_timing_not_output(tiny_server, tiny_pair, token_input,
                                                                             pd_driven):
    """Over a link with 15 ms of delay each way (time to draft candidates while the cloud works): rounds that adopt a
    parallel-drafted continuation (its pairs on predicted features, cropped back after) give the tokens drafting
    without it gives, greedy and sampled (position-keyed randomness); some rounds do adopt."""
    from hat_split.math.sampling import SamplingParams
    from testbed.link_emulator import LinkEmulator
    from testbed.links import LinkProfile
    from tests.test_hat import _run_split

    model = tiny_pair[1].model
    d = _perturbed(SplitModel(model, 1), seed=9, token_input=token_input)
    hits = 0
    host, port = tiny_server.endpoint.split("//")[1].rsplit(":", 1)
    with LinkEmulator(LinkProfile("pd-test", delay_s=0.015), (host, int(port))) as link:
        for params in (SamplingParams(0.0), SamplingParams(1.0)):
            kw = dict(n=30, seed=7, adapter=d, draft_stop_prob=0.3)
            on = _run_split(tiny_server, model, "hat", params, parallel_draft=True, pd_topk=4, endpoint=link.address,
                            **kw)
            off = _run_split(tiny_server, model, "hat", params, parallel_draft=False, **kw)
            assert on.tokens == off.tokens and on.pd_steps > 0
            hits += on.pd_hits
    assert hits > 0


@pytest.mark.real_models
def test_hat_distill_fits_a_feature_drafter_into_a_time_budget(smollm2, tmp_path, capsys):
    """--budget-s: the cache stops filling at half the budget (short of --windows, and resumable), one step is timed
    and the steps are what the rest holds; the record says what the budget bought. The budget is refused for Λ."""
    import json

    from edge_runtime.training.distill import main

    out = tmp_path / "fd"
    args = ["--model", "smollm2-135m", "--m", "2", "--batch", "2", "--seq-len", "64", "--windows", "2000",
            "--train-vocab", "64", "--eval-windows", "1", "--eval-prompts", "1", "--eval-tokens", "4",
            "--out", str(out)]
    assert main(["--drafter", "feature", "--budget-s", "16", "--record", str(tmp_path / "results/fd.json"), *args]) == 0
    record = json.loads((out / "drafter.json").read_text())["record"]
    assert json.loads((tmp_path / "results/fd.json").read_text()) == json.loads((out / "drafter.json").read_text())
    budget = record["budget"]
    cached = json.loads((out / "teacher-cache" / "meta.json").read_text())["done"]
    assert 2 <= budget["windows"] == cached == record["train_windows"] < 2000
    assert budget["steps"] == record["steps"] == len(record["history"]) >= 1 and budget["step_s"] > 0
    assert "--budget-s 16: " in capsys.readouterr().err
    assert main(["--budget-s", "16", *args]) == 2
    assert "--budget-s is a time in seconds > 0 for training a feature drafter afresh" in capsys.readouterr().err


@pytest.mark.real_models
def test_hat_distill_trains_a_feature_drafter_resumably_on_the_real_cut(smollm2, tmp_path, capsys):
    """`hat-distill --drafter feature` on SmolLM2-135M cut at m = 2: two steps, then --resume to three continues the
    same history; a resume with other data order is refused in one line; the artifact loads onto the cut and names
    what it is."""
    import json

    from edge_runtime.training.distill import main
    from hat_split.models.feature_drafter import load_drafter
    from hat_split.models.registry import default_adapter_dir

    out = tmp_path / "fd"
    args = ["--drafter", "feature", "--model", "smollm2-135m", "--m", "2", "--batch", "2", "--seq-len", "32",
            "--windows", "4", "--train-windows", "3", "--unroll", "2", "--train-vocab", "32", "--draft-vocab", "32",
            "--checkpoint-every", "1",
            "--eval-windows", "1", "--eval-prompts", "1", "--eval-tokens", "4", "--out", str(out)]
    assert main([*args, "--steps", "2"]) == 0
    first = json.loads((out / "drafter.json").read_text())["record"]["history"]
    assert main([*args, "--steps", "3", "--resume", "--eval-trees", "6x3x2"]) == 0
    meta = json.loads((out / "drafter.json").read_text())
    record = meta["record"]
    assert len(record["history"]) == 3 and record["history"][0] == first[0]
    assert record["drafter"] == "feature" and record["unroll"] == 2 and len(record["eval"]["top1_steps"]) == 2
    assert record["windows"] == 4 and record["train_windows"] == 3
    assert set(record["acceptance_draft_vocab_32"]) == {"sharegpt", "humaneval"}
    trees = record["trees_draft_vocab_32"]["t6d3w2"]  # the same prompts, drafted as trees
    assert set(trees) == {"sharegpt", "humaneval"} and all(t["tree"] == [6, 3, 2] for t in trees.values())
    assert all(t["rounds"] > 0 and 1 <= t["tokens_per_round"] <= 4 and t["nodes_per_round"] >= 1
               for t in trees.values())
    capsys.readouterr()
    assert main([*args, "--eval-only", "--eval-trees", "6x3"]) == 2
    assert "'6x3' is not NODESxDEPTHxWIDTH" in capsys.readouterr().err
    assert meta["kind"] == "feature" and meta["token_input"] == "shallow"
    assert len(meta["provenance"]["git_commit"]) == 40
    capsys.readouterr()
    assert main([*args, "--steps", "3", "--resume", "--seed", "1"]) == 2
    assert "was made with other --seed (0 there, 1 here)" in capsys.readouterr().err
    split = SplitModel(smollm2.model, 2)
    assert isinstance(load_drafter(out, split), FeatureDrafter)
    assert default_adapter_dir("smollm2-135m", 2, 0, "feature").as_posix() == "runs/adapters/smollm2-135m-m2-feature"


@pytest.mark.real_models
def test_hat_bench_runs_the_feature_drafters_rows_end_to_end(smollm2, tmp_path):
    """`hat-bench hat --feature-drafter DIR` on SmolLM2-135M (one prompt, 8 tokens, wifi-near): a cloud process, the
    link emulator and the device's rows U-shape, +SD F, HAT F v64, its 6-node trees and its cost-rule row run and are
    summarised, Table 4 has the feature drafter's row, and greedy tokens are U-shape's in every row."""
    import json
    import subprocess
    import sys

    from hat_split.models.adapter import rank_vocab, save_draft_vocab

    split = SplitModel(smollm2.model, 2)
    save_feature_drafter(tmp_path / "fd", FeatureDrafter(smollm2.model).eval(), split, smollm2.name, {"steps": 0})
    save_draft_vocab(tmp_path / "fd", rank_vocab([list(range(200))], smollm2.model.config.vocab_size))
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "profiles.bench.bench", "hat", "--model", "smollm2-135m", "--m", "2",
                           "--feature-drafter", str(tmp_path / "fd"), "--draft-vocab", "64",
                           "--trees", "6x3x2", "--cost-rule",
                           "--variants", "U-shape,+SD F,HAT F v64,HAT F v64 t6d3w2,HAT F v64 cost",
                           "--links", "wifi-near", "--prompts", "1",
                           "--min-prompt-tokens", "40", "--max-prompt-tokens", "300", "--max-new-tokens", "8",
                           "--dtype", "float32", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    table = report["tables"]["wifi-near"]
    assert list(table) == ["U-shape", "+SD F", "HAT F v64", "HAT F v64 t6d3w2", "HAT F v64 cost"]
    assert all(row["same_tokens_as_ushape"] == "1/1" for row in table.values())
    assert table["+SD F"]["drafts_per_round"] > 0 and "wifi-near, feature" in report["table4"]
    assert report["feature_parameters"] == FeatureDrafter(smollm2.model).n_params()


def test_hat_distill_trains_the_feature_drafter_live_as_over_its_cache(tmp_path, capsys):
    """`--no-cache` runs the frozen model live at every step (a GPU's way at scale: no disk of 6 KB a position): over
    float32 states it gives the history that training over a float32 cache gives, and makes no cache; a time budget,
    which sizes the cache, is refused with it."""
    import json

    from edge_runtime.training.distill import main

    model_dir = tiny_model_dir(tmp_path / "tiny")
    args = ["--drafter", "feature", "--model", str(model_dir), "--m", "2", "--batch", "2", "--seq-len", "32",
            "--windows", "4", "--steps", "3", "--unroll", "2", "--train-vocab", "64", "--dtype", "float32",
            "--cache-dtype", "float32", "--device", "cpu", "--eval-windows", "1", "--eval-prompts", "1",
            "--eval-tokens", "4"]
    records = {}
    for way, extra in (("cached", []), ("live", ["--no-cache"])):
        assert main([*args, *extra, "--out", str(tmp_path / way)]) == 0, capsys.readouterr().err[-2000:]
        records[way] = json.loads((tmp_path / way / "drafter.json").read_text())["record"]
    cached, live = records["cached"], records["live"]
    assert live["teacher_cache"] is None and not (tmp_path / "live" / "teacher-cache").exists()
    assert cached["teacher_cache"]["dtype"] == "float32" and len(live["history"]) == 3
    for a, b in zip(cached["history"], live["history"]):
        assert b[:5] == pytest.approx(a[:5], rel=1e-5) and b[5] == pytest.approx(a[5], rel=1e-5)
    capsys.readouterr()
    assert main([*args, "--no-cache", "--budget-s", "10", "--out", str(tmp_path / "budget")]) == 2
    assert "without --resume, --eval-only or --no-cache" in capsys.readouterr().err


def test_hat_distill_trains_on_a_corpus_of_ones_own(tmp_path, capsys, monkeypatch):
    """`--data FILE.jsonl`: the windows come from the file's conversations (a list of messages, or {"messages": ...}
    per line), the record names it; a line that is no conversation, or a file that is not there, is refused naming
    the file (and line) before any model loads."""
    import json

    from edge_runtime.training import distill
    from edge_runtime.training.common import windows
    from edge_runtime.training.distill import main
    from hat_split.models.loading import load_model

    model_dir = tiny_model_dir(tmp_path / "tiny")
    corpus = tmp_path / "corpus.jsonl"
    talk = [{"role": "user", "content": "Tell me about zebras. " * 6},
            {"role": "assistant", "content": "Zebras are striped horses of Africa. " * 8}]
    corpus.write_text("\n".join([json.dumps(talk), json.dumps({"messages": talk})] * 3) + "\n")
    tok = load_model(model_dir, tokenizer_only=True).tokenizer
    got = windows(tok, 4, 32, 1000, corpus=str(corpus))
    assert len(got) == 4 and all(len(w) == 32 for w in got) and "Zebras" in tok.decode(sum(got, []))
    with pytest.raises(ValueError, match=r"corpus.jsonl ran out after 24 windows of 32 tokens"):
        windows(tok, 100, 32, 0, corpus=str(corpus))
    args = ["--drafter", "feature", "--model", str(model_dir), "--m", "2", "--batch", "2", "--seq-len", "32",
            "--windows", "4", "--steps", "2", "--train-vocab", "16", "--dtype", "float32", "--device", "cpu",
            "--no-cache", "--eval-windows", "1", "--eval-prompts", "1", "--eval-tokens", "4"]
    assert main([*args, "--data", str(corpus), "--out", str(tmp_path / "fd")]) == 0, capsys.readouterr().err[-2000:]
    assert json.loads((tmp_path / "fd" / "drafter.json").read_text())["record"]["train_data"] == str(corpus)
    bad = tmp_path / "bad.jsonl"
    monkeypatch.setattr(distill, "load_model", lambda *a, **k: pytest.fail("a model loaded for a corpus refused"))
    for text, says in (('[{"role": "user", "content": "hi"}]\n{"oops"\n', "bad.jsonl:2: not JSON"),
                       ('[{"role": "robot", "content": "hi"}]\n', "bad.jsonl:1: each message needs a role"),
                       ("\n", "bad.jsonl: no conversations"), (None, "No such file or directory")):
        bad.unlink(missing_ok=True)
        if text is not None:
            bad.write_text(text)
        capsys.readouterr()
        assert main([*args, "--data", str(bad), "--out", str(tmp_path / "bad")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert says in err[-1] and err[-1].startswith("hat-distill: "), err
