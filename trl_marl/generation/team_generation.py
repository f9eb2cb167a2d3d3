"""The team's generation, a collaborator of `TeamTrainer`: one `generate` call for rows of any agents, each row through
its agent's adapter, after a check that every prompt leaves room for its completion; with vLLM, the sampler's
log-probs kept for TRL's importance-sampling correction (`vllm_generation.SamplingCorrection`). The rollouts'
`generate` hook is `TeamGeneration.generate`.

TRL's `_generate` would gather its metrics over processes, which needs equal row counts; tree turns differ between
processes, so TRL's `_tokenize_prompts` and `_generate_single_turn` are called here, and generation metrics are logged
once per rollout instead (`metrics.log_rollout_metrics`).
"""

from collections.abc import Callable, Sequence

import torch
from trl.extras.profiling import profiling_context
from trl.models.utils import unwrap_model_for_generation
from trl.trainer.utils import pad

from ..rollouts.rollout import Generated
from .captured_decode import CapturedDecoder
from .routing import AdapterRouter, rows_to_adapters
from .tool_calling import ToolCalling, ToolRow


class TeamGeneration:
    """Generates rows of any agents in one call.

    Args:
        router: the model's `AdapterRouter`.
        agent_adapters: the adapter of each agent (`agent_adapter_names`).
        agent_names: the agents' names, for errors.
        tokenize: TRL's `_tokenize_prompts`.
        generate_single_turn: TRL's `_generate_single_turn` (transformers' `generate` or the vLLM engine).
        processing_class: the tokenizer, to decode completions.
        position_limit: `(positions, whose, field)`: the most positions a prompt and its completion may take, whose
            limit it is and the field that sets it; `(None, ..)` for no limit.
        max_completion_length: the longest completion.
        sampling_correction: keeps vLLM's log-probs of each row when TRL's correction applies (None without vLLM).
        tool_calling: the agents' tools and TRL's tool loop (`ToolCalling`), when the trainer was given tools or an
            environment; None otherwise.
    """

    def __init__(
        self,
        router: AdapterRouter,
        agent_adapters: Sequence[str],
        agent_names: Sequence[str],
        *,
        tokenize: Callable,
        generate_single_turn: Callable,
        processing_class,
        position_limit: tuple[int | None, str, str],
        max_completion_length: int,
        sampling_correction=None,
        tool_calling: "ToolCalling | None" = None,
    ):
        self.router, self.agent_adapters, self.agent_names = router, list(agent_adapters), list(agent_names)
        self.tokenize, self.generate_single_turn = tokenize, generate_single_turn
        self.processing_class = processing_class
        self.position_limit, self.max_completion_length = position_limit, max_completion_length
        self.sampling_correction = sampling_correction
        self.tool_calling = tool_calling

    def route(self, agent_index: torch.Tensor | Sequence[int]) -> None:
        """Route each row to its agent's adapter (`routing.rows_to_adapters`; `BASE_ROW` to the base model alone)."""
        self.router.route(rows_to_adapters(agent_index, self.agent_adapters))

    def generate(self, model_inputs: list, agent_index: list[int], num_generations: int, environments=None):
        """Per row: prompt ids, completion ids and text, each row generated through its agent's adapter. With tools
        (`tool_calling`), each row's agent's tools (and those of its episode's environment, `environments[i]`) are
        rendered into its prompt and its calls run, the row going on after their results (`tool_calling.ToolLoop`):
        `Generated` with each row's tool mask."""
        tools = self.tool_calling
        if tools is not None and any(tools.team.uses_tools(agent) for agent in agent_index):
            return self._generate_with_tools(model_inputs, agent_index, num_generations, environments)
        # Rows of agents without tools in a team with tools: rendered without any (TRL's `_tokenize_prompts` would
        # render the trainer's tools, or an environment's for the batch it generates).
        prompt_ids = None if tools is None else tools.render(model_inputs, [[] for _ in agent_index])
        prompt_ids, completion_ids, logprobs = self._routed_call(
            model_inputs, agent_index, num_generations, prompt_ids
        )
        if logprobs is not None and self.sampling_correction is not None:  # vLLM's
            self.sampling_correction.record(agent_index, prompt_ids, completion_ids, logprobs)
        texts = self.processing_class.batch_decode(completion_ids, skip_special_tokens=True)
        return [list(ids) for ids in prompt_ids], completion_ids, texts

    def _routed_call(self, model_inputs, agent_index, num_generations, prompt_ids=None, check_lengths=True):
        """One routed call: the prompts tokenized (TRL's `_tokenize_prompts`, unless `prompt_ids` are given), checked
        (`check_lengths`: real prompts; a round of the tool loop keeps to TRL's rule instead, `ToolLoop.run`) and
        generated. `(prompt ids, completion ids, log-probs or None)`."""
        self.route(agent_index)
        try:
            images, multimodal_fields = None, {}
            if prompt_ids is None:
                prompt_ids, images, multimodal_fields = self.tokenize(model_inputs)
            if check_lengths:
                self.check_prompt_lengths(prompt_ids, agent_index)
            completion_ids, logprobs = self.generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations
            )
        finally:
            self.router.route(None)
        return prompt_ids, completion_ids, logprobs

    def _generate_with_tools(self, model_inputs, agent_index, num_generations, environments):
        tools = self.tool_calling
        environments = environments or [None] * len(agent_index)
        row_tools = [tools.team.of(agent, environment) for agent, environment in zip(agent_index, environments)]
        prompt_ids = tools.render(model_inputs, row_tools)
        prompt_ids, completion_ids, logprobs = self._routed_call(
            model_inputs, agent_index, num_generations, prompt_ids
        )
        rows = [
            ToolRow(
                agent,
                list(conversation),
                list(ids),
                list(completion),
                tools_of_row,
                None if logprobs is None else list(logprobs[row]),
            )  # fmt: skip
            for row, (agent, conversation, ids, completion, tools_of_row) in enumerate(
                zip(agent_index, model_inputs, prompt_ids, completion_ids, row_tools)
            )
        ]
        with_tools = [row for row in rows if row.tools]

        def more(sequences, agents):  # a round of the loop: one routed call over the rows that go on
            # a sequence is no prompt: the loop kept it within the completion budget and the model's positions
            _, more_ids, more_logprobs = self._routed_call(None, agents, 1, sequences, check_lengths=False)
            return more_ids, more_logprobs

        stats = tools.loop(more).run(with_tools)
        tools.record([row.agent for row in with_tools], stats)
        completion_ids = [row.completion_ids for row in rows]
        if logprobs is not None and self.sampling_correction is not None:
            self.sampling_correction.record(agent_index, prompt_ids, completion_ids, [row.logprobs for row in rows])
        texts = [
            row.answer if row.tools else self.processing_class.decode(row.completion_ids, skip_special_tokens=True)
            for row in rows
        ]
        tool_masks = [row.tool_mask if row.tools else None for row in rows]
        return Generated([list(ids) for ids in prompt_ids], completion_ids, texts, tool_masks)

    def check_prompt_lengths(self, prompt_ids: list[list[int]], agent_index: list[int]) -> None:
        """A prompt that leaves no room for `max_completion_length` new tokens within the model's positions is an
        error naming the agent and quoting the prompt's end, before anything is generated or trained."""
        limit, owner, field = self.position_limit
        if not limit:
            return
        room = limit - self.max_completion_length
        for ids, agent in zip(prompt_ids, agent_index):
            if len(ids) > room:
                tail = self.processing_class.decode(ids[-40:], skip_special_tokens=True)
                raise ValueError(
                    f"Agent '{self.agent_names[agent]}' got a prompt of {len(ids)} tokens; with "
                    f"max_completion_length={self.max_completion_length} it exceeds {owner} {limit} positions "
                    f"({field}). The prompt ends: ...{tail!r}. Filter out such rows (prompts of at most {room} "
                    "tokens, system prompt and earlier turns included), or lower max_completion_length"
                    + (" or raise vllm_max_model_length." if field == "vllm_max_model_length" else ".")
                )


def position_limit(model_config, vllm_max_model_length: int | None) -> tuple[int | None, str, str]:
    """`(positions, whose, field)` a prompt and its completion must fit in: the model's `max_position_embeddings`, or
    vLLM's `vllm_max_model_length` when that is smaller."""
    limit = getattr(model_config, "max_position_embeddings", None)
    if vllm_max_model_length and (not limit or vllm_max_model_length < limit):
        return vllm_max_model_length, "vLLM's", "vllm_max_model_length"
    return limit, "the model's", "max_position_embeddings"


def captured_single_turn(
    trainer, decoder: CapturedDecoder, prompt_ids: list[list[int]]
) -> tuple[list[list[int]], None]:
    """TRL's `_generate_single_turn` for text without vLLM (its transformers branch: left-padded prompts, the model
    unwrapped for generation, completions cut after their first EOS), with `decoder.generate` in place of the model's
    `generate`: `(completion ids per row, None)`. Re-read when the TRL pin moves."""
    input_ids, attention_mask = left_padded(
        prompt_ids, trainer._tokenizer.pad_token_id, trainer.pad_to_multiple_of, trainer.accelerator.device
    )
    with (
        profiling_context(trainer, "transformers.generate"),
        unwrap_model_for_generation(
            trainer.model_wrapped,
            trainer.accelerator,
            gather_deepspeed3_params=trainer.args.ds3_gather_for_generation,
            generation_kwargs=trainer.generation_kwargs,
            gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs,
        ),
        torch.no_grad(),
    ):
        output = decoder.generate(input_ids, attention_mask, trainer.generation_config)
    completion_ids = output[:, input_ids.size(1) :]
    return completions_through_eos(completion_ids, trainer.eos_token_ids), None


def completions_through_eos(completion_ids: torch.Tensor, eos_token_ids: Sequence[int]) -> list[list[int]]:
    """Each row's tokens up to and including its first EOS (all of them when it has none)."""
    is_eos = torch.isin(completion_ids, torch.tensor(list(eos_token_ids), device=completion_ids.device))
    length = torch.where(is_eos.any(dim=1), is_eos.int().argmax(dim=1) + 1, completion_ids.size(1))
    return [row[:n].tolist() for row, n in zip(completion_ids.cpu(), length.tolist(), strict=True)]


def left_padded(prompt_ids: list[list[int]], pad_id: int, pad_to_multiple_of: int | None, device) -> tuple:
    """Prompts left-padded as TRL pads them for `generate`: `(input_ids, attention_mask)` on `device`."""
    prompts = [torch.tensor(ids) for ids in prompt_ids]
    input_ids = pad(prompts, padding_value=pad_id, padding_side="left", pad_to_multiple_of=pad_to_multiple_of)
    attention_mask = pad(
        [torch.ones_like(ids) for ids in prompts],
        padding_value=0,
        padding_side="left",
        pad_to_multiple_of=pad_to_multiple_of,
    )
    return input_ids.to(device), attention_mask.to(device)
