"""`trl-marl serve` / `serve_team`: a saved team behind an OpenAI-compatible endpoint, driven by the official `openai`
client (sync, async, streaming) and by an agent framework (LangGraph), on a real server on a loopback port."""

import asyncio
import os
import subprocess
import sys

import pytest

pytest.importorskip("fastapi", reason="serving needs the `serve` extra (FastAPI, uvicorn)")
pytest.importorskip("uvicorn", reason="serving needs the `serve` extra (FastAPI, uvicorn)")
openai = pytest.importorskip("openai", reason="the serving tests drive the server with the `openai` client")
httpx = pytest.importorskip("httpx", reason="the serving tests read raw responses with httpx")

from test_serving_engine import AGENTS, QUESTION, no_reward, save_tiny_team  # noqa: E402

from trl_marl import load_team, serve_team  # noqa: E402
from trl_marl.team.base_generation import tokenize_text_prompts  # noqa: E402

API_KEY = "test-key"


@pytest.fixture(scope="module")
def team_dir(tiny_model_dir, tmp_path_factory) -> str:
    return save_tiny_team(tiny_model_dir, tmp_path_factory.mktemp("served-team"))


@pytest.fixture(scope="module")
def server(team_dir):
    with serve_team(team_dir, api_key=API_KEY, chunk_tokens=4, max_body_bytes=100_000) as handle:
        yield handle


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0)


def health(server) -> dict:
    return httpx.get(server.base_url.removesuffix("/v1") + "/health").json()


def greedy_chat(client, agent: str, messages=QUESTION, **kwargs):
    return client.chat.completions.create(model=agent, messages=messages, temperature=0, **kwargs)


@pytest.fixture(scope="module")
def cli_server(team_dir):
    """`python -m trl_marl.cli serve TEAM --port 0` in a subprocess: its base URL, from the line it prints."""
    process = subprocess.Popen(
        [sys.executable, "-m", "trl_marl.cli", "serve", team_dir, "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    try:
        line = process.stdout.readline()
        assert " at http://127.0.0.1:" in line, f"the server printed {line!r}"
        yield line.rsplit(" at ", 1)[1].strip()
    finally:
        process.terminate()
        process.wait(30)


def test_the_cli_servers_greedy_answers_equal_load_team_run_for_each_agent(cli_server, team_dir):
    client = openai.OpenAI(base_url=cli_server, api_key="unused", max_retries=0)
    served = {agent["name"]: greedy_chat(client, agent["name"]).choices[0].message.content for agent in AGENTS}
    team = load_team(team_dir)
    assert served == team.run(QUESTION, num_turns=1).final
    assert served["planner"] != served["checker"]


def test_models_lists_each_agent_by_name(client):
    assert [model.id for model in client.models.list()] == ["planner", "checker"]
    assert client.models.retrieve("checker").id == "checker"


def test_the_agents_system_prompt_comes_first_and_merges_into_a_requests_own_system_message(client, server):
    tokenizer = server.team.tokenizer

    def prompt_tokens(conversation):
        return len(tokenize_text_prompts(tokenizer, {}, None, [conversation])[0][0])

    recorded = [{"role": "system", "content": "Check."}, *QUESTION]
    own = [{"role": "system", "content": "You are a poet who answers in rhyme."}, *QUESTION]
    without = greedy_chat(client, "checker", max_tokens=2)
    explicit = greedy_chat(client, "checker", messages=recorded, max_tokens=2)
    merged = greedy_chat(client, "checker", messages=own, max_tokens=2)
    assert without.usage.prompt_tokens == prompt_tokens(recorded)
    assert without.choices[0].message.content == explicit.choices[0].message.content
    merged_conversation = [{"role": "system", "content": "Check.\n\nYou are a poet who answers in rhyme."}, *QUESTION]
    assert merged.usage.prompt_tokens == prompt_tokens(merged_conversation)


def test_with_a_system_message_greedy_answers_through_the_server_equal_load_team_run(client, team_dir):
    messages = [{"role": "system", "content": "You are terse."}, *QUESTION]
    served = {name: greedy_chat(client, name, messages).choices[0].message.content for name in ("planner", "checker")}
    assert served == load_team(team_dir).run(messages, num_turns=1).final


def test_a_message_with_a_name_is_served(client):
    messages = [
        {"role": "user", "content": "A story about rain."},
        {"role": "assistant", "content": "Rain fell.", "name": "planner"},
        {"role": "user", "content": "Go on.", "name": "reader"},
    ]
    response = greedy_chat(client, "checker", messages, max_tokens=2)
    assert response.choices[0].finish_reason == "length" and response.usage.completion_tokens == 2


def test_completions_take_raw_prompts_with_n_choices_each(client):
    response = client.completions.create(model="planner", prompt=["Once upon", "A cat"], n=2, max_tokens=3, seed=1)
    assert [choice.index for choice in response.choices] == [0, 1, 2, 3]
    assert all(choice.finish_reason == "length" and choice.text for choice in response.choices)
    assert response.usage.completion_tokens == 4 * 3
    assert response.usage.total_tokens == response.usage.prompt_tokens + 12


def test_a_streamed_answer_equals_the_unstreamed_one_and_ends_with_done(client, server):
    whole = greedy_chat(client, "planner")
    chunks = list(greedy_chat(client, "planner", stream=True))
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)  # every chunk has a choice
    assert streamed == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(chunk.usage is None for chunk in chunks)
    body = {"model": "checker", "prompt": "Hello", "max_tokens": 3, "stream": True, "temperature": 0}
    raw = httpx.post(f"{server.base_url}/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    events = [line for line in raw.text.splitlines() if line]
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert all(line.startswith("data: ") for line in events) and events[-1] == "data: [DONE]"
    assert all('"usage"' not in line for line in events)


def test_a_stream_with_include_usage_ends_with_a_usage_chunk_without_choices(client):
    whole = greedy_chat(client, "planner")
    chunks = list(greedy_chat(client, "planner", stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(chunk.choices and chunk.usage is None for chunk in chunks[:-1])


def test_concurrent_async_clients_are_batched_and_answer_as_they_would_alone(client, server):
    agents = ["planner", "checker"] * 4
    alone = [greedy_chat(client, agent).choices[0].message.content for agent in agents[:2]]

    async def together():
        async_client = openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0)
        requests = [
            async_client.chat.completions.create(model=agent, messages=QUESTION, temperature=0) for agent in agents
        ]
        return await asyncio.gather(*requests)

    calls_before = health(server)["calls"]
    answers = asyncio.run(together())
    calls = health(server)["calls"] - calls_before
    assert [answer.choices[0].message.content for answer in answers] == alone * 4
    assert calls < len(agents)  # requests shared routed calls


def test_the_same_seed_samples_the_same_answer_even_beside_other_requests(client, server):
    def sampled(seed):
        return client.chat.completions.create(
            model="planner", messages=QUESTION, temperature=1.0, top_p=0.95, seed=seed, max_tokens=8
        )

    first = sampled(3).choices[0].message.content
    assert sampled(3).choices[0].message.content == first
    assert sampled(4).choices[0].message.content != first

    async def beside_others():
        async_client = openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0)
        others = [
            async_client.chat.completions.create(model="checker", messages=QUESTION, temperature=0.8, max_tokens=12)
            for _ in range(3)
        ]
        seeded = async_client.chat.completions.create(
            model="planner", messages=QUESTION, temperature=1.0, top_p=0.95, seed=3, max_tokens=8
        )
        return (await asyncio.gather(seeded, *others))[0]

    assert asyncio.run(beside_others()).choices[0].message.content == first


def test_logprobs_give_each_tokens_log_probability_and_the_most_likely_alternatives(client):
    response = greedy_chat(client, "checker", max_tokens=4, logprobs=True, top_logprobs=3)
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens == 4
    assert "".join(entry.token for entry in content) == response.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
    completion = client.completions.create(model="checker", prompt="Hello", max_tokens=3, logprobs=2, temperature=0)
    assert len(completion.choices[0].logprobs.token_logprobs) == 3
    assert all(len(top) == 2 for top in completion.choices[0].logprobs.top_logprobs)


def test_streamed_logprobs_go_out_with_their_text_and_stop_with_it_at_a_stop_string(client):
    full = greedy_chat(client, "planner", max_tokens=12).choices[0].message.content
    stop = full[6:9]
    chunks = list(
        greedy_chat(
            client, "planner", max_tokens=12, stop=[stop], logprobs=True, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    logprobs = [chunk.choices[0].logprobs for chunk in chunks if chunk.choices and chunk.choices[0].logprobs]
    entries = [entry for part in logprobs for entry in part.content]
    assert text == full[: full.index(stop)]
    assert len(entries) == chunks[-1].usage.completion_tokens  # no token past the stop string, none twice
    assert bytes(byte for entry in entries for byte in entry.bytes).decode(errors="replace").startswith(text)


def test_a_stream_the_server_cancels_when_it_shuts_down_ends_in_an_error_not_a_finish_reason(team_dir):
    with serve_team(team_dir) as server:
        other = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        stream = greedy_chat(other, "planner", max_tokens=450, stream=True)
        next(iter(stream))  # the role chunk: the row is submitted
        server.engine.close()
        with pytest.raises(openai.APIError, match="shutting down"):
            for chunk in stream:
                assert chunk.choices[0].finish_reason in (None,)


def test_max_completion_tokens_and_stop_strings_end_the_answer(client):
    full = greedy_chat(client, "planner", max_completion_tokens=12).choices[0]
    short = greedy_chat(client, "planner", max_completion_tokens=3)
    assert short.usage.completion_tokens == 3 and short.choices[0].finish_reason == "length"
    stop = full.message.content[6:9]
    stopped = greedy_chat(client, "planner", max_completion_tokens=12, stop=[stop, "never appears"]).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.message.content == full.message.content[: full.message.content.index(stop)]


def test_a_request_without_max_tokens_gets_the_teams_completion_length_or_the_servers_default(client, team_dir):
    assert greedy_chat(client, "planner").usage.completion_tokens == 12  # team.json's max_completion_length
    with serve_team(team_dir, max_tokens=3) as server:
        other = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        assert greedy_chat(other, "planner").usage.completion_tokens == 3


def test_a_client_that_disconnects_mid_stream_stops_its_generation(client, server):
    cancelled_before = health(server)["rows_finished"].get("cancelled", 0)
    stream = greedy_chat(client, "planner", max_tokens=400, stream=True)
    for _, _ in zip(range(3), stream):
        pass
    stream.close()
    for _ in range(100):
        state = health(server)
        if state["rows_finished"].get("cancelled", 0) > cancelled_before and not state["rows_running"]:
            break
        asyncio.run(asyncio.sleep(0.1))
    assert state["rows_finished"].get("cancelled", 0) == cancelled_before + 1
    assert greedy_chat(client, "checker", max_tokens=2).usage.completion_tokens == 2  # still serving


def test_a_client_that_gives_up_on_a_waiting_request_stops_its_generation(server):
    cancelled_before = health(server)["rows_finished"].get("cancelled", 0)
    body = {"model": "planner", "messages": QUESTION, "max_tokens": 450, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/chat/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                   timeout=httpx.Timeout(10.0, read=0.2))  # fmt: skip
    for _ in range(100):
        state = health(server)
        if state["rows_finished"].get("cancelled", 0) > cancelled_before and not state["rows_running"]:
            break
        asyncio.run(asyncio.sleep(0.1))
    assert state["rows_finished"].get("cancelled", 0) == cancelled_before + 1


def test_a_failure_inside_generation_is_a_500_with_its_message_and_the_next_request_is_served(
    client, server, monkeypatch
):
    def broken(*args, **kwargs):
        raise RuntimeError("the accelerator fell over")

    monkeypatch.setattr(server.team.bases[0].model, "generate", broken)
    with pytest.raises(openai.InternalServerError) as failure:
        greedy_chat(client, "planner", max_tokens=2)
    monkeypatch.undo()
    assert failure.value.status_code == 500 and "the accelerator fell over" in failure.value.message
    assert failure.value.body["type"] == "server_error"
    assert greedy_chat(client, "planner", max_tokens=2).choices[0].finish_reason == "length"


def test_a_failure_outside_the_generate_call_is_a_500_and_the_engine_serves_the_next_request(
    client, server, monkeypatch
):
    stop_token_ids, calls = server.team.stop_token_ids, []

    def fails_once(agent):
        calls.append(agent)
        if len(calls) == 1:
            raise RuntimeError("stop tokens unavailable")
        return stop_token_ids(agent)

    monkeypatch.setattr(server.team, "stop_token_ids", fails_once)
    with pytest.raises(openai.InternalServerError) as failure:
        greedy_chat(client, "planner", max_tokens=2)
    assert "stop tokens unavailable" in failure.value.message
    assert greedy_chat(client, "planner", max_tokens=2).choices[0].finish_reason == "length"
    state = health(server)
    assert state["status"] == "ok" and state["engine"] == "running"


def test_when_the_engine_has_stopped_health_and_requests_answer_503_at_once(client, server, monkeypatch):
    monkeypatch.setattr(server.engine, "failure", RuntimeError("the engine thread died"))
    response = httpx.get(server.base_url.removesuffix("/v1") + "/health")
    assert response.status_code == 503 and response.json()["status"] == "unavailable"
    assert "the engine thread died" in response.json()["error"]
    with pytest.raises(openai.APIStatusError) as refused:
        greedy_chat(client, "planner", max_tokens=2, timeout=10)
    assert refused.value.status_code == 503 and "the engine thread died" in refused.value.message
    monkeypatch.undo()
    assert greedy_chat(client, "planner", max_tokens=2).choices[0].finish_reason == "length"


def test_loading_options_reach_load_team_a_4bit_team_answers_as_it_runs(team_dir):
    bitsandbytes = pytest.importorskip("bitsandbytes", reason="bitsandbytes is needed for 4-bit bases")
    team = load_team(team_dir, load_in_4bit=True)
    expected = team.run(QUESTION, num_turns=1).final
    team.close()
    with serve_team(team_dir, load_in_4bit=True) as server:
        assert any(isinstance(module, bitsandbytes.nn.Linear4bit) for module in server.team.model.modules())
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        served = {name: greedy_chat(client, name).choices[0].message.content for name in expected}
    assert served == expected


def test_a_langgraph_two_agent_exchange_runs_against_the_server(client, server):
    langgraph = pytest.importorskip("langgraph.graph", reason="the agent-framework test drives LangGraph")
    chat_openai = pytest.importorskip(
        "langchain_openai", reason="LangGraph reaches the server through langchain-openai"
    )
    from langchain_core.messages import AIMessage, HumanMessage

    def agent_node(name: str):
        model = chat_openai.ChatOpenAI(
            model=name, base_url=server.base_url, api_key=API_KEY, temperature=0, max_tokens=8, max_retries=0
        )

        def answer(state: dict) -> dict:
            reply = model.invoke(state["messages"])
            return {"messages": [AIMessage(content=reply.content)], "speakers": [name]}

        return answer

    def merged(left: list, right: list) -> list:
        return left + right

    from typing import Annotated, TypedDict

    class Exchange(TypedDict):
        messages: Annotated[list, merged]
        speakers: Annotated[list, merged]

    graph = langgraph.StateGraph(Exchange)
    graph.add_node("planner", agent_node("planner"))
    graph.add_node("checker", agent_node("checker"))
    graph.add_edge(langgraph.START, "planner")
    graph.add_edge("planner", "checker")
    graph.add_edge("checker", langgraph.END)
    result = graph.compile().invoke({"messages": [HumanMessage(content=QUESTION[0]["content"])], "speakers": []})

    assert result["speakers"] == ["planner", "checker"]
    plan, check = result["messages"][1].content, result["messages"][2].content
    assert plan == greedy_chat(client, "planner", max_tokens=8).choices[0].message.content
    conversation = [*QUESTION, {"role": "assistant", "content": plan}]
    assert check == greedy_chat(client, "checker", messages=conversation, max_tokens=8).choices[0].message.content


@pytest.mark.slow
def test_on_the_default_model_greedy_answers_through_the_server_equal_load_team_run(default_model_dir, tmp_path):
    from datasets import Dataset

    from trl_marl import MAGRPOConfig, MAGRPOTrainer

    agents = [
        {"name": "writer", "system_prompt": "You write one short sentence."},
        {"name": "critic", "system_prompt": "You point out one weakness, briefly."},
    ]
    args = MAGRPOConfig(
        output_dir=str(tmp_path / "team"),
        agents=agents,
        num_turns=1,
        max_completion_length=24,
        report_to="none",
        use_cpu=True,
        bf16=False,
    )
    data = Dataset.from_dict({"prompt": ["Hi."]})
    MAGRPOTrainer(default_model_dir, no_reward, args=args, train_dataset=data).save_model()
    question = [{"role": "user", "content": "Describe the sea in winter."}]
    team = load_team(tmp_path / "team")
    expected = team.run(question, num_turns=1).final
    with serve_team(team) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        served = {name: greedy_chat(client, name, messages=question).choices[0].message.content for name in expected}
    assert served == expected
    assert served["writer"] != served["critic"]  # their roles (system prompts) differ
