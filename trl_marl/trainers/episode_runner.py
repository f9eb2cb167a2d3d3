"""Agent programs run as episodes against the trainer's own server (docs/programs.md).

The trainer serves its team (the model it trains, every agent's adapter, its routing and decode step) behind the
OpenAI-compatible endpoint of `trl_marl.serving`, on a loopback port with a key of its own, for as long as it trains.
A batch of episodes opens one episode per prompt copy in the server's `EpisodeBook` and calls the episode function
once per copy with an `openai` client bound to that episode's base URL (`/episodes/<key>/v1`): concurrently, in
threads for a plain function, on one event loop for an `async` one (with an `openai.AsyncOpenAI` client). The server
batches their calls, samples as the trainer samples and records each completion. An episode that raises, returns
something other than a float or a mapping, or runs past `episode_timeout` seconds is left out (its error kept for the
logs). When the batch ends every episode is closed and the engine paused: its rows are cancelled and it takes none
until the next batch (a late call of a hung program, or of a thread the program left running, is refused), so the
model is the trainer's alone during the loss.
"""

import asyncio
import secrets
import ssl
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

from trl.trainer.utils import is_async_callable

from ..rollouts.program_rollout import EpisodeResult, checked_outcome
from ..serving.episodes import EpisodeBook, EpisodeSampling

EPISODE_GATHER_SECONDS = 0.1


class TrainingTeam:
    """The trainer's team as the serving engine reads a loaded `Team`: its bases (model, tokenizer, router, decode
    step), each agent's adapter and role, the tokens that end a completion, and the sampling it trains with."""

    def __init__(self, trainer: Any):
        # the trainer's vLLM engine (`use_vllm`), else None: transformers generates (routed `generate` or the captured
        # decode step)
        self.engine = trainer.vllm_generation if trainer.use_vllm else None
        self.bases, self.agent_base = trainer.bases, trainer.agent_base
        self.agent_names = trainer.agent_names
        self.agents = [
            {**agent, "adapter": adapter} for agent, adapter in zip(trainer.args.agents, trainer.agent_adapters)
        ]
        self.tokenizer = trainer.bases[0].tokenizer
        self.spec = {
            "max_completion_length": trainer.max_completion_length,
            "temperature": trainer.temperature,
            "top_p": trainer.args.top_p,
            "chat_template_kwargs": trainer.chat_template_kwargs or {},
        }

    def stop_token_ids(self, agent: int) -> list[int]:
        return list(self.bases[self.agent_base[agent]].eos_token_ids)

    def close(self) -> None:
        pass


class EpisodeRunner:
    """The trainer's server and the episodes run against it.

    Args:
        team: the trainer's team (`TrainingTeam`).
        episode: `fn(client, row)`, or an `async` one.
        sampling: the trainer's sampling (every call takes it).
        max_calls: the most requests one episode may make (None: no limit).
        timeout: seconds an episode may run (None: no limit).
        max_batch_rows: at most this many rows in one routed call.
    """

    def __init__(
        self,
        team: TrainingTeam,
        episode: Callable,
        sampling: EpisodeSampling,
        *,
        max_calls: int | None = None,
        timeout: float | None = None,
        max_batch_rows: int = 64,
    ):
        from ..serving.app import ServingSettings
        from ..serving.server import batching_engine, bind_server

        self.episode, self.timeout = episode, timeout
        self.book = EpisodeBook(sampling, max_calls)
        self.api_key = secrets.token_hex(16)
        # One TLS context for every episode's client. Without it the HTTP client of each builds its own (the system's
        # CA certificates parsed again, ~0.3 MiB), and its reference cycles keep it until a full garbage collection,
        # which a process holding a model's objects seldom runs: 8 episodes a step kept ~2.6 MiB a step alive
        # (docs/memory.md, "The program path's growth"). The server is plain HTTP on the loopback: it is never used.
        self.tls = ssl.create_default_context()
        # A batch's episodes start together: their first calls wait a little longer for each other to share one call
        # (a row that misses it joins the running call after at most 16 tokens; with vLLM, at its next step).
        engine = batching_engine(team, max_batch_rows=max_batch_rows, gather_seconds=EPISODE_GATHER_SECONDS)
        settings = ServingSettings(api_key=self.api_key, max_tokens=sampling.max_tokens, episodes=self.book)
        self.server = bind_server(engine, settings)
        self.server._start_in_thread()

    def base_url(self, key: str) -> str:
        return f"{self.server.root_url}/episodes/{key}/v1"

    def run(self, examples: list[dict], seeds: list[int]) -> list[EpisodeResult]:
        """One episode per example (`seeds[i]`: episode `i`'s sampling seed), all at once; their results in order."""
        keys = [self.book.open(seed) for seed in seeds]
        self.server.engine.resume()
        try:
            if is_async_callable(self.episode):
                outcomes = asyncio.run(self._run_async(keys, examples))
            else:
                outcomes = self._run_threads(keys, examples)
        finally:
            failures = [self.book.failures(key) for key in keys]
            recorded = [self.book.close(key) for key in keys]
            self.server.engine.pause()  # a late call (a hung program, a thread of its own) is refused from here on
        results = []
        for (outcome, error), calls, refused in zip(outcomes, recorded, failures):
            if error is None:
                outcome, error = checked_outcome(outcome)
            if error is not None and refused:  # what the server answered the program, which may have hidden it
                error = f"{error}; {'; '.join(refused)}"
            results.append(EpisodeResult(outcome, calls, error) if error is None else EpisodeResult(None, [], error))
        return results

    def _run_threads(self, keys: list[str], examples: list[dict]) -> list[tuple[Any, str | None]]:
        import openai

        clients = [
            openai.OpenAI(
                base_url=self.base_url(key),
                api_key=self.api_key,
                max_retries=0,
                timeout=self.timeout,
                http_client=openai.DefaultHttpxClient(verify=self.tls),
            )
            for key in keys
        ]
        executor = ThreadPoolExecutor(max_workers=len(keys), thread_name_prefix="trl-marl-episode")
        try:
            futures = [executor.submit(self.episode, client, example) for client, example in zip(clients, examples)]
            done, _ = wait(futures, timeout=self.timeout)
            outcomes = []
            for future in futures:
                if future not in done:
                    outcomes.append((None, f"timed out after {self.timeout:g} s (`episode_timeout`)"))
                elif future.exception() is not None:
                    error = future.exception()
                    outcomes.append((None, f"raised {type(error).__name__}: {error}"))
                else:
                    outcomes.append((future.result(), None))
            return outcomes
        finally:
            executor.shutdown(wait=False, cancel_futures=True)  # a hung program's thread is left to fail on its own
            for client in clients:
                client.close()

    async def _run_async(self, keys: list[str], examples: list[dict]) -> list[tuple[Any, str | None]]:
        import openai

        async def one(key: str, example: dict) -> tuple[Any, str | None]:
            client = openai.AsyncOpenAI(
                base_url=self.base_url(key),
                api_key=self.api_key,
                max_retries=0,
                timeout=self.timeout,
                http_client=openai.DefaultAsyncHttpxClient(verify=self.tls),
            )
            try:
                return await asyncio.wait_for(self.episode(client, example), self.timeout), None
            except (asyncio.TimeoutError, TimeoutError):
                return None, f"timed out after {self.timeout:g} s (`episode_timeout`)"
            except Exception as error:
                return None, f"raised {type(error).__name__}: {error}"
            finally:
                await client.close()

        return list(await asyncio.gather(*(one(key, example) for key, example in zip(keys, examples))))

    def close(self) -> None:
        self.server.close()
