"""`MAGRPOTrainer`: multi-agent GRPO (MAGRPO, arXiv 2508.04652). The team stack is [`TeamTrainer`]'s; this trainer
owns its rollout, the MAGRPO tree of each prompt (`rollout.TreeRollout`; one turn unless `num_turns > 1`): every agent
answers at every node, joint actions get one team reward, returns and advantages follow MAGRPO (docs/design.md, §5).
"""

import textwrap
from collections.abc import Callable

import torch
from trl.models import unwrap_model_for_generation

from ..config import MAGRPOConfig
from ..generation.vllm_serving import sampling_seed
from ..registry import load_plugin
from ..rollouts.magrpo_rollout import TreeRollout
from ..rollouts.program_rollout import EpisodeResult, ProgramRollout, episode_outcome
from ..rollouts.rollout import Rollout
from ..serving.server import require_serving_packages
from .metrics import log_local_rewards
from .team_trainer import TeamTrainer


class MAGRPOTrainer(TeamTrainer):
    """Multi-agent GRPO (MAGRPO, arXiv 2508.04652) as a thin [`~trl.GRPOTrainer`] subclass.

    Takes [`TeamTrainer`]'s arguments (the model, team reward functions or plugin names, a task, a transition for
    `num_turns > 1`, a scheduler, quantization and LoRA configs, and TRL's), with a [`MAGRPOConfig`] as `args`, and:

    Args:
        episode: an agent program as the rollout (docs/programs.md): `fn(client, row)` (or an `async` one) called once
            per episode with an `openai` client bound to it and the dataset row; it calls the agents by name as the
            `model`, as often and in whatever order it likes, and returns the team reward (a float) or a mapping for
            the reward functions (as the completion, with the row's columns as keyword arguments). The G episodes of
            a row form its group. A name is an episode plugin (`args.episode` names one too). Without reward
            functions or a task, a float outcome is the reward (`program_rollout.episode_outcome`).
    """

    _tag_names = ["trl", "trl-marl", "magrpo"]
    _name = "MAGRPO"
    _paper = {
        "title": "LLM Collaboration With Multi-Agent Reinforcement Learning",
        "id": "2508.04652",
        # docstyle-ignore
        "citation": textwrap.dedent("""\
            @article{liu2025llmcollaboration,
                title        = {{LLM Collaboration With Multi-Agent Reinforcement Learning}},
                author       = {Shuo Liu and Tianle Chen and Zeyu Liang and Xueguang Lyu and Christopher Amato},
                year         = 2025,
                eprint       = {arXiv:2508.04652},
            }"""),
    }
    _config_class = MAGRPOConfig

    def __init__(self, model, reward_funcs=None, args=None, *more, episode: Callable | str | None = None, **kwargs):
        if episode is None and isinstance(args, MAGRPOConfig):
            episode = args.episode
        if isinstance(episode, str):
            episode = load_plugin("episodes", episode)
        if episode is not None:
            check_episode_settings(args)
            require_serving_packages("openai")  # the trainer serves its team; each episode gets an `openai` client
            if reward_funcs is None and kwargs.get("task") is None:
                reward_funcs = [episode_outcome]
        funcs = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
        self._scores_floats = any(func is episode_outcome for func in funcs)
        self._scores_mappings = any(func is not episode_outcome for func in funcs)  # a task's rewards too
        self.episode = episode
        self._episode_runner = None
        super().__init__(model, reward_funcs, args, *more, **kwargs)

    def _rollout(self, inputs: list[dict], num_generations: int) -> Rollout:
        """This process's share of the batch's episodes: MAGRPO trees, or the episode function's programs. The task's
        local rewards are logged, not trained on (MAGRPO optimises the team reward)."""
        if self.episode is not None:
            hooks = self._rollout_hooks(inputs, num_generations)
            del hooks["generate"]
            rollout = ProgramRollout(
                self.rollout_settings,
                num_generations,
                self._scores_floats,
                self._scores_mappings,
                max_failed_fraction=self.args.episode_max_failed_fraction,
            )
            return rollout.run(inputs, run_episodes=self._run_episodes, **hooks)
        rollout = TreeRollout(
            self.rollout_settings,
            num_generations,
            joint_mode=self.args.joint_mode,
            discount=self.args.discount,
            process_index=self.accelerator.process_index,
        ).run(inputs, **self._rollout_hooks(inputs, num_generations))
        metrics = self._metrics["train" if self.model.training else "eval"]
        log_local_rewards(metrics, self.task, self.agent_names, rollout.samples, self.accelerator.num_processes)
        return rollout

    def _run_episodes(self, examples: list[dict]) -> list[EpisodeResult]:
        """Run one episode per prompt copy against the trainer's server (started at the first batch): on the model in
        TRL's generation context, or on the team's vLLM engine (`use_vllm`), awake with this step's adapters, whose
        log-probs of each recorded completion go to TRL's importance-sampling correction. Each episode's sampling
        seed comes from one draw of torch's generator, the process and the copy, so a rerun (or a run resumed from a
        checkpoint) samples as this one did."""
        # one draw from torch's generator, as `generate` draws from it: a checkpoint's random state restores it
        batch = int(torch.randint(0, 2**62, ()).item())
        process = self.accelerator.process_index
        seeds = [sampling_seed(batch, process, copy) for copy in range(len(examples))]
        if self.use_vllm:
            generating = self.vllm_generation.awake()
        else:
            generating = unwrap_model_for_generation(
                self.model_wrapped,
                self.accelerator,
                gather_deepspeed3_params=self.args.ds3_gather_for_generation,
                gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs,
            )
        with generating:
            results = self._episode_server().run(examples, seeds)
        if self.sampling_correction is not None:
            calls = [call for result in results for call in result.calls]
            self.sampling_correction.record(
                [call.agent for call in calls],
                [call.prompt_ids for call in calls],
                [call.completion_ids for call in calls],
                [call.logprobs for call in calls],
            )
        return results

    def _episode_server(self):
        """The server the episodes call (`episode_runner.EpisodeRunner`), started at the first batch."""
        from ..serving.episodes import EpisodeSampling
        from .episode_runner import EpisodeRunner, TrainingTeam

        if self._episode_runner is None:
            sampling = EpisodeSampling(self.temperature, self.args.top_p, self.max_completion_length)
            self._episode_runner = EpisodeRunner(
                TrainingTeam(self),
                self.episode,
                sampling,
                max_calls=self.args.episode_max_calls,
                timeout=self.args.episode_timeout,
            )
        return self._episode_runner

    def close_episode_server(self) -> None:
        """Stop the server the episodes call (started again by the next rollout)."""
        if self._episode_runner is not None:
            self._episode_runner.close()
            self._episode_runner = None

    def _release_generation(self) -> None:
        """The episode server stops first: its engine's thread holds the vLLM engine that `super()` then closes."""
        self.close_episode_server()
        super()._release_generation()

    def evaluate(self, *args, **kwargs):
        """TRL's; an evaluation that started the episode server stops it (a later rollout starts it again)."""
        started_here = self._episode_runner is None
        try:
            return super().evaluate(*args, **kwargs)
        finally:
            if started_here:
                self.close_episode_server()


def check_episode_settings(args) -> None:
    """What an episode rollout cannot do yet, refused before any model loads, naming the field."""
    if not isinstance(args, MAGRPOConfig):
        return  # TeamTrainer's own check says what `args` must be
    sampling_only = "the episode server samples with temperature and top-p only"
    refusals = {
        "num_turns": (args.num_turns != 1, "the program decides the turns: leave `num_turns=1`"),
        "joint_mode": (args.joint_mode != "aligned", "an episode is one joint action: use `joint_mode='aligned'`"),
        "top_k": (args.top_k not in (None, 0), sampling_only),
        "min_p": (args.min_p is not None, sampling_only),
        "repetition_penalty": (args.repetition_penalty != 1.0, "the episode server applies no repetition penalty"),
        "generation_kwargs": (bool(args.generation_kwargs), sampling_only),
        "vllm_structured_outputs_regex": (
            args.vllm_structured_outputs_regex is not None,
            "the episode server does not constrain what the agents write",
        ),
    }
    for name, (refused, why) in refusals.items():
        if refused:
            raise ValueError(f"`{name}={getattr(args, name)!r}` is not supported with an episode function: {why}.")
