"""The team a trainer trains, assembled around TRL's `GRPOTrainer.__init__` (`TeamTrainer.__init__` calls these).

Before TRL's init, `load_team_models`: each base planned and checked before anything loads (`bases.plan_bases`),
loaded once, and given its agents' adapters, seeded as TRL seeds (a fresh adapter per agent, or one shared by all);
which agents and adapters train. After it, `check_team_training` refuses what the team cannot train under the
accelerator TRL set up, and `assemble_parts` builds what generates and scores the team's episodes around TRL's model:
the other bases prepared as TRL and Trainer prepared the first, the router, the captured decode step or the team's
vLLM engine, the routed generation, the team reward functions, each base's `TeamBase` and the rollout settings.
"""

import functools
from dataclasses import dataclass
from typing import Any

from accelerate.utils import set_seed
from trl.extras.profiling import profiling_context

from ..agents import (
    adapter_parameters,
    agent_adapter_names,
    agent_lora_config,
    agent_prompt,
    attach_agent_adapters,
    cast_frozen_adapters_like_trained,
    keep_4bit_weights_trainable,
)
from ..generation.captured_decode import captured_decoder
from ..generation.routing import AdapterRouter, check_sharding_routable
from ..generation.team_generation import TeamGeneration, position_limit
from ..generation.tool_calling import episode_environments, team_tool_calling
from ..generation.vllm_generation import SamplingCorrection, TeamVLLMGeneration
from ..memory.geometry import vllm_max_num_seqs
from ..rollouts.rollout import RolloutSettings
from ..rollouts.rows import PER_ROW_LOSS_TYPES
from ..team.base_generation import other_base, tokenize_text_prompts
from ..team.bases import TeamBase, plan_bases, prepare_base, register_bases
from .scoring import TeamScoring


@dataclass
class TeamModels:
    """The loaded bases of a team and who trains.

    Args:
        plans: each base's plan (`bases.BasePlan`: its name, its agents, how it loads), the trainer's base first.
        models: each base's `PeftModel`, carrying its agents' adapters.
        agent_adapters: each agent's adapter name (agents sharing one adapter share its name).
        agent_base: each agent's base (its index in `plans`).
        trained_agents: the agents that train (not in `frozen_agents`).
    """

    plans: list
    models: list
    agent_adapters: list[str]
    agent_base: list[int]
    trained_agents: list[int]

    @property
    def adapter_names(self) -> list[str]:
        """Every adapter once."""
        return list(dict.fromkeys(self.agent_adapters))

    @property
    def trained_adapters(self) -> list[str]:
        """The adapters of the trained agents, each once."""
        return list(dict.fromkeys(self.agent_adapters[i] for i in self.trained_agents))


def load_team_models(args: Any, model: Any, quantization_config, base_models, processing_class, peft_config):
    """Plan, check and load the team's bases, each with its agents' adapters (`peft_config`, else one built from the
    config's `lora_*` fields). Raises ValueError before anything loads when `processing_class` is given but the first
    agent sits on a model of its own (whose tokenizer TRL would then use)."""
    plans = plan_bases(args, model, quantization_config, base_models)
    if processing_class is not None and not plans[0].trainer_base:
        raise ValueError(
            f"`processing_class` is given, but the first agent sits on its own model ({plans[0].name}), "
            "whose tokenizer TRL would then use. Put the first agent on the trainer's model, or leave "
            "`processing_class` out (each base loads its own tokenizer)."
        )
    models = [plan.load(args) for plan in plans]
    agent_adapters = agent_adapter_names(args.agent_names, args.adapter_mode)
    agent_base = [next(k for k, plan in enumerate(plans) if i in plan.agents) for i in range(args.num_agents)]
    # As TRL: seed before creating adapters, so their initialisation is reproducible (and equal to TRL's).
    set_seed(args.seed)
    lora_config = peft_config or agent_lora_config(
        args.lora_r, args.lora_alpha, args.lora_dropout, args.lora_target_modules
    )
    models = [
        attach_agent_adapters(base, [agent_adapters[i] for i in plan.agents], lora_config)
        for base, plan in zip(models, plans)
    ]
    trained_agents = [i for i, name in enumerate(args.agent_names) if name not in args.frozen_agents]
    return TeamModels(plans, models, agent_adapters, agent_base, trained_agents)


def check_team_training(
    args: Any, num_adapters: int, sharding: str | None, loss_type: str, extra_loss_terms: bool
) -> None:
    """Refuse what the team cannot train under the accelerator TRL set up (`sharding`: "FSDP", "DeepSpeed ZeRO-3" or
    None), each error saying why and what to use instead."""
    check_sharding_routable(num_adapters, sharding)
    if args.num_turns > 1 and sharding is not None:
        raise ValueError(
            f"`num_turns={args.num_turns}` is not supported with FSDP or DeepSpeed ZeRO-3: trees differ between "
            "processes, so they run different numbers of `generate` calls, which sharded parameters cannot serve. "
            "Use DDP or ZeRO-1/2, or `num_turns=1`."
        )
    if args.num_turns > 1 and loss_type in PER_ROW_LOSS_TYPES and extra_loss_terms:
        raise ValueError(
            f"`loss_type={loss_type!r}` with `num_turns={args.num_turns}` and an entropy bonus "
            "(`entropy_coef` / `use_adaptive_entropy`) or a router aux loss is not supported: trees pad their "
            "rows, and the padding correction of this per-row loss would scale those terms too. Use "
            "`loss_type='dapo'` (or 'bnpo'), which count real tokens only, or turn the extra term off."
        )


def prepare_other_bases(first: Any, others: list, args: Any, temperature: float, device) -> None:
    """The bases after the first get what TRL and Trainer did to the first (`first`: TRL's unwrapped model, which
    then knows them: `bases.register_bases`)."""
    for other in others:
        prepare_base(other, args, temperature)
        if not getattr(other, "is_loaded_in_4bit", False) and not getattr(other, "is_loaded_in_8bit", False):
            other.to(device)
    register_bases(first, others)


@dataclass
class TeamParts:
    """What generates and scores a trainer's episodes, built after TRL's init (`assemble_parts`).

    Args:
        router: routes each row of the first base to its agent's adapter (`routing.AdapterRouter`).
        adapter_parameters: each adapter's parameters (`agents.adapter_parameters`), checked before every loss.
        captured_decoder: the first base's captured decode step, or None (with vLLM, sharded parameters or a
            vision-language model, which generate otherwise).
        vllm_generation: the team's vLLM engine (`vllm_generation.TeamVLLMGeneration`) with `use_vllm`, else None.
        sampling_correction: vLLM's log-probs carried to TRL's importance-sampling correction, or None.
        team_generation: the first base's routed generation (`team_generation.TeamGeneration`).
        scoring: the team reward functions (`scoring.TeamScoring`).
        bases: each base's `bases.TeamBase`, TRL's model first.
        rollout_settings: what every rollout reads (`rollout.RolloutSettings`).
    """

    router: AdapterRouter
    adapter_parameters: Any
    captured_decoder: Any
    vllm_generation: Any
    sampling_correction: SamplingCorrection | None
    team_generation: TeamGeneration
    scoring: TeamScoring
    bases: list[TeamBase]
    rollout_settings: RolloutSettings


def assemble_parts(trainer: Any, team: TeamModels, use_vllm: bool, sharding: str | None) -> TeamParts:
    """The parts around the model TRL's init prepared (`trainer`: a `TeamTrainer` just past `GRPOTrainer.__init__`;
    `team`: its bases from `load_team_models`; `sharding` as in `check_team_training`). TRL's generation methods are
    looked up on the trainer at each call (as TRL's `_generate` does), so a subclass or a test may replace them."""
    args = trainer.args
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    prepare_other_bases(unwrapped, team.models[1:], args, trainer.temperature, trainer.accelerator.device)
    # Every forward is routed, a one-adapter team's too: the KL reference goes to the base model through the router
    # (PEFT's `disable_adapter` would change which adapters require grad). One adapter's rows are computed as PEFT
    # computes them, so a one-agent team stays numerically identical to GRPOTrainer.
    router = AdapterRouter(unwrapped, trainer._base_adapters(0))
    keep_4bit_weights_trainable(unwrapped)
    for base in team.models:
        cast_frozen_adapters_like_trained(base, team.trained_adapters)
    # Without vLLM, the team's decode step is captured (`captured_decode`): not under sharded parameters, which are
    # gathered module by module while the step runs.
    sharded = sharding is not None
    if args.captured_decode and (sharded or trainer._is_vlm):
        raise ValueError(
            "`captured_decode=True` is not supported with FSDP or DeepSpeed ZeRO-3 (parameters gathered module by "
            "module) or a vision-language model. Leave it None or False."
        )
    use_captured = not (use_vllm or sharded or trainer._is_vlm)
    decoder = captured_decoder(unwrapped, router, args.captured_decode) if use_captured else None
    vllm_engine = sampling_correction = None
    if use_vllm:
        vllm_engine = team_vllm_engine(
            trainer.model,
            args,
            accelerator=trainer.accelerator,
            processing_class=trainer.processing_class,
            router=router,
            adapter_names=team.adapter_names,
            trained_adapters=team.trained_adapters,
            current_step=lambda: trainer.state.global_step,
        )
        if trainer.vllm_importance_sampling_correction:
            sampling_correction = SamplingCorrection(
                trainer.vllm_importance_sampling_mode,
                trainer.vllm_importance_sampling_clip_min,
                trainer.vllm_importance_sampling_clip_max,
            )
    limit = position_limit(trainer.model.config, args.vllm_max_model_length if use_vllm else None)
    tools, environment_factory = trainer._team_tools or (None, None)
    generation = TeamGeneration(
        router,
        team.agent_adapters,
        args.agent_names,
        tokenize=lambda *call: trainer._tokenize_prompts(*call),
        generate_single_turn=lambda *call: trainer._generate_single_turn(*call),
        processing_class=trainer.processing_class,
        position_limit=limit,
        max_completion_length=trainer.max_completion_length,
        sampling_correction=sampling_correction,
        tool_calling=(
            team_tool_calling(trainer, args, tools, environment_factory, tokenize_text_prompts, limit[0])
            if trainer._team_tools
            else None
        ),
    )
    profile = functools.partial(profiling_context, trainer)
    scoring = TeamScoring(
        trainer.reward_funcs,
        trainer.reward_func_names,
        trainer_state=lambda: trainer.state,
        log_extra=trainer._log_completion_extra,
        log_metric=trainer._log_metric,
        async_loop=getattr(trainer, "async_loop", None),
        profile=profile,
    )
    first = team.plans[0]
    bases = [
        TeamBase(
            first.name, unwrapped, trainer._tokenizer, first.agents, router, decoder, generation, trainer.eos_token_ids
        )
    ]
    for plan, model in zip(team.plans[1:], team.models[1:]):
        # a base other than TRL's model, with its own tokenizer, router, captured decoder and generation, generating
        # as TRL's model does
        bases.append(
            other_base(
                plan,
                model,
                first_tokenizer=trainer._tokenizer,
                agent_adapters=team.agent_adapters,
                agent_names=args.agent_names,
                generation_config=trainer.generation_config,
                captured=args.captured_decode if use_captured else False,
                chat_template_kwargs=trainer.chat_template_kwargs,
                tools=trainer.tools,
                pad_to_multiple_of=trainer.pad_to_multiple_of,
                gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs,
                max_completion_length=trainer.max_completion_length,
                profile=profile,
            )
        )
    chat = getattr(trainer.processing_class, "chat_template", None) is not None
    roles = [agent["system_prompt"] for agent in args.agents]
    rollout_settings = RolloutSettings.from_config(
        args,
        trainer.task,
        reward_weights=trainer.reward_weights,
        baseline=trainer.baseline,
        scale_rewards=trainer.scale_rewards,
        transition=trainer.transition,
        agent_input=functools.partial(_agent_input, roles, chat),
        scheduler=trainer.scheduler,
        environment=episode_environments(environment_factory) if environment_factory is not None else None,
    )
    return TeamParts(
        router,
        adapter_parameters(unwrapped, team.adapter_names),
        decoder,
        vllm_engine,
        sampling_correction,
        generation,
        scoring,
        bases,
        rollout_settings,
    )


def _agent_input(system_prompts: list[str], use_chat_template: bool, agent: int, prompt):
    """What agent `agent` is given: its role, then the prompt (the rollouts' `agent_input`)."""
    return agent_prompt(system_prompts[agent], prompt, use_chat_template)


def team_vllm_engine(model: Any, args: Any, *, accelerator: Any, processing_class: Any, router: Any, **team: Any):
    """The trainer's `TeamVLLMGeneration`, built after `GRPOTrainer.__init__` (which ran with `use_vllm` off, so that
    it built no engine of its own) with the keywords GRPOTrainer 1.16 gives `VLLMGeneration` (re-read them when the
    TRL pin moves), plus the team's: `router` (its routing picks each row's adapter), and in `team` the
    `adapter_names`, `trained_adapters` and `current_step` of `TeamVLLMGeneration`."""
    if args.loss_type == "vespo" and args.vllm_importance_sampling_correction:
        if args.vllm_importance_sampling_mode not in ["token_truncate", "token_mask"]:  # as GRPOTrainer checks
            raise ValueError(
                "VESPO loss requires `vllm_importance_sampling_mode` to be either 'token_truncate' or 'token_mask'. "
                f"Got: {args.vllm_importance_sampling_mode}."
            )
    ranks = [config.r for name, config in model.peft_config.items() if name in team["adapter_names"]]
    return TeamVLLMGeneration(
        model=model,
        row_adapters=lambda: router.row_adapters,
        lora_rank=max(ranks),
        team_rows=vllm_max_num_seqs(args),
        seed=args.seed,
        **team,
        accelerator=accelerator,
        processing_class=processing_class,
        mode=args.vllm_mode,
        structured_outputs_regex=args.vllm_structured_outputs_regex,
        server_base_url=args.vllm_server_base_url,
        server_host=args.vllm_server_host,
        server_port=args.vllm_server_port,
        group_port=args.vllm_group_port,
        server_timeout=args.vllm_server_timeout,
        tensor_parallel_size=args.vllm_tensor_parallel_size,
        gpu_memory_utilization=args.vllm_gpu_memory_utilization,
        max_model_length=args.vllm_max_model_length,
        max_num_seqs=args.per_device_train_batch_size * args.vllm_tensor_parallel_size * args.steps_per_generation,
        enable_sleep_mode=args.vllm_enable_sleep_mode,
        model_impl=args.vllm_model_impl,
        trust_remote_code=args.trust_remote_code,
        repetition_penalty=args.repetition_penalty,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        max_completion_length=args.max_completion_length,
        logprobs=0,  # the sampled tokens' log-probs, for the importance-sampling correction
        generation_kwargs=args.generation_kwargs,
    )
