"""The JSON schemas of constrained answers behind the endpoint (docs/serving.md, "Tools and structured output"): open
objects closed in tool calls (and in strict response formats) unless the schema says otherwise, pydantic's nested and
recursive models (`$defs` / `$ref`) served as tool parameters and response formats, and a schema the grammar cannot
enforce refused naming the tool and the keyword; on a real server, with the `openai` client and the Agents SDK."""

import asyncio
import json
from typing import Literal, Optional

import pytest

pytest.importorskip("fastapi", reason="serving needs the `serve` extra (FastAPI, uvicorn)")
pytest.importorskip("llguidance", reason="constrained decoding needs llguidance (the `serve` extra)")
openai = pytest.importorskip("openai", reason="the serving tests drive the server with the `openai` client")
httpx = pytest.importorskip("httpx", reason="the serving tests send raw requests with httpx")
jsonschema = pytest.importorskip("jsonschema", reason="answers are validated against their schema with jsonschema")

import test_serving  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402

from trl_marl.serving.tool_requests import read_output_rules  # noqa: E402

API_KEY = test_serving.API_KEY
team_dir, server, client = test_serving.team_dir, test_serving.server, test_serving.client  # the same fixtures

QUESTION = [{"role": "user", "content": "Where?"}]
MAX_TOKENS = 150  # the tiny model's context is 512 tokens, its prompts here (the tools' schemas) up to 390


def tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def sampled_calls(client, tools: list[dict], n: int, **kwargs) -> list:
    """`n` answers sampled at temperature 1 under `tool_choice: required` (one call each, unless `kwargs` say other),
    each answer's calls."""
    settings = {"tool_choice": "required", "parallel_tool_calls": False, "max_tokens": MAX_TOKENS, **kwargs}
    reply = client.chat.completions.create(
        model="planner", messages=QUESTION, tools=tools, n=n, temperature=1.0, seed=0, **settings
    )
    assert all(choice.finish_reason == "tool_calls" for choice in reply.choices)
    return [choice.message.tool_calls for choice in reply.choices]


def accepts(server, rules: dict, text: str) -> bool:
    """Whether the grammar of a request's `rules` lets a model write `text` (then end)."""
    tokenizer = server.team.bases[0].tokenizer
    matcher = server.engine.grammars_of(0).compiled(read_output_rules(rules), "tools").matcher().matcher
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) and matcher.is_accepting()


# -- open objects closed

CITY = {"enum": ["Paris", "Rome"]}
PLACE = {  # no `additionalProperties` at either level: JSON Schema leaves both objects open
    "type": "object",
    "properties": {"place": {"type": "object", "properties": {"city": CITY}, "required": ["city"]}},
    "required": ["place"],
}


def call_text(arguments: str, name: str = "go") -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def test_sampled_calls_of_a_tool_whose_objects_are_open_hold_only_the_keys_it_lists(client):
    for (call,) in sampled_calls(client, [tool("go", PLACE)], n=24):
        arguments = json.loads(call.function.arguments)
        assert list(arguments) == ["place"] and list(arguments["place"]) == ["city"]


def test_a_tool_call_grammar_closes_open_objects_at_every_depth_and_keeps_an_explicit_additional_properties(server):
    rules = {"tools": [tool("go", PLACE)], "tool_choice": "required"}
    assert accepts(server, rules, call_text('{"place": {"city": "Rome"}}'))
    assert not accepts(server, rules, call_text('{"place": {"city": "Rome"}, "x": 1}'))
    assert not accepts(server, rules, call_text('{"place": {"city": "Rome", "x": 1}}'))
    inner = {**PLACE["properties"]["place"], "additionalProperties": True}  # the schema's own word: open
    rules = {"tools": [tool("go", {**PLACE, "properties": {"place": inner}})], "tool_choice": "required"}
    assert accepts(server, rules, call_text('{"place": {"city": "Rome", "x": 1}}'))
    assert not accepts(server, rules, call_text('{"place": {"city": "Rome"}, "x": 1}'))
    # a key `required` names but `properties` does not describe stays allowed (with any value)
    rules = {
        "tools": [tool("go", {"type": "object", "properties": {}, "required": ["note"]})],
        "tool_choice": "required",
    }
    assert accepts(server, rules, call_text('{"note": [1, "a"]}'))
    assert not accepts(server, rules, call_text('{"note": 1, "x": 1}'))


@pytest.mark.parametrize(
    ("parameters", "allowed"),
    [
        ({"allOf": [{"properties": {"a": {"type": "integer"}}}, {"properties": {"b": {"type": "integer"}}}]},
         '{"a": 1, "b": 2}'),
        ({"properties": {"a": {"type": "integer"}}, "anyOf": [{"properties": {"b": {"type": "integer"}}}]},
         '{"a": 1, "b": 2}'),
        ({"properties": {"a": {"type": "integer"}}, "required": ["a"], "minProperties": 2}, '{"a": 1, "b": 2}'),
    ],
)  # fmt: skip
def test_objects_whose_keys_another_keyword_completes_are_left_open(server, parameters, allowed):
    assert accepts(server, {"tools": [tool("go", {"type": "object", **parameters})], "tool_choice": "required"},
                   call_text(allowed))  # fmt: skip


def test_a_strict_response_format_closes_open_objects_and_a_non_strict_one_follows_its_schema(server):
    def response_format(strict: bool) -> dict:
        return {
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PLACE, "strict": strict}}
        }

    assert accepts(server, response_format(True), '{"place": {"city": "Rome"}}')
    assert not accepts(server, response_format(True), '{"place": {"city": "Rome", "x": 1}}')
    assert accepts(server, response_format(False), '{"place": {"city": "Rome", "x": 1}}')


# -- nested and recursive models


class Spot(BaseModel):
    city: Literal["Paris", "Rome"]


class Trip(BaseModel):  # nested: pydantic writes `$defs` and a `$ref` to them
    to: Spot
    fast: bool


class Route(BaseModel):
    stops: list[Spot] = Field(min_length=1, max_length=2)


class Step(BaseModel):  # recursive: a `$ref` to itself
    move: Literal["left", "right"]
    then: Optional["Step"] = None


def test_a_nested_models_schema_as_tool_parameters_is_served_and_every_call_validates(client):
    go = tool("go", Trip.model_json_schema())
    assert "$defs" in go["function"]["parameters"]
    for (call,) in sampled_calls(client, [go], n=8):
        assert call.function.name == "go"
        Trip.model_validate_json(call.function.arguments)
    named = {"type": "function", "function": {"name": "walk"}}
    tools = [go, tool("walk", Step.model_json_schema())]  # two tools, each with its own `$defs`
    for (call,) in sampled_calls(client, tools, n=8, tool_choice=named, max_tokens=120):
        assert call.function.name == "walk"
        Step.model_validate_json(call.function.arguments)


def test_a_nested_models_response_format_beside_a_nested_models_tool_is_served_and_validates(client):
    schema = Route.model_json_schema()
    response_format = {"type": "json_schema", "json_schema": {"name": "route", "schema": schema, "strict": True}}
    reply = client.chat.completions.create(
        model="planner", messages=QUESTION, tools=[tool("go", Trip.model_json_schema())],
        response_format=response_format, n=8, temperature=1.0, max_tokens=MAX_TOKENS, seed=0,
    )  # fmt: skip
    for choice in reply.choices:
        assert choice.finish_reason in ("stop", "tool_calls")
        if choice.message.tool_calls:
            Trip.model_validate_json(choice.message.tool_calls[0].function.arguments)
        else:
            jsonschema.validate(json.loads(choice.message.content), schema)
            Route.model_validate_json(choice.message.content)


def test_an_agents_sdk_tool_taking_a_nested_model_is_called_with_tool_choice_required(server):
    sdk = pytest.importorskip("agents", reason="the OpenAI Agents SDK (`openai-agents`) drives this test")
    sdk.set_tracing_disabled(True)
    taken = []

    @sdk.function_tool
    def go(trip: Trip) -> str:
        """Go somewhere."""
        taken.append(trip)
        return f"went to {trip.to.city}"

    async def run():
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0)
        settings = sdk.ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=120)
        agent = sdk.Agent(
            name="planner", model=sdk.OpenAIChatCompletionsModel(model="planner", openai_client=client),
            tools=[go], model_settings=settings, tool_use_behavior="stop_on_first_tool",
        )  # fmt: skip
        return await sdk.Runner.run(agent, "Go.", max_turns=2)

    result = asyncio.run(run())
    assert len(taken) == 1 and isinstance(taken[0], Trip) and result.final_output == f"went to {taken[0].to.city}"


def test_a_schema_the_grammar_cannot_enforce_is_a_400_naming_the_tool_and_the_keyword(server):
    when = {"type": "object", "properties": {"day": {"type": "string", "format": "stardate"}}}
    body = {
        "model": "planner",
        "messages": QUESTION,
        "tools": [tool("go", Trip.model_json_schema()), tool("plan", when)],
        "tool_choice": "required",
    }
    response = httpx.post(
        f"{server.base_url}/chat/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}
    )
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "tools[1].function.parameters.properties.day.format"
    assert "`plan`" in error["message"] and "stardate" in error["message"]
    assert "at 1(" not in error["message"] and "at 3(" not in error["message"]  # no position in the server's grammar
    response_format = {"type": "json_schema", "json_schema": {"name": "p", "schema": {
        "type": "object", "properties": {"shape": {"$ref": "#/$defs/Missing"}}}}}  # fmt: skip
    body = {"model": "planner", "messages": QUESTION, "response_format": response_format}
    response = httpx.post(
        f"{server.base_url}/chat/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}
    )
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "response_format.json_schema.schema.properties.shape.$ref"


# -- objects completed through `$ref`, and `oneOf` / `not`, whose closing would change what the schema allows

FLAG = {"type": "boolean"}
BASE = {"type": "object", "properties": {"a": FLAG}, "required": ["a"]}
# `Base`'s keys are completed in place by the other `allOf` branch / by the `properties` beside the `$ref`
BASE_AND_B = {"$defs": {"Base": BASE}, "allOf": [{"$ref": "#/$defs/Base"},
              {"type": "object", "properties": {"b": FLAG}, "required": ["b"]}]}  # fmt: skip
REF_BESIDE_B = {"$defs": {"Base": BASE}, "type": "object", "$ref": "#/$defs/Base", "properties": {"b": FLAG},
                "required": ["b"]}  # fmt: skip
# through a chain of definitions: `Base` reached from an `allOf` branch by way of `Middle`
CHAINED = {"$defs": {"Base": BASE, "Middle": {"$ref": "#/$defs/Base"}}, "allOf": [{"$ref": "#/$defs/Middle"},
           {"type": "object", "properties": {"b": FLAG}, "required": ["b"]}]}  # fmt: skip
COMPLETED_THROUGH_REFS = [BASE_AND_B, REF_BESIDE_B, CHAINED]


def optional_b(schema: dict) -> dict:
    """`schema` with `b` no longer required (`a` still is)."""
    text = json.dumps(schema).replace('"required": ["b"]', '"required": []')
    return json.loads(text)


@pytest.mark.parametrize("parameters", COMPLETED_THROUGH_REFS)
def test_a_definition_completed_in_place_through_a_ref_is_served_and_every_call_validates(client, parameters):
    reply = client.chat.completions.create(
        model="planner", messages=QUESTION, tools=[tool("go", parameters)], tool_choice="required", n=8,
        parallel_tool_calls=False, temperature=1.0, seed=0, max_tokens=MAX_TOKENS,
    )  # fmt: skip
    whole = [choice.message.tool_calls[0] for choice in reply.choices if choice.finish_reason == "tool_calls"]
    # the composed object itself stays open (its keys come from two subschemas), so some answers write other keys
    # until `max_tokens`; every call that came back whole follows the schema as given
    assert len(whole) >= 4 and all(choice.finish_reason in ("tool_calls", "length") for choice in reply.choices)
    for call in whole:
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, parameters)
        assert {"a", "b"} <= set(arguments)


@pytest.mark.parametrize("parameters", COMPLETED_THROUGH_REFS)
def test_a_key_that_a_sibling_of_a_ref_lists_can_be_written_when_it_is_optional(server, parameters):
    rules = {"tools": [tool("go", optional_b(parameters))], "tool_choice": "required"}
    assert accepts(server, rules, call_text('{"a": true, "b": false}'))
    assert accepts(server, rules, call_text('{"a": true}'))


def test_closing_leaves_open_the_definitions_a_ref_completes_in_place_and_closes_those_a_value_refers_to():
    from trl_marl.serving.json_schemas import closed_objects

    for schema in COMPLETED_THROUGH_REFS:
        closed = closed_objects(schema)
        assert "additionalProperties" not in closed["$defs"]["Base"]
        assert all("additionalProperties" not in branch for branch in closed.get("allOf", ()))
    assert "additionalProperties" not in closed_objects(REF_BESIDE_B)
    # a definition a property's value refers to (pydantic's nested model) is closed, even behind an Optional's anyOf
    closed = closed_objects(Trip.model_json_schema())
    assert closed["$defs"]["Spot"]["additionalProperties"] is False and closed["additionalProperties"] is False
    closed = closed_objects(Step.model_json_schema())  # `Step` refers to itself from a value: still closed
    assert closed["$defs"]["Step"]["additionalProperties"] is False
    # the same definition reached from a value and from an `allOf` branch: left open
    both = {**BASE_AND_B, "properties": {"inner": {"$ref": "#/$defs/Base"}}}
    assert "additionalProperties" not in closed_objects(both)["$defs"]["Base"]


ONE_OF = {  # `{"a": 1}` is valid under both open branches, so the schema refuses it
    "type": "object",
    "oneOf": [
        {"type": "object", "properties": {"a": {"const": 1}}, "required": ["a"]},
        {"type": "object", "properties": {"b": {"type": "integer"}}},
    ],
}
NOT = {  # refuses an `a` holding `x: 1`, whatever else `a` holds
    "type": "object",
    "properties": {"a": {"type": "object"}},
    "not": {"properties": {"a": {"type": "object", "properties": {"x": {"const": 1}}, "required": ["x"]}},
            "required": ["a"]},
}  # fmt: skip
IF = {  # an `a` holding `x: 1` must also hold `y`
    "type": "object",
    "properties": {"a": {"type": "object"}},
    "if": {"properties": {"a": {"type": "object", "properties": {"x": {"const": 1}}, "required": ["x"]}},
           "required": ["a"]},
    "then": {"properties": {"a": {"required": ["y"]}}},
}  # fmt: skip


class Cat(BaseModel):
    kind: Literal["cat"]
    lives: int


class Dog(BaseModel):
    kind: Literal["dog"]
    good: bool


class Pet(BaseModel):  # a discriminated union: pydantic writes a `oneOf` of `$ref`s and a `discriminator`
    pet: Cat | Dog = Field(discriminator="kind")


@pytest.mark.parametrize(
    ("schema", "instances"),
    [
        (ONE_OF, [{"a": 1}, {"b": 2}, {"a": 1, "b": 2}, {"a": 2}]),
        (NOT, [{"a": {"x": 1}}, {"a": {"x": 1, "z": 0}}, {"a": {"x": 2}}, {"a": {}}]),
        (IF, [{"a": {"x": 1}}, {"a": {"x": 1, "y": 0}}, {"a": {"x": 1, "z": 0}}, {"a": {"x": 2}}]),
        (Pet.model_json_schema(), [{"pet": {"kind": "cat", "lives": 9}}, {"pet": {"kind": "dog", "good": True}},
                                   {"pet": {"kind": "cat", "lives": 9, "good": True}}]),
        (BASE_AND_B, [{"a": True, "b": True}, {"a": True}, {"a": True, "b": True, "c": 0}]),
    ],
)  # fmt: skip
def test_every_instance_a_closed_schema_accepts_the_schema_accepts(schema, instances):
    from trl_marl.serving.json_schemas import closed_objects

    closed = closed_objects(schema)
    for instance in instances:
        if jsonschema.Draft202012Validator(closed).is_valid(instance):
            assert jsonschema.Draft202012Validator(schema).is_valid(instance), instance


def test_one_of_branches_are_left_as_written_unless_a_required_constant_tells_them_apart():
    from trl_marl.serving.json_schemas import closed_objects

    assert closed_objects(ONE_OF)["oneOf"] == ONE_OF["oneOf"]
    assert closed_objects(NOT)["not"] == NOT["not"] and closed_objects(IF)["if"] == IF["if"]
    closed = closed_objects(Pet.model_json_schema())  # `kind` tells Cat from Dog: at most one branch holds
    assert closed["$defs"]["Cat"]["additionalProperties"] is False
    assert closed["$defs"]["Dog"]["additionalProperties"] is False
