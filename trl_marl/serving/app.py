"""The ASGI app (FastAPI): OpenAI's endpoints over a `BatchingEngine`, each agent of the team a model.

`GET /v1/models` lists the agents; `POST /v1/chat/completions` renders the messages with the agent's base tokenizer's
chat template (the agent's system prompt from team.json first, merged into the messages' own system message as
`trl_marl.agents.agent_prompt` does for training and `Team.run`) and
`POST /v1/completions` takes raw prompts; `stream: true` answers with server-sent events ending in `data: [DONE]`.
Every error is in OpenAI's format (`requests.APIError`), and none stops the server. `GET /health` needs no key.

The event loop only moves bytes: rendering and tokenising a prompt run on a thread of their own (one, as tokenizers are
not shared safely between threads), and a large response body is built and serialised on another, so that one big
request never holds up the others (or `/health`). A prompt that cannot fit the context is refused by its size before
it is tokenised (`fewest_tokens`).
"""

import asyncio
import json
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from .access import AccessGuard, check_api_key
from .engine import BatchingEngine, EngineStopped
from .episodes import EpisodeBook
from .prompts import PromptRenderer
from .requests import (
    APIError,
    GenerationRequest,
    read_chat_request,
    read_completion_request,
)
from .responses import TextStream, chat_logprobs, completion_body, completion_logprobs, server_sent_event, usage
from .responses_api import (
    ResponseEvents,
    ResponsesRequest,
    new_id,
    output_items,
    read_responses_request,
    response_object,
)
from .rows import GeneratedRow
from .tokens import TokenPieces

MAX_BODY_BYTES = 4 * 1024 * 1024
MAX_REQUEST_ROWS = 128  # a request's completions (prompts x `n`), as OpenAI bounds `n`
# A request's log-probabilities: its completion tokens (rows x `max_tokens`) x (1 + `top_logprobs`). At about 90 bytes
# of JSON each, 2^17 of them make a body of about 12 MB.
MAX_LOGPROB_ENTRIES = 2**17
DISCONNECT_POLL_SECONDS = 0.25  # how often a waiting non-streamed request checks that its client is still there


@dataclass
class ServingSettings:
    """The app's settings.

    Args:
        api_key: when set, every `/v1` request must send `Authorization: Bearer <api_key>`.
        max_body_bytes: a larger request body is refused (413).
        max_tokens: a request's completion length when it sets none; None is team.json's `max_completion_length`.
        max_request_rows: a request asking for more completions (its prompts times `n`) is refused (400).
        max_logprob_entries: a request whose log-probabilities could exceed this many values (its completion tokens
            times 1 + `top_logprobs`) is refused (400).
        allowed_hosts: names the server answers to besides its own address (`access.AccessGuard`; "*": any).
        allowed_origins: web origins allowed to call it (`access.AccessGuard`; "*": any).
        episodes: while a trainer rolls out agent programs: the open episodes. Requests are then answered only
            through an episode's base URL (`/episodes/<key>/v1`), sample as the trainer does, and are recorded.
    """

    api_key: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    max_tokens: int | None = None
    max_request_rows: int = MAX_REQUEST_ROWS
    max_logprob_entries: int = MAX_LOGPROB_ENTRIES
    allowed_hosts: tuple[str, ...] = field(default_factory=tuple)
    allowed_origins: tuple[str, ...] = field(default_factory=tuple)
    episodes: EpisodeBook | None = None


def build_app(engine: BatchingEngine, settings: ServingSettings, tokenizing: ThreadPoolExecutor):
    """The server's ASGI app over a started `engine`: FastAPI's, behind the `access.AccessGuard`. Prompts are rendered
    and tokenised on `tokenizing` (one thread; the caller shuts it down)."""
    settings = settings or ServingSettings()
    team = engine.team
    agents = {name: index for index, name in enumerate(team.agent_names)}
    default_max_tokens = settings.max_tokens or team.spec["max_completion_length"]
    # A request without sampling settings samples as the team trained (team.json), else as OpenAI does.
    default_temperature = team.spec.get("temperature")
    default_temperature = 1.0 if default_temperature is None else float(default_temperature)
    default_top_p = float(team.spec.get("top_p") or 1.0)
    started = int(time.time())
    pieces = {id(base.tokenizer): TokenPieces(base.tokenizer) for base in team.bases}
    renderer = PromptRenderer(
        engine,
        settings.max_request_rows,
        settings.max_logprob_entries,
        default_max_tokens,
        default_temperature,
        default_top_p,
    )
    app = FastAPI(title="trl-marl team", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:  # unknown paths, methods
        message = f"{request.method} {request.url.path}: {error.detail}"
        return JSONResponse(APIError(error.status_code, message).body(), status_code=error.status_code)

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, error: Exception) -> JSONResponse:  # logged by the server too
        failure = APIError(500, f"The server failed: {type(error).__name__}: {error}", code="internal_error")
        return JSONResponse(failure.body(), status_code=500)

    def authorize(request: Request) -> None:
        check_api_key(request.headers, settings.api_key)

    def model_entry(name: str) -> dict:
        return {"id": name, "object": "model", "created": started, "owned_by": "trl-marl"}

    def agent_index(model: str) -> int:
        if model not in agents:
            raise APIError(
                404,
                f"The model `{model}` does not exist: this team's agents are {', '.join(agents)}.",
                param="model",
                code="model_not_found",
            )
        return agents[model]

    @app.get("/health")
    async def health() -> JSONResponse:
        # 503 once the engine's thread is not running (closed, or stopped by a failure): nothing would be answered
        body = {"status": "ok" if engine.alive else "unavailable", "agents": team.agent_names, **engine.stats()}
        if engine.failure is not None:
            body["error"] = f"{type(engine.failure).__name__}: {engine.failure}"
        return JSONResponse(body, status_code=200 if engine.alive else 503)

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict:
        authorize(request)
        return {"object": "list", "data": [model_entry(name) for name in agents]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str, request: Request) -> dict:
        authorize(request)
        agent_index(model)
        return model_entry(model)

    def read_any(kind: str, body):
        """The body of a `kind` request ("chat", "completion", "responses") as `answer` takes it: the chat or
        completion request, and for the Responses API what its response repeats."""
        if kind == "responses":
            responses = read_responses_request(body)
            return responses.chat, responses
        return (read_chat_request(body) if kind == "chat" else read_completion_request(body)), None

    async def serve(request: Request, kind: str, episode: str | None = None):
        """A generation request of `kind`, through `/v1` or (`episode`) an episode's base URL; an episode's refused or
        failed request is noted in its episode (the trainer's error names it)."""
        authorize(request)
        book, parsed = settings.episodes, None
        number = book.received(episode) if book is not None and episode is not None else 0

        def noted(error: APIError) -> None:  # what the program's call got: the trainer's error names it
            if book is not None and episode is not None:
                book.note_failure(episode, number, getattr(parsed, "model", None), error)

        try:
            parsed, responses = read_any(kind, await read_json(request, settings.max_body_bytes))
            return await answer(request, parsed, episode, responses, noted)
        except APIError as error:
            noted(error)
            raise
        except Exception as error:  # answered 500 by `unexpected_error`
            noted(APIError(500, f"The server failed: {type(error).__name__}: {error}", code="internal_error"))
            raise

    def endpoints(kind: str):
        async def endpoint(request: Request):
            return await serve(request, kind)

        async def episode_endpoint(episode: str, request: Request):
            return await serve(request, kind, episode)

        return endpoint, episode_endpoint

    # The generation endpoints, at /v1 and at an episode's own base URL (training on agent programs,
    # `serving.episodes`: the same endpoints, recorded).
    for path, kind in (("chat/completions", "chat"), ("completions", "completion"), ("responses", "responses")):
        endpoint, episode_endpoint = endpoints(kind)
        app.add_api_route(f"/v1/{path}", endpoint, methods=["POST"])
        app.add_api_route(f"/episodes/{{episode}}/v1/{path}", episode_endpoint, methods=["POST"])

    @app.get("/episodes/{episode}/v1/models")
    async def episode_models(episode: str, request: Request) -> dict:
        return await list_models(request)

    @app.get("/episodes/{episode}/v1/models/{model:path}")
    async def episode_model(episode: str, model: str, request: Request) -> dict:
        return await get_model(model, request)

    def admit(parsed: GenerationRequest, episode: str | None) -> None:
        """During training, a request must come from an open episode, and takes the trainer's sampling."""
        book = settings.episodes
        if book is None:
            if episode is not None:
                raise APIError(404, "This server is not training: it has no episodes; send requests to /v1.")
            return
        if episode is None:
            raise APIError(
                403,
                "This server is training a team: every request must come from an episode, through the client its "
                "episode function was given (a base URL ending in /episodes/<key>/v1).",
                code="episode_required",
            )
        agent_index(parsed.model)  # an unknown agent is a 404 before the episode counts the call
        book.admit(episode, parsed)

    async def answer(
        request: Request,
        parsed: GenerationRequest,
        episode: str | None = None,
        responses: ResponsesRequest | None = None,
        noted: Callable[[APIError], None] = lambda error: None,
    ):
        """Generate a request's rows and answer: a chat or text completion, or (`responses`) a Responses API
        response; streamed as server-sent events when the request asks. A stream's failure is told to `noted` (a
        failure before it is raised)."""
        admit(parsed, episode)
        agent = agent_index(parsed.model)
        rendered = await asyncio.get_running_loop().run_in_executor(tokenizing, renderer.rows_of, parsed, agent)
        requests, prompt_tokens, reader = rendered.rows, rendered.prompt_tokens, rendered.reader
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def listener(row: GeneratedRow, finished: bool) -> None:
            if finished or parsed.stream:
                try:
                    loop.call_soon_threadsafe(events.put_nowait, row)
                except RuntimeError:  # the server's loop has closed
                    pass

        if not engine.alive:  # its thread has stopped: refuse now rather than wait for rows it will not generate
            raise unavailable(engine)
        try:
            rows = engine.submit(requests, listener)
        except EngineStopped as error:
            raise unavailable(engine, str(error)) from error
        tokens = pieces[id(engine.tokenizer_of(agent))]
        # where each row's text offsets start (text completions): its prompt's length
        chat = parsed.kind == "chat"
        prompt_chars = [0] * len(rows) if chat else [len(prompt) for prompt in parsed.prompts for _ in range(parsed.n)]
        if parsed.stream:
            deltas = choice_deltas(parsed, rows, events, reader, tokens, prompt_chars)
            if responses is not None:
                stream = responses_stream(parsed, responses, rows, deltas, prompt_tokens, episode, noted)
            else:
                stream = completion_stream(parsed, rows, deltas, prompt_tokens, episode, noted)
            return StreamingResponse(stream, media_type="text/event-stream")
        try:
            while not all(row.done for row in rows):
                try:
                    await asyncio.wait_for(events.get(), DISCONNECT_POLL_SECONDS)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return None
        finally:
            engine.cancel([row for row in rows if not row.done])
        raise_failure(rows)
        if episode is not None:
            settings.episodes.record(episode, parsed, rows)
        logprobs = parsed.top_logprobs is not None

        def body() -> bytes:  # off the event loop: a body with log-probabilities may be megabytes
            messages = [
                reader.message(row.completion_ids, row.request.prompt_ids, row.text, row.finish_reason) for row in rows
            ]
            if responses is not None:
                content, calls = messages[0]
                status, incomplete = (
                    ("incomplete", "max_output_tokens") if rows[0].finish_reason == "length" else ("completed", None)
                )
                built = response_object(
                    new_id("resp"), int(time.time()), parsed.model, responses.echo, status,
                    output_items(content, calls), usage(prompt_tokens, rows), incomplete,
                )  # fmt: skip
            else:
                prefix = "chatcmpl" if chat else "cmpl"
                built = completion_body(
                    parsed.kind, f"{prefix}-{uuid.uuid4().hex}", int(time.time()), parsed.model, rows, prompt_tokens,
                    tokens, logprobs, prompt_chars, messages,
                )  # fmt: skip
            return json.dumps(built, ensure_ascii=False).encode()

        return Response(await asyncio.to_thread(body), media_type="application/json")

    async def choice_deltas(parsed, rows, events, reader, tokens, prompt_chars):
        """The stream of a request's choices as they are generated, in the chat path's terms: `("text", index, text,
        logprobs)` (the content, or a completion's text), `("tool_call", index, delta)` (OpenAI's tool-call delta),
        `("finish", index, reason)`, and `("error", APIError)` as the last when a row failed or was cancelled."""
        chat = parsed.kind == "chat"
        position = {id(row): index for index, row in enumerate(rows)}
        streams = [TextStream(engine.decoder_of(row.request.agent), parsed.stop) for row in rows]
        calls = [reader.stream(row.request.prompt_ids) for row in rows] if chat and reader.reads_tool_calls else None
        written = [""] * len(rows)  # each row's text so far, tool-call markup included
        finished = set()
        while len(finished) < len(rows):
            row = await events.get()
            index = position[id(row)]
            if index in finished:
                continue
            if row.finish_reason in ("error", "cancelled"):  # a failure, or the server shutting down
                yield ("error", unanswered(row))
                return
            stream, done = streams[index], row.done
            text = stream.delta(row)
            end = stream.tokens_sent_whole(row)
            logprobs = None
            if parsed.top_logprobs is not None and end > stream.tokens_sent:
                if chat:
                    logprobs = chat_logprobs(tokens, row, stream.tokens_sent, end)
                else:
                    logprobs = completion_logprobs(tokens, row, stream.tokens_sent, end, prompt_chars[index])
                stream.tokens_sent = end
            finish_reason = row.finish_reason
            call_deltas = []
            if calls is not None:  # the content around the calls, and each call once it is whole
                written[index] += text
                ended = finish_reason if done else None  # None: the answer is still being written
                text, call_deltas = calls[index].deltas(
                    row.completion_ids, row.text if done else written[index], ended
                )
                if done and calls[index].calls_sent and finish_reason == "stop":
                    finish_reason = "tool_calls"
            if text or logprobs is not None:
                yield ("text", index, text, logprobs)
            for delta in call_deltas:
                yield ("tool_call", index, delta)
            if done:
                finished.add(index)
                yield ("finish", index, finish_reason)

    async def completion_stream(parsed, rows, deltas, prompt_tokens, episode, noted):
        """Chat completion chunks (`chat.completion.chunk`) or text completion ones, ending with `data: [DONE]`."""
        chat = parsed.kind == "chat"
        head = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": parsed.model,
        }

        def chunk(index: int, delta: dict, logprobs=None, finish_reason=None) -> str:
            if chat:
                choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            else:
                text = delta.get("content", "")
                choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
            return server_sent_event({**head, "choices": [choice]})

        try:
            if chat:
                for index in range(len(rows)):
                    yield chunk(index, {"role": "assistant", "content": ""})
            async for kind, *event in deltas:
                if kind == "error":
                    noted(event[0])
                    yield server_sent_event(event[0].body())
                    return
                if kind == "text":
                    index, text, logprobs = event
                    yield chunk(index, {"content": text} if text else {}, logprobs)
                elif kind == "tool_call":
                    index, delta = event
                    yield chunk(index, {"tool_calls": [delta]})
                else:
                    index, finish_reason = event
                    yield chunk(index, {}, finish_reason=finish_reason)
            if episode is not None:
                settings.episodes.record(episode, parsed, rows)
            if parsed.include_usage:  # as OpenAI: the usage chunk (with no choices) only when asked for
                yield server_sent_event({**head, "choices": [], "usage": usage(prompt_tokens, rows)})
            yield server_sent_event("[DONE]")
        finally:  # the client went away (or the stream failed): stop generating for it
            engine.cancel([row for row in rows if not row.done])

    async def responses_stream(parsed, responses, rows, deltas, prompt_tokens, episode, noted):
        """The Responses API's events of one answer (`responses_api.ResponseEvents`)."""
        stream = ResponseEvents(parsed.model, responses.echo)
        finish_reason = "stop"
        try:
            for event in stream.start():
                yield event
            async for kind, *event in deltas:
                if kind == "error":
                    noted(event[0])
                    for failed in stream.failure(event[0]):
                        yield failed
                    return
                if kind == "text" and event[1]:
                    pieces_out = stream.content(event[1])
                elif kind == "tool_call":
                    pieces_out = stream.tool_call(event[1])
                else:
                    pieces_out = []
                    if kind == "finish":
                        finish_reason = event[1]
                for piece in pieces_out:
                    yield piece
            if episode is not None:
                settings.episodes.record(episode, parsed, rows)
            for piece in stream.finish(usage(prompt_tokens, rows), finish_reason):
                yield piece
        finally:
            engine.cancel([row for row in rows if not row.done])

    return AccessGuard(app, settings.allowed_hosts, settings.allowed_origins)


def failure(row: GeneratedRow) -> APIError:
    return APIError(500, f"Generation failed: {type(row.error).__name__}: {row.error}", code="generation_failed")


def unavailable(engine: BatchingEngine, reason: str | None = None) -> APIError:
    if engine.failure is not None:
        reason = f"{type(engine.failure).__name__}: {engine.failure}"
    return APIError(
        503, f"The server's engine is not running ({reason or 'it is shutting down'}).", code="engine_unavailable"
    )


def unanswered(row: GeneratedRow) -> APIError:
    """The error of a row that is not answered: it failed (500), or the server cancelled it, shutting down (503)."""
    if row.finish_reason == "error":
        return failure(row)
    return APIError(503, "The request was cancelled: the server is shutting down.", code="server_shutting_down")


def raise_failure(rows: list[GeneratedRow]) -> None:
    """Raise the `APIError` of the first row that was not answered (`unanswered`), if any."""
    for row in rows:
        if row.finish_reason in ("error", "cancelled"):
            raise unanswered(row)


async def read_json(request: Request, max_bytes: int):
    """The request's body as JSON, read up to `max_bytes` (413 past it; 400 when it is not JSON)."""
    declared = request.headers.get("content-length")
    too_large = APIError(413, f"The request body is larger than this server's limit of {max_bytes} bytes.")
    too_large.code = "request_too_large"
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    body, size = [], 0
    async for piece in request.stream():
        size += len(piece)
        if size > max_bytes:
            raise too_large
        body.append(piece)
    try:
        return json.loads(b"".join(body))
    except (ValueError, UnicodeDecodeError) as error:
        raise APIError(400, f"The request body is not valid JSON: {error}", code="invalid_json") from error
    except RecursionError:
        raise APIError(400, "The request body is not valid JSON: it nests too deeply.", code="invalid_json") from None
