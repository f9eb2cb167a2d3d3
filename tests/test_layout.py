"""The package's layout rules (CONTRIBUTING.md): no import cycle, and a layout table that matches the tree. File size
is a guideline for review, not a test: a file holds one concern, whatever its length."""

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "trl_marl"


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def module_level_imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that `name` imports when it is imported: top-level imports, outside
    `if TYPE_CHECKING:` blocks and function bodies."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    imported = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            candidates = [target] + [f"{target}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        else:
            continue
        imported |= {c for c in candidates if c in known and c != name}
    return imported


def test_there_is_no_import_cycle():
    found = modules()
    graph = {name: module_level_imports(name, path, set(found)) for name, path in found.items()}
    # A package's __init__ importing its own submodules is how packages re-export, not a cycle.
    graph = {name: {t for t in targets if not t.startswith(name + ".")} for name, targets in graph.items()}
    state: dict[str, int] = {}

    def visit(node, trail):
        state[node] = 1
        for target in sorted(graph[node]):
            assert state.get(target) != 1, f"import cycle: {' -> '.join([*trail, node, target])}"
            if target not in state:
                visit(target, [*trail, node])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    assert len(state) == len(found) > 20


def test_the_import_graph_sees_a_cycle_when_there_is_one(tmp_path):
    (tmp_path / "a.py").write_text("from .b import x\n")
    (tmp_path / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import y\n")
    known = {"p.a", "p.b"}
    assert module_level_imports("p.a", tmp_path / "a.py", known) == {"p.b"}
    assert module_level_imports("p.b", tmp_path / "b.py", known) == set()  # type-checking only: no cycle


def test_contributings_layout_table_matches_the_tree():
    text = (PACKAGE.parent / "CONTRIBUTING.md").read_text()
    table = text[text.index("<!-- layout-table:start -->") : text.index("<!-- layout-table:end -->")]
    named = re.findall(r"^\| `([^`]+)`", table, flags=re.MULTILINE)
    missing_paths = [path for path in named if not (PACKAGE.parent / path).exists()]
    assert missing_paths == [], f"the layout table names paths that do not exist: {missing_paths}"
    top_level = {
        f"trl_marl/{p.name}" + ("/" if p.is_dir() else "")
        for p in PACKAGE.iterdir()
        if p.name != "__init__.py" and (p.suffix == ".py" or (p / "__init__.py").exists())
    }
    assert sorted(top_level - set(named)) == [], "modules missing from CONTRIBUTING.md's layout table"
