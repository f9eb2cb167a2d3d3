"""How the team acts and is scored, for both trainers: what a trainer's inputs resolve to (a task's rewards, data and
transition; reward plugins by name; the dataset columns they read), one `generate` call for rows of any agents, and
the team rewards of joint actions.
"""

from collections.abc import Callable

from accelerate.utils import gather_object

from .agents import agent_prompt
from .registry import load_plugin
from .reward_checks import (
    LOCAL_REWARD_ARGUMENTS,
    TEAM_REWARD_ARGUMENTS,
    TRANSITION_ARGUMENTS,
    check_dataset_columns,
    checked_team_reward,
)
from .tasks import resolve_task


def resolve_team_inputs(args, task, reward_funcs, train_dataset, eval_dataset, transition) -> tuple:
    """`(task, reward_funcs, train_dataset, eval_dataset, transition)` of a trainer: the task (an object or plugin
    name) supplies what was not given (its eval split when evaluation is on); a reward given by name is a plugin.
    Fails before any model loads when there is no reward, the transition is not callable, or a dataset lacks the
    `prompt` column or a column that a reward, local reward or transition reads.
    """
    # A task supplies what was not given: team rewards, training data, evaluation data, transition.
    task = resolve_task(task) if task is not None else None
    if task is not None:
        reward_funcs = reward_funcs if reward_funcs is not None else list(task.reward_funcs)
        train_dataset = train_dataset if train_dataset is not None else task.dataset("train")
        if eval_dataset is None and args.eval_strategy != "no":
            eval_dataset = task.dataset("eval")
        transition = transition or task.transition
    if eval_dataset is None and args.eval_strategy != "no":  # Trainer would say so only after the model loaded
        raise ValueError(
            f"`eval_strategy={args.eval_strategy.value!r}` needs evaluation data: pass `eval_dataset`, or a `task` "
            "(its eval split is used), or set `eval_strategy='no'`."
        )
    reward_funcs = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
    if not reward_funcs or reward_funcs == [None]:
        raise ValueError("`reward_funcs` is empty: give at least one team reward function (or a task).")
    # A name is a reward plugin (`trl-marl list rewards`).
    reward_funcs = [load_plugin("rewards", f) if isinstance(f, str) else f for f in reward_funcs]
    reward_funcs = [checked_team_reward(func, args.reward_timeout) for func in reward_funcs]
    if transition is not None and not callable(transition):
        raise TypeError(f"`transition` must be callable, got {transition!r}.")
    # A column that a reward, local reward or transition reads and the data lacks fails here, not mid-training.
    consumers = [("Team reward", func, TEAM_REWARD_ARGUMENTS) for func in reward_funcs]
    for agent, funcs in (task.local_reward_funcs if task is not None else {}).items():
        consumers += [(f"Local reward of agent '{agent}'", func, LOCAL_REWARD_ARGUMENTS) for func in funcs]
    if transition is not None and args.num_turns > 1:
        consumers.append(("Transition", transition, TRANSITION_ARGUMENTS))
    check_dataset_columns(train_dataset, consumers, "train dataset")
    eval_datasets = eval_dataset if isinstance(eval_dataset, dict) else {"": eval_dataset}
    for name, dataset in eval_datasets.items():
        check_dataset_columns(dataset, consumers, f"eval dataset {name}".strip())
    return task, reward_funcs, train_dataset, eval_dataset, transition


class TeamActionsMixin:
    """The team's `generate` and team-reward calls, for a `GRPOTrainer` subclass with agents (`TeamTrainer`)."""

    @property
    def _gather(self) -> Callable[[list], list]:
        return gather_object if self.accelerator.num_processes > 1 else list

    def _agent_input(self, agent: int, prompt):
        return agent_prompt(self.args.agents[agent]["system_prompt"], prompt, self._use_chat_template)

    def _generate_team(self, model_inputs: list, agent_index: list[int], num_generations: int):
        """One `generate` call for rows of any agents, each row through its agent's adapter.

        TRL's `_generate` would gather its metrics over processes, which needs equal row counts; tree turns differ
        between processes, so generation metrics are logged once per rollout instead (`metrics.log_rollout_metrics`).
        """
        self._route_rows(agent_index)
        try:
            prompt_ids, images, multimodal_fields = self._tokenize_prompts(model_inputs)
            self._check_prompt_lengths(prompt_ids, agent_index)
            completion_ids, logprobs = self._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations
            )
        finally:
            self._clear_routing()
        if logprobs is not None:  # vLLM's: for the importance-sampling correction
            self._record_sampling_logps(agent_index, prompt_ids, completion_ids, logprobs)
        texts = self.processing_class.batch_decode(completion_ids, skip_special_tokens=True)
        return [list(ids) for ids in prompt_ids], completion_ids, texts

    def _check_prompt_lengths(self, prompt_ids: list[list[int]], agent_index: list[int]) -> None:
        """A prompt that leaves no room for `max_completion_length` new tokens within the model's positions is an
        error naming the agent and quoting the prompt's end, before anything is generated or trained."""
        limit = getattr(self.model.config, "max_position_embeddings", None)
        owner, field = "the model's", "max_position_embeddings"
        vllm_limit = self.args.vllm_max_model_length if self.use_vllm else None
        if vllm_limit and (not limit or vllm_limit < limit):
            limit, owner, field = vllm_limit, "vLLM's", "vllm_max_model_length"
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
