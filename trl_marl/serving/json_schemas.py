"""The JSON schemas of constrained answers, made ready for the grammar (`grammars.py`): open objects closed, each
tool's `$ref`s re-rooted under the one schema of all its calls, and the keyword llguidance cannot enforce found.

**Closing open objects.** JSON Schema lets an object hold keys its `properties` do not list unless it says
`"additionalProperties": false`. A grammar that follows that literally lets a model write any key there, and a small
or freshly trained model does: `{"a": 3, "b": 4, "example: [ ": 5, ...` until `max_tokens`. An object with only the
listed keys is a valid answer to the open schema too, so `closed_objects` closes each object schema that lists its
`properties` and says nothing of other keys (no `additionalProperties`, `patternProperties`, `unevaluatedProperties`,
`propertyNames`), at every depth: nested objects, array items, `$defs`, the branches of an `anyOf` / `oneOf`. A schema
keeps its own word: `"additionalProperties": true` (or a schema of extra keys) stays as written. Left open, as closing
them could refuse what the schema allows: an object whose listed keys are completed by a sibling `allOf`, `anyOf`,
`oneOf`, `$ref`, `if` or `dependentSchemas`, the branches of an `allOf` (and of an `anyOf` / `oneOf` beside
`properties`), what a `not` refuses, and an object with fewer listed keys than its `minProperties`. A key `required`
names but `properties` does not describe is listed, with any value.

**Re-rooting references.** A tool's `parameters` become the `arguments` of its calls inside one larger schema (all the
offered tools' calls), where its `#/$defs/...` (pydantic's nested models) would point at that larger schema's root.
`rerooted` rewrites each local `$ref` of a tool's schema to point inside `#/$defs/<tool>`, where the grammar keeps the
tool's whole schema: recursive models stay recursive, and two tools' `$defs` of the same name stay apart.
"""

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
# Subschemas that apply to the same instance as their parent (the others describe a value inside it).
IN_PLACE = ("allOf", "anyOf", "oneOf", "not", "if", "then", "else", "dependentSchemas")
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


def with_subschemas(schema: dict, change: Callable[[str, Any], Any]) -> dict:
    """A copy of `schema` whose direct subschemas are `change(keyword, subschema)` (`schema` itself unchanged)."""
    copy = dict(schema)
    for keyword, key, subschema in subschemas(schema):
        if key is None:
            copy[keyword] = change(keyword, subschema)
            continue
        if copy[keyword] is schema[keyword]:  # the list or map itself copied once
            copy[keyword] = list(schema[keyword]) if isinstance(key, int) else dict(schema[keyword])
        copy[keyword][key] = change(keyword, subschema)
    return copy


def closed_objects(schema: Any, closable: bool = True) -> Any:
    """`schema` with its open objects closed (`"additionalProperties": false`), at every depth (the module's rules);
    `closable` False leaves `schema` itself open (its subschemas are still closed where they may be)."""
    if not isinstance(schema, dict):
        return schema
    lists_keys = "properties" in schema or "additionalProperties" in schema

    def close(keyword: str, subschema: Any) -> Any:
        if keyword not in IN_PLACE:  # a value inside the instance: closed on its own terms
            return closed_objects(subschema)
        branch_closable = keyword in ("anyOf", "oneOf") and not lists_keys
        return closed_objects(subschema, branch_closable)

    schema = with_subschemas(schema, close)
    properties = schema.get("properties")
    if not closable or not isinstance(properties, dict) or any(key in schema for key in OWN_WORD_ON_KEYS + COMPOSED):
        return schema
    required = [name for name in schema.get("required", ()) if isinstance(name, str) and name not in properties]
    properties = {**properties, **{name: {} for name in required}}
    if schema.get("minProperties", 0) > len(properties):
        return schema
    return {**schema, "properties": properties, "additionalProperties": False}


def rerooted(schema: Any, root: str) -> Any:
    """`schema` with each local `$ref` (`#`, `#/...`) pointing at the same place under `root` (`#/$defs/<name>`),
    where the schema will be kept."""
    if not isinstance(schema, dict):
        return schema
    schema = with_subschemas(schema, lambda keyword, subschema: rerooted(subschema, root))
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
