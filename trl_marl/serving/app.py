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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from ..agents import agent_prompt
from ..team_bases import tokenize_text_prompts
from .access import AccessGuard, check_api_key
from .engine import BatchingEngine, EngineStopped
from .episodes import EpisodeBook
from .requests import (
    MIN_SAMPLING_TEMPERATURE,
    APIError,
    GenerationRequest,
    read_chat_request,
    read_completion_request,
)
from .responses import TextStream, chat_logprobs, completion_body, completion_logprobs, server_sent_event, usage
from .rows import GeneratedRow, RowRequest
from .tokens import TokenPieces

MAX_BODY_BYTES = 4 * 1024 * 1024
MAX_REQUEST_ROWS = 128  # a request's completions (prompts x `n`), as OpenAI bounds `n`
# A request's log-probabilities: its completion tokens (rows x `max_tokens`) x (1 + `top_logprobs`). At about 90 bytes
# of JSON each, 2^17 of them make a body of about 12 MB.
MAX_LOGPROB_ENTRIES = 2**17
# A prompt longer than this many characters per token of the context is measured by tokenising that much of it first.
PREFIX_CHARACTERS_PER_TOKEN = 16
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
    token_bytes = {id(base.tokenizer): longest_token_bytes(base.tokenizer) for base in team.bases}
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

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        authorize(request)
        return await answer(request, read_chat_request(await read_json(request, settings.max_body_bytes)))

    @app.post("/v1/completions")
    async def completions(request: Request):
        authorize(request)
        return await answer(request, read_completion_request(await read_json(request, settings.max_body_bytes)))

    # An episode's own base URL (training on agent programs, `serving.episodes`): the same endpoints, recorded.
    @app.get("/episodes/{episode}/v1/models")
    async def episode_models(episode: str, request: Request) -> dict:
        return await list_models(request)

    @app.get("/episodes/{episode}/v1/models/{model:path}")
    async def episode_model(episode: str, model: str, request: Request) -> dict:
        return await get_model(model, request)

    @app.post("/episodes/{episode}/v1/chat/completions")
    async def episode_chat_completions(episode: str, request: Request):
        authorize(request)
        return await episode_answer(request, episode, read_chat_request)

    @app.post("/episodes/{episode}/v1/completions")
    async def episode_completions(episode: str, request: Request):
        authorize(request)
        return await episode_answer(request, episode, read_completion_request)

    async def episode_answer(request: Request, episode: str, read_request):
        """An episode's call; a refused or failed one is noted in its episode (the trainer's error names it)."""
        book, parsed = settings.episodes, None
        number = book.received(episode) if book is not None else 0
        try:
            parsed = read_request(await read_json(request, settings.max_body_bytes))
            return await answer(request, parsed, episode)
        except APIError as error:
            if book is not None:
                book.note_failure(episode, number, getattr(parsed, "model", None), error)
            raise

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

    def row_requests(parsed: GenerationRequest) -> tuple[list[RowRequest], int]:
        """The engine's rows of a request (`n` per prompt) and its prompt tokens. Renders and tokenises: called off
        the event loop (`tokenizing`)."""
        agent = agent_index(parsed.model)
        prompt_count = len(parsed.prompts) if parsed.kind == "completion" else 1
        if prompt_count * parsed.n > settings.max_request_rows:
            raise APIError(
                400,
                f"The request asks for {prompt_count * parsed.n} completions ({prompt_count} prompt(s), n = "
                f"{parsed.n}), more than this server's limit of {settings.max_request_rows} per request: send fewer "
                "prompts, a smaller `n`, or several requests.",
                param="n" if prompt_count == 1 else "prompt",
            )
        tokenizer = engine.tokenizer_of(agent)
        check_fits_before_tokenising(parsed, tokenizer, token_bytes[id(tokenizer)], engine.context_length(agent))
        prompts = parsed.prompts
        if parsed.kind == "chat":  # the agent's role as training and `Team.run` put it (merged into a system message)
            use_chat_template = getattr(tokenizer, "chat_template", None) is not None
            prompts = [agent_prompt(team.agents[agent].get("system_prompt") or "", parsed.prompts, use_chat_template)]
        try:
            kwargs = (team.spec.get("chat_template_kwargs") or {}) if parsed.kind == "chat" else {}
            prompt_ids, _, _ = tokenize_text_prompts(tokenizer, kwargs, None, prompts)
        except Exception as error:  # a chat template that refuses the conversation (roles, order)
            param = "messages" if parsed.kind == "chat" else "prompt"
            raise APIError(400, f"The prompt cannot be rendered for `{parsed.model}`: {error}", param=param) from error
        if any(not ids for ids in prompt_ids):  # nothing to condition on: `generate` cannot start from no token
            raise APIError(
                400, "The prompt is empty: it renders to no tokens. Send at least one character.", param="prompt"
            )
        max_tokens = completion_budget(parsed, prompt_ids, engine.context_length(agent), default_max_tokens)
        check_logprob_entries(parsed, len(prompt_ids) * parsed.n * max_tokens, settings.max_logprob_entries)
        temperature = default_temperature if parsed.temperature is None else parsed.temperature
        if temperature < MIN_SAMPLING_TEMPERATURE:  # as vLLM: below it, sampling is the argmax (and would overflow)
            temperature = 0.0
        top_p = default_top_p if parsed.top_p is None else parsed.top_p
        requests = [
            RowRequest(
                agent,
                list(ids),
                max_tokens,
                temperature=temperature,
                top_p=top_p,
                seed=None if parsed.seed is None else parsed.seed + choice,
                stop=parsed.stop,
                top_logprobs=parsed.top_logprobs or 0,
            )
            for ids in prompt_ids
            for choice in range(parsed.n)
        ]
        return requests, sum(len(ids) for ids in prompt_ids)

    async def answer(request: Request, parsed: GenerationRequest, episode: str | None = None):
        admit(parsed, episode)
        requests, prompt_tokens = await asyncio.get_running_loop().run_in_executor(tokenizing, row_requests, parsed)
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
        prefix = "chatcmpl" if parsed.kind == "chat" else "cmpl"
        completion_id, created = f"{prefix}-{uuid.uuid4().hex}", int(time.time())
        tokens = pieces[id(engine.tokenizer_of(requests[0].agent))]
        # where each row's text offsets start (text completions): its prompt's length
        chat = parsed.kind == "chat"
        prompt_chars = [0] * len(rows) if chat else [len(prompt) for prompt in parsed.prompts for _ in range(parsed.n)]
        if parsed.stream:
            stream = stream_events(
                parsed, rows, events, completion_id, created, prompt_tokens, tokens, prompt_chars, episode
            )
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
            built = completion_body(
                parsed.kind, completion_id, created, parsed.model, rows, prompt_tokens, tokens, logprobs, prompt_chars
            )
            return json.dumps(built, ensure_ascii=False).encode()

        return Response(await asyncio.to_thread(body), media_type="application/json")

    async def stream_events(
        parsed, rows, events, completion_id, created, prompt_tokens, tokens, prompt_chars, episode=None
    ):
        chat = parsed.kind == "chat"
        head = {
            "id": completion_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": parsed.model,
        }

        def chunk(index: int, text: str, logprobs=None, finish_reason=None, role: bool = False) -> str:
            if chat:
                delta = {"role": "assistant", "content": text} if role else ({"content": text} if text else {})
                choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            else:
                choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
            return server_sent_event({**head, "choices": [choice]})

        position = {id(row): index for index, row in enumerate(rows)}
        streams = [TextStream(engine.decoder_of(row.request.agent), parsed.stop) for row in rows]
        try:
            if chat:
                for index in range(len(rows)):
                    yield chunk(index, "", role=True)
            finished = set()
            while len(finished) < len(rows):
                row = await events.get()
                index = position[id(row)]
                if index in finished:
                    continue
                if row.finish_reason in ("error", "cancelled"):  # a failure, or the server shutting down
                    yield server_sent_event(unanswered(row).body())
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
                if text or logprobs is not None:
                    yield chunk(index, text, logprobs)
                if done:
                    finished.add(index)
                    yield chunk(index, "", finish_reason=row.finish_reason)
            if episode is not None:
                settings.episodes.record(episode, parsed, rows)
            if parsed.include_usage:  # as OpenAI: the usage chunk (with no choices) only when asked for
                yield server_sent_event({**head, "choices": [], "usage": usage(prompt_tokens, rows)})
            yield server_sent_event("[DONE]")
        finally:  # the client went away (or the stream failed): stop generating for it
            engine.cancel([row for row in rows if not row.done])

    return AccessGuard(app, settings.allowed_hosts, settings.allowed_origins)


def longest_token_bytes(tokenizer) -> int:
    """An upper bound on the UTF-8 bytes of text one token stands for: its longest vocabulary entry's (an entry's
    characters take at least as many bytes as the text it decodes to: byte-level BPE's byte characters, SentencePiece's
    `▁` and `<0xNN>`), special and added tokens included."""
    return max(len(piece.encode()) for piece in tokenizer.get_vocab())


def fewest_tokens(text: str, tokenizer, token_bytes: int, context: int) -> int:
    """A lower bound on the tokens of `text`, at a bounded cost whatever its length: its UTF-8 bytes over the most one
    token stands for (`token_bytes`; halved, for normalisers that shorten text, NFKC's ligatures), else, for a text
    longer than `PREFIX_CHARACTERS_PER_TOKEN` characters per token of `context`, the tokens of that much of it (less
    one: the cut may split a word in two). A shorter text gets the first bound alone: tokenising it is cheap."""
    bound = len(text.encode()) // (2 * token_bytes)
    prefix = text[: PREFIX_CHARACTERS_PER_TOKEN * context]
    if bound >= context or len(prefix) == len(text):
        return bound
    return max(bound, len(tokenizer(prefix, add_special_tokens=False)["input_ids"]) - 1)


def check_fits_before_tokenising(parsed: GenerationRequest, tokenizer, token_bytes: int, context: int) -> None:
    """Refuse (400, `context_length_exceeded`) a prompt whose text alone cannot fit the context (`fewest_tokens`),
    before its chat template and tokenisation: a body of megabytes costs a few milliseconds."""
    texts = ["".join(m["content"] for m in parsed.prompts)] if parsed.kind == "chat" else parsed.prompts
    fewest = max(fewest_tokens(text, tokenizer, token_bytes, context) for text in texts)
    if fewest >= context:
        param = "messages" if parsed.kind == "chat" else "prompt"
        raise APIError(
            400,
            f"This model's maximum context length is {context} tokens. However, the {param} alone is at least "
            f"{fewest} tokens. Please reduce the length of the {param}.",
            param=param,
            code="context_length_exceeded",
        )


def check_logprob_entries(parsed: GenerationRequest, completion_tokens: int, limit: int) -> None:
    """Refuse (400, naming `top_logprobs` and `max_tokens`) a request whose log-probabilities could pass `limit`
    values: its completion tokens (rows x `max_tokens`) times 1 + `top_logprobs`."""
    if parsed.top_logprobs is None:
        return
    entries = completion_tokens * (1 + parsed.top_logprobs)
    if entries > limit:
        name = "top_logprobs" if parsed.kind == "chat" else "logprobs"
        raise APIError(
            400,
            f"The request may return {entries} log-probabilities ({completion_tokens} completion tokens: the rows "
            f"times `max_tokens`, each with 1 + `{name}` = {1 + parsed.top_logprobs} values), more than this "
            f"server's limit of {limit}: lower `{name}`, `max_tokens` or `n`.",
            param=name,
            code="logprobs_too_large",
        )


def completion_budget(parsed: GenerationRequest, prompt_ids: list[list[int]], context: int, default: int) -> int:
    """The completion length of a request's rows: its `max_tokens`, which must fit the context with the longest
    prompt, else the default cut to what fits. Raises `APIError` (400, `context_length_exceeded`)."""
    longest = max(len(ids) for ids in prompt_ids)
    param = "messages" if parsed.kind == "chat" else "prompt"
    requested = parsed.max_tokens if parsed.max_tokens is not None else 1
    if longest + requested > context:
        raise APIError(
            400,
            f"This model's maximum context length is {context} tokens. However, you requested {longest + requested} "
            f"tokens ({longest} in the {param}, {requested} for the completion). Please reduce the length of the "
            f"{param} or the completion.",
            param=param,
            code="context_length_exceeded",
        )
    return parsed.max_tokens if parsed.max_tokens is not None else min(default, context - longest)


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
