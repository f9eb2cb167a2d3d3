"""The server process: a team loaded (or given), its `BatchingEngine` started, the app served by uvicorn on a
loopback port, either in a thread (`serve_team`, a `TeamServer` handle) or in the foreground (`trl-marl serve`)."""

import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .engine import BatchingEngine

SERVE_EXTRA_HINT = 'pip install "trl-marl[serve]"'


def require_serving_packages(*more: str) -> None:
    """Import FastAPI and uvicorn (and the packages `more` names, of the same extra), or say how to install them."""
    missing = []
    for package in ("fastapi", "uvicorn", *more):
        try:
            __import__(package)
        except ImportError:
            missing.append(package)
    if missing:
        raise ImportError(
            f"Serving a team needs {' and '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not "
            f"installed: {SERVE_EXTRA_HINT} "
            "(FastAPI, uvicorn and the `openai` client)."
        )


def bound_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on `host:port` (0: a free port, read back from the socket)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class TeamServer:
    """A team served over HTTP: `base_url` (`http://host:port/v1`, what OpenAI clients take), `close()` (also as a
    context manager). Built by `serve_team`."""

    def __init__(
        self,
        team: Any,
        engine: BatchingEngine,
        server: Any,
        sock: socket.socket,
        owns_team: bool,
        tokenizing: ThreadPoolExecutor | None = None,
    ):
        self.team, self.engine, self._server, self._socket, self._owns_team = team, engine, server, sock, owns_team
        self._tokenizing = tokenizing
        host, port = sock.getsockname()[:2]
        self.host, self.port = host, port
        self.base_url = f"http://{host if ':' not in host else f'[{host}]'}:{port}/v1"
        self._thread: threading.Thread | None = None

    @property
    def root_url(self) -> str:
        """`http://host:port`, the server's address without `/v1`."""
        return self.base_url.removesuffix("/v1")

    def _start_in_thread(self) -> None:
        failure = []

        def run() -> None:
            try:
                self._server.run(sockets=[self._socket])
            except BaseException as error:  # reported to the caller below when it happens while starting
                failure.append(error)

        self._thread = threading.Thread(target=run, name="trl-marl-serving-http", daemon=True)
        self._thread.start()
        while not self._server.started and self._thread.is_alive():
            self._thread.join(0.02)
        if not self._server.started:
            self.close()
            raise RuntimeError(f"The server did not start: {failure[0] if failure else 'unknown reason'}")

    def close(self) -> None:
        """Stop serving, stop the engine and, when `serve_team` loaded the team, free it (`Team.close`)."""
        if self._thread is not None:
            self._server.should_exit = True
            self._thread.join()
            self._thread = None
        self.engine.close()
        if self._tokenizing is not None:
            self._tokenizing.shutdown(wait=False)
        self._socket.close()
        if self._owns_team:
            self.team.close()
            self._owns_team = False

    def __enter__(self) -> "TeamServer":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def batching_engine(team: Any, **settings: Any) -> BatchingEngine:
    """The engine that batches `team`'s rows (`settings`: `BatchingEngine`'s): vLLM's when the team generates with
    vLLM (`team.engine`: loaded with `use_vllm=True`, or a trainer's vLLM engine), else transformers'."""
    if team.engine is not None:
        from .vllm_engine import VLLMBatchingEngine

        return VLLMBatchingEngine(team, **settings)
    return BatchingEngine(team, **settings)


def prepare_server(
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
) -> TeamServer:
    """The team (loaded with `load_team(team_or_path, **load_options)` unless a `Team` is given), its engine started,
    and a uvicorn server bound to its socket, not yet serving. Raises ImportError without the `serve` extra."""
    require_serving_packages()
    for name, value in {"max_request_rows": max_request_rows, "max_body_bytes": max_body_bytes}.items():
        if value is not None and value < 1:
            raise ValueError(f"`{name}` must be at least 1, got {value}.")

    from ..team.saved import Team, load_team
    from .app import MAX_BODY_BYTES, MAX_REQUEST_ROWS, ServingSettings

    if isinstance(team_or_path, Team):
        if load_options:
            raise ValueError(
                f"serve_team got a loaded Team and loading options {sorted(load_options)}: pass the team's folder "
                "or Hub id to load it with them, or the Team alone."
            )
        team, owns_team = team_or_path, False
    else:
        team, owns_team = load_team(team_or_path, **load_options), True
    engine = batching_engine(team, max_batch_rows=max_batch_rows, chunk_tokens=chunk_tokens)
    settings = ServingSettings(
        api_key=api_key,
        max_body_bytes=MAX_BODY_BYTES if max_body_bytes is None else max_body_bytes,
        max_tokens=max_tokens,
        max_request_rows=MAX_REQUEST_ROWS if max_request_rows is None else max_request_rows,
        allowed_hosts=tuple(allowed_hosts),
        allowed_origins=tuple(allowed_origins),
    )
    return bind_server(engine, settings, host=host, port=port, log_level=log_level, owns_team=owns_team)


def bind_server(
    engine: BatchingEngine,
    settings: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    log_level: str = "warning",
    owns_team: bool = False,
) -> TeamServer:
    """The app over `engine` (its `ServingSettings`) and a uvicorn server bound to a socket, not yet serving; the
    engine started. Raises ImportError without the `serve` extra."""
    require_serving_packages()
    import uvicorn

    from .app import build_app

    tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trl-marl-serving-tokenize")
    app = build_app(engine, settings, tokenizing)
    sock = bound_socket(host, port)
    config = uvicorn.Config(app, log_level=log_level, lifespan="off", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    engine.start()
    return TeamServer(engine.team, engine, server, sock, owns_team, tokenizing)


def serve_team(team_or_path: Any, **options: Any) -> TeamServer:
    """Serve a team behind an OpenAI-compatible endpoint from a background thread; see `trl_marl.serving`."""
    handle = prepare_server(team_or_path, **options)
    handle._start_in_thread()
    return handle


def serve_forever(team_or_path: Any, **options: Any) -> None:
    """`trl-marl serve`: serve in the foreground, printing the base URL once listening, until SIGINT or SIGTERM."""
    handle = prepare_server(team_or_path, **options)
    agents = ", ".join(handle.team.agent_names)
    # the base URL stays last on the line: scripts read it from there
    access = "an API key is required" if options.get("api_key") else "no API key: any local program may call it"
    print(f"trl-marl serve ({access}): agents {agents} at {handle.base_url}", flush=True)
    try:
        handle._server.run(sockets=[handle._socket])
    finally:
        handle.close()
