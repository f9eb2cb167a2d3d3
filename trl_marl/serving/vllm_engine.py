"""The serving engine on a team loaded with vLLM (`load_team(..., use_vllm=True)`), or on a trainer's vLLM engine
while it trains agent programs: vLLM batches the rows itself.

Each row becomes one request to the team's vLLM engine (`SavedTeamEngine`, or the trainer's `TeamVLLMGeneration`): its
agent's LoRA, its own sampling settings and seed, its completion budget, the log-probability of each sampled token (and
of the `top_logprobs` most likely) as the engine computes them: a saved team's engine gives the raw ones (before
temperature and top-p, as on the transformers path); a trainer's engine, serving its episodes (`episode_runner.py`),
gives them after temperature and top-p (its `processed_logprobs`, what TRL's importance-sampling correction compares).
The engine's thread adds the waiting rows (up to `max_batch_rows` at once, taken in turn from each request as
`BatchingEngine` takes them), steps vLLM (`LLMEngine.step`, one scheduler iteration: rows join and leave the running
batch between steps, vLLM's continuous batching) and hands each step's new tokens to their rows. Stop strings and
cancellation are this engine's, as on the transformers path: a row whose text reaches a stop string, or that is
cancelled, is aborted in vLLM and finished here (its tokens past the stop string dropped). `chunk_tokens` has nothing
to do: a new row joins the running batch at the next step.

The team's own `run` and `play` use the same vLLM engine: do not call them while the team is served.
"""

import itertools
from typing import Any

from ..team.saved import Team
from .engine import BatchingEngine
from .rows import GeneratedRow
from .step_hooks import finish


class VLLMBatchingEngine(BatchingEngine):
    """`BatchingEngine`'s queue, cancellation and shutdown over the vLLM engine of `team` (`team.engine`).

    Args:
        team: a team loaded with `use_vllm=True`.
        max_batch_rows: at most this many rows in vLLM at once (vLLM's own `max_num_seqs` may run fewer at a time).
        chunk_tokens: unused (rows join the running batch at every step); kept for `BatchingEngine`'s signature.
        **settings: `BatchingEngine`'s (`gather_seconds`).
    """

    serves_grammars = False  # constrained requests are refused by name (`prompts.PromptRenderer.grammar`)

    def __init__(self, team: Team, max_batch_rows: int = 16, chunk_tokens: int = 16, **settings: Any):
        if team.engine is None:
            raise ValueError("VLLMBatchingEngine serves a team loaded with `use_vllm=True`; use BatchingEngine.")
        super().__init__(team, max_batch_rows=max_batch_rows, chunk_tokens=chunk_tokens, **settings)
        self._active: dict[str, GeneratedRow] = {}  # vLLM's request id -> its row
        self._request_ids = itertools.count()

    def context_length(self, agent: int) -> int:
        """The most tokens (prompt and completion) vLLM takes: its `max_model_len`."""
        return int(self.team.engine.llm.llm_engine.model_config.max_model_len)

    def _serve_calls(self) -> None:
        engine = self.team.engine.llm.llm_engine
        try:
            while True:
                with self._condition:
                    self._running = list(self._active.values())  # `pause` waits until no row runs
                    while not self._queue and not self._active and not self._closing:
                        self._condition.wait()
                    if self._closing:
                        return
                    free = self.max_batch_rows - len(self._active)
                    new = self._take_rows(free) if self._queue and free > 0 else []
                    self._running = [*self._active.values(), *new]
                for row in new:
                    self._add(engine, row)
                for request_id, row in list(self._active.items()):
                    if row.cancelled:
                        self._end(engine, request_id, "cancelled")
                if self._active:
                    self._step(engine)
        except BaseException as error:  # the thread stops: its rows in vLLM fail with the cause (a 500, not a 503)
            self._fail_active(engine, error)
            raise
        finally:  # closed: the rows still in vLLM are cancelled, and vLLM keeps nothing of ours
            for request_id in list(self._active):
                self._end(engine, request_id, "cancelled")
            self._running = []

    def _add(self, engine: Any, row: GeneratedRow) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        request = row.request
        adapter = self.team.agents[request.agent]["adapter"]
        penalty = getattr(self.team.bases[0].model.generation_config, "repetition_penalty", None)
        params = SamplingParams(
            max_tokens=request.max_new_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            seed=request.seed,
            repetition_penalty=penalty or 1.0,  # as `SavedTeamEngine.generate` (and `generate`) apply it
            stop_token_ids=self.team.stop_token_ids(request.agent),
            logprobs=request.top_logprobs,  # 0: the sampled token's alone
            output_kind=RequestOutputKind.DELTA,
            detokenize=False,  # the text is decoded here, as on the transformers path
        )
        request_id = f"trl-marl-{next(self._request_ids)}"
        try:
            prompt = {"prompt_token_ids": request.prompt_ids}
            engine.add_request(request_id, prompt, params, lora_request=self.team.engine.lora_requests[adapter])
        except Exception as error:  # this row fails (a prompt vLLM refuses); the others go on
            self._fail([row], error)
            self._done(row)
            return
        self._active[request_id] = row

    def _step(self, engine: Any) -> None:
        self.calls += 1
        try:
            outputs = engine.step()
        except Exception as error:  # the rows in vLLM fail; the next rows are tried
            self._fail_active(engine, error)
            return
        for output in outputs:
            row = self._active.get(output.request_id)
            if row is None:
                continue
            completion = output.outputs[0]
            decode = self.decoder_of(row.request.agent)
            for position, token in enumerate(completion.token_ids):
                logprobs = completion.logprobs[position]
                ranked = sorted((entry.rank, token_id, entry.logprob) for token_id, entry in logprobs.items())
                top = [(other, value) for rank, other, value in ranked[: row.request.top_logprobs]]
                row.record(token, logprobs[token].logprob, top, decode)
            if row.cancelled:
                self._end(engine, output.request_id, "cancelled")
            elif row.request.stop and row.decoded is not None and row.decoded.reaches(row.request.stop):
                self._end(engine, output.request_id, "stop")
            elif output.finished:
                reason = "stop" if completion.finish_reason == "stop" else "length"
                self._end(engine, output.request_id, reason, in_vllm=False)
            elif completion.token_ids:
                row.notify(False)

    def _end(self, engine: Any, request_id: str, reason: str | None, in_vllm: bool = True) -> None:
        """Take the row out of vLLM (aborted, unless vLLM has finished it: `in_vllm` False) and finish it for `reason`
        (None: the caller fails it)."""
        row = self._active.pop(request_id)
        if in_vllm:
            try:
                engine.abort_request([request_id])
            except Exception:  # vLLM has already dropped it
                pass
        if reason is not None:
            finish(row, reason, self.decoder_of(row.request.agent))
            self._done(row)

    def _fail_active(self, engine: Any, error: BaseException) -> None:
        """Every row in vLLM aborted and failed with `error`."""
        rows = list(self._active.values())
        for request_id in list(self._active):
            self._end(engine, request_id, None)
        self._fail(rows, error)
        for row in rows:
            self._done(row)

    def _done(self, row: GeneratedRow) -> None:
        self._finished[row.finish_reason] += 1
        row.done_event.set()
