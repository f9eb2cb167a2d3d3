"""`serve_team` / `trl-marl serve --use_vllm`: a team loaded with vLLM served behind the OpenAI-compatible endpoint,
each row a vLLM request with its agent's LoRA (`trl_marl.serving.vllm_engine`). Needs vLLM (see test_vllm.py) and the
serve extra; in a module of its own so that other modules' engines are shut down first."""

import asyncio

import pytest
import torch
from test_vllm_team import QUESTIONS, VLLM, saved_team  # noqa: F401  (a fixture)
from vllm_required import skip_without_vllm

skip_without_vllm()
pytest.importorskip("fastapi", reason="serving needs the `serve` extra (FastAPI, uvicorn)")
openai = pytest.importorskip("openai", reason="the serving tests drive the server with the `openai` client")
httpx = pytest.importorskip("httpx", reason="the serving tests read the server's health with httpx")

from trl_marl import load_team, serve_team  # noqa: E402
from trl_marl.serving.vllm_engine import VLLMBatchingEngine  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def served(saved_team):  # noqa: F811
    """The team loaded with vLLM, its greedy one-turn answers from `Team.run` (before it is served: the two share
    the engine), then served."""
    team = load_team(saved_team, dtype=torch.float32, **VLLM)
    expected = {
        question: team.run([{"role": "user", "content": question}], num_turns=1).final for question in QUESTIONS
    }
    try:
        with serve_team(team, chunk_tokens=4) as server:
            yield server, expected
    finally:
        team.close()


def chat(client, agent: str, question: str, **kwargs):
    messages = [{"role": "user", "content": question}]
    return client.chat.completions.create(model=agent, messages=messages, **{"temperature": 0, **kwargs})


def test_greedy_answers_through_the_vllm_server_equal_load_team_run_for_each_agent(served):
    server, expected = served
    assert isinstance(server.engine, VLLMBatchingEngine)
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    for question in QUESTIONS:
        answers = {agent: chat(client, agent, question).choices[0].message.content for agent in expected[question]}
        assert answers == expected[question]
    assert expected[QUESTIONS[0]]["concise"] != expected[QUESTIONS[0]]["detailed"]


def test_concurrent_requests_are_answered_as_alone_and_seeded_samples_repeat(served):
    server, expected = served
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)

    async def together():
        greedy = [chat(client, agent, question) for question in QUESTIONS for agent in ("concise", "detailed")]
        sampled = [chat(client, "detailed", QUESTIONS[0], temperature=1.0, seed=7, max_tokens=8) for _ in range(2)]
        return await asyncio.gather(*greedy, *sampled)

    responses = asyncio.run(together())
    answers = [response.choices[0].message.content for response in responses]
    assert answers[:4] == [expected[question][agent] for question in QUESTIONS for agent in ("concise", "detailed")]
    assert answers[4] == answers[5]  # one seed, one sample, whatever ran beside it


def test_logprobs_stop_strings_and_streams_through_vllm(served):
    server, expected = served
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    full = expected[QUESTIONS[1]]["concise"]
    response = chat(client, "concise", QUESTIONS[1], logprobs=True, top_logprobs=2)
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens > 0
    for entry in content:  # greedy: the chosen token is the most likely one
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert entry.logprob <= 0
    stop = full[3:6]
    stopped = chat(client, "concise", QUESTIONS[1], stop=[stop]).choices[0]
    assert (stopped.message.content, stopped.finish_reason) == (full[: full.index(stop)], "stop")
    chunks = list(chat(client, "concise", QUESTIONS[1], stream=True))
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == full


def test_a_client_that_disconnects_mid_stream_stops_its_vllm_request(served):
    server, _ = served
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    health = server.base_url.removesuffix("/v1") + "/health"
    before = httpx.get(health).json()["rows_finished"].get("cancelled", 0)
    stream = chat(client, "detailed", QUESTIONS[0], max_tokens=400, stream=True)
    for _, _ in zip(range(3), stream):
        pass
    stream.close()
    for _ in range(100):
        state = httpx.get(health).json()
        if state["rows_finished"].get("cancelled", 0) > before and not state["rows_running"]:
            break
        asyncio.run(asyncio.sleep(0.1))
    assert state["rows_finished"].get("cancelled", 0) == before + 1 and state["rows_waiting"] == 0
    assert chat(client, "concise", QUESTIONS[0], max_tokens=2).usage.completion_tokens == 2  # still serving


def test_tools_on_auto_are_rendered_through_vllm_and_constrained_output_is_refused_by_name(served):
    server, _ = served
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    parameters = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tools = [{"type": "function", "function": {"name": "weather", "parameters": parameters}}]
    plain = chat(client, "concise", QUESTIONS[0], max_tokens=8)
    offered = chat(client, "concise", QUESTIONS[0], tools=tools, max_tokens=8)
    assert offered.usage.prompt_tokens > plain.usage.prompt_tokens + 40  # the tools were rendered into the prompt
    assert offered.choices[0].finish_reason in ("stop", "length", "tool_calls")
    for fields, param in (
        ({"tools": tools, "tool_choice": "required"}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            chat(client, "concise", QUESTIONS[0], **fields)
        assert refused.value.body["param"] == param and "vLLM" in refused.value.message
