"""What the serving engine is asked for and gives back, per row: one completion of one agent.

A request becomes one row per choice (`n`); each row carries its own sampling settings, so rows of any agents and
settings share a routed `generate` call. A row records the token ids it sampled and their log-probabilities (the
model's, before temperature and top-p; after them on a trainer's vLLM engine), what a recorder of episodes needs
beside the prompt's ids.
"""

import random
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .completion_text import CompletionText, follow_text

FINISH_REASONS = ("stop", "length", "cancelled", "error")


@dataclass(frozen=True)
class RowRequest:
    """One completion to generate.

    Args:
        agent: the agent's index in the team (`Team.agent_names`).
        prompt_ids: the prompt's token ids, rendered with the agent's base tokenizer.
        max_new_tokens: at most this many completion tokens.
        temperature: 0 is greedy (the argmax, as `Team.run` generates); above 0, sampling at this temperature.
        top_p: nucleus sampling's probability mass (1 keeps every token).
        seed: the row's own random generator's seed: the same seed samples the same tokens, whatever else shares
            the call. None draws one.
        stop: strings that end the completion (not included in its text).
        top_logprobs: how many of the most likely tokens to record with each sampled token's log-probability.
    """

    agent: int
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    top_logprobs: int = 0
    grammar: Any = None  # a `grammars.CompiledGrammar` the row's tokens must follow, or None


@dataclass(eq=False)
class GeneratedRow:
    """A row's progress and result, filled in by the engine's thread.

    `completion_ids[i]` was sampled with log-probability `logprobs[i]`; `top_logprobs[i]` holds the
    `request.top_logprobs` most likely `(token id, log-probability)` pairs at that step. `finish_reason` is set once
    the row is done: "stop" (an end-of-sequence token or a stop string), "length" (`max_new_tokens`), "cancelled"
    (`cancel`), "error" (`error` holds the exception). `text` is the completion decoded (special tokens skipped), cut
    before the first stop string; `decoded` follows the text of `completion_ids` as `record` appends them (None before
    the first, and for a row whose tokens were set otherwise). `listener(row, finished)` is called from the engine's
    thread after each step that added tokens and once when the row is done; `done_event` is set once the row is done
    and the call that finished it has returned (the model is the caller's again when the engine is idle)."""

    request: RowRequest
    listener: Callable[["GeneratedRow", bool], None] | None = None
    submission: int = 0  # which `submit` call queued the row (the engine's count; a request's rows share it)
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    decoded: CompletionText | None = None
    finish_reason: str | None = None
    text: str | None = None
    error: BaseException | None = None
    cancelled: bool = False
    alone: bool = False  # a call of several rows failed with this one in it: it runs in calls of its own from now on
    matcher: Any = None  # the row's state in its grammar (`grammars.RowGrammar`), when it has one
    generator: torch.Generator | None = None
    done_event: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self):
        if self.request.grammar is not None:
            self.matcher = self.request.grammar.matcher()

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining_tokens(self) -> int:
        return self.request.max_new_tokens - len(self.completion_ids)

    def record(
        self, token_id: int, logprob: float, top: list[tuple[int, float]], decode: Callable[[list[int]], str]
    ) -> None:
        """Append a sampled token, its log-probability and the most likely others, then its text to `decoded` (begun
        at the first token with `decode`: `completion_text.follow_text`). Another thread reading the row meanwhile
        sees the lists grow in that order."""
        if self.decoded is None:
            self.decoded = follow_text(decode, self.completion_ids)
        self.completion_ids.append(token_id)
        self.logprobs.append(logprob)
        self.top_logprobs.append(top)
        self.decoded.append(token_id)

    def random_generator(self, device: torch.device) -> torch.Generator:
        """The row's generator on `device`, seeded once (its seed, else a fresh one), kept across calls."""
        if self.generator is None:
            seed = self.request.seed if self.request.seed is not None else random.SystemRandom().randrange(2**63)
            self.generator = torch.Generator(device=device).manual_seed(seed)
        return self.generator

    def notify(self, finished: bool) -> None:
        if self.listener is not None:
            self.listener(self, finished)
