"""Episodes of agent programs during training: which are open, what each one's calls produced, and the sampling every
call takes (docs/programs.md).

While a trainer rolls out agent programs, its server answers only requests sent through an open episode's base URL
(`/episodes/<key>/v1`), so every call belongs to one episode whatever else runs at once. A call samples as the
trainer samples (its temperature and top-p, at most `max_completion_length` tokens) with a seed made from its
episode's and its place among the episode's calls, so a program that makes the same calls samples the same tokens in a
rerun. What each call produced is recorded as the model produced it: the prompt's token ids (after the agent's role
and chat template), the completion's token ids and their log-probabilities. Training uses exactly those ids, never a
tokenisation of the text the program got back.
"""

import secrets
import threading
from dataclasses import dataclass, field

from ..rollouts.program_rollout import RecordedCall
from .requests import APIError, GenerationRequest, invalid
from .rows import GeneratedRow

SEED_SPAN = 2**62  # call seeds stay below this (a request's row i samples with seed + i)
NOTED_FAILURES = 3  # an episode's failed requests described in its error (the others counted)


@dataclass
class EpisodeSampling:
    """How every episode call samples: the trainer's `temperature`, `top_p` and `max_completion_length`."""

    temperature: float
    top_p: float
    max_tokens: int


@dataclass
class _Episode:
    seed: int
    calls: int = 0  # calls admitted (each samples with its own seed)
    requests: int = 0  # requests received, refused ones included
    recorded: list[RecordedCall] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # the first requests the server refused or failed, described
    failed_requests: int = 0


class EpisodeBook:
    """The open episodes of a rollout and their recorded calls; thread-safe (the server's requests and the trainer
    share it).

    Args:
        sampling: the trainer's sampling, which every call takes.
        max_calls: the most requests one episode may make (None: no limit); the next is refused (429).
    """

    def __init__(self, sampling: EpisodeSampling, max_calls: int | None = None):
        self.sampling, self.max_calls = sampling, max_calls
        self._open: dict[str, _Episode] = {}
        self._lock = threading.Lock()

    def open(self, seed: int) -> str:
        """Open an episode sampling from `seed`; its key (the path segment of its base URL)."""
        key = secrets.token_hex(8)
        with self._lock:
            self._open[key] = _Episode(seed % SEED_SPAN)
        return key

    def close(self, key: str) -> list[RecordedCall]:
        """End the episode: its later requests are refused (404). Its recorded calls, in the order they finished."""
        with self._lock:
            episode = self._open.pop(key, None)
        return [] if episode is None else episode.recorded

    def received(self, key: str) -> int:
        """Count a request of the episode as it arrives; its number (1 for the first; 0 for a closed episode)."""
        with self._lock:
            episode = self._open.get(key)
            if episode is None:
                return 0
            episode.requests += 1
            return episode.requests

    def note_failure(self, key: str, number: int, model: str | None, error: APIError) -> None:
        """Note that the server answered the episode's request `number` with `error` (a closed episode notes none).
        The first `NOTED_FAILURES` are described, the others counted: a program that retries refused calls until it
        times out must not make its error megabytes long."""
        to = f" to `{model}`" if model is not None else ""
        described = f"its request {number}{to} was answered {error.status} ({error.code or 'error'}): {error.message}"
        with self._lock:
            episode = self._open.get(key)
            if episode is None:
                return
            episode.failed_requests += 1
            if len(episode.failures) < NOTED_FAILURES:
                episode.failures.append(described)

    def failures(self, key: str) -> list[str]:
        """The episode's requests that the server refused or failed so far, described (which request, to which
        agent, the status and the server's message): the first `NOTED_FAILURES`, then how many more."""
        with self._lock:
            episode = self._open.get(key)
            if episode is None:
                return []
            more = episode.failed_requests - len(episode.failures)
            return [*episode.failures, *([f"{more} more of its requests failed"] if more else [])]

    def admit(self, key: str, request: GenerationRequest) -> None:
        """Check a request of episode `key` and give it the trainer's sampling and its seed. Raises `APIError`: the
        episode is not open (404), it made `max_calls` calls already (429), or the request sets its own sampling
        (400, naming the field)."""
        sampling = self.sampling
        checks = (
            ("temperature", request.temperature, sampling.temperature),
            ("top_p", request.top_p, sampling.top_p),
        )
        for name, value, trained in checks:
            if value is not None and value != trained:
                raise invalid(
                    name,
                    f"During training every call samples with the trainer's `{name}` ({trained}); this request asks "
                    f"for {value}. Leave `{name}` out (or send {trained}); set it in the trainer's config.",
                )
        if request.seed is not None:
            raise invalid("seed", "During training the trainer seeds each episode's calls: leave `seed` out.")
        if request.max_tokens is not None and request.max_tokens > sampling.max_tokens:
            raise invalid(
                "max_tokens",
                f"`max_tokens` ({request.max_tokens}) is above the trainer's `max_completion_length` "
                f"({sampling.max_tokens}): ask for at most that many tokens, or raise `max_completion_length`.",
            )
        with self._lock:
            episode = self._open.get(key)
            if episode is None:
                raise APIError(
                    404,
                    f"No open episode `{key}`: it ended (finished, timed out or failed) or never began. During "
                    "training, call the agents through the client the episode function was given.",
                    code="episode_not_found",
                )
            if self.max_calls is not None and episode.calls >= self.max_calls:
                raise APIError(
                    429,
                    f"This episode has made its {self.max_calls} calls (`episode_max_calls`); it ends without more.",
                    code="episode_call_limit",
                )
            call = episode.calls
            episode.calls += 1
        request.temperature, request.top_p = sampling.temperature, sampling.top_p
        request.seed = (episode.seed * 1_000_003 + call * 1_009) % SEED_SPAN
        request.max_tokens = request.max_tokens or sampling.max_tokens

    def record(self, key: str, request: GenerationRequest, rows: list[GeneratedRow]) -> None:
        """Record the finished rows of one of the episode's requests (a closed episode records nothing)."""
        prompts = request.prompts if request.kind == "completion" else [request.prompts]
        calls = [
            RecordedCall(
                row.request.agent,
                prompts[index // request.n],
                list(row.request.prompt_ids),
                list(row.completion_ids),
                list(row.logprobs),
                row.text,
                row.finish_reason,
            )
            for index, row in enumerate(rows)
            if row.finish_reason in ("stop", "length") and row.completion_ids  # a stop string first: nothing to train
        ]
        with self._lock:
            episode = self._open.get(key)
            if episode is not None:
                episode.recorded.extend(calls)
