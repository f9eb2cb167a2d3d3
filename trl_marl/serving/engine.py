"""The batching engine behind the server: rows of any agents, from any number of concurrent requests, generated
together in routed `generate` calls on a loaded `Team`.

One thread runs the calls, one after another. A call takes the waiting rows in order (those of one base, up to
`max_batch_rows`), routes each to its agent's adapter (`AdapterRouter.route`, as `Team` does) and generates through
the base's captured decoder or `model.generate`, with per-row sampling and stopping (`step_hooks.CallHooks`).

A long row does not hold the others back: once a call has generated `chunk_tokens` tokens, it ends as soon as a row is
waiting, and its unfinished rows go to the back of the queue; the next call takes the waiting rows and those, each
continuing from its prompt and what it has generated so far (prefilled again). A row that arrives while a call runs so
waits at most `chunk_tokens` tokens of that call (and its own prefill), while a request alone runs in one call, as a
direct `Team` call does. A call takes rows from each waiting request in turn, so a request of many rows (`n`, several
prompts) shares the calls with those that come after it rather than holding them back until it is done.
"""

import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ..generation.captured_decode import CapturedStepFailed
from ..generation.team_generation import left_padded
from ..memory.host import release_free_memory
from ..team.saved import Team
from .completion_text import CompletionDecoder
from .rows import GeneratedRow, RowRequest

if TYPE_CHECKING:
    from .grammars import BaseGrammars
from .step_hooks import CallHooks, finish

logger = logging.getLogger(__name__)

# When a row arrives at an idle engine, the engine waits this long for the rows sent with it (concurrent clients'
# requests arrive a few milliseconds apart) so that they start in one call rather than the first alone.
GATHER_SECONDS = 0.01
# An engine left without rows this long after serving gives what its calls freed back to the system (`memory.host`).
IDLE_SECONDS = 1.0


class EngineStopped(RuntimeError):
    """The engine takes no more rows: it was closed, or its thread stopped on a failure."""


class BatchingEngine:
    """Generates `RowRequest`s on `team` in shared routed calls, from a thread of its own (`start`, `close`). A row
    with a grammar (`RowRequest.grammar`) samples only what it allows (`grammars.py`), beside rows without one.

    Args:
        team: a loaded team (`load_team`) generating with transformers (its vLLM engine, if any, is not used).
        max_batch_rows: at most this many rows in one call.
        chunk_tokens: a call that has generated this many tokens ends when rows are waiting (its unfinished rows
            continue in the next call).
        gather_seconds: when a row reaches an idle engine, how long it waits for the rows sent with it.
    """

    def __init__(
        self, team: Team, max_batch_rows: int = 16, chunk_tokens: int = 16, gather_seconds: float = GATHER_SECONDS
    ):
        if max_batch_rows < 1 or chunk_tokens < 1:
            raise ValueError(
                f"max_batch_rows and chunk_tokens must be at least 1, got {max_batch_rows} and {chunk_tokens}."
            )
        self.team, self.max_batch_rows, self.chunk_tokens = team, max_batch_rows, chunk_tokens
        self.gather_seconds = gather_seconds
        self._queue: list[GeneratedRow] = []
        self._condition = threading.Condition()
        self._closing = False
        self._paused = False  # `pause`: no rows taken until `resume`
        self._thread: threading.Thread | None = None
        self.calls = 0  # routed calls made so far
        self._submissions = 0
        self._running: list[GeneratedRow] = []
        self._finished: Counter = Counter()  # rows done so far, by finish reason
        self.failure: BaseException | None = None  # what stopped the engine's thread, if anything did
        self._grammars: dict[int, BaseGrammars] = {}  # per base, built at its first constrained request
        self._grammars_lock = threading.Lock()
        self._decoders: dict[int, CompletionDecoder] = {}  # `decoder_of`'s, by base

    serves_grammars = True  # rows with a grammar are constrained (`step_hooks`)

    def grammars_of(self, agent: int) -> "BaseGrammars":
        """The grammars of the agent's base (`grammars.BaseGrammars`: its llguidance tokenizer, over the model's
        vocabulary, the base's end-of-sequence tokens ending an answer), built once."""
        base_index = self.team.agent_base[agent]
        with self._grammars_lock:
            if base_index not in self._grammars:
                from .grammars import BaseGrammars

                base = self.team.bases[base_index]
                vocab_size = base.model.get_output_embeddings().weight.shape[0]
                self._grammars[base_index] = BaseGrammars(base.tokenizer, vocab_size, self.team.stop_token_ids(agent))
            return self._grammars[base_index]

    def stats(self) -> dict:
        """The calls made, the rows waiting and running now, and the rows done so far by finish reason."""
        return {
            "engine": "running" if self.alive else ("stopped" if self.failure is None else "failed"),
            "calls": self.calls,
            "rows_waiting": len(self._queue),
            "rows_running": len(self._running),
            "rows_finished": dict(self._finished),
        }

    def start(self) -> "BatchingEngine":
        """Start the engine's thread, on the CUDA device of the thread that starts it: CUDA's current device is per
        thread, and a new thread's is device 0 (not, under `accelerate launch`, the process's own GPU)."""
        if self._thread is None:
            initialized = torch.cuda.is_available() and torch.cuda.is_initialized()
            cuda_device = torch.cuda.current_device() if initialized else None
            self._thread = threading.Thread(
                target=self._serve, args=(cuda_device,), name="trl-marl-serving-engine", daemon=True
            )
            self._thread.start()
        return self

    def close(self) -> None:
        """Stop the engine's thread: rows still waiting finish as "cancelled" now, and the running call's rows at its
        next token."""
        with self._condition:
            self._closing = True
            waiting, self._queue = self._queue, []
            for row in self._running:
                row.cancelled = True
            self._condition.notify_all()
        self._finish_cancelled(waiting)
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def pause(self) -> None:
        """Take no more rows (`submit` refuses them until `resume`), cancel every row, waiting or running, and return
        once no call runs: the model is the caller's alone (a trainer's, between its rollouts)."""
        with self._condition:
            self._paused = True
            waiting, self._queue = self._queue, []
            for row in self._running:
                row.cancelled = True
        self._finish_cancelled(waiting)
        while self._running:
            time.sleep(0.005)

    def resume(self) -> None:
        """Take rows again after `pause`."""
        with self._condition:
            self._paused = False

    def tokenizer_of(self, agent: int):
        """The tokenizer of the base the agent (its index) sits on."""
        return self.team.bases[self.team.agent_base[agent]].tokenizer

    def decoder_of(self, agent: int) -> CompletionDecoder:
        """The decoding of the agent's completion ids as a row's text (special tokens skipped), whole when called or
        token by token (`CompletionDecoder.follow`), built at its first use."""
        base = self.team.agent_base[agent]
        if base not in self._decoders:
            self._decoders[base] = CompletionDecoder(self.tokenizer_of(agent))
        return self._decoders[base]

    def context_length(self, agent: int) -> int:
        """The most tokens (prompt and completion) the agent's base model takes."""
        config = self.team.bases[self.team.agent_base[agent]].model.config.get_text_config(decoder=True)
        return int(config.max_position_embeddings)

    def submit(
        self, requests: list[RowRequest], listener: Callable[[GeneratedRow, bool], None] | None = None
    ) -> list[GeneratedRow]:
        """Queue `requests`; their rows fill in as the calls run (`GeneratedRow.done_event` is set when one is done,
        and `listener` is called from the engine's thread, see `GeneratedRow`)."""
        with self._condition:
            self._submissions += 1
            rows = [GeneratedRow(request, listener, submission=self._submissions) for request in requests]
            if self._closing:
                raise EngineStopped("The serving engine is closed.")
            if self._paused:
                raise EngineStopped("The serving engine is paused: the trainer is between rollouts.")
            if self.failure is not None:
                raise EngineStopped(f"The serving engine stopped: {type(self.failure).__name__}: {self.failure}")
            self._queue.extend(rows)
            self._condition.notify_all()
        return rows

    def generate(self, requests: list[RowRequest]) -> list[GeneratedRow]:
        """`submit` and wait until every row is done."""
        rows = self.submit(requests)
        for row in rows:
            row.done_event.wait()
        return rows

    def cancel(self, rows: list[GeneratedRow]) -> None:
        """Stop generating `rows`: a waiting row finishes now, a running one after the call's next token."""
        with self._condition:
            for row in rows:
                row.cancelled = True
            waiting = [row for row in rows if row in self._queue]
            self._queue = [row for row in self._queue if not row.cancelled]
        self._finish_cancelled(waiting)

    def _finish_cancelled(self, rows: list[GeneratedRow]) -> None:
        for row in rows:
            finish(row, "cancelled", self.decoder_of(row.request.agent))
            self._finished[row.finish_reason] += 1
            row.done_event.set()

    @property
    def alive(self) -> bool:
        """Whether the engine's thread is running (started, not closed, not stopped by a failure)."""
        return self._thread is not None and self._thread.is_alive() and self.failure is None

    def _fail(self, rows: list[GeneratedRow], error: BaseException) -> None:
        """Finish the rows not yet done as "error" (their requests answer 500 with `error`)."""
        for row in rows:
            if not row.done:
                row.error = error
                finish(row, "error", self.decoder_of(row.request.agent))

    def _serve(self, cuda_device: int | None = None) -> None:
        try:
            if cuda_device is not None:
                torch.cuda.set_device(cuda_device)
            self._serve_calls()
        except BaseException as error:  # the thread stops: later requests are refused (503), not left waiting
            with self._condition:
                self.failure = error
                waiting, self._queue = self._queue, []
            self._fail(waiting, error)
            for row in waiting:
                row.done_event.set()
            raise

    def _serve_calls(self) -> None:
        while True:
            with self._condition:
                if not self._queue and not self._closing:
                    released = not self.calls
                    while not self._queue and not self._closing:
                        # Idle for IDLE_SECONDS after calls: what they freed, in every thread's arena, back to the
                        # system (`memory.host`), once per idle spell. Not under the lock (requests submit and cancel
                        # under it), and not while paused: a trainer gives memory back at its own phases' ends.
                        if not self._condition.wait(None if released else IDLE_SECONDS) and not released:
                            released = True
                            if not self._paused:
                                self._condition.release()
                                try:
                                    release_free_memory()
                                finally:
                                    self._condition.acquire()
                    gathered_by = time.monotonic() + self.gather_seconds
                    while not self._closing and (left := gathered_by - time.monotonic()) > 0:
                        self._condition.wait(left)
                if self._closing:
                    return
                if not self._queue:  # its rows were cancelled while gathering
                    continue
                rows = self._running = self._take_rows()
            try:
                self._call(rows)
            except Exception as error:  # whatever failed, this call's rows fail and the next call is served
                self._fail(rows, error)
            finally:
                self._finished.update(row.finish_reason for row in rows if row.done)
                self._running = []
                for row in rows:
                    if row.done:
                        row.done_event.set()

    def _take_rows(self, limit: int | None = None) -> list[GeneratedRow]:
        """Up to `limit` (`max_batch_rows`) waiting rows on the base of the longest-waiting one, taken in turn from
        each submission (in the order they wait), so that a request of many rows does not hold back the others. A row
        to run alone (`GeneratedRow.alone`) is taken by itself, before the others."""
        alone = next((row for row in self._queue if row.alone), None)
        if alone is not None:
            self._queue.remove(alone)
            return [alone]
        base = self.team.agent_base[self._queue[0].request.agent]
        by_submission: dict[int, list[GeneratedRow]] = {}
        for row in self._queue:
            if self.team.agent_base[row.request.agent] == base:
                by_submission.setdefault(row.submission, []).append(row)
        in_turn = [row for turn in itertools.zip_longest(*by_submission.values()) for row in turn if row is not None]
        taken = in_turn[: limit or self.max_batch_rows]
        self._queue = [row for row in self._queue if row not in taken]
        return taken

    def _waiting(self) -> bool:
        return bool(self._queue)

    @torch.no_grad()
    def _call(self, rows: list[GeneratedRow]) -> None:
        """One routed `generate` call over `rows`; unfinished rows go back to the end of the queue."""
        self.calls += 1
        team = self.team
        base = team.bases[team.agent_base[rows[0].request.agent]]
        tokenizer, model = base.tokenizer, base.model
        decode = self.decoder_of(rows[0].request.agent)
        hooks = None
        try:
            hooks = CallHooks(
                rows,
                team.stop_token_ids(rows[0].request.agent),
                decode,
                should_yield=lambda steps: steps >= self.chunk_tokens and self._waiting(),
            )
            pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
            prompts = [row.request.prompt_ids + row.completion_ids for row in rows]
            input_ids, attention_mask = left_padded(prompts, pad_id, None, next(model.parameters()).device)
            if base.router is not None:
                base.router.route([team.agents[row.request.agent]["adapter"] for row in rows])
            generate = base.decoder.generate if base.decoder is not None else model.generate
            try:
                generate(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    max_new_tokens=max(row.remaining_tokens for row in rows),
                    do_sample=False,
                    pad_token_id=pad_id,
                    **hooks.generate_kwargs(),
                )
            finally:
                if base.router is not None:
                    base.router.route(None)
        except CapturedStepFailed:  # the captured step failed (logged): the rows continue on eager `generate`
            hooks.rewind()
            self._requeue(rows, decode, front=True)
            return
        except Exception as error:
            if hooks is not None:
                hooks.rewind()  # the failed step's draws are drawn again
            if len(rows) > 1:  # one row's failure must not be the others': each row runs again in a call of its own
                logger.warning("A call of %d rows failed (%s: %s); each runs again alone.", len(rows),
                               type(error).__name__, error)  # fmt: skip
                self._retry_alone(rows, decode)
            else:  # a row that fails alone fails; the engine serves the next call
                self._fail(rows, error)
            return
        for row in rows:  # a row that ran alone and did not fail shares calls again
            row.alone = False
        self._requeue(rows, decode)

    def _retry_alone(self, rows: list[GeneratedRow], decode: Callable[[list[int]], str]) -> None:
        """After a failed call of several rows: each row that is not done goes back to the front of the queue, to run
        once in a call of its own (`GeneratedRow.alone`), continuing from the tokens it had; a row that fails alone
        fails, the others then share calls again."""
        for row in rows:
            row.alone = True
        self._requeue(rows, decode, front=True)

    def _requeue(self, rows: list[GeneratedRow], decode: Callable[[list[int]], str], front: bool = False) -> None:
        """The call's unfinished rows back in the queue (at its end, or its front), a cancelled one finished."""
        with self._condition:  # under the lock: a row cancelled now is either re-queued (and found) or finished here
            unfinished = [row for row in rows if not row.done]
            cancelled = [row for row in unfinished if row.cancelled]
            waiting = [row for row in unfinished if not row.cancelled]
            self._queue = [*waiting, *self._queue] if front else [*self._queue, *waiting]
            self._condition.notify_all()
        for row in cancelled:
            finish(row, "cancelled", decode)
