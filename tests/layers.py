"""The import contract of the layers (docs/ARCHITECTURE.md), checked on the source by reading every import statement.

A rule names the modules it covers (a dotted prefix) and what they may or may not import; `check(root)` returns one
sentence per violation. Imports inside functions count as well: a lazy import still ties the layers together. The
exceptions are the optional, heavy third-party packages that `ALWAYS_LAZY` lists, which the "no torch" rules follow
through the import graph at module level only (what importing the module loads).
"""
from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

PACKAGES = ("hat_split", "hardware", "testbed", "edge_runtime", "cloud_runtime", "export", "profiles", "scripts")
STDLIB = frozenset(sys.stdlib_module_names) | {"__future__"}


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, dotted
    target: str  # what it imports, dotted (a `from X import y` counts as X.y when X.y is a module, else X)
    line: int
    top_level: bool  # executed when the module is imported (not inside a function)


@dataclass(frozen=True)
class OnlyImports:
    """Modules under `scope` import nothing but the stdlib and `allowed` (dotted prefixes)."""
    scope: str
    allowed: Tuple[str, ...]
    why: str


@dataclass(frozen=True)
class NeverImports:
    """Modules under `scope` never import anything under `forbidden` (dotted prefixes), lazily or not."""
    scope: str
    forbidden: Tuple[str, ...]
    why: str


@dataclass(frozen=True)
class NeverLoads:
    """Importing a module under `scope` never loads `package` (followed through the project's top-level imports)."""
    scope: str
    package: str
    why: str


RULES = (
    OnlyImports("hat_split.math", ("numpy", "hat_split.math"), "the pure math imports only numpy"),
    OnlyImports("hat_split.wire", ("numpy", "msgspec", "typing_extensions", "hat_split.math", "hat_split.wire"),
                "the wire imports only numpy and msgspec (and the math it encodes; typing_extensions on Python 3.8)"),
    OnlyImports("hat_split.protocols", (), "the protocol table is stdlib only"),
    OnlyImports("hat_split.files", ("hat_split.files", "hat_split.wire", "hat_split.math", "tomli", "numpy",
                                    "matplotlib"),
                "config files, the bundle contract and figures are read on a device without torch"),
    NeverImports("hat_split", ("hardware", "testbed", "edge_runtime", "cloud_runtime", "export", "profiles"),
                 "the core imports neither side"),
    NeverImports("edge_runtime", ("cloud_runtime", "export", "profiles", "testbed"),
                 "the device never imports the cloud, the exporter, the benchmarks or the link testbed"),
    NeverImports("cloud_runtime", ("edge_runtime", "export", "profiles", "testbed"),
                 "the cloud never imports the device"),
    NeverImports("hardware", ("edge_runtime", "cloud_runtime", "export", "profiles", "testbed"),
                 "the device's own knowledge stands below the runtimes"),
    NeverImports("testbed", ("edge_runtime", "cloud_runtime", "export", "profiles"),
                 "the link testbed stands below the runtimes"),
    NeverImports("", ("scripts",), "nothing imports scripts/ (shell and launch files)"),
    NeverLoads("cloud_runtime.scheduler", "torch", "the scheduler is plain Python"),
    NeverLoads("cloud_runtime.handlers", "torch", "the cloud's message handlers validate, queue and verify"),
    *(NeverLoads(f"cloud_runtime.{m}", "torch", "the cloud's request handling is plain Python and numpy")
      for m in ("token_handlers", "split_handlers", "family", "devices", "quotas", "sessions", "state", "work")),
    NeverLoads("hat_split.wire", "torch", "the wire runs without torch"),
)


def modules(root: Path) -> Dict[str, Path]:
    """Every project module under `root`, by dotted name (packages by their __init__)."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def imports(name: str, path: Path, known: Set[str]) -> Iterator[Import]:
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    inside = {id(s) for f in functions for s in ast.walk(f)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(name, alias.name, node.lineno, id(node) not in inside)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                yield Import(name, full if full in known else base, node.lineno, id(node) not in inside)


def _under(name: str, prefix: str) -> bool:
    return prefix == "" or name == prefix or name.startswith(prefix + ".")


def graph(root: Path) -> Tuple[Dict[str, Path], Dict[str, List[Import]]]:
    mods = modules(root)
    known = set(mods)
    return mods, {name: list(imports(name, path, known)) for name, path in mods.items()}


def _loads(start: str, package: str, edges: Dict[str, List[Import]]) -> List[str]:
    """The chain of top-level imports from `start` that loads `package`, or []."""
    seen, stack = {start}, [(start, [start])]
    while stack:
        mod, chain = stack.pop()
        for imp in edges.get(mod, ()):
            if not imp.top_level:
                continue
            if _under(imp.target, package):
                return chain + [imp.target]
            # importing a.b.c runs a/__init__, a/b/__init__ too
            parts = imp.target.split(".")
            for i in range(1, len(parts) + 1):
                step = ".".join(parts[:i])
                if step in edges and step not in seen:
                    seen.add(step)
                    stack.append((step, chain + [step]))
    return []


def cycles(edges: Dict[str, List[Import]]) -> List[List[str]]:
    """Import circles among the project's modules (top-level imports and lazy ones alike), as Tarjan's SCCs."""
    adj = {m: sorted({i.target for i in imps if i.target in edges and i.target != m}) for m, imps in edges.items()}
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    on, stack, out = set(), [], []
    counter = [0]
    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in adj[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(adj):
        if v not in index:
            visit(v)
    return out


def check(root: Path) -> List[str]:
    """Every violation of RULES and every import circle in the tree at `root`, one sentence each."""
    mods, edges = graph(root)
    problems = []
    for rule in RULES:
        for mod in sorted(m for m in mods if _under(m, rule.scope)):
            where = lambda imp: f"{mods[mod].relative_to(root)}:{imp.line}"  # noqa: E731
            if isinstance(rule, OnlyImports):
                for imp in edges[mod]:
                    top = imp.target.split(".")[0]
                    if top in STDLIB or any(_under(imp.target, a) for a in rule.allowed):
                        continue
                    problems.append(f"{where(imp)}: {mod} imports {imp.target} ({rule.why})")
            elif isinstance(rule, NeverImports):
                for imp in edges[mod]:
                    if any(_under(imp.target, f) for f in rule.forbidden):
                        problems.append(f"{where(imp)}: {mod} imports {imp.target} ({rule.why})")
            else:
                chain = _loads(mod, rule.package, edges)
                if chain:
                    problems.append(f"{mods[mod].relative_to(root)}: importing {mod} loads {rule.package} through "
                                    f"{' -> '.join(chain)} ({rule.why})")
    for comp in cycles(edges):
        problems.append(f"import circle: {' <-> '.join(comp)}")
    return problems


if __name__ == "__main__":
    found = check(Path(sys.argv[1] if len(sys.argv) > 1 else "."))
    print("\n".join(found) or "the layers hold")
    sys.exit(1 if found else 0)
