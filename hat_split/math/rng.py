"""Seeded random streams for the two sides of one generation.

The device draws the uniforms that sample draft tokens; the cloud draws the uniforms that accept, resample and pick
bonus tokens. Those must be independent streams: seeding both generators with the same integer would make the first
acceptance uniform equal the first draft-sampling uniform, correlating acceptance with the draft and breaking
exactness. Each role therefore gets its own child of one SeedSequence.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

ROLES = {"device": 0, "cloud": 1, "uncertainty": 2, "skip": 3,  # 2, 3: device-side U-HLM draws
         "draft": 4, "accept": 5, "resample": 6,  # 4-6: position-keyed draws of the split protocols (keyed_uniform)
         "tree_draft": 7, "tree_verify": 8}  # a draft tree's draws at a position (keyed_rng)


def session_rng(seed: Optional[int], role: str) -> np.random.Generator:
    """Generator for `role` (one of ROLES) of a request seeded with `seed` (None: fresh entropy)."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {sorted(ROLES)}, got {role!r}")
    if seed is None:
        return np.random.default_rng()
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(ROLES[role],)))


def keyed_uniform(seed: Optional[int], role: str, position: int) -> float:
    """One uniform in [0, 1) for `role` at absolute sequence `position` of a request seeded with `seed`.

    Counter-based rather than a stream: the draw for a position does not depend on how many draws came before, so a
    draft continuation computed early (HAT's parallel drafting) gets the very tokens a fresh draft would, and output
    is identical with the feature on or off. Each position's draft, accept and resample draws are independent.
    """
    if role not in ROLES:
        raise ValueError(f"role must be one of {sorted(ROLES)}, got {role!r}")
    if position < 0:
        raise ValueError(f"position must be >= 0, got {position}")
    if seed is None:
        return float(np.random.default_rng().random())
    return float(np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(ROLES[role], position))).random())


def keyed_rng(seed: Optional[int], role: str, position: int) -> np.random.Generator:
    """A generator for `role` at absolute sequence `position` (keyed_uniform's counter-based keying, for the many draws
    of one draft tree: drawing its children, verifying it)."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {sorted(ROLES)}, got {role!r}")
    if position < 0:
        raise ValueError(f"position must be >= 0, got {position}")
    if seed is None:
        return np.random.default_rng()
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(ROLES[role], position)))
