"""Team rewards of joint actions: each team reward function called once per rollout step with every joint action of
this process (sync ones under TRL's profiling context, async ones concurrently on TRL's event loop), its Nones read as
"does not apply" (NaN). The functions arrive wrapped with their checks (`reward_checks.checked_team_reward`)."""

import asyncio
import math
from collections.abc import Callable

import torch
from trl.trainer.utils import is_async_callable

from ..rollouts.rollout import JointAction


class TeamScoring:
    """Scores joint actions with the team reward functions.

    Args:
        reward_funcs: the (checked) team reward functions.
        reward_func_names: their names, for TRL's profiling.
        trainer_state: gives TRL's `TrainerState` (handed to the functions as `trainer_state`).
        log_extra, log_metric: TRL's `_log_completion_extra` / `_log_metric` (handed to the functions).
        async_loop: TRL's event loop for async functions (None when there are none).
        profile: `profile(name)` is a context manager timing one function's call (TRL's `profiling_context`).
    """

    def __init__(
        self,
        reward_funcs: list[Callable],
        reward_func_names: list[str],
        *,
        trainer_state: Callable,
        log_extra: Callable,
        log_metric: Callable,
        async_loop,
        profile: Callable,
    ):
        self.reward_funcs, self.reward_func_names = reward_funcs, reward_func_names
        self.trainer_state, self.log_extra, self.log_metric = trainer_state, log_extra, log_metric
        self.async_loop, self.profile = async_loop, profile

    def score(self, joint_actions: list[JointAction]) -> torch.Tensor:
        """`(J, F)` team rewards of this process's joint actions (not gathered: processes score different numbers).

        Reward functions get the dataset prompt, each joint action as a mapping agent -> text, and as kwargs the
        dataset columns, `completion_ids` (agent -> ids), `turn`, `history` (the earlier joint actions of the
        branch), `state` (AT-GRPO, when the task keeps one), `environments` (each joint action's episode environment,
        with `environment_factory=`; TRL's `get_reward` of the environment reads them) and TRL's `trainer_state`,
        `log_extra`, `log_metric`.
        """
        if not joint_actions:
            return torch.zeros(0, len(self.reward_funcs))
        rows = [{**ja.branch.example, "turn": ja.turn, "history": list(ja.branch.history)} for ja in joint_actions]
        if any(ja.state is not None for ja in joint_actions):  # AT-GRPO with a task that keeps an environment state
            for row, ja in zip(rows, joint_actions):
                row["state"] = ja.state
        columns = [key for key in rows[0] if key not in ("prompt", "completion", "completion_ids")]
        call = {key: [row[key] for row in rows] for key in columns}
        if any(ja.environment is not None for ja in joint_actions):  # `environment_factory=`: as TRL passes them
            call["environments"] = [ja.environment for ja in joint_actions]
        call.update(
            prompts=[row["prompt"] for row in rows],
            completions=[ja.completions for ja in joint_actions],
            completion_ids=[ja.completion_ids for ja in joint_actions],
            trainer_state=self.trainer_state(),
            log_extra=self.log_extra,
            log_metric=self.log_metric,
        )
        results = {}
        pending = []
        for index, (func, name) in enumerate(zip(self.reward_funcs, self.reward_func_names)):
            if is_async_callable(func):
                pending.append((index, func(**call)))
            else:
                with self.profile(name):
                    results[index] = func(**call)
        if pending:

            async def run_all():
                return await asyncio.gather(*(coroutine for _, coroutine in pending))

            outputs = asyncio.run_coroutine_threadsafe(run_all(), self.async_loop).result()
            results.update({index: output for (index, _), output in zip(pending, outputs)})
        rewards = [[math.nan if r is None else float(r) for r in results[i]] for i in range(len(self.reward_funcs))]
        return torch.tensor(rewards, dtype=torch.float32).T.reshape(len(joint_actions), -1)
