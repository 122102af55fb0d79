"""The package's arrows (issues 24, 53): no import circle, function-local imports included; every import of another
package points down the floors, a name imported through a package's face counted as an import of the module that
defines it; no module imports another step's `stage.py` (train's `recipe.py`) or a private name of another package;
the batch step `prune/` is imported only by what drives it;
no module over 500 lines; no decision function over 5 parameters; no name of an LLM task, engine, table-store
format or GPU-check section compared outside its registry. Read from the source with `ast`."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "memprune"
# The floors, bottom first (docs/architecture.md). A package imports its own modules and lower floors only;
# the floor's modules (shared machinery, no method logic) may import each other, without circles.
FLOORS = [
    {"", "errors", "schema", "config", "storage", "io", "work", "rejects", "markdown", "figures", "timing", "precision",
     "runtime", "raysession", "registry", "archive", "calibration", "encoders", "tokens", "texts", "times", "stages",
     "usagelog", "outputs", "scorers"},
    {"adapters", "synth", "llm", "scorer"},
    {"ingest", "label", "decision", "memory", "review"},
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


def _imported(name: str, path: Path, known: dict[str, Path]) -> list[tuple[str, str | None]]:
    """(module, name imported from it or None) for every memprune import of `name`, at the top or inside a function."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out: list[tuple[str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(a.name, None) for a in node.names if a.name.split(".")[0] == "memprune"]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else (node.module or "")
            if base.split(".")[0] != "memprune":
                continue
            out += [(f"{base}.{a.name}", None) if f"{base}.{a.name}" in known else (base, a.name) for a in node.names]
    return out


def _definer(module: str, name: str | None, known: dict[str, Path], seen: frozenset[str] = frozenset()) -> str:
    """The module that defines `name` when it is imported from `module` (a package face re-exporting it: followed to
    the module it comes from)."""
    if name is None or module not in known or module in seen:
        return module
    for target, imported in _imported(module, known[module], known):
        if imported == name or target.rsplit(".", 1)[-1] == name:
            return _definer(target, imported, known, seen | {module})
    return module


def imports(name: str, path: Path, known: dict[str, Path], faces: bool = True) -> set[str]:
    """Every memprune module `name` imports (`from a import b`: a.b if a module, else, with `faces`, the module that
    defines b: a package face's re-export is followed)."""
    out = {_definer(m, n, known) if faces and known.get(m, Path()).name == "__init__.py" else m
           for m, n in _imported(name, path, known)}
    return {m for m in out if m in known and m != name}


def graph(faces: bool = True) -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known, faces) for name, path in known.items()}


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
    direct = graph(faces=False)  # a step's package face may re-export its stage's `run`; its stage.py is its own
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
            if target.rsplit(".", 1)[-1] in ("stage", "recipe") and target in direct[module]:
                wrong.append(f"{module} -> {target} (another step's stage.py)")
    assert wrong == []


def test_no_package_imports_another_packages_private_names() -> None:
    known = modules()
    wrong = [f"{module} -> {target}.{name}"
             for module, path in known.items() for target, name in _imported(module, path, known)
             if name is not None and name.startswith("_") and not name.startswith("__")
             and package_of(target) != package_of(module)]
    assert wrong == []


# Who may import the batch step `prune/`: what drives a prune (the CLI, the store step, the service, the pipeline).
PRUNE_USERS = {"prune", "cli", "stores", "serve", "pipeline"}


def test_the_batch_step_prune_is_imported_only_by_what_drives_it() -> None:
    wrong = sorted(f"{m} -> {t}" for m, targets in graph().items() for t in targets
                   if package_of(t) == "prune" and package_of(m) not in PRUNE_USERS)
    assert wrong == []


def test_no_module_is_over_500_lines() -> None:
    roots = [PACKAGE, PACKAGE.parent / "bench"]
    long = {str(p.relative_to(PACKAGE.parent)): n for root in roots for p in root.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > 500}
    assert long == {}


def test_no_decision_function_takes_more_than_5_parameters() -> None:
    wide = []
    for path in (PACKAGE / "decision").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args
                names = [a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs] if a.arg not in ("self", "cls")]
                if len(names) > 5:
                    wide.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({len(names)})")
    assert wide == []


def _registered_names() -> dict[str, set[str]]:
    """The names of every LLM task, LLM engine and table-store file format, with the modules that may compare them
    (their registry and the modules that implement them)."""
    from memprune.llm.kinds import ENGINE_KINDS
    from memprune.llm.tasks import TASKS
    from memprune.stores.tablefile import FILE_FORMATS

    formats = {cls.fmt for cls in FILE_FORMATS.values() if getattr(cls, "fmt", "")} | {"parquet"}
    return {"llm/tasks.py": set(TASKS), "llm/kinds.py": set(ENGINE_KINDS),
            "stores/tablefile.py stores/table_parquet.py stores/table_text.py stores/records.py": formats}


BENCH = PACKAGE.parent / "bench"


def _gpu_sections() -> set[str]:
    """The GPU check's section names, read from its registry (`bench/gpu/sections.py`: `Section("judge", ...)`)."""
    tree = ast.parse((BENCH / "gpu" / "sections.py").read_text(encoding="utf-8"))
    return {node.args[0].value for node in ast.walk(tree) if isinstance(node, ast.Call)
            and getattr(node.func, "id", "") == "Section" and isinstance(node.args[0], ast.Constant)}


def _compared(path: Path, names: set[str]) -> list[str]:
    """`path`'s comparisons with a string constant among `names` (as `file:line: code`)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Compare):
            continue
        parts = [node.left, *node.comparators]
        texts = {c.value for part in parts for c in ([part] + list(getattr(part, "elts", [])))
                 if isinstance(c, ast.Constant) and isinstance(c.value, str)}
        if texts & names and "scope" not in ast.unparse(node):
            out.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return out


def test_no_gpu_check_section_name_is_compared_outside_its_registry() -> None:
    sections = _gpu_sections()
    assert {"judge", "prune", "train", "tests"} <= sections
    files = [BENCH / "gpu_check.py", *(p for p in (BENCH / "gpu").glob("*.py") if p.name != "sections.py")]
    assert [hit for path in files for hit in _compared(path, sections)] == []


def test_no_task_engine_or_table_format_name_is_compared_outside_its_registry() -> None:
    """`x == "vllm"`, `task in ("judge", ...)`, `fmt == "csv"`: a string switch where a registry entry belongs."""
    owners = _registered_names()
    wrong = [hit for path in PACKAGE.rglob("*.py") for where, names in owners.items()
             if str(path.relative_to(PACKAGE)) not in where.split() for hit in _compared(path, names)]
    assert wrong == []
