"""The team a trainer trains, assembled around TRL's `GRPOTrainer.__init__` (`TeamTrainer.__init__` calls these).

Before TRL's init, `load_team_models`: each base planned and checked before anything loads (`team_bases.plan_bases`),
loaded once, and given its agents' adapters, seeded as TRL seeds (a fresh adapter per agent, or one shared by all);
which agents and adapters train. After it, `check_team_training` refuses what the team cannot train under the
accelerator TRL set up, and `prepare_other_bases` gives the other bases what TRL and Trainer did to the first.
"""

from dataclasses import dataclass
from typing import Any

from accelerate.utils import set_seed

from .agents import agent_adapter_names, agent_lora_config, attach_agent_adapters
from .routing import check_sharding_routable
from .rows import PER_ROW_LOSS_TYPES
from .team_bases import plan_bases, prepare_base, register_bases


@dataclass
class TeamModels:
    """The loaded bases of a team and who trains.

    Args:
        plans: each base's plan (`team_bases.BasePlan`: its name, its agents, how it loads), the trainer's base first.
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
    then knows them: `team_bases.register_bases`)."""
    for other in others:
        prepare_base(other, args, temperature)
        if not getattr(other, "is_loaded_in_4bit", False) and not getattr(other, "is_loaded_in_8bit", False):
            other.to(device)
    register_bases(first, others)
