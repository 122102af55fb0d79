"""The package's arrows (issue 24): no import circle, function-local imports included; every import of another
package points down the floors; no module imports another step's `stage.py`. Read from the source with `ast`."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "memprune"
# The floors, bottom first (docs/architecture.md). A package imports its own modules and lower floors only;
# the floor's modules (shared machinery, no method logic) may import each other, without circles.
FLOORS = [
    {"", "errors", "schema", "config", "storage", "io", "work", "rejects", "markdown", "figures", "timing", "precision",
     "runtime", "archive", "calibration", "encoders", "tokens", "texts", "times", "stages", "usagelog"},
    {"adapters", "synth", "llm", "scorer"},
    {"ingest", "label", "decision", "memory"},
    {"prune", "summarize", "evaluate", "dialogue", "qa"},
    {"train", "stores"},
    {"tune", "serve"},
    {"pipeline", "integrations"},
    {"cli"},
]
FLOOR = {name: i for i, names in enumerate(FLOORS) for name in names}


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Every memprune module `name` imports, at the top or inside a function (`from a import b`: a.b if a module)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "memprune"}
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else (node.module or "")
            if base.split(".")[0] != "memprune":
                continue
            out |= {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names}
    return {m for m in out if m in known and m != name}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_package_has_a_floor() -> None:
    assert {package_of(m) for m in graph()} - set(FLOOR) == set()


def test_no_import_circle() -> None:
    edges = graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    assert circles == []


def test_imports_point_down_and_never_into_another_steps_stage() -> None:
    wrong = []
    for module, targets in graph().items():
        src = package_of(module)
        for target in targets:
            dst = package_of(target)
            if dst == src:
                continue
            if FLOOR[src] == 0 and FLOOR[dst] == 0:
                continue  # the floor's own modules
            if FLOOR[dst] >= FLOOR[src]:
                wrong.append(f"{module} -> {target} (floor {FLOOR[src]} -> {FLOOR[dst]})")
            if target.rsplit(".", 1)[-1] == "stage":
                wrong.append(f"{module} -> {target} (another step's stage.py)")
    assert wrong == []
