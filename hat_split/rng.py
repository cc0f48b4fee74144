"""Seeded random streams for the two sides of one generation.

The device draws the uniforms that sample draft tokens; the cloud draws the uniforms that accept, resample and pick
bonus tokens. Those must be independent streams: seeding both generators with the same integer would make the first
acceptance uniform equal the first draft-sampling uniform, correlating acceptance with the draft and breaking
exactness. Each role therefore gets its own child of one SeedSequence.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

ROLES = {"device": 0, "cloud": 1, "uncertainty": 2, "skip": 3}  # the last two: device-side U-HLM draws


def session_rng(seed: Optional[int], role: str) -> np.random.Generator:
    """Generator for `role` (one of ROLES) of a request seeded with `seed` (None: fresh entropy)."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {sorted(ROLES)}, got {role!r}")
    if seed is None:
        return np.random.default_rng()
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(ROLES[role],)))
