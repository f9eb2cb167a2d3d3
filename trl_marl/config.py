"""Configurations of the trainers: `TeamConfig` (TRL's `GRPOConfig` plus the team) and its siblings, `MAGRPOConfig`,
`ATGRPOConfig` and the actor-critic `IACConfig` and `MAACConfig` (`ActorCriticConfig`), each with the fields of its
algorithm."""

import logging
from dataclasses import dataclass, field
from typing import Any, ClassVar

from trl import GRPOConfig

from .agents import normalize_agents
from .generation.decode_support import captured_decode_setting
from .generation.vllm_limits import SERVER_MODE_REASON
from .precision import default_mixed_precision
from .registry import check_plugin_name
from .rollouts.atgrpo_rollout import CONTINUATIONS

logger = logging.getLogger("trl_marl")

JOINT_MODES = ("aligned", "cross")
BASELINES = ("mean", "rloo", "max", "none")
ADAPTER_MODES = ("per_agent", "shared")


def _choice_error(field_name: str, value: Any, allowed: tuple[str, ...]) -> ValueError:
    return ValueError(f"`{field_name}` must be one of {list(allowed)}, got {value!r}.")


class _TeamConfigType(type):
    """Builds a team config from its keyword arguments less the sibling config's fields (see
    `TeamConfig.without_inapplicable`), so such a field gets an error that says why rather than a `TypeError`."""

    def __call__(cls, *args, **kwargs):
        return super().__call__(*args, **cls.without_inapplicable(kwargs))


@dataclass
class TeamConfig(GRPOConfig, metaclass=_TeamConfigType):
    r"""
    What [`MAGRPOConfig`] and [`ATGRPOConfig`] share: everything [`~trl.GRPOConfig`] has, plus the team.

    `per_device_train_batch_size` and `generation_batch_size` count prompt copies as in TRL; each copy yields one
    completion *per agent*, so a micro-batch trains `len(agents) * per_device_train_batch_size` sequences. Build one of
    the two algorithm configs; this class holds no algorithm of its own.

    Parameters:
        > Parameters that define the team

        agents (`list[str | dict]`):
            The agents, in order. Each is a name or a dict `{"name": ..., "system_prompt": ...}`. The name names the
            agent's LoRA adapter and its output folder; the system prompt (its role) is prepended to the task prompt.
        baseline (`str`, *optional*, defaults to `"mean"`):
            Baseline subtracted from a reward within its group: `"mean"` (as GRPO), `"rloo"` (mean of the others),
            `"max"`, or `"none"`. Scaling then follows `scale_rewards` (`"group"`, `"batch"` or `"none"`), as in TRL.
        max_joint_actions (`int`, *optional*, defaults to `256`):
            Upper bound on the team reward evaluations of one prompt, all turns counted; a configuration that exceeds
            it is rejected before any model is loaded.
        reward_timeout (`float` or `None`, *optional*, defaults to `None`):
            Seconds a team reward function may take to score one batch; longer is an error naming the function.

        > Parameters that control multi-turn episodes

        num_turns (`int`, *optional*, defaults to `1`):
            Turns per episode (T).
        termination_threshold (`float` or `None`, *optional*, defaults to `None`):
            Early termination once the team reward reaches this value (see each algorithm's config). `None`: the
            episode runs until `num_turns` or until the transition says it is done.
        scheduler (`str`, *optional*, defaults to `"parallel"`):
            Name of the turn scheduler plugin that says which agents act at each turn and what each sees: `parallel`
            (all act; each sees the earlier turns), `sequential` (in order within a turn; each also sees the agents
            before it this turn), `round_robin` (one agent per turn), `debate` (all act; each sees the others'
            previous answers), or one registered by an installed package (`trl-marl list schedulers`).

        > Parameters that control the adapters

        adapter_mode (`str`, *optional*, defaults to `"per_agent"`):
            `"per_agent"`: one LoRA adapter per agent, named after it. `"shared"`: one adapter named `"team"` serves
            every agent; the system prompts tell them apart.
        lora_r (`int`, *optional*, defaults to `16`):
            LoRA rank of each adapter.
        lora_alpha (`int`, *optional*, defaults to `32`):
            LoRA scaling numerator.
        lora_dropout (`float`, *optional*, defaults to `0.0`):
            Dropout on the LoRA input.
        lora_target_modules (`list[str]`, *optional*, defaults to `["all-linear"]`):
            Modules that carry adapters. Ignored when a `peft_config` is passed to the trainer.
        frozen_agents (`list[str]`, *optional*, defaults to `[]`):
            Agents that act but do not train: their completions are generated and scored, and carry no loss. With
            `adapter_mode="per_agent"` their adapters stay exactly as loaded.

        > Parameters that control generation

        captured_decode (`bool`, `str` or `None`, *optional*, defaults to `None`):
            Generate with the captured decode step (`trl_marl.generation.captured_decode`): a static KV cache, the
            routing to each row's adapter held in tensors, and the one-token forward replayed on fixed shapes. `None`:
            on for CUDA devices, recorded as CUDA graphs (a few steps' time per shape), off elsewhere; `True`: on
            (CUDA graphs on CUDA, compiled on a CPU); `"cuda-graphs"` or `"compiled"` (`torch.compile`: one compile
            for every shape, kept on disk for later runs; CUDA graphs through it on a GPU): that mechanism; `False`:
            transformers' eager `generate`. Without vLLM only.

        > Differences from `GRPOConfig`'s defaults

        bf16 (`bool` or `None`, *optional*, defaults to `None`):
            As TRL (`True` unless `fp16`), except with `use_cpu=True`, where `None` means `False`: bf16 autocast on
            a CPU without native bf16 support made a training step 9.9x slower (docs/benchmarks.md), and on a GPU
            without bf16, where `None` means fp16 (with a warning).
    """

    # Fields of the sibling config that mean nothing here: name -> (the value under which it changes nothing, why).
    not_applicable: ClassVar[dict[str, tuple[Any, str]]] = {}
    _algorithm: ClassVar[str] = "a team"
    _trainer: ClassVar[str] = ""  # the trainer this config goes to

    @classmethod
    def without_inapplicable(cls, values: dict[str, Any]) -> dict[str, Any]:
        """`values` without the sibling config's fields that are set to the value under which they change nothing
        (AT-GRPO with `discount=1.0`, as configs written before the split may say); any other value of such a field
        is a `ValueError` that names it and says why it does not apply."""
        kept = dict(values)
        for name, (neutral, reason) in cls.not_applicable.items():
            if name in kept and (value := kept.pop(name)) != neutral:
                raise ValueError(f"`{name}={value!r}` does not apply to {cls._algorithm}: {reason}")
        return kept

    # Parameters that define the team
    # Typed as names for command-line parsing; Python code and YAML files may give {'name', 'system_prompt'} dicts.
    agents: list[str] | None = field(
        default=None,
        metadata={
            "help": "The agents: names or {'name', 'system_prompt'} dicts. Names are unique: a letter, then "
            "letters, digits, _ or -; not ref, __base__, default, nor a piece of PEFT's prefix 'lora_'."
        },
    )
    baseline: str = field(
        default="mean",
        metadata={"help": "Baseline of the team reward within a prompt group.", "choices": list(BASELINES)},
    )
    max_joint_actions: int = field(
        default=256,
        metadata={"help": "Upper bound on joint actions (team reward evaluations) per prompt."},
    )
    reward_timeout: float | None = field(
        default=None,
        metadata={"help": "Seconds a team reward function may take to score one batch; longer is an error naming the "
                  "function (None: no limit)."},
    )  # fmt: skip

    # Parameters that control multi-turn episodes
    num_turns: int = field(default=1, metadata={"help": "Turns per episode."})
    termination_threshold: float | None = field(
        default=None,
        metadata={"help": "Stop early once the team reward reaches this value (None: no early stop)."},
    )
    scheduler: str = field(
        default="parallel",
        metadata={"help": "Turn scheduler plugin: parallel, sequential, round_robin, debate, or an installed one."},
    )

    # Parameters that control the adapters
    adapter_mode: str = field(
        default="per_agent",
        metadata={"help": "One LoRA adapter per agent, or one shared adapter.", "choices": list(ADAPTER_MODES)},
    )
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha."})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout."})
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["all-linear"],
        metadata={"help": "Modules that carry LoRA adapters (module names, or 'all-linear')."},
    )
    frozen_agents: list[str] = field(
        default_factory=list,
        metadata={"help": "Agents that act but do not train (their adapters stay as loaded)."},
    )

    # Parameters that control generation
    # Typed `str | None` for the command line (where "true", "false" and "none" are read as True, False and None);
    # Python takes True, False and None as they are.
    captured_decode: str | None = field(
        default=None,
        metadata={
            "help": "Generate with a static KV cache and a one-token step replayed on fixed shapes. None: on for CUDA "
            "devices (recorded CUDA graphs), off elsewhere; true: on; 'cuda-graphs' or 'compiled' (torch.compile, "
            "cached on disk): that mechanism; false: eager generate. Without vLLM only."
        },
    )

    def __post_init__(self):
        if not self._trainer:
            raise TypeError(
                f"{type(self).__name__} is a base the configs share: use MAGRPOConfig, ATGRPOConfig, IACConfig or "
                "MAACConfig."
            )
        self.agents = normalize_agents(self.agents)
        frozen = self.frozen_agents or []
        self.frozen_agents = [frozen] if isinstance(frozen, str) else list(frozen)  # `frozen_agents: critic`
        unknown = [name for name in self.frozen_agents if name not in self.agent_names]
        if unknown:
            raise ValueError(
                f"`frozen_agents` names {unknown}, which are not agents; the agents are {self.agent_names}."
            )
        if len(set(self.frozen_agents)) == len(self.agent_names):
            raise ValueError(
                f"`frozen_agents` freezes every agent ({self.frozen_agents}): nothing would train. Leave at least one "
                "agent out of it."
            )
        if self.baseline not in BASELINES:
            raise _choice_error("baseline", self.baseline, BASELINES)
        if self.adapter_mode not in ADAPTER_MODES:
            raise _choice_error("adapter_mode", self.adapter_mode, ADAPTER_MODES)
        if isinstance(self.scheduler, str):  # found now, not when the trainer starts
            check_plugin_name("schedulers", self.scheduler, "scheduler")
        if not isinstance(self.max_joint_actions, int) or self.max_joint_actions < 1:
            raise ValueError(f"`max_joint_actions` must be a positive integer, got {self.max_joint_actions!r}.")
        if not isinstance(self.num_turns, int) or isinstance(self.num_turns, bool) or self.num_turns < 1:
            raise ValueError(f"`num_turns` must be a positive integer, got {self.num_turns!r}.")
        if self.reward_timeout is not None and not (
            isinstance(self.reward_timeout, (int, float)) and self.reward_timeout > 0
        ):
            raise ValueError(
                f"`reward_timeout` must be a positive number of seconds or None, got {self.reward_timeout!r}."
            )
        if self.termination_threshold is not None and not isinstance(self.termination_threshold, (int, float)):
            raise ValueError(f"`termination_threshold` must be a number or None, got {self.termination_threshold!r}.")
        if not isinstance(self.lora_r, int) or self.lora_r < 1:
            raise ValueError(f"`lora_r` must be a positive integer, got {self.lora_r!r}.")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"`lora_dropout` must be in [0, 1), got {self.lora_dropout!r}.")
        if not isinstance(self.num_generations, int) or self.num_generations < 2:
            raise ValueError(
                f"`num_generations` must be at least 2 (got {self.num_generations!r}): advantages compare the joint "
                "actions sampled for one prompt, so each agent needs at least two completions per prompt."
            )
        self.captured_decode = captured_decode_setting(self.captured_decode)
        if self.captured_decode and self.use_vllm:
            raise ValueError(
                f"`captured_decode={self.captured_decode!r}` and `use_vllm=True` both choose how to generate: vLLM "
                "serves the team's adapters itself. Set one of them."
            )
        if self.use_vllm and self.vllm_mode != "colocate":
            raise ValueError(SERVER_MODE_REASON)
        if self.use_vllm and self.vllm_tensor_parallel_size != 1:
            raise ValueError(
                f"`vllm_tensor_parallel_size={self.vllm_tensor_parallel_size}` is not supported with `use_vllm`: "
                "TRL's tensor-parallel generation gathers the prompts of several processes into one call, while each "
                "process's rows carry their own agents' adapters. Set it to 1 (a team's base fits one GPU)."
            )
        # Continuous batching does not keep rows in order, so it cannot route rows to adapters.
        if self.use_transformers_continuous_batching:
            raise ValueError(
                "`use_transformers_continuous_batching=True` is not supported: it does not keep rows in order, so "
                "rows cannot be routed to their agents' adapters. Set it to False."
            )
        self.bf16, self.fp16 = default_mixed_precision(self.bf16, self.fp16, self.use_cpu)
        if self.torch_compile:
            raise ValueError(
                "`torch_compile=True` is not supported: the per-row adapter routing runs in forward hooks whose "
                "routing changes with every batch, so the compiled model would recompile at every step. Set "
                "`torch_compile=False`."
            )
        if self.multi_objective_aggregation != "sum_then_normalize":
            raise ValueError(
                f"`multi_objective_aggregation={self.multi_objective_aggregation!r}` is not supported by "
                f"{self._algorithm}: team rewards are combined as a weighted sum, then baselined per prompt group. "
                "Use 'sum_then_normalize'."
            )
        if self.load_best_model_at_end and self.metric_for_best_model is None:
            # transformers would rank checkpoints by the eval loss, GRPO's surrogate: it says nothing of the team.
            self.metric_for_best_model = "reward"
        super().__post_init__()

        for field_name in ("num_generations", "num_generations_eval"):
            num_generations = getattr(self, field_name)
            if num_generations is None:
                continue
            size = self.joint_actions_per_prompt(num_generations)
            if size > self.max_joint_actions:
                raise ValueError(self._tree_too_large_message(field_name, num_generations, size))

    @classmethod
    def for_task(cls, task, **kwargs) -> "MAGRPOConfig":
        """A config taking the task's agents, turns and scheduler (a `Task` or task plugin name), overridable by
        `kwargs`."""
        from .tasks import resolve_task, task_defaults

        return cls(**{**task_defaults(resolve_task(task)), **kwargs})

    @property
    def num_agents(self) -> int:
        return len(self.agents)

    @property
    def agent_names(self) -> list[str]:
        return [agent["name"] for agent in self.agents]

    def joint_actions_per_prompt(self, num_generations: int) -> int:
        """Team reward evaluations of one prompt at most (bounded by `max_joint_actions`)."""
        raise NotImplementedError

    def _tree_too_large_message(self, field_name: str, num_generations: int, size: int) -> str:
        raise NotImplementedError


@dataclass
class MAGRPOConfig(TeamConfig):
    r"""
    Configuration class for [`MAGRPOTrainer`]: everything [`~trl.GRPOConfig`] has, plus the team ([`TeamConfig`]) and
    MAGRPO's joint actions and returns.

    In MAGRPO (arXiv 2508.04652) every agent samples `num_generations` (G) completions for each prompt; joint actions
    combine them and receive one team reward; each agent's completion is trained with an advantage derived from the
    rewards of the joint actions it took part in. With `num_turns > 1` every joint action
    of turn t < T−1 opens a child node where each agent samples G new completions, prompted with what the trainer's
    `transition` shows it: a full tree has G^T leaves (aligned) or G^(N·T) (cross); `termination_threshold` stops
    expanding a node whose mean team reward reached it (its joint actions are leaves).

    Parameters:
        joint_mode (`str`, *optional*, defaults to `"aligned"`):
            How agents' completions form joint actions: `"aligned"` pairs the g-th completion of every agent (G joint
            actions per prompt); `"cross"` takes the Cartesian product (G^N joint actions per prompt).
        discount (`float`, *optional*, defaults to `1.0`):
            γ in the Monte-Carlo return R(j) = r(j) + γ · mean(R of j's children); a leaf's return is its reward.
        episode (`str` or `None`, *optional*):
            An episode plugin (entry-point group `trl_marl.episodes`): an agent program run as the rollout, each of
            the G episodes of a prompt calling the agents through the trainer's endpoint (docs/programs.md). The
            trainer's `episode=` argument takes a function directly.
        episode_max_calls (`int` or `None`, *optional*, defaults to `64`):
            The most requests one episode may make; the next is refused (429).
        episode_timeout (`float` or `None`, *optional*, defaults to `300`):
            Seconds an episode may run; one that runs longer is left out of its group.
        episode_max_failed_fraction (`float`, *optional*, defaults to `0.5`):
            The largest share of a step's episodes that may fail (raise, time out, return nothing the rewards
            score); when more fail, training stops with an error naming the first failed episode and its cause.
            `1.0` never stops.

    The team's fields are [`TeamConfig`]'s.
    """

    _algorithm: ClassVar[str] = "MAGRPO"
    _trainer: ClassVar[str] = "MAGRPOTrainer"

    joint_mode: str = field(
        default="aligned",
        metadata={"help": "How completions form joint actions.", "choices": list(JOINT_MODES)},
    )
    discount: float = field(default=1.0, metadata={"help": "Discount γ of the Monte-Carlo returns over turns."})
    episode: str | None = field(
        default=None, metadata={"help": "An episode plugin: an agent program run as the rollout (docs/programs.md)."}
    )
    episode_max_calls: int | None = field(default=64, metadata={"help": "The most requests one episode may make."})
    episode_timeout: float | None = field(default=300.0, metadata={"help": "Seconds an episode may run."})
    episode_max_failed_fraction: float = field(
        default=0.5,
        metadata={"help": "The largest share of a step's episodes that may fail before training stops (1.0: never)."},
    )

    def __post_init__(self):
        if self.joint_mode not in JOINT_MODES:
            raise _choice_error("joint_mode", self.joint_mode, JOINT_MODES)
        if not isinstance(self.discount, (int, float)) or not 0.0 <= self.discount <= 1.0:
            raise ValueError(f"`discount` must be a number in [0, 1], got {self.discount!r}.")
        for name in ("episode_max_calls", "episode_timeout"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise ValueError(f"`{name}` must be a positive number or None, got {value!r}.")
        fraction = self.episode_max_failed_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 <= fraction <= 1.0:
            raise ValueError(
                f"`episode_max_failed_fraction` must be a number in [0, 1] (the share of a step's episodes that may "
                f"fail; 1.0 never stops), got {fraction!r}."
            )
        if self.episode is not None:
            check_plugin_name("episodes", self.episode, "episode")
        super().__post_init__()

    def joint_actions_per_node(self, num_generations: int) -> int:
        """Joint actions at one tree node: G (aligned) or G^N (cross)."""
        return num_generations if self.joint_mode == "aligned" else num_generations**self.num_agents

    def joint_actions_per_prompt(self, num_generations: int) -> int:
        """Team reward evaluations of one prompt's full tree: Σ_{t=1..T} K^t, with K joint actions per node."""
        per_node = self.joint_actions_per_node(num_generations)
        return sum(per_node**turn for turn in range(1, self.num_turns + 1))

    def _tree_too_large_message(self, field_name: str, num_generations: int, size: int) -> str:
        per_node = self.joint_actions_per_node(num_generations)
        per_turn = " + ".join(str(per_node**turn) for turn in range(1, self.num_turns + 1))
        counted = f"{per_turn} = {size}" if self.num_turns > 1 else str(size)
        lower = "`num_turns` or `num_generations`" if self.num_turns > 1 else "`num_generations`"
        mode = ", use `joint_mode='aligned'`" if self.joint_mode == "cross" else ""
        return (
            f"The tree of one prompt is too large: `joint_mode={self.joint_mode!r}` with {self.num_agents} agents, "
            f"{field_name}={num_generations} and num_turns={self.num_turns} gives {counted} joint actions "
            f"({per_node**self.num_turns} leaves), more than `max_joint_actions` ({self.max_joint_actions}). "
            f"Lower {lower}{mode}, or raise `max_joint_actions`."
        )


@dataclass
class ATGRPOConfig(TeamConfig):
    r"""
    Configuration class for [`ATGRPOTrainer`]: everything [`~trl.GRPOConfig`] has, plus the team ([`TeamConfig`]) and
    AT-GRPO's fields (arXiv 2510.11062).

    Each problem is played as one episode. At every turn the acting agents act one after another in the scheduler's
    order; for the acting agent, `num_generations` (K) candidates are sampled from the same state and scored with
    r = α · team reward + the agent's local reward (the task's `local_reward_funcs`). The K candidates of
    (problem, turn, agent) form one group: advantage = (r − mean) / (std + ε) within it (`baseline` and
    `scale_rewards` apply as in MAGRPO). The episode continues from the chosen candidate; the next agent acts from
    the updated state. `adapter_mode` picks the policy regime: `"per_agent"` (one adapter per agent) or `"shared"`
    (one adapter, role prompts tell agents apart).

    MAGRPO's `joint_mode` and `discount` are not fields here (an AT-GRPO group is one agent's candidates, each rewarded
    at its own step): `joint_mode="aligned"` and `discount=1.0`, which change nothing, are accepted and dropped; any
    other value is an error that says why. `termination_threshold` ends an episode after a turn whose last chosen
    candidate's team reward reached it.

    Parameters:
        team_reward_weight (`float`, *optional*, defaults to `1.0`):
            α in r = α · team + local.
        continuation (`str`, *optional*, defaults to `"greedy"`):
            Which candidate the episode continues from: `"greedy"` (the highest reward; ties: the first) or
            `"sample"` (uniformly among the scorable ones).

    The team's fields are [`TeamConfig`]'s.
    """

    _algorithm: ClassVar[str] = "AT-GRPO"
    _trainer: ClassVar[str] = "ATGRPOTrainer"
    not_applicable: ClassVar[dict[str, tuple[Any, str]]] = {
        "joint_mode": (
            "aligned",
            "each group holds one agent's candidates from one state, not joint actions. Leave it out (use "
            "MAGRPOConfig for cross mode).",
        ),
        "discount": (
            1.0,
            "every candidate is rewarded at its own step, without returns over later turns. Leave it out (use "
            "MAGRPOConfig for discounted returns).",
        ),
    }

    team_reward_weight: float = field(
        default=1.0, metadata={"help": "α: weight of the team reward in r = α·team + local."}
    )
    continuation: str = field(
        default="greedy",
        metadata={"help": "Continue from the best candidate or a sampled one.", "choices": list(CONTINUATIONS)},
    )

    def __post_init__(self):
        if self.continuation not in CONTINUATIONS:
            raise _choice_error("continuation", self.continuation, CONTINUATIONS)
        if not isinstance(self.team_reward_weight, (int, float)) or isinstance(self.team_reward_weight, bool):
            raise ValueError(f"`team_reward_weight` must be a number, got {self.team_reward_weight!r}.")
        super().__post_init__()

    def joint_actions_per_prompt(self, num_generations: int) -> int:
        """Reward evaluations of one problem at most: one per candidate, K per acting agent per turn."""
        return num_generations * self.num_agents * self.num_turns

    def _tree_too_large_message(self, field_name: str, num_generations: int, size: int) -> str:
        return (
            f"One AT-GRPO episode evaluates up to {field_name}={num_generations} × {self.num_agents} agents × "
            f"num_turns={self.num_turns} = {size} candidates, more than `max_joint_actions` "
            f"({self.max_joint_actions}). Lower `num_turns` or `num_generations`, or raise `max_joint_actions`."
        )


@dataclass
class ActorCriticConfig(TeamConfig):
    r"""
    Configuration shared by [`IACConfig`] and [`MAACConfig`]: everything [`~trl.GRPOConfig`] has, plus the team
    ([`TeamConfig`]) and the critics' fields (docs/critics.md).

    Each of the `num_generations` copies of a prompt is one trajectory: at every turn every agent acts once (as in
    MAGRPO, without its tree), the team reward scores the joint action, and a critic (a LoRA adapter on the team's base
    with a value head) values the history before it. Each agent's completion is trained with TRL's GRPO loss whose
    advantage is the generalized advantage estimate A_t = Σ_l (γλ)^l δ_{t+l}, δ_t = r_t + γ·V_{t+1} − V_t, and the
    critic with a value loss towards the λ-returns A_t + V_t. `baseline` and `scale_rewards` do not apply: the critic
    is the baseline and `normalize_advantages` the scaling.

    Parameters:
        discount (`float`, *optional*, defaults to `1.0`):
            γ.
        gae_lambda (`float`, *optional*, defaults to `0.95`):
            λ of the generalized advantage estimate: 0 is the one-step TD error (CoMLRL's), 1 the Monte-Carlo
            return less the value.
        value_loss_coef (`float`, *optional*, defaults to `0.1`):
            Weight of the critics' value loss (TRL's `PPOConfig.vf_coef`).
        value_clip_range (`float` or `None`, *optional*, defaults to `0.2`):
            A new value is clipped to within this of the value the rollout computed before the value loss is taken
            (the larger of the clipped and unclipped losses, as TRL's PPO; `cliprange_value`). `None`: no clipping.
        critic_learning_rate (`float` or `None`, *optional*):
            Learning rate of the critics' adapters and value heads (their own optimizer parameter group, on the same
            schedule); `None`: `learning_rate`.
        normalize_advantages (`bool`, *optional*, defaults to `True`):
            Z-score each critic's advantages over the process's scored joint actions of the step (PPO's whitening).

    The team's fields are [`TeamConfig`]'s.
    """

    _algorithm: ClassVar[str] = "an actor-critic team"
    _critic_kind: ClassVar[str] = ""
    not_applicable: ClassVar[dict[str, tuple[Any, str]]] = {
        "joint_mode": (
            "aligned",
            "every agent's g-th completion forms the g-th trajectory's joint action; there is no tree to cross.",
        ),
    }

    discount: float = field(default=1.0, metadata={"help": "Discount γ."})
    gae_lambda: float = field(default=0.95, metadata={"help": "λ of the generalized advantage estimate."})
    value_loss_coef: float = field(default=0.1, metadata={"help": "Weight of the critics' value loss."})
    value_clip_range: float | None = field(
        default=0.2, metadata={"help": "Clip new values to within this of the rollout's (None: no clipping)."}
    )
    critic_learning_rate: float | None = field(
        default=None, metadata={"help": "The critics' learning rate (None: learning_rate)."}
    )
    normalize_advantages: bool = field(
        default=True, metadata={"help": "Z-score each critic's advantages over the step's joint actions."}
    )

    def __post_init__(self):
        for name in ("discount", "gae_lambda"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise ValueError(f"`{name}` must be a number in [0, 1], got {value!r}.")
        if isinstance(self.value_loss_coef, bool) or not isinstance(self.value_loss_coef, (int, float)):
            raise ValueError(f"`value_loss_coef` must be a number, got {self.value_loss_coef!r}.")
        if self.value_loss_coef < 0:
            raise ValueError(f"`value_loss_coef` must be 0 or more, got {self.value_loss_coef!r}.")
        for name in ("value_clip_range", "critic_learning_rate"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise ValueError(f"`{name}` must be a positive number or None, got {value!r}.")
        if self.baseline != "mean":
            raise ValueError(
                f"`baseline={self.baseline!r}` does not apply to {self._algorithm}: the critic's value is the "
                "baseline. Leave `baseline` out."
            )
        super().__post_init__()

    def joint_actions_per_prompt(self, num_generations: int) -> int:
        """Team reward evaluations of one prompt at most: one per trajectory and turn."""
        return num_generations * self.num_turns

    def _tree_too_large_message(self, field_name: str, num_generations: int, size: int) -> str:
        return (
            f"The trajectories of one prompt make {field_name}={num_generations} × num_turns={self.num_turns} = "
            f"{size} joint actions, more than `max_joint_actions` ({self.max_joint_actions}). Lower `num_turns` or "
            "`num_generations`, or raise `max_joint_actions`."
        )


@dataclass
class IACConfig(ActorCriticConfig):
    r"""
    Configuration class for [`IACTrainer`], independent actor-critic: one critic per agent (the adapter
    `critic_<agent>` and its value head), reading that agent's own prompt of the turn; each agent's completions take
    its own critic's advantages. Its fields are [`ActorCriticConfig`]'s.
    """

    _algorithm: ClassVar[str] = "IAC"
    _trainer: ClassVar[str] = "IACTrainer"
    _critic_kind: ClassVar[str] = "iac"


@dataclass
class MAACConfig(ActorCriticConfig):
    r"""
    Configuration class for [`MAACTrainer`], multi-agent actor-critic: one centralised critic for the team (the
    adapter `critic` and its value head), reading every agent's prompt of the turn; every agent's completions take the
    team's advantage. Its fields are [`ActorCriticConfig`]'s.
    """

    _algorithm: ClassVar[str] = "MAAC"
    _trainer: ClassVar[str] = "MAACTrainer"
    _critic_kind: ClassVar[str] = "maac"
