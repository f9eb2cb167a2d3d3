"""`MAGRPOTrainer`: multi-agent GRPO (MAGRPO, arXiv 2508.04652). The team stack is [`TeamTrainer`]'s; this trainer
owns its rollout, the MAGRPO tree of each prompt (`rollout.TreeRollout`; one turn unless `num_turns > 1`): every agent
answers at every node, joint actions get one team reward, returns and advantages follow MAGRPO (docs/design.md, §5).
"""

import textwrap

from .config import MAGRPOConfig
from .magrpo_rollout import TreeRollout
from .metrics import log_local_rewards
from .rollout import Rollout
from .team_trainer import TeamTrainer


class MAGRPOTrainer(TeamTrainer):
    """Multi-agent GRPO (MAGRPO, arXiv 2508.04652) as a thin [`~trl.GRPOTrainer`] subclass.

    Takes [`TeamTrainer`]'s arguments (the model, team reward functions or plugin names, a task, a transition for
    `num_turns > 1`, a scheduler, quantization and LoRA configs, and TRL's), with a [`MAGRPOConfig`] as `args`.
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

    def _rollout(self, inputs: list[dict], num_generations: int) -> Rollout:
        """This process's share of the batch's episodes: MAGRPO trees. The task's local rewards are logged, not
        trained on (MAGRPO optimises the team reward)."""
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
