"""`ATGRPOTrainer`: AT-GRPO (arXiv 2510.11062). The team stack is [`TeamTrainer`]'s; this trainer owns its rollout
(`atgrpo.ATGRPORollout`) and the task's local rewards that are part of its reward.
"""

import textwrap

from ..config import ATGRPOConfig
from ..rollouts.atgrpo_rollout import ATGRPORollout
from ..rollouts.rollout import JointAction, Rollout
from ..tasks import local_rewards
from .team_trainer import TeamTrainer


class ATGRPOTrainer(TeamTrainer):
    """AT-GRPO (arXiv 2510.11062): agent- and turn-wise groups with greedy continuation, on the same stack as
    [`MAGRPOTrainer`] ([`TeamTrainer`]: adapters, routing, loss, saving and metrics are shared; only the rollout
    differs).

    Each problem is one episode; at every turn the acting agents act in the scheduler's order, and for each of them
    `num_generations` candidates from the same state form a group, scored r = α · team reward + the agent's local
    reward (the task's `local_reward_funcs`); the episode continues from the best candidate. Tasks with an
    environment state implement `Task.reset` / `Task.step` (every branch holds its own copy). Takes the same arguments
    as [`TeamTrainer`], with an [`ATGRPOConfig`].
    """

    _tag_names = ["trl", "trl-marl", "at-grpo"]
    _name = "AT-GRPO"
    _paper = {
        "title": "Stronger Together: On-Policy Reinforcement Learning for Collaborative LLMs",
        "id": "2510.11062",
        # docstyle-ignore
        "citation": textwrap.dedent("""\
            @article{zhao2025stronger,
                title        = {{Stronger Together: On-Policy Reinforcement Learning for Collaborative LLMs}},
                author       = {Yujie Zhao and Lanxiang Hu and Yang Wang and Minmin Hou and Hao Zhang and Ke Ding and Jishen Zhao},
                year         = 2025,
                eprint       = {arXiv:2510.11062},
            }"""),  # noqa: E501
    }
    _config_class = ATGRPOConfig

    def _rollout(self, inputs: list[dict], num_generations: int) -> Rollout:
        """This process's share of the batch's episodes: one greedy path per problem, one group per (problem, turn,
        agent)."""
        return ATGRPORollout(
            self.rollout_settings,
            num_generations,
            team_reward_weight=self.args.team_reward_weight,
            continuation=self.args.continuation,
            seed=self.args.seed * 1_000_003 + self.state.global_step,  # the same on every process
        ).run(inputs, local_score=self._local_scores, **self._rollout_hooks(inputs, num_generations))

    def _local_scores(self, agent: int, joint_actions: list[JointAction]) -> list[float] | None:
        """The task's local rewards of the acting agent's candidates (None when it has none)."""
        if self.task is None or not joint_actions:
            return None
        name = self.agent_names[agent]
        rows = [ja.branch.example for ja in joint_actions]
        columns = {key: [row[key] for row in rows] for key in rows[0] if key != "prompt"}
        return local_rewards(
            self.task,
            name,
            [row["prompt"] for row in rows],
            [ja.completions[name] for ja in joint_actions],
            turn=[ja.turn for ja in joint_actions],
            state=[ja.state for ja in joint_actions],
            **columns,
        )
