"""Tools and structured output behind the endpoint (docs/serving.md, "Tools and structured output"): tools rendered by
the agent's chat template (ChatML with Hermes-style calls for the embedded SmolLM2, whose own template drops them),
answers read back into OpenAI `tool_calls`, `tool_choice` and `response_format` enforced token by token with
llguidance, streamed tool-call deltas, the Responses API, and the agent frameworks that use them (the OpenAI Agents
SDK, LangGraph) on a real server."""

import asyncio
import dataclasses
import json
from typing import Literal

import pytest

pytest.importorskip("fastapi", reason="serving needs the `serve` extra (FastAPI, uvicorn)")
pytest.importorskip("llguidance", reason="constrained decoding needs llguidance (the `serve` extra)")
openai = pytest.importorskip("openai", reason="the serving tests drive the server with the `openai` client")
httpx = pytest.importorskip("httpx", reason="the serving tests send raw requests with httpx")
jsonschema = pytest.importorskip("jsonschema", reason="answers are validated against their schema with jsonschema")

import test_serving  # noqa: E402
from test_serving_engine import agent_prompt_ids, save_tiny_team  # noqa: E402

from trl_marl import serve_team  # noqa: E402
from trl_marl.generation.tool_templates import CHATML_TOOLS, CHATML_TOOLS_TEMPLATE  # noqa: E402
from trl_marl.serving.engine import BatchingEngine  # noqa: E402
from trl_marl.serving.rows import RowRequest  # noqa: E402
from trl_marl.serving.tool_requests import read_output_rules  # noqa: E402

API_KEY = test_serving.API_KEY
team_dir, server, client = test_serving.team_dir, test_serving.server, test_serving.client  # the same fixtures

QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
# Schemas as strict tools give them (no properties beyond the named ones), their values bounded, so that the tiny
# random model's answers end within `max_tokens`.
CITY = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "weather", "description": "Today's weather", "parameters": CITY}}
FLAG = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
FLAG_TOOL = {"type": "function", "function": {"name": "flag", "parameters": FLAG}}
VERDICT = {
    "type": "object",
    "properties": {"verdict": {"enum": ["yes", "no", "maybe"]}, "score": {"type": "integer", "minimum": 0,
                   "maximum": 9}, "sure": {"type": "boolean"}},
    "required": ["verdict", "score", "sure"],
    "additionalProperties": False,
}  # fmt: skip


def tool_chat(client, **kwargs):
    # the tiny random model spells the markup in any of its tokenizations, often one character a token: room for it
    settings = {"model": "planner", "messages": QUESTION, "max_tokens": 200, "temperature": 1.0, **kwargs}
    return client.chat.completions.create(**settings)


def call_schema(tools: list[dict]) -> dict:
    """A call's name and arguments, as an answer must give them."""
    return {"anyOf": [{"properties": {"name": {"const": tool["function"]["name"]}, "arguments":
            tool["function"]["parameters"]}} for tool in tools]}  # fmt: skip


def test_a_base_whose_template_drops_tools_gets_chatml_with_hermes_calls_which_renders_the_whole_exchange(
    tiny_model_dir,
):
    from transformers import AutoTokenizer
    from trl.chat_template_utils import is_chat_template_prefix_preserving, supports_tool_calling

    from trl_marl.generation.tool_templates import ToolsUnsupported, tool_chat_template, tool_template_name

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)  # SmolLM2's tokenizer and chat template
    assert not supports_tool_calling(tokenizer)  # its own template drops a tool call silently
    assert tool_template_name(tokenizer) == CHATML_TOOLS and tool_chat_template(tokenizer) == CHATML_TOOLS_TEMPLATE
    tokenizer.chat_template = CHATML_TOOLS_TEMPLATE
    assert supports_tool_calling(tokenizer) and is_chat_template_prefix_preserving(tokenizer)
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."}]
    rendered = tokenizer.apply_chat_template(plain, tools=[WEATHER], tokenize=False, add_generation_prompt=True)
    assert rendered.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n") and '"name": "weather"' in rendered
    # without tools, a conversation renders as the base's own ChatML does (given a system message)
    tokenizer_own = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert tokenizer.apply_chat_template(plain, tokenize=False) == tokenizer_own.apply_chat_template(
        plain, tokenize=False
    )
    tokenizer.chat_template = "{% for m in messages %}[INST] {{ m.content }} [/INST]{% endfor %}"
    with pytest.raises(ToolsUnsupported, match="cannot render tools.*not ChatML"):
        tool_template_name(tokenizer)


def test_a_required_tool_call_comes_back_as_openai_tool_calls_with_valid_arguments(client):
    reply = tool_chat(client, tools=[WEATHER, FLAG_TOOL], tool_choice="required", parallel_tool_calls=False)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name in ("weather", "flag")
    schema = CITY if call.function.name == "weather" else FLAG
    jsonschema.validate(json.loads(call.function.arguments), schema)


def test_a_named_function_is_the_one_called(client):
    choice = {"type": "function", "function": {"name": "flag"}}
    reply = tool_chat(client, tools=[WEATHER, FLAG_TOOL], tool_choice=choice)
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "flag" and json.loads(call.function.arguments)["ok"] in (True, False)


def test_constrained_answers_sampled_at_temperature_1_always_parse_and_validate(client):
    """100 json_schema answers and 50 required tool calls, sampled."""
    answers = []
    for _ in range(2):
        fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": VERDICT, "strict": True}}
        reply = tool_chat(client, response_format=fmt, n=50, max_tokens=150)
        answers += [choice.message.content for choice in reply.choices]
    assert len(answers) == 100
    for answer in answers:
        jsonschema.validate(json.loads(answer), VERDICT)
    tools = [WEATHER, FLAG_TOOL]
    reply = tool_chat(client, tools=tools, tool_choice="required", parallel_tool_calls=False, n=50, max_tokens=200)
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            made = {"name": call.function.name, "arguments": json.loads(call.function.arguments)}
            jsonschema.validate(made, call_schema([WEATHER, FLAG_TOOL]))


@pytest.mark.parametrize("path", ["eager", "captured"])
def test_rows_of_different_grammars_and_none_share_one_routed_call(server, monkeypatch, path):
    """Each row follows its own grammar (or none), in one call, on eager `generate` and on the captured decode step."""
    from trl_marl.generation.captured_decode import CapturedDecoder

    team = server.team
    if path == "captured":
        base = team.bases[0]
        monkeypatch.setattr(base, "decoder", CapturedDecoder(base.model, base.router, path="static"))
    engine = BatchingEngine(team, chunk_tokens=200)
    grammars = engine.grammars_of(0)
    verdict = {"type": "json_schema", "json_schema": {"name": "v", "schema": VERDICT}}
    rules = [
        read_output_rules({"response_format": verdict}),
        read_output_rules({"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False}),
    ]
    requests = [
        RowRequest(agent, agent_prompt_ids(team, agent), 200, temperature=1.0, seed=seed, grammar=grammar)
        for seed, (agent, grammar) in enumerate(
            [(0, grammars.compiled(rules[0], "x")), (1, grammars.compiled(rules[1], "x")), (0, None), (1, None)]
        )
    ]
    engine.start()
    try:
        rows = engine.generate(requests)
    finally:
        engine.close()
    assert engine.calls == 1 and [row.finish_reason for row in rows[:2]] == ["stop", "stop"]
    jsonschema.validate(json.loads(rows[0].text), VERDICT)
    assert rows[1].text.startswith("<tool_call>\n") and rows[1].text.endswith("\n</tool_call>")
    call = json.loads(rows[1].text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
    assert call["name"] == "weather" and call["arguments"]["city"] in ("Paris", "Rome")
    assert not rows[2].text.startswith("{") or rows[2].finish_reason == "length"  # unconstrained rows stay free


def test_a_streamed_tool_call_arrives_as_openais_deltas_and_equals_the_unstreamed_one(client):
    settings = dict(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, temperature=0)
    whole = tool_chat(client, **settings).choices[0].message.tool_calls[0]
    chunks = list(tool_chat(client, stream=True, **settings))
    deltas = [call for chunk in chunks if chunk.choices for call in chunk.choices[0].delta.tool_calls or ()]
    first = deltas[0]
    assert (first.index, first.type, first.function.name) == (0, "function", "weather") and first.id.startswith(
        "call_"
    )
    assert "".join(delta.function.arguments or "" for delta in deltas) == whole.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert all(not (chunk.choices and chunk.choices[0].delta.content) for chunk in chunks)  # no markup as content


def test_a_history_with_a_tool_exchange_is_rendered_by_the_tool_template(client, server):
    from trl_marl.agents import agent_prompt

    arguments = {"city": "Paris"}
    function = {"name": "weather", "arguments": json.dumps(arguments)}
    history = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": function}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]  # fmt: skip
    reply = tool_chat(client, messages=history, tools=[WEATHER], temperature=0, max_tokens=4)
    tokenizer = server.team.bases[0].tokenizer
    expected = [
        *history[:1],
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "weather", "arguments": arguments}, "id": "call_1"}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1", "name": "weather"},
    ]  # fmt: skip
    conversation = agent_prompt(server.team.agents[0]["system_prompt"], expected, True)
    ids = tokenizer.apply_chat_template(
        conversation, tools=[WEATHER], chat_template=CHATML_TOOLS_TEMPLATE, add_generation_prompt=True, tokenize=True
    )["input_ids"]
    assert reply.usage.prompt_tokens == len(ids)
    rendered = tokenizer.decode(ids)
    assert '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>' in rendered
    assert "<tool_response>\nsunny\n</tool_response>" in rendered


def test_the_responses_api_answers_with_function_call_items_and_takes_their_outputs(client):
    tool = {"type": "function", "name": "weather", "parameters": CITY}
    settings = dict(model="planner", tools=[tool], tool_choice="required", parallel_tool_calls=False)
    response = client.responses.create(input="Weather in Paris?", max_output_tokens=200, **settings)
    assert response.status == "completed"
    (item,) = response.output
    assert item.type == "function_call" and item.name == "weather" and item.call_id.startswith("call_")
    jsonschema.validate(json.loads(item.arguments), CITY)
    follow_up = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": item.call_id, "name": "weather", "arguments": item.arguments},
        {"type": "function_call_output", "call_id": item.call_id, "output": "sunny"},
    ]
    answer = client.responses.create(model="planner", input=follow_up, instructions="Be brief.", max_output_tokens=5)
    assert answer.output[0].type == "message" and answer.status == "incomplete"  # 5 tokens: cut short, as OpenAI
    assert answer.usage.output_tokens == 5 and answer.usage.input_tokens > 20
    events = [event.type for event in client.responses.create(input="Weather?", stream=True, max_output_tokens=200,
                                                              **settings)]  # fmt: skip
    assert events[:2] == ["response.created", "response.in_progress"] and events[-1] == "response.completed"
    assert "response.function_call_arguments.done" in events and "response.output_item.done" in events


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"store": True}, "store"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        ({"text": {"format": {"type": "xml"}}}, "text.format"),
    ],
)
def test_what_the_responses_api_does_not_serve_is_a_400_naming_it(client, fields, param):
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(**{"model": "planner", "input": "Hi.", **fields})
    assert refused.value.body["param"] == param


def test_constrained_requests_on_an_engine_without_grammars_are_refused_by_name(server, monkeypatch):
    monkeypatch.setattr(type(server.engine), "serves_grammars", False)  # as the vLLM engine
    response = httpx.post(
        f"{server.base_url}/chat/completions",
        json={"model": "planner", "messages": QUESTION, "tools": [WEATHER], "tool_choice": "required"},
        headers={"Authorization": f"Bearer {API_KEY}"},
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "tool_choice"
    assert "vLLM" in response.json()["error"]["message"]


# -- agent frameworks


def agents_sdk():
    return pytest.importorskip("agents", reason="the OpenAI Agents SDK (`openai-agents`) drives these tests")


def run_agent(server, build, prompt: str, api: str):
    """Build agents with `build(model_of)` (`model_of(name)`: the agent's model through the chat completions API, or
    its name through the Responses API, the SDK's default) and run the first."""
    sdk = agents_sdk()
    sdk.set_tracing_disabled(True)

    async def run():
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0)
        if api == "responses":
            sdk.set_default_openai_client(client, use_for_tracing=False)
            sdk.set_default_openai_api("responses")

            def model_of(name):
                return name
        else:

            def model_of(name):
                return sdk.OpenAIChatCompletionsModel(model=name, openai_client=client)

        return await sdk.Runner.run(build(model_of), prompt, max_turns=4)

    return asyncio.run(run())


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_an_agents_sdk_agent_calls_a_function_tool_and_hands_off(server, api):
    sdk = agents_sdk()
    from pydantic import BaseModel

    called = []

    @sdk.function_tool
    def weather(city: Literal["Paris", "Rome"]) -> str:
        """Today's weather in a city."""
        called.append(city)
        return f"sunny in {city}"

    class Verdict(BaseModel):
        ok: bool

    def settings(**kwargs):
        return sdk.ModelSettings(temperature=1.0, max_tokens=200, parallel_tool_calls=False, **kwargs)

    def with_tool(model_of):
        return sdk.Agent(
            name="planner", instructions="Look the weather up.", model=model_of("planner"), tools=[weather],
            model_settings=settings(tool_choice="required"), tool_use_behavior="stop_on_first_tool",
        )  # fmt: skip

    result = run_agent(server, with_tool, "Weather in Paris?", api)
    assert called and result.final_output == f"sunny in {called[0]}"

    def with_handoff(model_of):
        checker = sdk.Agent(name="checker", model=model_of("checker"), output_type=Verdict, model_settings=settings())
        return sdk.Agent(
            name="planner", instructions="Hand over to the checker.", model=model_of("planner"), handoffs=[checker],
            model_settings=settings(tool_choice="required"),
        )  # fmt: skip

    result = run_agent(server, with_handoff, "Is it fine?", api)
    assert result.last_agent.name == "checker" and isinstance(result.final_output, Verdict)


def test_an_agents_sdk_run_streams_its_tool_call(server):
    sdk = agents_sdk()
    sdk.set_tracing_disabled(True)

    @sdk.function_tool
    def weather(city: Literal["Paris", "Rome"]) -> str:
        """Today's weather in a city."""
        return f"sunny in {city}"

    async def run():
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0)
        model = sdk.OpenAIChatCompletionsModel(model="planner", openai_client=client)
        settings = sdk.ModelSettings(max_tokens=200, tool_choice="required", parallel_tool_calls=False)
        agent = sdk.Agent(
            name="planner", model=model, tools=[weather], model_settings=settings,
            tool_use_behavior="stop_on_first_tool",
        )  # fmt: skip
        streamed = sdk.Runner.run_streamed(agent, "Weather?", max_turns=2)
        kinds = [event.type async for event in streamed.stream_events()]
        return streamed.final_output, kinds

    output, kinds = asyncio.run(run())
    assert output.startswith("sunny in ") and "run_item_stream_event" in kinds


def test_a_langgraph_react_agent_calls_its_tool_and_structured_output_follows_the_schema(server):
    pytest.importorskip("langgraph", reason="LangGraph drives this test")
    langchain_openai = pytest.importorskip(
        "langchain_openai", reason="LangGraph calls the server with langchain-openai"
    )
    from langchain_core.tools import tool
    from langgraph.prebuilt import create_react_agent
    from pydantic import BaseModel

    called = []

    @tool(return_direct=True)
    def weather(city: Literal["Paris", "Rome"]) -> str:
        """Today's weather in a city."""
        called.append(city)
        return f"sunny in {city}"

    def model(**kwargs):
        return langchain_openai.ChatOpenAI(
            model="planner", base_url=server.base_url, api_key=API_KEY, max_retries=0, max_tokens=200, **kwargs
        )

    bound = model().bind_tools([weather], tool_choice="required", parallel_tool_calls=False, strict=True)
    agent = create_react_agent(bound, [weather])
    result = agent.invoke({"messages": [("user", "Weather in Paris?")]})
    assert called and result["messages"][-1].content == f"sunny in {called[0]}"
    assert result["messages"][1].tool_calls[0]["name"] == "weather"

    class Verdict(BaseModel):
        verdict: Literal["yes", "no"]
        sure: bool

    for method in ("json_schema", "function_calling"):
        answer = model().with_structured_output(Verdict, method=method, strict=True).invoke("Is it sunny?")
        assert isinstance(answer, Verdict), method


def test_a_grammars_bitmask_unpacks_to_the_same_allowed_tokens_on_the_host_and_on_a_device():
    import torch

    from trl_marl.serving.grammars import unpacked_on_device, unpacked_on_host

    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 5), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    expected = torch.tensor(
        [[(int(bitmask[row, token // 32]) >> (token % 32)) & 1 for token in range(150)] for row in range(3)]
    ).bool()
    assert torch.equal(unpacked_on_host(bitmask, 150), expected)
    assert torch.equal(unpacked_on_device(bitmask, 150), expected)  # what a GPU runs, here on the CPU


# -- what the model wrote, read back the same way whole and streamed


@pytest.fixture
def written(server, monkeypatch):
    """`written(text)`: from now on, every row the server generates writes exactly `text` (a grammar of that one
    string on the real model, then its end-of-sequence token), whatever the request's own rules; what the answer is
    read back as (content, tool calls, stream deltas) is then the server's doing alone. `max_new_tokens` cuts it
    there (finish reason "length")."""
    import llguidance

    from trl_marl.serving.grammars import CompiledGrammar
    from trl_marl.serving.prompts import PromptRenderer

    def write(text: str, max_new_tokens: int = 400) -> None:
        rows_of = PromptRenderer.rows_of
        grammar = CompiledGrammar(server.engine.grammars_of(0), llguidance.LLMatcher.grammar_from_lark(
            f"start: {json.dumps(text)}\n"))  # fmt: skip

        def scripted(renderer, parsed, agent):
            rendered = rows_of(renderer, parsed, agent)
            rendered.rows[:] = [
                dataclasses.replace(row, grammar=grammar, max_new_tokens=max_new_tokens) for row in rendered.rows
            ]
            return rendered

        monkeypatch.setattr(PromptRenderer, "rows_of", scripted)

    return write


MALFORMED = "<tool_call>\nnot json\n</tool_call>"


def hermes_call(city: str) -> str:
    return f'<tool_call>\n{{"name": "weather", "arguments": {{"city": "{city}"}}}}\n</tool_call>'


def streamed_message(client, **settings) -> tuple[str, list[dict], str]:
    """A streamed chat answer put together: its content, its tool calls (by index: id, name, arguments) and its
    finish reason."""
    content, calls, finish_reason = "", {}, None
    for chunk in tool_chat(client, stream=True, **settings):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or ():
            call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = delta.id or call["id"]
            call["name"] += (delta.function.name or "") if delta.function else ""
            call["arguments"] += (delta.function.arguments or "") if delta.function else ""
        finish_reason = choice.finish_reason or finish_reason
    return content, [calls[index] for index in sorted(calls)], finish_reason


def test_parallel_tool_calls_false_gives_at_most_one_call_on_auto_whole_streamed_and_as_responses(client, written):
    written(f"{hermes_call('Paris')}\n{hermes_call('Rome')}")
    settings = dict(tools=[WEATHER], parallel_tool_calls=False, temperature=0)
    message = tool_chat(client, **settings).choices[0].message
    assert [(call.function.name, call.function.arguments) for call in message.tool_calls] == [
        ("weather", '{"city": "Paris"}')
    ]
    _, calls, finish_reason = streamed_message(client, **settings)
    assert [(call["name"], call["arguments"]) for call in calls] == [("weather", '{"city": "Paris"}')]
    assert finish_reason == "tool_calls"
    tool = {"type": "function", "name": "weather", "parameters": CITY}
    response = client.responses.create(model="planner", input="Weather?", tools=[tool], parallel_tool_calls=False)
    assert [(item.type, item.arguments) for item in response.output] == [("function_call", '{"city": "Paris"}')]
    events = client.responses.create(
        model="planner", input="Weather?", tools=[tool], parallel_tool_calls=False, stream=True
    )
    done = [event.item for event in events if event.type == "response.output_item.done"]
    assert [(item.type, item.arguments) for item in done] == [("function_call", '{"city": "Paris"}')]
    # with parallel calls (the default), both
    assert len(tool_chat(client, tools=[WEATHER], temperature=0).choices[0].message.tool_calls) == 2


@pytest.mark.parametrize(
    ("text", "content"),
    [
        (f"Let me look.\n{hermes_call('Paris')}\nDone, it is sunny.", "Let me look.\n\nDone, it is sunny."),
        (f"\n{hermes_call('Paris')}\n{hermes_call('Rome')}\n", None),
        (f"  Sure.\n{hermes_call('Rome')}", "Sure."),
        ("  No tool needed.  ", "No tool needed."),
        (f"{MALFORMED} then {hermes_call('Rome')} after", f"{MALFORMED} then  after"),  # as written
    ],
)
def test_streamed_content_equals_the_unstreamed_messages_around_and_after_the_calls(client, written, text, content):
    written(text)
    message = tool_chat(client, tools=[WEATHER], temperature=0).choices[0].message
    assert message.content == content
    streamed_content, calls, _ = streamed_message(client, tools=[WEATHER], temperature=0)
    assert streamed_content == (content or "")
    assert [call["arguments"] for call in calls] == [call.function.arguments for call in message.tool_calls or ()]
    tool = {"type": "function", "name": "weather", "parameters": CITY}
    response = client.responses.create(model="planner", input="Weather?", tools=[tool])
    events = list(client.responses.create(model="planner", input="Weather?", tools=[tool], stream=True))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == "".join(part.text for item in response.output if item.type == "message" for part in item.content)
    assert deltas == (content or "")


RESPONSES_WEATHER = {"type": "function", **WEATHER["function"]}  # the same tool, as the Responses API gives it


def output_items(items) -> list[tuple]:
    """A response's output items as what they say (their ids aside): a message's status and text, a call's status,
    name and arguments."""
    return [
        (item.type, item.status, item.content[0].text)
        if item.type == "message"
        else (item.type, item.status, item.name, item.arguments)
        for item in items
    ]


def responses_both_ways(client, **settings) -> tuple:
    """The same Responses request answered unstreamed (the response) and streamed (the stream's events, the last of
    them `response.completed` or `response.incomplete`, holding the streamed response)."""
    settings = {"model": "planner", "input": "Weather?", "tools": [RESPONSES_WEATHER], **settings}
    response = client.responses.create(**settings)
    events = list(client.responses.create(stream=True, **settings))
    return response, events


@pytest.mark.parametrize(
    "text",
    [
        f"Hello{hermes_call('Paris')}\n\nWorld",
        f"{hermes_call('Paris')}\nDone, it is sunny.",
        f"Before {hermes_call('Paris')} between {hermes_call('Rome')} after",
        f"{hermes_call('Paris')}\n{hermes_call('Rome')}",
        "No tool needed.",
    ],
)
def test_a_streamed_responses_output_holds_the_unstreamed_responses_items_in_its_order(client, written, text):
    written(text)
    response, events = responses_both_ways(client)
    assert events[-1].type == "response.completed"
    assert output_items(events[-1].response.output) == output_items(response.output)
    done = [event for event in events if event.type == "response.output_item.done"]
    assert [event.output_index for event in done] == list(range(len(response.output)))  # one item after another
    assert output_items([event.item for event in done]) == output_items(response.output)


def test_a_streamed_responses_output_fed_back_with_its_calls_results_is_answered_as_the_unstreamed_one(
    client, server, written
):
    written(f"Hello{hermes_call('Paris')}\n\nWorld")
    response, events = responses_both_ways(client)

    def fed_back(output) -> list[dict]:  # what the Agents SDK sends next: the input, the output, each call's result
        results = [{"type": "function_call_output", "call_id": item.call_id, "output": "sunny"}
                   for item in output if item.type == "function_call"]  # fmt: skip
        return [{"role": "user", "content": "Weather?"}, *(item.model_dump(exclude_none=True) for item in output),
                *results]  # fmt: skip

    answers = [
        httpx.post(f"{server.base_url}/responses", headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"model": "planner", "input": fed_back(output), "tools": [RESPONSES_WEATHER]})
        for output in (events[-1].response.output, response.output)
    ]  # fmt: skip
    assert [answer.status_code for answer in answers] == [200, 200], answers[0].text
    assert answers[0].json()["usage"]["input_tokens"] == answers[1].json()["usage"]["input_tokens"]


def test_an_assistant_message_item_between_calls_and_their_outputs_is_the_text_of_the_turn_that_called(client):
    call = {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": '{"city": "Paris"}'}
    result = {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}
    question = {"role": "user", "content": "Weather?"}

    def said(text: str) -> dict:
        return {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}

    def input_tokens(items: list[dict]) -> int:
        settings = dict(model="planner", tools=[RESPONSES_WEATHER], max_output_tokens=1)
        return client.responses.create(input=items, **settings).usage.input_tokens

    def chat_prompt_tokens(content: str) -> int:
        function = {"name": "weather", "arguments": call["arguments"]}
        messages = [question, {"role": "assistant", "content": content, "tool_calls": [
            {"id": "call_1", "type": "function", "function": function}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]  # fmt: skip
        return tool_chat(client, messages=messages, tools=[WEATHER], max_tokens=1).usage.prompt_tokens

    assert input_tokens([question, call, said("World"), result]) == chat_prompt_tokens("World")
    assert input_tokens([question, said("Hello"), call, said("World"), result]) == chat_prompt_tokens("Hello\n\nWorld")
    assert chat_prompt_tokens("World") != chat_prompt_tokens("")


UNCLOSED = 'Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Par'
CUT_INSIDE_THE_CALL = 20  # tokens: the tiny model writes `Let me look.\n<tool_call>\n` in 11, the whole call in 33


def test_an_unclosed_tool_call_at_a_normal_end_stays_in_the_content_as_written_whole_and_streamed(client, written):
    written(UNCLOSED)
    choice = tool_chat(client, tools=[WEATHER], temperature=0).choices[0]
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (UNCLOSED, None, "stop")
    assert streamed_message(client, tools=[WEATHER], temperature=0) == (UNCLOSED, [], "stop")
    response, events = responses_both_ways(client)
    assert output_items(response.output) == [("message", "completed", UNCLOSED)]
    assert output_items(events[-1].response.output) == output_items(response.output)


def test_a_tool_call_cut_by_the_length_limit_is_left_out_of_the_content_whole_and_streamed(client, written):
    written(UNCLOSED + 'is"}}\n</tool_call>', max_new_tokens=CUT_INSIDE_THE_CALL)
    choice = tool_chat(client, tools=[WEATHER], temperature=0).choices[0]
    assert (choice.message.content, choice.message.tool_calls) == ("Let me look.", None)
    assert choice.finish_reason == "length"
    assert streamed_message(client, tools=[WEATHER], temperature=0) == ("Let me look.", [], "length")
    response, events = responses_both_ways(client)
    assert response.status == "incomplete" and events[-1].type == "response.incomplete"
    assert output_items(response.output) == [("message", "completed", "Let me look.")]
    assert output_items(events[-1].response.output) == output_items(response.output)


# -- the programs guide's Agents SDK episode (docs/programs.md, "The OpenAI Agents SDK")


@pytest.fixture(scope="module")
def writer_critic_dir(tiny_model_dir, tmp_path_factory) -> str:
    agents = [{"name": "writer", "system_prompt": "Report."}, {"name": "critic", "system_prompt": "Check."}]
    return save_tiny_team(tiny_model_dir, tmp_path_factory.mktemp("writer-critic"), agents)


def documented_episode():
    """The Agents SDK episode function of docs/programs.md, defined as the guide writes it."""
    agents_sdk()
    from pathlib import Path

    text = (Path(__file__).parent.parent / "docs" / "programs.md").read_text()
    blocks = [block.split("```", 1)[0] for block in text.split("```python\n")[1:]]
    (block,) = [block for block in blocks if "OpenAIProvider(openai_client=client)" in block]
    namespace = {}
    exec(compile(block, "docs/programs.md", "exec"), namespace)
    return namespace["weather_report"]


def counting_client(base_url: str, sent: list) -> "openai.AsyncOpenAI":
    async def count(request):
        sent.append(request.url.path)

    http_client = httpx.AsyncClient(event_hooks={"request": [count]})
    return openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, http_client=http_client)


def test_the_programs_guides_agents_sdk_episode_sends_every_call_through_its_own_episodes_client(writer_critic_dir):
    episode = documented_episode()
    sent = [[], []]
    with serve_team(writer_critic_dir, max_tokens=150) as served:

        async def two_episodes_at_once():
            clients = [counting_client(served.base_url, calls) for calls in sent]
            row = {"prompt": "Is it warm in Paris?"}
            return await asyncio.gather(*(episode(client, row) for client in clients))

        outcomes = asyncio.run(two_episodes_at_once())
    assert all(outcome in (0.0, 1.0) for outcome in outcomes)
    assert sent == [["/v1/responses", "/v1/responses"]] * 2  # the writer's call, then the critic's, each its own


def test_an_agents_sdk_run_whose_responses_answer_is_cut_by_the_length_limit_raises_as_the_guide_says(
    writer_critic_dir,
):
    sdk = agents_sdk()
    episode = documented_episode()
    with serve_team(writer_critic_dir, max_tokens=4) as served:  # shorter than any call
        client = openai.AsyncOpenAI(base_url=served.base_url, api_key="unused", max_retries=0)
        with pytest.raises(sdk.exceptions.ModelBehaviorError, match="incomplete"):
            asyncio.run(episode(client, {"prompt": "Is it warm in Paris?"}))
