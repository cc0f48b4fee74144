"""How a draft tree becomes llama.cpp sequence-id sets (hat_split.models.llamacpp_tree, plain Python): a sequence
per leaf, each node at position start + depth carrying exactly the paths through it (the masking one first: its own
path, so it sees its ancestors and itself), copies of the prefix or of a cached ancestor's path for new sequences, a
tree grown a level at a time planned like the same tree in one batch, and bad trees refused."""
from __future__ import annotations

import numpy as np
import pytest

from hat_split.models.llamacpp_tree import paths, plan_tree

OWN = 7  # the state's own sequence id


def random_tree(rng, n):
    return [-1] + [int(rng.integers(-1, i)) for i in range(1, n)]


def ancestors_or_self(parents, i):
    out = set()
    while i >= 0:
        out.add(i)
        i = parents[i]
    return out


@pytest.mark.parametrize("seed", range(20))
def test_one_batch_takes_a_sequence_per_leaf_and_each_node_carries_the_paths_through_it(seed):
    rng = np.random.default_rng(seed)
    parents = random_tree(rng, int(rng.integers(1, 40)))
    plan = plan_tree(None, OWN, 100, parents, len(parents), 100)
    assert plan.taken == paths(parents) == sum(i not in parents for i in range(len(parents)))
    plan.bind(list(range(200, 200 + plan.taken)))
    depth = [len(ancestors_or_self(parents, i)) - 1 for i in range(len(parents))]
    assert plan.positions == [100 + d for d in depth]
    tips = {n: s for s, n in plan.tree.tips.items()}
    leaves = [i for i in range(len(parents)) if i not in parents]
    assert sorted(tips) == leaves
    for i, ids in enumerate(plan.seq_ids):
        through = {tips[leaf] for leaf in leaves if i in ancestors_or_self(parents, leaf)}
        assert set(ids) == through and len(ids) == len(through)  # every path through it, once
        assert i in {n for leaf in leaves if tips[leaf] == ids[0] for n in ancestors_or_self(parents, leaf)}
    assert plan.copies == [(OWN, s, -1) for s in sorted(tips.values())]  # every path holds the prefix


def test_a_tree_grown_a_level_at_a_time_copies_cached_paths_and_reuses_tips():
    parents = [-1, -1, 0, 0, 1, 2, 2, 4]
    first = plan_tree(None, OWN, 50, parents[:2], 2, 50)
    first.bind([20, 21])
    assert first.seq_ids == [[20], [21]] and first.copies == [(OWN, 20, -1), (OWN, 21, -1)]
    second = plan_tree(first.tree, OWN, 52, parents[:5], 3, 50)
    second.bind([22])
    # node 2 takes node 0's path (its tip), node 3 a new one copying node 0's path up to its position, node 4 node 1's
    assert second.seq_ids == [[20], [22], [21]] and second.copies == [(20, 22, 51)]
    assert second.positions == [51, 51, 51] and second.taken == 1
    third = plan_tree(second.tree, OWN, 55, parents, 3, 50)
    third.bind([23])
    assert third.seq_ids == [[20], [23], [21]] and third.copies == [(20, 23, 52)] and third.positions == [52, 52, 52]
    assert sorted(third.tree.tips.values()) == [3, 5, 6, 7]  # the leaves


@pytest.mark.parametrize("held,parents,n_new,start,why", [
    (None, [-1, 1], 2, 10, "not an earlier node"),
    (None, [-1, -2], 2, 10, "not an earlier node"),
    (None, [-1], 1, 9, "begins at the state's length"),
    (None, [-1, 0], 1, 10, "cannot have 1 new after 0"),
])
def test_bad_trees_are_refused(held, parents, n_new, start, why):
    with pytest.raises(ValueError, match=why):
        plan_tree(held, OWN, 10, parents, n_new, start)
    grown = plan_tree(None, OWN, 10, [-1, 0], 2, 10)
    with pytest.raises(ValueError, match="extend the draft tree"):
        plan_tree(grown.tree, OWN, 12, [-1, -1, 0], 1, 10)
