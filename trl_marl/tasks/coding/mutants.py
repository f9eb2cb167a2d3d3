"""Deliberately broken variants (mutants) of a reference solution, derived deterministically from its syntax tree.

The `code_tester` task rewards a tester whose tests catch a broken variant of the problem's canonical solution. The
variants come from classic mutation operators applied to one site of the solution's body at a time, in a fixed order:

1. comparison boundaries: `<` ↔ `<=`, `>` ↔ `>=`;
2. other comparisons: `==` ↔ `!=`, `in` ↔ `not in`, `is` ↔ `is not`;
3. arithmetic: `+` ↔ `-`, `*` → `+`, `/` → `*`, `//` → `%`, `%` → `//` (in expressions and augmented assignments);
4. integer constants: `n` → `n + 1`;
5. boolean operators: `and` ↔ `or`;
6. negation dropped: `not x` → `x`;
7. boolean constants: `True` ↔ `False`;
8. comprehension filters negated: `[x for x in xs if c]` → `[x for x in xs if not c]`;
9. swapped built-ins and methods: `min` ↔ `max`, `any` ↔ `all`, `.upper` ↔ `.lower`, `.startswith` ↔ `.endswith`;
10. returned values doubled: `return e` → `return e * 2` (the last resort, for one-line solutions).

Within an operator, sites go in source order. Only the solution's own lines are mutated (never the problem's prompt:
its signature, docstring or given helper functions). `mutants(program, first_line)` lists every variant in that
order; which of them really breaks the solution is for the caller to check against the problem's tests.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from dataclasses import dataclass

_BOUNDARY = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt}
_COMPARISON = {ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot,
               ast.IsNot: ast.Is}  # fmt: skip
_ARITHMETIC = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Add, ast.Div: ast.Mult, ast.FloorDiv: ast.Mod,
               ast.Mod: ast.FloorDiv}  # fmt: skip
_BOOLEAN = {ast.And: ast.Or, ast.Or: ast.And}
_CALLS = {"min": "max", "max": "min", "any": "all", "all": "any", "upper": "lower", "lower": "upper",
          "startswith": "endswith", "endswith": "startswith"}  # fmt: skip
_SYMBOLS = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!=", ast.In: "in",
            ast.NotIn: "not in", ast.Is: "is", ast.IsNot: "is not", ast.Add: "+", ast.Sub: "-", ast.Mult: "*",
            ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%", ast.And: "and", ast.Or: "or"}  # fmt: skip


@dataclass(frozen=True)
class Mutant:
    """A variant of a program: its full source, and what was changed (e.g. "line 14: `<` → `<=`")."""

    source: str
    description: str


def _operator_sites(node: ast.AST, table: dict) -> Iterator[Callable[[], str]]:
    """A `mutate()` for each operator of `node` that `table` maps: it swaps that operator and describes the change."""

    def swap(holder: list | ast.AST, index_or_field, old):
        def apply() -> str:
            new = table[type(old)]()
            if isinstance(holder, list):
                holder[index_or_field] = new
            else:
                setattr(holder, index_or_field, new)
            return f"`{_SYMBOLS[type(old)]}` → `{_SYMBOLS[type(new)]}`"

        return apply

    if isinstance(node, ast.Compare):
        for index, op in enumerate(node.ops):
            if type(op) in table:
                yield swap(node.ops, index, op)
    elif isinstance(node, (ast.BinOp, ast.AugAssign, ast.BoolOp)) and type(node.op) in table:
        yield swap(node, "op", node.op)


def _sites(tree: ast.Module, first_line: int) -> list[tuple[int, int, int, Callable[[], str]]]:
    """Every mutation site of `tree` on or after `first_line`, as (operator rank, line, column, mutate), sorted."""
    sites = []
    for node in ast.walk(tree):
        located = node.iter if isinstance(node, ast.comprehension) else node  # a `for` clause has no position
        line, column = getattr(located, "lineno", 0), getattr(located, "col_offset", 0)
        if line < first_line:
            continue
        for rank, table in enumerate((_BOUNDARY, _COMPARISON, _ARITHMETIC)):
            sites += [(rank, line, column, mutate) for mutate in _operator_sites(node, table)]
        if isinstance(node, ast.Constant) and type(node.value) is int:
            sites.append((3, line, column, _increment(node)))
        sites += [(4, line, column, mutate) for mutate in _operator_sites(node, _BOOLEAN)]
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            sites.append((5, line, column, _drop_not(tree, node)))
        if isinstance(node, ast.Constant) and type(node.value) is bool:
            sites.append((6, line, column, _flip_bool(node)))
        if isinstance(node, ast.comprehension):
            sites += [(7, line, column, _negate(node.ifs, index)) for index in range(len(node.ifs))]
        if isinstance(node, ast.Call) and _called_name(node) in _CALLS:
            sites.append((8, line, column, _swap_call(node)))
        if isinstance(node, ast.Return) and node.value is not None:
            sites.append((9, line, column, _double(node)))
    sites.sort(key=lambda site: site[:3])
    return sites


def _increment(node: ast.Constant) -> Callable[[], str]:
    def apply() -> str:
        old, node.value = node.value, node.value + 1
        return f"`{old}` → `{node.value}`"

    return apply


def _flip_bool(node: ast.Constant) -> Callable[[], str]:
    def apply() -> str:
        node.value = not node.value
        return f"`{not node.value}` → `{node.value}`"

    return apply


def _negate(conditions: list, index: int) -> Callable[[], str]:
    def apply() -> str:
        conditions[index] = ast.UnaryOp(ast.Not(), conditions[index])
        return "`if c` → `if not c`"

    return apply


def _called_name(call: ast.Call) -> str | None:
    if isinstance(call.func, ast.Name):
        return call.func.id
    return call.func.attr if isinstance(call.func, ast.Attribute) else None


def _swap_call(call: ast.Call) -> Callable[[], str]:
    def apply() -> str:
        old = _called_name(call)
        if isinstance(call.func, ast.Name):
            call.func.id = _CALLS[old]
        else:
            call.func.attr = _CALLS[old]
        return f"`{old}` → `{_CALLS[old]}`"

    return apply


def _double(node: ast.Return) -> Callable[[], str]:
    def apply() -> str:
        node.value = ast.BinOp(node.value, ast.Mult(), ast.Constant(2))
        return "`return e` → `return e * 2`"

    return apply


def _drop_not(tree: ast.Module, target: ast.UnaryOp) -> Callable[[], str]:
    def apply() -> str:
        for parent in ast.walk(tree):
            for field, value in ast.iter_fields(parent):
                if value is target:
                    setattr(parent, field, target.operand)
                elif isinstance(value, list) and any(item is target for item in value):
                    value[[id(item) for item in value].index(id(target))] = target.operand
        return "`not x` → `x`"

    return apply


def mutants(program: str, first_line: int = 1) -> list[Mutant]:
    """Every single-site mutant of `program` whose site is on line `first_line` or later (1-based), in the fixed
    operator order above, then by position. Raises SyntaxError when `program` does not parse."""
    count = len(_sites(ast.parse(program), first_line))
    result = []
    for index in range(count):
        tree = ast.parse(program)
        _, line, _, mutate = _sites(tree, first_line)[index]
        change = mutate()
        result.append(Mutant(ast.unparse(tree) + "\n", f"line {line}: {change}"))
    return result
