"""trl_marl: cooperative multi-agent reinforcement learning for teams of LLM agents, on top of TRL."""

# ruff: noqa: E402 (the bitsandbytes filter below must be in place before the package's imports run)
import logging
import warnings

# On CPUs with AVX512-BF16, importing bitsandbytes (which PEFT does, so every trl_marl command did) logs "Failed to
# load CPU gemm_4bit_forward from kernels-community: No module named 'kernels'...". That kernel serves only the CPU
# inference layout of 4-bit weights, which trl_marl turns off wherever a 4-bit base is used (the trainers and
# `load_team` call `keep_4bit_weights_trainable`), so the line cannot concern a trl_marl run, 4-bit or not. Only this
# message is dropped, and only when trl_marl is imported before bitsandbytes (the filter must exist when it logs).
BITSANDBYTES_KERNELS_NOTICE = "Failed to load CPU gemm_4bit_forward from kernels-community"
logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(
    lambda record: not str(record.msg).startswith(BITSANDBYTES_KERNELS_NOTICE)
)

from .config import ATGRPOConfig, IACConfig, MAACConfig, MAGRPOConfig, TeamConfig
from .registry import PluginError, register_episode, register_reward, register_scheduler, register_task
from .rollouts.advantages import aligned_credit, baseline_values, cross_credit, group_advantages, team_rewards
from .rollouts.rollout import NextTurn, RolloutSettings, TransitionError, default_transition
from .serving import serve_team  # FastAPI and uvicorn are imported only when a server starts
from .tasks import Task
from .team.default_model import DEFAULT_MODEL_ID, default_model_path
from .team.saved import Team, TeamRun, load_team
from .trainers.actor_critic_trainer import IACTrainer, MAACTrainer
from .trainers.atgrpo_trainer import ATGRPOTrainer
from .trainers.magrpo_trainer import MAGRPOTrainer
from .trainers.reward_checks import RewardFunctionError, for_agent
from .trainers.team_trainer import TeamTrainer

__version__ = "0.1.0.dev0"

# transformers 5 renamed gradient checkpointing to activation checkpointing and warns on every use of the old names,
# but TRL 1.16 still uses them on the user's behalf: its configs default `gradient_checkpointing=True` (warned by
# `TrainingArguments.__post_init__`), its generation context calls `is_gradient_checkpointing`,
# `gradient_checkpointing_disable` and `gradient_checkpointing_enable`, and PEFT's `get_peft_model` reads
# `is_gradient_checkpointing`: four FutureWarnings in every run that a user cannot act on. Only these messages, only
# as transformers raises them, are silenced. Remove this once trl_marl requires a TRL and a PEFT that use the new
# names (TRL 1.16 and PEFT 0.21 do not).
warnings.filterwarnings(
    "ignore",
    message=r"`(is_)?gradient_checkpointing(_kwargs|_enable|_disable)?` is deprecated and will be removed in v6\.",
    category=FutureWarning,
    module=r"transformers\.(training_args|modeling_utils)$",
)

__all__ = [
    "ATGRPOConfig",
    "ATGRPOTrainer",
    "DEFAULT_MODEL_ID",
    "IACConfig",
    "IACTrainer",
    "MAACConfig",
    "MAACTrainer",
    "MAGRPOConfig",
    "MAGRPOTrainer",
    "NextTurn",
    "PluginError",
    "Task",
    "RewardFunctionError",
    "RolloutSettings",
    "Team",
    "TeamConfig",
    "TeamRun",
    "TeamTrainer",
    "TransitionError",
    "aligned_credit",
    "baseline_values",
    "cross_credit",
    "default_model_path",
    "default_transition",
    "for_agent",
    "group_advantages",
    "load_team",
    "register_episode",
    "register_reward",
    "register_scheduler",
    "register_task",
    "serve_team",
    "team_rewards",
]
