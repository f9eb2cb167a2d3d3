"""The server's refusals, each in OpenAI's error format (`{"error": {"message", "type", "param", "code"}}`) with the
status a client expects and a message naming the field; none of them stops the server."""

import pytest

pytest.importorskip("fastapi", reason="serving needs the `serve` extra (FastAPI, uvicorn)")
openai = pytest.importorskip("openai", reason="the serving tests drive the server with the `openai` client")
httpx = pytest.importorskip("httpx", reason="the serving tests send raw requests with httpx")

import test_serving  # noqa: E402

from trl_marl import serve_team  # noqa: E402

API_KEY = test_serving.API_KEY
team_dir, server, client = test_serving.team_dir, test_serving.server, test_serving.client  # the same fixtures

CHAT = {"model": "planner", "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 2}
COMPLETION = {"model": "planner", "prompt": "Hi.", "max_tokens": 2}
AUTHORIZED = {"Authorization": f"Bearer {API_KEY}"}


def post(server, path: str, body=None, headers=AUTHORIZED, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, headers=headers, **kwargs)


def error_of(response: httpx.Response) -> dict:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize(
    "path, fields, param",
    [
        ("/chat/completions", {"tools": [{"type": "web_search"}]}, "tools[0].type"),
        (
            "/chat/completions",
            {"tools": [{"type": "function", "function": {"name": "a b"}}]},
            "tools[0].function.name",
        ),  # fmt: skip
        (
            "/chat/completions",
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]},
            "tools[0].function.parameters",
        ),  # fmt: skip
        ("/chat/completions", {"tool_choice": "sometimes"}, "tool_choice"),
        (
            "/chat/completions",
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "tool_choice",
        ),  # fmt: skip
        ("/chat/completions", {"response_format": {"type": "xml"}}, "response_format"),
        (
            "/chat/completions",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"n": {"type": "bogus"}}}},
                }
            },
            "response_format.json_schema.schema.properties.n.type",  # the keyword the grammar cannot enforce
        ),  # fmt: skip
        ("/chat/completions", {"reasoning_effort": 3}, "reasoning_effort"),
        (
            "/chat/completions",
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}
                        ],
                    }
                ]
            },
            "messages[0].tool_calls[0].function.arguments",
        ),  # fmt: skip
        ("/chat/completions", {"messages": [{"role": "tool", "content": "3"}]}, "messages[0].tool_call_id"),
        ("/chat/completions", {"presence_penalty": 0.5}, "presence_penalty"),
        ("/chat/completions", {"frequency_penalty": -1}, "frequency_penalty"),
        ("/chat/completions", {"logit_bias": {"50": 10}}, "logit_bias"),
        ("/chat/completions", {"top_k": 5}, "top_k"),
        ("/chat/completions", {"not_a_field": 1}, "not_a_field"),
        ("/chat/completions", {"temperature": 3}, "temperature"),
        ("/chat/completions", {"temperature": "hot"}, "temperature"),
        ("/chat/completions", {"top_p": 0}, "top_p"),
        ("/chat/completions", {"n": 0}, "n"),
        ("/chat/completions", {"max_tokens": 0}, "max_tokens"),
        ("/chat/completions", {"max_completion_tokens": 3}, "max_completion_tokens"),  # disagrees with max_tokens
        ("/chat/completions", {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ("/chat/completions", {"seed": 1.5}, "seed"),
        ("/chat/completions", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs
        ("/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/chat/completions", {"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
        ("/chat/completions", {"messages": []}, "messages"),
        ("/chat/completions", {"messages": [{"role": "robot", "content": "Hi."}]}, "messages[0].role"),
        ("/chat/completions", {"messages": [{"role": "user", "content": "Hi.", "name": 3}]}, "messages[0].name"),
        ("/chat/completions", {"messages": [{"role": "user", "content": "Hi.", "x": 1}]}, "messages[0].x"),
        ("/chat/completions", {"tools": [], "tool_choice": "required"}, "tool_choice"),
        ("/chat/completions", {"store": True}, "store"),
        ("/chat/completions", {"service_tier": "flex"}, "service_tier"),
        ("/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
        ("/chat/completions", {"metadata": "tag"}, "metadata"),
        ("/chat/completions", {"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ("/chat/completions", {"logit_bias": {"50": 0}}, "logit_bias"),
        ("/completions", {"logit_bias": {"50": 10}}, "logit_bias"),
        (
            "/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content[0]",
        ),
        ("/chat/completions", {"model": 3}, "model"),
        ("/completions", {"echo": True}, "echo"),
        ("/completions", {"suffix": "end"}, "suffix"),
        ("/completions", {"best_of": 3}, "best_of"),
        ("/completions", {"logprobs": 6}, "logprobs"),
        ("/completions", {"prompt": [1, 2, 3]}, "prompt"),
    ],
)
def test_an_unsupported_or_bad_parameter_is_a_400_naming_it(server, path, fields, param):
    response = post(server, path, {**(CHAT if path == "/chat/completions" else COMPLETION), **fields})
    error = error_of(response)
    assert response.status_code == 400
    assert error["param"] == param and f"`{param}`" in error["message"]
    assert error["type"] == "invalid_request_error"


def test_the_openai_client_sees_a_refused_parameter_as_a_bad_request_naming_it(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="planner", messages=CHAT["messages"], response_format={"type": "xml"})
    assert refused.value.status_code == 400 and "response_format" in refused.value.message


@pytest.mark.parametrize(
    "fields",
    [
        {"metadata": {"run": "a", "step": "2"}},
        {"store": False},
        {"service_tier": "auto"},
        {"service_tier": "default"},
        {"parallel_tool_calls": False},
        {"response_format": {"type": "text"}},
        {"logit_bias": {}},
        {"tools": []},
        {"tool_choice": "none"},
        {"modalities": ["text"]},
        {"user": "user-1"},
        {"tools": [], "tool_choice": "none", "parallel_tool_calls": True, "store": False, "metadata": {}},
        {"prompt_cache_key": "agent-1", "safety_identifier": "user-1", "reasoning_effort": "low"},  # SDK defaults
    ],
)
def test_a_field_at_its_no_op_value_is_accepted(client, fields):
    response = client.chat.completions.create(model="planner", messages=CHAT["messages"], max_tokens=2, **fields)
    assert response.choices[0].finish_reason == "length"


def test_a_completion_takes_an_empty_logit_bias_and_a_user(server):
    response = post(server, "/completions", {**COMPLETION, "logit_bias": {}, "user": "user-1"})
    assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "length"


def test_a_non_streamed_request_cancelled_by_the_servers_shutdown_is_a_503_not_a_crash():
    from trl_marl.serving.app import raise_failure
    from trl_marl.serving.requests import APIError
    from trl_marl.serving.rows import GeneratedRow, RowRequest

    row = GeneratedRow(RowRequest(0, [1, 2], 4))
    row.finish_reason = "cancelled"
    with pytest.raises(APIError) as refused:
        raise_failure([row])
    assert refused.value.status == 503 and "shutting down" in refused.value.message


def test_a_request_for_more_completions_than_the_servers_limit_is_a_400_naming_the_field(server):
    many = post(server, "/completions", {**COMPLETION, "prompt": ["Hi."] * 100, "n": 2})
    assert many.status_code == 400
    assert error_of(many)["param"] == "prompt" and "200 completions" in error_of(many)["message"]
    assert "limit of 128" in error_of(many)["message"]
    assert post(server, "/completions", {**COMPLETION, "prompt": ["Hi."] * 2, "n": 2}).status_code == 200


def test_a_seed_past_64_bits_is_a_400_naming_it_and_the_rows_beside_it_are_not_failed(server):
    too_big = post(server, "/completions", {**COMPLETION, "seed": 2**64})
    assert too_big.status_code == 400 and error_of(too_big)["param"] == "seed"
    last = post(server, "/completions", {**COMPLETION, "seed": 2**63 - 2, "n": 2})  # choice 1 samples with 2**63 - 1
    assert last.status_code == 200
    assert post(server, "/completions", {**COMPLETION, "seed": 2**63 - 2, "n": 3}).status_code == 400


def test_an_unknown_model_is_a_404_naming_the_agents(client):
    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(model="gpt-4o", messages=CHAT["messages"])
    assert unknown.value.code == "model_not_found"
    assert "gpt-4o" in unknown.value.message and "planner, checker" in unknown.value.message


def test_a_prompt_past_the_context_is_a_400_with_the_limit(server):
    long_prompt = " ".join(["word"] * 600)  # the tiny model's context is 512 tokens
    response = post(server, "/completions", {**COMPLETION, "prompt": long_prompt})
    error = error_of(response)
    assert response.status_code == 400 and error["code"] == "context_length_exceeded"
    assert "512 tokens" in error["message"] and error["param"] == "prompt"
    fits_alone = post(server, "/chat/completions", {**CHAT, "max_tokens": 510})
    assert fits_alone.status_code == 400 and "512 tokens" in error_of(fits_alone)["message"]
    assert error_of(fits_alone)["param"] == "messages"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}])
def test_a_missing_or_wrong_api_key_is_a_401(server, headers):
    response = post(server, "/chat/completions", CHAT, headers=headers)
    assert response.status_code == 401 and error_of(response)["code"] == "invalid_api_key"
    assert httpx.get(f"{server.base_url}/models", headers=headers).status_code == 401


def test_health_needs_no_key(server):
    response = httpx.get(server.base_url.removesuffix("/v1") + "/health")
    assert response.status_code == 200 and response.json()["agents"] == ["planner", "checker"]


def test_a_body_that_is_not_json_or_not_an_object_is_a_400(server):
    headers = {**AUTHORIZED, "Content-Type": "application/json"}
    broken = httpx.post(f"{server.base_url}/chat/completions", content=b'{"model": "planner",', headers=headers)
    assert broken.status_code == 400 and "not valid JSON" in error_of(broken)["message"]
    listed = post(server, "/chat/completions", [CHAT])
    assert listed.status_code == 400 and "JSON object" in error_of(listed)["message"]


def test_a_body_past_the_size_limit_is_a_413_and_the_server_stays_up(server):
    huge = {**CHAT, "messages": [{"role": "user", "content": "x" * 200_000}]}  # the fixture's limit: 100,000 bytes
    response = post(server, "/chat/completions", huge)
    assert response.status_code == 413 and "100000 bytes" in error_of(response)["message"]

    def chunks():
        yield b'{"model": "planner", "messages": [{"role": "user", "content": "'
        for _ in range(30):
            yield b"x" * 10_000  # no Content-Length: the body is counted as it arrives
        yield b'"}]}'

    headers = {**AUTHORIZED, "Content-Type": "application/json"}
    streamed = httpx.post(f"{server.base_url}/chat/completions", content=chunks(), headers=headers)
    assert streamed.status_code == 413
    assert post(server, "/chat/completions", CHAT).status_code == 200


def test_an_unknown_path_is_a_404_in_openais_format(server):
    response = post(server, "/embeddings", {"model": "planner", "input": "Hi."})
    assert response.status_code == 404 and "/v1/embeddings" in error_of(response)["message"]


def test_an_empty_prompt_is_a_400_naming_it(server):
    response = post(server, "/completions", {**COMPLETION, "prompt": ""})
    assert response.status_code == 400 and error_of(response)["param"] == "prompt"
    assert "renders to no tokens" in error_of(response)["message"]


def test_a_temperature_too_small_to_sample_with_answers_as_greedy(client):
    def answer(temperature):
        reply = client.completions.create(model="planner", prompt="Hi.", max_tokens=6, temperature=temperature)
        return reply.choices[0].text

    assert answer(1e-39) == answer(0)  # dividing the logits by it would overflow: the argmax, as vLLM rules


def test_a_request_whose_log_probabilities_could_be_too_large_is_a_400_naming_both_fields(server):
    body = {**CHAT, "n": 16, "max_tokens": 400, "logprobs": True, "top_logprobs": 20}
    response = post(server, "/chat/completions", body)
    error = error_of(response)
    assert response.status_code == 400 and error["param"] == "top_logprobs" and error["code"] == "logprobs_too_large"
    assert "134400 log-probabilities" in error["message"] and "`max_tokens`" in error["message"]
    smaller = post(server, "/chat/completions", {**body, "top_logprobs": 2, "max_tokens": 2})
    assert smaller.status_code == 200 and len(smaller.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"])


def test_prompts_are_tokenised_and_bodies_built_off_the_event_loop(server, monkeypatch):
    import threading

    import trl_marl.serving.app as app_module
    import trl_marl.serving.prompts as prompts_module

    threads = {}

    def noting(module, name):
        function = getattr(module, name)

        def wrapper(*args, **kwargs):
            threads[name] = threading.current_thread().name
            return function(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    noting(prompts_module, "tokenize_text_prompts")
    noting(app_module, "completion_body")
    assert post(server, "/chat/completions", CHAT).status_code == 200
    assert threads["tokenize_text_prompts"].startswith("trl-marl-serving-tokenize")
    assert threads["completion_body"] not in ("trl-marl-serving-http", "trl-marl-serving-tokenize_0")


def test_a_prompt_that_cannot_fit_is_refused_before_its_chat_template_and_tokenisation(server, monkeypatch):
    import trl_marl.serving.prompts as prompts_module

    rendered = []
    monkeypatch.setattr(prompts_module, "tokenize_text_prompts", lambda *args: rendered.append(args))
    long = {**CHAT, "messages": [{"role": "user", "content": "hello " * 15_000}]}  # 90 kB: ~15,000 tokens
    response = post(server, "/chat/completions", long)
    assert response.status_code == 400 and error_of(response)["code"] == "context_length_exceeded"
    assert "maximum context length is 512 tokens" in error_of(response)["message"] and rendered == []
    many = {**COMPLETION, "prompt": ["Hi.", "word " * 18_000]}
    response = post(server, "/completions", many)
    assert response.status_code == 400 and error_of(response)["param"] == "prompt" and rendered == []


def test_deeply_nested_json_is_a_400_not_a_server_failure(server):
    headers = {**AUTHORIZED, "Content-Type": "application/json"}
    nested = b'{"model": "planner", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    response = httpx.post(f"{server.base_url}/chat/completions", content=nested, headers=headers)
    assert response.status_code == 400 and error_of(response)["code"] == "invalid_json"
    shallow = b'{"model": "planner", "messages": ' + b"[" * 500 + b"]" * 500 + b"}"  # parses; refused, shown short
    response = httpx.post(f"{server.base_url}/chat/completions", content=shallow, headers=headers)
    assert response.status_code == 400 and error_of(response)["param"] == "messages[0]"
    assert len(error_of(response)["message"]) < 200


@pytest.mark.parametrize(
    ("headers", "status", "code"),
    [
        ({"Host": "attacker.example:80"}, 421, "host_not_allowed"),  # a DNS-rebinding page
        ({"Origin": "https://attacker.example"}, 403, "origin_not_allowed"),  # any web page
        ({"Origin": "null"}, 403, "origin_not_allowed"),  # a sandboxed page or a file
        ({"Content-Type": "text/plain"}, 415, "unsupported_media_type"),  # a "simple" cross-origin POST
    ],
)
def test_a_request_a_web_page_could_send_is_refused_before_the_app_with_or_without_a_key(
    server, monkeypatch, headers, status, code
):
    import json

    monkeypatch.setattr(server.engine, "submit", lambda *args: pytest.fail("the request reached the engine"))
    sent = {**AUTHORIZED, "Content-Type": "application/json", **headers}
    response = httpx.post(f"{server.base_url}/chat/completions", content=json.dumps(CHAT), headers=sent)
    assert response.status_code == status and error_of(response)["code"] == code


def test_the_servers_own_addresses_and_allowed_origins_are_answered(server):
    port = server.port
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"LOCALHOST:{port}"):
        assert httpx.get(f"{server.root_url}/health", headers={"Host": host}).status_code == 200
    own = {"Origin": f"http://localhost:{port}"}
    assert post(server, "/chat/completions", CHAT, headers={**AUTHORIZED, **own}).status_code == 200
    tunnelled = {"Host": f"localhost:{port + 1}"}  # `ssh -L`, a container's port mapping: the client's port
    assert httpx.get(f"{server.root_url}/health", headers=tunnelled).status_code == 200
    other_port = {"Origin": f"http://localhost:{port + 1}"}  # another local web server's page
    assert post(server, "/chat/completions", CHAT, headers={**AUTHORIZED, **other_port}).status_code == 403
    with serve_team(server.team, allowed_origins=("https://ui.example",), allowed_hosts=("box.lan",)) as allowing:
        ui = {"Origin": "https://ui.example", "Host": f"box.lan:{allowing.port}"}
        assert post(allowing, "/chat/completions", CHAT, headers=ui).status_code == 200
        other = {"Origin": "https://else.example"}
        assert post(allowing, "/chat/completions", CHAT, headers=other).status_code == 403


def test_a_dual_stack_server_answers_ipv4_clients_by_their_loopback_names():
    from trl_marl.serving.access import AccessGuard

    guard = AccessGuard(app=None)
    scope = {"server": ("::ffff:127.0.0.1", 8000)}  # what a socket bound to `::` reports for an IPv4 client
    assert guard.answers_to("127.0.0.1", None, scope) and guard.answers_to("localhost", None, scope)
    assert not guard.answers_to("attacker.example", None, scope)


def test_a_tool_calls_arguments_nested_past_parsing_are_a_400_naming_them(server):
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[" * 20000 + "]" * 20000}}
    body = {**CHAT, "messages": [{"role": "assistant", "tool_calls": [call]}, {"role": "user", "content": "Hi."}]}
    response = post(server, "/chat/completions", body)
    assert response.status_code == 400
    assert error_of(response)["param"] == "messages[0].tool_calls[0].function.arguments"


def test_an_empty_prompt_among_several_is_named_by_its_place(server):
    response = post(server, "/completions", {**COMPLETION, "prompt": ["Hi.", ""]})
    assert response.status_code == 400 and error_of(response)["param"] == "prompt[1]"


def weather_call(call_id: str, city: str = "Paris") -> dict:
    arguments = f'{{"city": "{city}"}}'
    return {"id": call_id, "type": "function", "function": {"name": "weather", "arguments": arguments}}


ASKED = {"role": "user", "content": "Weather in Paris and Rome?"}
CALLED = {"role": "assistant", "content": None, "tool_calls": [weather_call("call_a"), weather_call("call_b", "Rome")]}


def result(call_id: str) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": "sunny"}


@pytest.mark.parametrize(
    ("messages", "param", "says"),
    [
        ([ASKED, CALLED, result("call_a"), result("call_b"), result("call_x")], "messages[4]", "call_x"),
        ([ASKED, CALLED, result("call_a"), result("call_x")], "messages[3]", "call_x"),
        ([ASKED, result("call_a")], "messages[1]", "no tool call"),
        ([ASKED, CALLED, result("call_a"), result("call_a"), result("call_b")], "messages[3]", "again"),
        ([ASKED, CALLED, result("call_a"), ASKED], "messages[1].tool_calls[1]", "call_b"),
        ([ASKED, CALLED, result("call_a")], "messages[1].tool_calls[1]", "call_b"),
        ([ASKED, CALLED, result("call_a"), result("call_b"), ASKED, result("call_b")], "messages[5]", "no tool call"),
        (
            [ASKED, {"role": "assistant", "tool_calls": [weather_call("call_a"), weather_call("call_a")]}],
            "messages[1].tool_calls[1].id",
            "call_a",
        ),
        (
            [
                ASKED,
                {
                    "role": "assistant",
                    "tool_calls": [{"type": "function", "function": CALLED["tool_calls"][0]["function"]}],
                },
                result("call_a"),
            ],
            "messages[1].tool_calls[0].id",
            "id",
        ),  # fmt: skip
    ],
)
def test_a_history_whose_tool_results_and_calls_do_not_match_is_a_400_naming_the_message(
    server, messages, param, says
):
    response = post(server, "/chat/completions", {**CHAT, "messages": messages})
    error = error_of(response)
    assert response.status_code == 400
    assert error["param"] == param and f"`{param}`" in error["message"] and says in error["message"]


def test_a_responses_function_call_output_answering_no_call_is_a_400_naming_the_input_item(server):
    items = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_a", "name": "weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_a", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_x", "output": "rain"},
    ]
    response = post(server, "/responses", {"model": "planner", "input": items, "max_output_tokens": 2})
    error = error_of(response)
    assert response.status_code == 400 and error["param"] == "input[3]" and "call_x" in error["message"]
    unanswered = post(server, "/responses", {"model": "planner", "input": items[:2], "max_output_tokens": 2})
    assert unanswered.status_code == 400 and error_of(unanswered)["param"] == "input[1]"
