"""AT-GRPO on a generated puzzle with an environment state: two agents move a counter to a target.

The task (`reach_target`): a counter starts at a number and must reach a target. At each of two turns `mover` adds a
whole number, then `finisher`, who sees that move, adds another; the environment state (the counter) is stepped after
every move, and the next turn's prompt shows its value. Team reward: the share of the distance covered (1 on target);
each agent's local reward: answering with a bare number. AT-GRPO samples `num_generations` candidates for each agent
at each step from the same state, scores each as `team_reward_weight` × team + local, trains on the group of
candidates, and continues the episode from the best one.

    python recipes/atgrpo_reach_target.py                          # defaults below
    python recipes/atgrpo_reach_target.py --algorithm magrpo       # the same task with MAGRPO trees, for comparison
    python recipes/atgrpo_reach_target.py --adapter_mode shared --frozen_agents mover --max_steps 30

Every `ATGRPOConfig` / `GRPOConfig` field is a command-line flag (with `--algorithm magrpo`: `MAGRPOConfig`'s).
Prints the team reward and success rate on held-out puzzles before and after training; writes
`<output_dir>/results.json`.
"""

import argparse
import json
import os
import time
from dataclasses import dataclass, field

import torch
from trl import TrlParser

from trl_marl import ATGRPOConfig, ATGRPOTrainer, MAGRPOConfig, MAGRPOTrainer, default_model_path
from trl_marl.memory import peak_memory
from trl_marl.tasks import task_defaults
from trl_marl.tasks.toy import ReachTarget


@dataclass
class RecipeArguments:
    algorithm: str = field(
        default="at_grpo", metadata={"help": "at_grpo or magrpo.", "choices": ["at_grpo", "magrpo"]}
    )
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Base model; defaults to the embedded SmolLM2-135M-Instruct."}
    )
    eval_puzzles: int = field(default=8, metadata={"help": "Held-out puzzles for the before/after figures."})


def figures(metrics: dict) -> dict:
    """Team reward and success rate from `evaluate()` metrics (the success rate is logged by AT-GRPO only)."""
    return {
        "team_reward": metrics.get("eval_reward"),
        "final_team_reward": metrics.get("eval_episodes/team_reward"),  # AT-GRPO only
        "success_rate": metrics.get("eval_episodes/success_rate"),
    }


def main() -> None:
    choice = argparse.ArgumentParser(add_help=False)
    choice.add_argument("--algorithm", default="at_grpo", choices=["at_grpo", "magrpo"])
    algorithm = choice.parse_known_args()[0].algorithm  # picks the config class the full parser reads
    config_class, trainer_class = (
        (ATGRPOConfig, ATGRPOTrainer) if algorithm == "at_grpo" else (MAGRPOConfig, MAGRPOTrainer)
    )
    parser = TrlParser((RecipeArguments, config_class))
    on_gpu = torch.cuda.is_available()
    task = ReachTarget()
    parser.set_defaults(
        **task_defaults(task),  # agents, 2 turns, the sequential scheduler
        output_dir=f"outputs/{algorithm}-reach-target",
        num_generations=4,  # AT-GRPO: 4 candidates per (puzzle, turn, agent); MAGRPO: 4 per agent per node
        # Two puzzles per step: 8 copies, generated at once. The CPU trains their rows in 4 micro-batches (a peak of
        # 8.8 GiB in one); the same update with TRL's default `loss_type`. A GPU trains them in one.
        per_device_train_batch_size=8 if on_gpu else 2,
        gradient_accumulation_steps=1 if on_gpu else 4,
        per_device_eval_batch_size=8,
        num_generations_eval=4,
        max_completion_length=12,
        max_steps=12,
        learning_rate=5e-4,
        lr_scheduler_type="constant",
        logging_steps=4,
        save_strategy="no",
        report_to="none",
        seed=0,
        use_cpu=not on_gpu,
    )
    script_args, args = parser.parse_args_and_config()

    model = script_args.model_name_or_path or default_model_path()
    eval_dataset = task.dataset("eval").select(range(script_args.eval_puzzles))
    trainer = trainer_class(model, args=args, task=task, eval_dataset=eval_dataset)

    start = time.perf_counter()
    before = figures(trainer.evaluate())
    print(f"Before training: {before}", flush=True)
    trainer.train()
    after = figures(trainer.evaluate())
    print(f"After {trainer.state.global_step} steps: {after}", flush=True)
    trainer.save_model(args.output_dir)
    minutes = (time.perf_counter() - start) / 60
    results = {
        "algorithm": algorithm,
        "before": before,
        "after": after,
        "steps": trainer.state.global_step,
        "minutes": minutes,
        "team": args.output_dir,
    }
    peak = peak_memory()  # the run's peak: host RSS on the CPU, torch's peaks on a GPU
    results.update(peak.as_dict())
    print(peak.describe())
    with open(os.path.join(args.output_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    print(f"Team saved in {args.output_dir}; results.json written ({minutes:.1f} min)")


if __name__ == "__main__":
    main()
