"""hat_split.protocols is the one list of protocols: its records are consistent, and the README's table shows each."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from edge_runtime.protocols import ROUNDS
from hat_split import protocols

REPO = Path(__file__).resolve().parents[1]


def test_every_protocol_has_one_consistent_record():
    assert list(protocols.PROTOCOLS) == list(protocols.NAMES)
    assert set(protocols.of_family("token")) | set(protocols.of_family("split")) | set(protocols.of_family("local")) \
        == set(protocols.NAMES)
    assert [p.name for p in protocols.PROTOCOLS.values() if not p.needs_cloud] == ["slm"]
    assert protocols.of_family("split") == ("ushape", "hat")
    assert {protocols.get(n).round for n in ("qs", "ksqs", "csqs", "sq")} == {"qs"}


def test_unknown_names_and_families_are_refused_with_the_choices():
    with pytest.raises(ValueError, match="unknown protocol 'nope'; choose from sd, hlm"):
        protocols.get("nope")
    with pytest.raises(ValueError, match="family must be one of"):
        protocols.of_family("tokens")
    with pytest.raises(ValueError, match="family must be one of"):
        protocols.Protocol("x", "remote", "x", True, "")


def test_the_readme_table_lists_every_protocol_once():
    """Every protocol, and auto (which a request may name too), once."""
    text = (REPO / "README.md").read_text()
    table = text[text.index("## Protocols available now"):]
    table = table[: table.index("\n\n", table.index("|"))]
    rows = re.findall(r"^\| `([a-z]+)` \|", table, re.M)
    assert sorted(rows) == sorted(protocols.REQUESTABLE)


def test_the_device_has_a_round_for_every_record():
    assert set(ROUNDS) == {p.round for p in protocols.PROTOCOLS.values()}
