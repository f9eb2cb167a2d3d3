"""trl_marl: cooperative multi-agent reinforcement learning for teams of LLM agents, on top of TRL."""

from .advantages import aligned_credit, baseline_values, cross_credit, group_advantages, team_rewards
from .atgrpo_trainer import ATGRPOTrainer
from .config import ATGRPOConfig, MAGRPOConfig, TeamConfig
from .episode import NextTurn, RolloutSettings, TransitionError
from .magrpo_trainer import MAGRPOTrainer
from .models import DEFAULT_MODEL_ID, default_model_path
from .registry import PluginError, register_reward, register_scheduler, register_task
from .reward_checks import RewardFunctionError, for_agent
from .rollout import default_transition
from .tasks import Task
from .team import Team, TeamRun, load_team
from .team_trainer import TeamTrainer

__version__ = "0.1.0.dev0"

__all__ = [
    "ATGRPOConfig",
    "ATGRPOTrainer",
    "DEFAULT_MODEL_ID",
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
    "register_reward",
    "register_scheduler",
    "register_task",
    "team_rewards",
]
