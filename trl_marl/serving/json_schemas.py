"""The JSON schemas of constrained answers, made ready for the grammar (`grammars.py`): open objects closed, each
tool's `$ref`s re-rooted under the one schema of all its calls, and the keyword llguidance cannot enforce found.

**Closing open objects.** JSON Schema lets an object hold keys its `properties` do not list unless it says
`"additionalProperties": false`. A grammar that follows that literally lets a model write any key there, and a small
or freshly trained model does: `{"a": 3, "b": 4, "example: [ ": 5, ...` until `max_tokens`. An object with only the
listed keys is a valid answer to the open schema too, so `closed_objects` closes each object schema that lists its
`properties` and says nothing of other keys (no `additionalProperties`, `patternProperties`, `unevaluatedProperties`,
`propertyNames`), at every depth: nested objects, array items, the `$defs` a value refers to, the branches of an
`anyOf`. A schema keeps its own word: `"additionalProperties": true` (or a schema of extra keys) stays as written. A
key `required` names but `properties` does not describe is listed, with any value.

Closing a subschema makes it accept fewer instances. That is safe where the schema asks that a subschema hold (a
property's value, an array's items, an `anyOf` branch, `then` / `else`), and only there, so each subschema is treated
as one of three, the least closed of all the ways it is reached (its place, and every `$ref` to it):

- *closable*: its object is closed, and the objects inside it;
- *kept open*: its object is left open, the objects inside it closed. Its keys may be completed by another subschema
  applied to the same instance: an object beside an `allOf`, `anyOf`, `oneOf`, `$ref`, `if` or `dependentSchemas`
  (or with fewer listed keys than its `minProperties`) is not closed itself, and the branches of an `allOf` (but
  the one branch of an `allOf` standing alone), `then`, `else`, `dependentSchemas`, an `anyOf`'s branches beside
  another keyword on keys (`properties`, `required`, a `$ref`, ...), and the definition a `$ref` reaches from such a
  place or from beside such a keyword (`{"$ref": "#/$defs/Base", "properties": {"b": ...}}`, `"allOf": [{"$ref":
  ...}, ...]`) are kept open, and what a kept-open `$ref` reaches in its turn;
- *as written*: nothing in it is closed, nor in the definitions it refers to, where accepting less would let the whole
  schema accept more: what a `not` refuses, the condition of an `if`, and the branches of a `oneOf` (an instance that
  two open branches accept, and the `oneOf` therefore refuses, may be accepted by one branch alone once the other is
  closed). A `oneOf` whose branches all require one key to hold a constant (`const`, or an `enum` of one value), a
  different one in each (pydantic's discriminated unions), is the exception: at most one branch can hold for an object
  whether or not they are closed, so it is closed as an `anyOf` is.

**Re-rooting references.** A tool's `parameters` become the `arguments` of its calls inside one larger schema (all the
offered tools' calls), where its `#/$defs/...` (pydantic's nested models) would point at that larger schema's root.
`rerooted` rewrites each local `$ref` of a tool's schema to point inside `#/$defs/<tool>`, where the grammar keeps the
tool's whole schema: recursive models stay recursive, and two tools' `$defs` of the same name stay apart.
"""

import json
from collections.abc import Callable, Iterator
from typing import Any

# The keywords whose values are subschemas: one, a list of them, or a map of names to them.
ONE_SUBSCHEMA = (
    "additionalProperties", "items", "additionalItems", "contains", "propertyNames", "not", "if", "then", "else",
    "unevaluatedItems", "unevaluatedProperties",
)  # fmt: skip
SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# An object schema with one of these says itself which other keys it takes (or lets another subschema say it).
OWN_WORD_ON_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties", "propertyNames")
COMPOSED = ("allOf", "anyOf", "oneOf", "$ref", "if", "dependentSchemas")
# The keywords that say which keys an object holds: beside one of them, a subschema applied in place is kept open.
ON_KEYS = (
    "properties", "required", "additionalProperties", "patternProperties", "unevaluatedProperties", "minProperties",
    "dependentRequired", "dependentSchemas", "allOf", "anyOf", "oneOf", "$ref", "if", "then", "else",
)  # fmt: skip
# How a subschema is closed (`closed_objects`), from the most closed to the least.
CLOSABLE, KEPT_OPEN, AS_WRITTEN = 0, 1, 2
MOST_KEYWORD_TRIES = 400  # `unservable_keyword` gives up past this many compilations


def subschemas(schema: dict) -> Iterator[tuple[str, Any, Any]]:
    """The direct subschemas of `schema`: `(keyword, key or index or None, subschema)`."""
    for keyword in ONE_SUBSCHEMA:
        if isinstance(schema.get(keyword), dict):
            yield keyword, None, schema[keyword]
    for keyword in SUBSCHEMA_LISTS:
        if isinstance(schema.get(keyword), list):
            yield from ((keyword, index, item) for index, item in enumerate(schema[keyword]))
    for keyword in SUBSCHEMA_MAPS:
        if isinstance(schema.get(keyword), dict):
            yield from ((keyword, key, item) for key, item in schema[keyword].items())


def with_subschemas(schema: dict, change: Callable[[str, Any, Any], Any]) -> dict:
    """A copy of `schema` whose direct subschemas are `change(keyword, key or index or None, subschema)` (`schema`
    itself unchanged)."""
    copy = dict(schema)
    for keyword, key, subschema in subschemas(schema):
        if key is None:
            copy[keyword] = change(keyword, key, subschema)
            continue
        if copy[keyword] is schema[keyword]:  # the list or map itself copied once
            copy[keyword] = list(schema[keyword]) if isinstance(key, int) else dict(schema[keyword])
        copy[keyword][key] = change(keyword, key, subschema)
    return copy


def closed_objects(schema: Any) -> Any:
    """`schema` with its open objects closed (`"additionalProperties": false`), at every depth, where that cannot
    change what it allows beyond the extra keys (the module's rules)."""
    if not isinstance(schema, dict):
        return schema
    modes = closing_modes(schema)

    def closed(subschema: Any, path: tuple) -> Any:
        mode = modes.get(path, CLOSABLE)
        if not isinstance(subschema, dict) or mode == AS_WRITTEN:
            return subschema
        subschema = with_subschemas(
            subschema, lambda keyword, key, inner: closed(inner, path + schema_step(keyword, key))
        )
        properties = subschema.get("properties")
        if mode != CLOSABLE or not isinstance(properties, dict):
            return subschema
        if any(key in subschema for key in OWN_WORD_ON_KEYS + COMPOSED):
            return subschema
        required = [name for name in subschema.get("required", ()) if isinstance(name, str) and name not in properties]
        properties = {**properties, **{name: {} for name in required}}
        if subschema.get("minProperties", 0) > len(properties):
            return subschema
        return {**subschema, "properties": properties, "additionalProperties": False}

    return closed(schema, ())


def closing_modes(root: dict) -> dict[tuple, int]:
    """How each subschema of `root` is closed (`CLOSABLE`, `KEPT_OPEN`, `AS_WRITTEN`), by its path (`schema_step`s):
    the least closed of its place's mode and the modes of the `$ref`s that reach it."""
    modes: dict[tuple, int] = {}
    pending = [((), root, CLOSABLE)]
    while pending:
        path, schema, mode = pending.pop()
        if not isinstance(schema, dict) or modes.get(path, -1) >= mode:
            continue
        modes[path] = mode
        for keyword, key, subschema in subschemas(schema):
            pending.append((path + schema_step(keyword, key), subschema, subschema_mode(root, schema, mode, keyword)))
        target = pointer(schema.get("$ref"))
        if target is not None and isinstance(found := resolved(root, target), dict):
            beside = any(keyword in schema for keyword in ON_KEYS if keyword != "$ref")
            pending.append((target, found, max(mode, KEPT_OPEN if beside else CLOSABLE)))
    return modes


def subschema_mode(root: dict, schema: dict, mode: int, keyword: str) -> int:
    """How a subschema that `schema` (closed as `mode`) holds under `keyword` is closed, by its place alone."""
    if mode == AS_WRITTEN or keyword in ("not", "if"):
        return AS_WRITTEN
    if keyword == "oneOf" and not told_apart(root, schema["oneOf"]):
        return AS_WRITTEN
    if keyword in ("anyOf", "oneOf") or (keyword == "allOf" and len(schema["allOf"]) == 1):
        alone = not any(other in schema for other in ON_KEYS if other != keyword)
        return CLOSABLE if mode == CLOSABLE and alone else KEPT_OPEN
    return KEPT_OPEN if keyword in ("allOf", "then", "else", "dependentSchemas") else CLOSABLE


def told_apart(root: dict, branches: list) -> bool:
    """Whether at most one of `branches` can hold for an object: each requires one key (the same in all) to hold a
    constant, a different one in each (looked for in the branch, or in the definition its `$ref` reaches)."""
    constants = [branch_constants(root, branch) for branch in branches]
    for key in constants[0] if constants else ():
        if all(key in found for found in constants):
            values = {json.dumps(found[key], sort_keys=True) for found in constants}
            if len(values) == len(constants):
                return True
    return False


def branch_constants(root: dict, branch: Any) -> dict:
    """The keys a branch requires to hold a constant (`const`, or an `enum` of one value), and their constants."""
    seen = set()  # the schemas passed, by id: a `$ref` may lead back to one
    while isinstance(branch, dict) and not isinstance(branch.get("properties"), dict) and id(branch) not in seen:
        seen.add(id(branch))  # follow a `$ref` to the definition that lists the keys
        target = pointer(branch.get("$ref"))
        branch = resolved(root, target) if target is not None else None
    if not isinstance(branch, dict) or not isinstance(branch.get("properties"), dict):
        return {}
    constants = {}
    for key in branch.get("required", ()):
        value = branch["properties"].get(key)
        if isinstance(value, dict) and "const" in value:
            constants[key] = value["const"]
        elif isinstance(value, dict) and isinstance(value.get("enum"), list) and len(value["enum"]) == 1:
            constants[key] = value["enum"][0]
    return constants


def schema_step(keyword: str, key: Any) -> tuple:
    """The path steps (JSON pointer tokens) from a schema to its subschema under `keyword` (and `key`)."""
    return (keyword,) if key is None else (keyword, str(key))


def pointer(reference: Any) -> tuple | None:
    """A local `$ref` (`#`, `#/$defs/Name`, any JSON pointer) as path steps; None for another document's."""
    if reference == "#":
        return ()
    if not isinstance(reference, str) or not reference.startswith("#/"):
        return None
    return tuple(token.replace("~1", "/").replace("~0", "~") for token in reference[2:].split("/"))


def resolved(root: Any, path: tuple) -> Any:
    """What `path` leads to in `root`, or None."""
    for token in path:
        if isinstance(root, dict):
            root = root.get(token)
        elif isinstance(root, list) and token.isdigit() and int(token) < len(root):
            root = root[int(token)]
        else:
            return None
    return root


def rerooted(schema: Any, root: str) -> Any:
    """`schema` with each local `$ref` (`#`, `#/...`) pointing at the same place under `root` (`#/$defs/<name>`),
    where the schema will be kept."""
    if not isinstance(schema, dict):
        return schema
    schema = with_subschemas(schema, lambda keyword, key, subschema: rerooted(subschema, root))
    reference = schema.get("$ref")
    if isinstance(reference, str) and (reference == "#" or reference.startswith("#/")):
        schema["$ref"] = root + reference[1:]
    return schema


def holds_references(schema: Any) -> bool:
    """Whether `schema` has a `$ref` at any depth."""
    if not isinstance(schema, dict):
        return False
    return "$ref" in schema or any(holds_references(subschema) for _, _, subschema in subschemas(schema))


def keyword_paths(schema: Any, path: str = "") -> Iterator[tuple[str, tuple]]:
    """Every keyword of `schema` at any depth: `(its path, as "properties.a.format", the keys leading to it)`."""
    if not isinstance(schema, dict):
        return
    for keyword in schema:
        yield f"{path}.{keyword}".lstrip("."), (keyword,)
    for keyword, key, subschema in subschemas(schema):
        step = (keyword,) if key is None else (keyword, key)
        shown = keyword if key is None else (f"{keyword}[{key}]" if isinstance(key, int) else f"{keyword}.{key}")
        for inner_path, inner_keys in keyword_paths(subschema, f"{path}.{shown}".lstrip(".")):
            yield inner_path, step + inner_keys


def without(schema: dict, keys: tuple) -> dict:
    """A copy of `schema` without the keyword that `keys` lead to."""
    if len(keys) == 1:
        return {key: value for key, value in schema.items() if key != keys[0]}
    copy = dict(schema) if isinstance(schema, dict) else list(schema)
    copy[keys[0]] = without(schema[keys[0]], keys[1:])
    return copy


def unservable_keyword(schema: dict, compiles: Callable[[dict], bool]) -> str | None:
    """The path of the deepest keyword of `schema` without which it `compiles` (the one the grammar library cannot
    enforce; at one depth, a keyword that holds no subschemas first), or None when none is found within
    `MOST_KEYWORD_TRIES` compilations."""
    holders = {*ONE_SUBSCHEMA, *SUBSCHEMA_LISTS, *SUBSCHEMA_MAPS}
    candidates = sorted(keyword_paths(schema), key=lambda candidate: (-len(candidate[1]), candidate[1][-1] in holders))
    for path, keys in candidates[:MOST_KEYWORD_TRIES]:
        if compiles(without(schema, keys)):
            return path
    return None
