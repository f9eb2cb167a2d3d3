"""Functions named by import path in `team.json` (the transition, the tools, the environment factory), so that another
process can rebuild them."""

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path


def importable_name(func: Callable) -> str | None:
    """`"module:qualname"` when importing that gives back `func`, so another process can rebuild it; a function of a
    script run as `__main__` is named by the script's path (`"/path/script.py:qualname"`). None otherwise (lambdas,
    local functions)."""
    module, qualname = getattr(func, "__module__", None), getattr(func, "__qualname__", "")
    if not module or "<" in qualname:
        return None
    if module == "__main__":
        script = getattr(sys.modules["__main__"], "__file__", None)
        found = sys.modules["__main__"]
        for part in qualname.split("."):
            found = getattr(found, part, None)
        return f"{os.path.abspath(script)}:{qualname}" if script and found is func else None
    try:
        found = import_by_name(f"{module}:{qualname}")
    except (ImportError, AttributeError):
        return None
    return f"{module}:{qualname}" if found is func else None


# Where modules were before they moved: the built-in tasks' before `trl_marl.tasks` became a package, the rollouts'
# before `trl_marl.rollouts` did. `team.json` files written then name their transitions by these paths.
MOVED_MODULES = {
    "trl_marl.plugins.tasks": "trl_marl.tasks.toy",
    "trl_marl.plugins.coding": "trl_marl.tasks.coding.coop_coding",
    "trl_marl.plugins.code_tester": "trl_marl.tasks.coding.code_tester",
    "trl_marl.plugins.math_tool": "trl_marl.tasks.math_tool",
    "trl_marl.plugins.puzzles.tasks": "trl_marl.tasks.puzzles.tool_and_plan",
    "trl_marl.rollout": "trl_marl.rollouts.rollout",
    "trl_marl.scheduling": "trl_marl.rollouts.scheduling",
}


def import_by_name(name: str) -> Callable:
    """The object named `"module:qualname"` (`qualname` may be dotted: `"module:Class.method"`),
    `"/path/script.py:qualname"` (the script run as a module: its `if __name__ == "__main__":` block is left out) or,
    as TRL names tools, `"package.module.function"` (a module in `MOVED_MODULES` is looked up where it is now). Raises
    what importing raises: ImportError, AttributeError, or any error of the module's own code."""
    module_name, separator, qualname = name.rpartition(":")
    if not separator:
        module_name, _, qualname = name.rpartition(".")
    module_name = MOVED_MODULES.get(module_name, module_name)
    if module_name.endswith(".py"):
        spec = importlib.util.spec_from_file_location(Path(module_name).stem, module_name)
        if spec is None or not Path(module_name).is_file():
            raise ImportError(f"no script at {module_name}")
        found = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(found)
    else:
        found = importlib.import_module(module_name)
    for part in qualname.split("."):
        found = getattr(found, part)
    return found
