"""`hat-bench eta-tail`'s parts (profiles.bench.bench_eta_tail) on hand-made texts and a hand-made draft model: the
η-chain drafted for real along the draft's own tokens, and the comparison with what the reads price."""
import math

import numpy as np
import pytest

from hat_split.math.draft_stop import eta_tail
from profiles.bench.bench_eta_tail import compare, drafted_rounds, text_tail


class _State:
    def __init__(self):
        self.tokens = []

    @property
    def length(self) -> int:
        return len(self.tokens)


class _CountingLM:
    """Vocabulary of 5: after token t its argmax is (t + 1) mod 5, with softmax probability 0.9, except after 2
    (0.3, below η = 0.4). Counts its forwards."""
    def __init__(self):
        self.forwards = 0

    def new_state(self) -> _State:
        return _State()

    def forward(self, state: _State, tokens, n_logits: int):
        self.forwards += 1
        state.tokens.extend(tokens)
        rows = []
        for t in state.tokens[len(state.tokens) - n_logits:] if n_logits else []:
            p = 0.3 if t == 2 else 0.9
            rest = math.log((1 - p) / 4)
            row = np.full(5, rest)
            row[(t + 1) % 5] = math.log(p)
            rows.append(row)
        return np.asarray(rows).reshape(n_logits, 5)

    def crop(self, state: _State, n: int) -> None:
        state.tokens = state.tokens[:n]


def test_the_eta_chain_is_drafted_along_its_own_tokens_and_ends_below_eta_or_at_the_depth():
    """By hand. Prompt [0]; the draft counts 1, 2, 3 (3 drafted after 2 at 0.3 < η: the round ends there). The text
    1, 2, 4, 0, 1: the first round's drafts 1, 2, 3 accept 2 (3 ≠ 4) and commit 1, 2, 4; the second, after 4,
    drafts 0, 1, 2, 3 (2 sure, 3 below η) against the text's 0, 1 and its end: 2 accepted, committed."""
    lm = _CountingLM()
    rounds = drafted_rounds(lm, [0], [1, 2, 4, 0, 1], depth=8, eta=0.4)
    assert rounds == [{"at": 0, "sent": 3, "accepted": 2}, {"at": 3, "sent": 4, "accepted": 2}]
    assert drafted_rounds(_CountingLM(), [0], [1, 2, 4, 0, 1], depth=2, eta=0.4)[0] == {"at": 0, "sent": 2,
                                                                                        "accepted": 2}


def test_a_prompts_figures_compare_the_drafted_tail_with_the_texts_and_the_priced_one():
    """By hand. A text of 8 read positions; drafted rounds: one that went on past its rejected draft at 1 (2 past
    it, room 6), one all accepted, one whose rejected draft ended it, one cut by the text's end (left out). The
    text's confidences past position 1: 0.9, 0.9, 0.2 (sent, ends): 3. Priced: the geometric tail at this text's
    share of positions after an agreed one at least η."""
    agreed = [True, False, True, True, True, False, True, True]
    sure = [0.9, 0.9, 0.9, 0.9, 0.2, 0.3, 0.9, 0.9]
    assert text_tail(agreed, sure, 2, 6, 0.4) == 3 and text_tail(agreed, sure, 2, 2, 0.4) == 2
    assert text_tail(agreed, sure, 7, 6, 0.4) == 1  # the text's end
    rounds = [{"at": 0, "sent": 4, "accepted": 1}, {"at": 2, "sent": 2, "accepted": 2},
              {"at": 5, "sent": 1, "accepted": 0}, {"at": 6, "sent": 4, "accepted": 2}]
    got = compare(agreed, sure, rounds, depth=8, eta=0.4)
    onward = 3 / 5  # after the agreed positions 0, 2, 3, 4, 6: 0.9, 0.9, 0.2, 0.3, 0.9
    assert got["onward"] == pytest.approx(onward)
    assert (got["rounds_drafted"], got["went_on"], got["past_drafted"], got["past_text"]) == (3, 1, 2, 3)
    assert got["past_priced"] == pytest.approx(eta_tail(onward, 6))
    assert got["sent_drafted"] == pytest.approx(7 / 3)


def test_each_prompt_is_priced_from_the_others_texts_weighed_by_its_own_reads_as_auto_prices_it():
    """Four texts: two easy (every 12th token a confident rejection, the rest agreed and sure: long rounds that go
    on past their rejection at c = 1) and two hard (a confident rejection, then two agreed below η: rounds of one
    draft, half going on past it at c = 1/2). Priced with none of its own reads, a prompt's texts count alike
    whichever way; with its own reads, weighed, the other text like it dominates: the hard prompt is priced to send
    less than alike, the easy one to commit more. The table's errors are each price against the drafted rounds'."""
    from profiles.bench.bench_eta_tail import census_priced, census_table

    easy = [(i, i % 12 != 11, 0.9) for i in range(36)]
    hard = [(i, i % 3 != 0, 0.9 if i % 3 == 0 else 0.2) for i in range(36)]
    marks = [easy, list(easy), hard, list(hard)]
    assert census_priced(marks, 2, 0, 8, 0.4, True) == pytest.approx(census_priced(marks, 2, 0, 8, 0.4, False))
    weighed, alike = census_priced(marks, 2, 36, 8, 0.4, True), census_priced(marks, 2, 36, 8, 0.4, False)
    assert weighed[1] < alike[1] - 0.2
    assert census_priced(marks, 0, 36, 8, 0.4, True)[0] > census_priced(marks, 0, 36, 8, 0.4, False)[0] + 0.5
    rows = [{"marks": m, "tokens_drafted": 4.0, "sent_drafted": 4.0} for m in marks]
    table = census_table(rows, [0, 36], 8, 0.4)
    got = rows[2]["census"]["weighed_36"]
    assert got == pytest.approx(list(weighed))
    want = sum(abs(r["census"]["weighed_36"][1] / 4.0 - 1) for r in rows) / 4 * 100
    assert table["weighed_36"]["sent"] == pytest.approx(want) and table["weighed_36"]["n"] == 4
    summed = sum(r["census"]["weighed_36"][0] for r in rows) / 16 * 100 - 100
    assert table["weighed_36"]["tokens_summed"] == pytest.approx(summed)
    assert table["weighed_0"] == pytest.approx(table["alike_0"])


def test_the_census_table_says_where_nothing_prices_and_bad_own_reads_are_refused_before_any_model_loads(capsys):
    """Texts too short for the rounds auto prices from: no figures, said so (no crash). --own-reads that are not
    token counts are refused by name before the cloud or any model starts."""
    import argparse

    from profiles.bench.bench_eta_tail import census_table, run

    rows = [{"marks": [(0, True, 0.9)], "tokens_drafted": 2.0, "sent_drafted": 1.0} for _ in range(2)]
    table = census_table(rows, [0], 8, 0.4)
    assert table["weighed_0"]["n"] == 0 and table["weighed_0"]["tokens"] is None
    assert "not priced" in capsys.readouterr().out
    for bad in ("8,x", "-1", ""):
        args = argparse.Namespace(depth=8, eta=0.4, max_new_tokens=48, own_reads=bad, demo_prompts=1,
                                  calibration_prompts=0)
        with pytest.raises(ValueError, match="--own-reads"):
            run(args)
