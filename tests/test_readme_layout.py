"""README.md's Layout section names only paths that exist (folders moved before: profiles/device is hardware/,
profiles/testbed is testbed/)."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def layout_paths(readme: str) -> list:
    """The backticked paths of the "## Layout" section: every token with a slash or a file suffix."""
    section = readme.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    return [t for t in re.findall(r"`([^`\s]+)`", section) if "/" in t or re.search(r"\.(py|md|toml|sh)$", t)]


def test_every_path_the_readme_layout_names_exists():
    paths = layout_paths((REPO / "README.md").read_text(encoding="utf-8"))
    assert len(paths) >= 15 and "hardware/" in paths and "testbed/" in paths
    missing = [p for p in paths if not (REPO / p).exists()]
    assert not missing, f"README's Layout names paths that do not exist: {missing}"
    assert not any(p.startswith(("profiles/device", "profiles/testbed")) for p in paths)


def test_a_moved_folder_would_be_caught():
    assert layout_paths("x\n## Layout\n`profiles/device/` and `Testbed` and `docs/X.md`\n## Next\n`a/`") == [
        "profiles/device/", "docs/X.md"]
