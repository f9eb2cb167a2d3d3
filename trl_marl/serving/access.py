"""Who may call the server: the API key, and the checks that keep web pages out.

A server on a user's laptop is reachable by every web page the user opens: a page may POST to `127.0.0.1` (a
"simple" cross-origin request: `Content-Type: text/plain`, no preflight), or rebind a name of its own to `127.0.0.1`
(DNS rebinding) and then read the answers. So, whatever the API key, every request must:

- name in `Host` an address the server answers on (the address its connection reached, `localhost` on loopback) or a
  host the user allowed (`allowed_hosts`; `"*"` allows any);
- carry no `Origin`, or the server's own, or one the user allowed (`allowed_origins`; `"*"` allows any): browsers
  send `Origin` with every cross-origin POST, programs (the `openai` client, LangChain, the Agents SDK) send none;
- send a POST body as `application/json`, which no page can send to another origin without a preflight that this
  server does not answer.

The API key comes from `serve_team(api_key=...)`, or on the command line from `--api_key_file`, the `TRL_MARL_API_KEY`
environment variable, or `--api_key` (visible to every local user in the process list).
"""

import hmac
import ipaddress
import json
import os
from collections.abc import Iterable

from .errors import APIError

API_KEY_ENVIRONMENT = "TRL_MARL_API_KEY"
LOOPBACK_NAMES = ("localhost",)


def api_key_from(api_key: str | None, api_key_file: str | None) -> str | None:
    """The key a `trl-marl serve` command line gives: the first line of `--api_key_file`, or `--api_key` (not both),
    else `$TRL_MARL_API_KEY`, else None (no key). Raises ValueError for both, or an empty or unreadable key file."""
    if api_key is not None and api_key_file is not None:
        raise ValueError("--api_key and --api_key_file both give a key: give one.")
    if api_key_file is not None:
        try:
            with open(api_key_file, encoding="utf-8") as handle:
                key = handle.readline().strip()
        except OSError as error:
            raise ValueError(f"--api_key_file {api_key_file}: cannot read it ({error.strerror}).") from None
        if not key:
            raise ValueError(f"--api_key_file {api_key_file}: its first line is empty; write the key there.")
        return key
    if api_key is not None:
        if not api_key.strip():
            raise ValueError("--api_key is empty: give the key, or leave the option out to serve without one.")
        return api_key.strip()
    return (os.environ.get(API_KEY_ENVIRONMENT) or "").strip() or None


def check_api_key(headers: dict[str, str], api_key: str | None) -> None:
    """Raise a 401 `APIError` unless `api_key` is None or the headers send `Authorization: Bearer <api_key>`."""
    if api_key is None:
        return
    given = headers.get("authorization", "")
    scheme, _, key = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), api_key.encode()):
        what = "No API key was given" if not given else "The API key is wrong"
        raise APIError(401, f"{what}: send `Authorization: Bearer <key>`.", code="invalid_api_key")


def split_host(value: str) -> tuple[str, int | None]:
    """`host[:port]` (an IPv6 address in brackets) as (host in lower case, without brackets; port or None)."""
    value = value.strip().lower()
    if value.startswith("["):
        host, _, rest = value[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    else:
        host, _, port = value.rpartition(":") if value.count(":") == 1 else (value, "", "")
    return host, int(port) if port.isdigit() else None


def plain_address(host: str) -> str:
    """An IPv4-mapped IPv6 address (`::ffff:127.0.0.1`, what a dual-stack socket reports for an IPv4 client) as its
    IPv4 address; any other host as it is."""
    try:
        mapped = getattr(ipaddress.ip_address(host), "ipv4_mapped", None)  # IPv6 addresses have it
    except ValueError:
        return host
    return str(mapped) if mapped is not None else host


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(plain_address(host)).is_loopback
    except ValueError:
        return host in LOOPBACK_NAMES


class AccessGuard:
    """ASGI middleware: refuses (in OpenAI's error format) a request whose `Host` the server does not answer to (421),
    whose `Origin` is foreign (403), or a POST whose body is not `application/json` (415), before the app sees it.

    Args:
        app: the ASGI app.
        allowed_hosts: host names or addresses the server answers to besides its own address (`"*"`: any).
        allowed_origins: origins (`scheme://host[:port]`) allowed besides the server's own (`"*"`: any).
    """

    def __init__(self, app, allowed_hosts: Iterable[str] = (), allowed_origins: Iterable[str] = ()):
        self.app = app
        self.allowed_hosts = {split_host(host)[0] for host in allowed_hosts}
        self.allowed_origins = {origin.rstrip("/").lower() for origin in allowed_origins}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
        refusal = self.refusal(scope, headers)
        if refusal is None:
            return await self.app(scope, receive, send)
        body = json.dumps(refusal.body()).encode()
        await send(
            {
                "type": "http.response.start",
                "status": refusal.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})

    def answers_to(self, host: str, port: int | None, scope) -> bool:
        """Whether `host` names this server: its own address (the one the connection reached), `localhost` when that
        address is loopback, or an allowed host. The port is compared only when given (an `Origin`'s): a `Host`
        names the port its client connected to, which a tunnel or a container's port mapping may have changed."""
        if "*" in self.allowed_hosts or host in self.allowed_hosts:
            return True
        server_host, server_port = scope.get("server") or (None, None)
        if port is not None and server_port is not None and port != server_port:
            return False
        if server_host is None:
            return False
        server_host, host = plain_address(server_host.lower()), plain_address(host)
        return host == server_host or (is_loopback(server_host) and is_loopback(host))

    def refusal(self, scope, headers: dict[str, str]) -> APIError | None:
        host, _ = split_host(headers.get("host", ""))
        if not self.answers_to(host, None, scope):
            return APIError(
                421,
                f"This server does not answer to the host {headers.get('host', '')!r}: send requests to the address "
                "it listens on, or start it with that name allowed (`allowed_hosts`, `--allowed_hosts`).",
                code="host_not_allowed",
            )
        origin = headers.get("origin")
        if origin is not None and not self.origin_allowed(origin.rstrip("/").lower(), scope):
            return APIError(
                403,
                f"Requests from the web origin {origin!r} are refused: a web page may not call this server unless "
                "its origin is allowed (`allowed_origins`, `--allowed_origins`).",
                code="origin_not_allowed",
            )
        if scope["method"] == "POST":
            media_type = headers.get("content-type", "").split(";")[0].strip().lower()
            if media_type != "application/json":
                return APIError(
                    415,
                    "The request body must be sent as `Content-Type: application/json`, got "
                    f"{media_type or 'none'!r}.",
                    code="unsupported_media_type",
                )
        return None

    def origin_allowed(self, origin: str, scope) -> bool:
        if "*" in self.allowed_origins or origin in self.allowed_origins:
            return True
        scheme, _, rest = origin.partition("://")
        if scheme not in ("http", "https") or not rest:
            return False  # `null` (a sandboxed page, a file), or not an origin at all
        host, port = split_host(rest)
        return self.answers_to(host, port if port is not None else {"http": 80, "https": 443}[scheme], scope)
