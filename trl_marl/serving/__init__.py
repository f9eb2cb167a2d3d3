"""A trained team behind an OpenAI-compatible endpoint: each agent a model name, all on one loaded `Team`, and the
rows of concurrent requests generated together in routed calls (docs/serving.md).

Files: `requests.py` (the OpenAI request bodies, checked), `errors.py` (errors in OpenAI's format),
`tool_requests.py` (a chat request's tools, tool choice and response format, checked), `grammars.py` (constrained
decoding with llguidance), `json_schemas.py` (the schemas it enforces, prepared: open objects closed, each tool's
`$ref`s re-rooted, the keyword it cannot enforce found), `tool_calls.py` (answers read back as content and tool
calls, whole or streamed), `responses.py` (response bodies,
stream events, log-probabilities), `rows.py` (what the engine is asked and gives back per row), `completion_text.py`
(a row's text decoded as its tokens come), `step_hooks.py` (each row's sampling and stopping inside a `generate`
call), `engine.py` (the batching engine), `vllm_engine.py` (the engine on a team loaded with vLLM), `tokens.py` (each
token's bytes and text for log-probabilities), `app.py` (the ASGI app), `access.py` (who may call it: the API key,
`Host`, `Origin`, `Content-Type`), `server.py` (the server and its handle). FastAPI and uvicorn come with the `serve`
extra and are imported only when a server starts.

May import: every layer below it (the foundation, `sandbox`, `rollouts`, `tasks`, `generation`, `config`, `team`,
`memory`); nothing above: the trainers use it (a trainer serves its own team to agent programs), never the reverse.
"""

from typing import Any

__all__ = ["serve_team"]


def serve_team(
    team_or_path: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    api_key: str | None = None,
    max_batch_rows: int = 16,
    chunk_tokens: int = 16,
    max_tokens: int | None = None,
    max_body_bytes: int | None = None,
    max_request_rows: int | None = None,
    allowed_hosts: tuple[str, ...] = (),
    allowed_origins: tuple[str, ...] = (),
    log_level: str = "warning",
    **load_options: Any,
):
    """Serve a team over HTTP from a background thread, as OpenAI's API: `GET /v1/models`, `POST
    /v1/chat/completions`, `POST /v1/completions`, `GET /health`.

    Args:
        team_or_path: a loaded `Team`, or what `load_team` takes (a folder written by `save_model`, a Hub id).
        host: the address to listen on (loopback by default).
        port: the port; 0 picks a free one (read it from the handle's `base_url`).
        api_key: when set, `/v1` requests must send `Authorization: Bearer <api_key>` (401 otherwise).
        max_batch_rows: at most this many rows (completions) in one routed `generate` call.
        chunk_tokens: a call that has generated this many tokens ends when other rows wait; its unfinished rows
            continue in the next call, with them.
        max_tokens: a request's completion length when it sets none (default: team.json's `max_completion_length`),
            cut to what fits the context.
        max_body_bytes: larger request bodies are refused with 413 (default 4 MiB).
        max_request_rows: a request asking for more completions (prompts x `n`) is refused with 400 (default 128).
        allowed_hosts: names the server answers to besides the address it listens on (and `localhost` on loopback);
            a request naming another `Host` is refused (421), which keeps DNS-rebinding pages out. `"*"`: any.
        allowed_origins: web origins (`https://app.example`) whose pages may call the server; a request with
            another `Origin` header is refused (403). Programs send none. `"*"`: any.
        log_level: uvicorn's log level.
        load_options: `load_team`'s keywords (`load_in_4bit`, `dtype`, `captured_decode`, `base_model`, `use_vllm`,
            ...) when `team_or_path` is not a loaded team. A team loaded with `use_vllm=True` generates with vLLM
            (each row a vLLM request with its agent's LoRA; `chunk_tokens` unused).

    Returns:
        A `TeamServer`: `base_url` (`http://127.0.0.1:<port>/v1`) and `close()`; a context manager.

    Raises:
        ImportError: FastAPI or uvicorn is missing (`pip install "trl-marl[serve]"`).
    """
    from .server import serve_team as start

    return start(
        team_or_path,
        host=host,
        port=port,
        api_key=api_key,
        max_batch_rows=max_batch_rows,
        chunk_tokens=chunk_tokens,
        max_tokens=max_tokens,
        max_body_bytes=max_body_bytes,
        max_request_rows=max_request_rows,
        allowed_hosts=allowed_hosts,
        allowed_origins=allowed_origins,
        log_level=log_level,
        **load_options,
    )
