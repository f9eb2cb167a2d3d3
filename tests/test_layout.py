"""The package's layout rules (CONTRIBUTING.md): no import cycle, counting every import; imports that point only
down the layers CONTRIBUTING.md lists, with no cycle between its folders; and a layout table that matches the tree.
File size is a guideline for review, not a test: a file holds one concern, whatever its length."""

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


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that `name` imports anywhere: at the top, inside functions and in `if TYPE_CHECKING:`
    blocks alike (a deferred import is still a dependency). Importing the folder a module sits in is not counted;
    importing the package itself (`from trl_marl import X`, `from .. import X` up to it) is: its `__init__`, the front
    door, sits above every layer."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
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
        imported |= {c for c in candidates if c in known and c != name and not ("." in c and name.startswith(c + "."))}
    return imported


def import_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` (module -> the modules it imports), as the path that closes it, or None."""
    state: dict[str, int] = {}

    def visit(node, trail):
        state[node] = 1
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return [*trail, node, target]
            if target not in state and (cycle := visit(target, [*trail, node])):
                return cycle
        state[node] = 2
        return None

    for name in sorted(graph):
        if name not in state and (cycle := visit(name, [])):
            return cycle
    return None


def test_there_is_no_import_cycle_counting_every_import():
    found = modules()
    graph = {name: imports(name, path, set(found)) for name, path in found.items()}
    # A package's __init__ importing its own submodules is how packages re-export, not a cycle.
    graph = {name: {t for t in targets if not t.startswith(name + ".")} for name, targets in graph.items()}
    assert len(graph) > 20 and sum(map(len, graph.values())) > 100
    cycle = import_cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_the_import_graph_counts_deferred_and_type_checking_imports_and_sees_their_cycles(tmp_path):
    (tmp_path / "a.py").write_text("def f():\n    from .b import x\n")
    (tmp_path / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import y\n")
    (tmp_path / "c.py").write_text("from . import b\n")
    known = {"p.a", "p.b", "p.c"}
    graph = {name: imports(name, tmp_path / f"{name[2:]}.py", known) for name in known}
    assert graph == {"p.a": {"p.b"}, "p.b": {"p.a"}, "p.c": {"p.b"}}
    assert import_cycle(graph) == ["p.a", "p.b", "p.a"]
    assert import_cycle({"p.a": {"p.b"}, "p.b": set(), "p.c": {"p.b"}}) is None


def layers() -> list[list[str]]:
    """CONTRIBUTING.md's layers, bottom first (its numbered list): each the package's units that its line names, a
    top-level module (`trl_marl.config`) or folder (`trl_marl.team`)."""
    text = (PACKAGE.parent / "CONTRIBUTING.md").read_text()
    block = text[text.index("<!-- layers:start -->") : text.index("<!-- layers:end -->")]
    lines = [line for line in block.splitlines() if re.match(r"^\d+\. ", line)]
    units = [re.findall(r"`trl_marl/(\w+)(?:/|\.py)`", line) for line in lines]
    return [[f"trl_marl.{name}" for name in names] for names in units]


def unit(name: str) -> str:
    """The layer unit a module belongs to: its top-level folder, or itself for a top-level module."""
    return ".".join(name.split(".")[:2])


def layer_violations(graph: dict[str, set[str]], order: list[list[str]]) -> list[str]:
    """Every import of `graph` (module -> the modules it imports) from a unit of a lower layer of `order` (bottom
    first) to one of a higher layer, as "importer imports imported (layer i, ..., is below layer j, ...)". The package
    itself (its `__init__`, the front door) sits above every layer and imports from all of them."""
    rank = {name: index for index, names in enumerate(order) for name in names}
    found = []
    for name, targets in sorted(graph.items()):
        if "." not in name:
            continue
        for target in sorted(targets):
            if "." not in target:
                found.append(f"{name} imports {target} (the package's __init__, above every layer)")
            elif rank[unit(name)] < rank[unit(target)]:
                found.append(
                    f"{name} imports {target} (layer {rank[unit(name)] + 1}, {unit(name)}, is below layer "
                    f"{rank[unit(target)] + 1}, {unit(target)})"
                )
    return found


def package_graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports(name, path, set(found)) for name, path in found.items()}


def test_every_top_level_module_and_folder_sits_in_one_layer():
    named = [name for names in layers() for name in names]
    units = {unit(name) for name in modules() if "." in name}
    assert len(named) == len(set(named)), f"named in two layers: {sorted(n for n in named if named.count(n) > 1)}"
    assert sorted(units - set(named)) == [], "modules or folders missing from CONTRIBUTING.md's layers"
    assert sorted(set(named) - units) == [], "CONTRIBUTING.md's layers name what is not in the package"


def test_imports_point_only_down_the_layers():
    violations = layer_violations(package_graph(), layers())
    assert violations == [], "imports from a lower layer to a higher one:\n" + "\n".join(violations)


def test_there_is_no_import_cycle_between_the_packages_folders():
    graph: dict[str, set[str]] = {}
    for name, targets in package_graph().items():
        if "." in name:
            graph.setdefault(unit(name), set()).update(unit(t) for t in targets if "." in t and unit(t) != unit(name))
    assert len(graph) > 8
    cycle = import_cycle(graph)
    assert cycle is None, f"import cycle between folders: {' -> '.join(cycle)}"


def test_the_layer_rule_names_an_import_that_points_up():
    order = [["p.low"], ["p.mid", "p.other"], ["p.top"]]
    graph = {"p": {"p.top.a"}, "p.low.a": {"p.mid.b"}, "p.mid.b": {"p.low.a", "p.other"}, "p.top.a": {"p.mid.b"}}
    assert layer_violations(graph, order) == ["p.low.a imports p.mid.b (layer 1, p.low, is below layer 2, p.mid)"]
    graph["p.low.a"] = set()
    assert layer_violations(graph, order) == []


def test_an_import_of_the_package_itself_from_inside_it_points_up(tmp_path):
    (tmp_path / "a.py").write_text("from p import Trainer\n")
    (tmp_path / "b.py").write_text("def f():\n    from .. import load_team\n")
    (tmp_path / "c.py").write_text("from . import a\n")
    known = {"p", "p.low", "p.low.a", "p.low.b", "p.low.c"}
    graph = {name: imports(name, tmp_path / f"{name[-1]}.py", known) for name in ("p.low.a", "p.low.b", "p.low.c")}
    assert graph == {"p.low.a": {"p"}, "p.low.b": {"p"}, "p.low.c": {"p.low.a"}}  # its own folder's import: no edge
    assert layer_violations(graph, [["p.low"]]) == [
        "p.low.a imports p (the package's __init__, above every layer)",
        "p.low.b imports p (the package's __init__, above every layer)",
    ]


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


def loads_bitsandbytes(node: ast.stmt) -> bool:
    """Whether a top-level import statement imports bitsandbytes on its way: PEFT does, and so do transformers'
    Trainer and its callbacks (plain `import transformers`, `import torch` or `import trl` do not)."""
    if isinstance(node, ast.Import):
        return any(alias.name.split(".")[0] in ("peft", "bitsandbytes") for alias in node.names)
    if isinstance(node, ast.ImportFrom) and not node.level and node.module:
        top = node.module.split(".")[0]
        trainer = top == "transformers" and any("Trainer" in a.name or "Callback" in a.name for a in node.names)
        return top in ("peft", "bitsandbytes") or trainer
    return False


def test_every_recipe_imports_trl_marl_before_what_loads_bitsandbytes():
    # trl_marl filters a bitsandbytes notice that cannot concern its runs; the filter must exist before bitsandbytes
    # is imported, which logs it once, at import.
    late = []
    for path in sorted((PACKAGE.parent / "recipes").rglob("*.py")):
        seen_trl_marl = False
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.Import, ast.ImportFrom)) and "trl_marl" in ast.unparse(node).split()[1]:
                seen_trl_marl = True
            elif loads_bitsandbytes(node) and not seen_trl_marl:
                late.append(f"{path.relative_to(PACKAGE.parent)}: {ast.unparse(node)}")
                break
    assert not late, f"import trl_marl first in: {late}"
