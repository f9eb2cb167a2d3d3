"""AT-GRPO on the paper's planning puzzles, on the CPU: a `tool` agent writes a Python program that prints a proposed
solution (run in the sandbox), a `plan` agent reads the board and the program and commits actions.

The tasks (`plan_path`, `sokoban`, `sudoku`; docs/atgrpo_puzzles.md) are the AT-GRPO paper's planning puzzles
(arXiv 2510.11062), generated offline from seeds. Team reward: the episode's shaped return (a small cost per action,
a penalty per invalid action, progress towards the goal, +1 solved, +0.5 for an optimal solution, −1 at the turn
limit unsolved); each agent's local reward: the shaped reward of its own proposal (the tool's is simulated on a copy
of the board). AT-GRPO samples `num_generations` candidates per (puzzle, turn, agent) from the same state, scores
each as `team_reward_weight` × team + local, trains on each group, and continues from the best candidate.

    python recipes/atgrpo_puzzles.py                                   # Plan-Path, easy boards, defaults below
    python recipes/atgrpo_puzzles.py --task sokoban --max_steps 20
    python recipes/atgrpo_puzzles.py --task sudoku --difficulty paper --num_turns 4 --max_completion_length 256

The embedded 135M default model rarely writes a working solver, so expect small numbers: the point is the whole loop
(generation, sandboxed tool runs, environment steps, groups, training) on a laptop. For the paper's scale see
`recipes/paper/atgrpo_puzzles.yaml`. Every `ATGRPOConfig` / `GRPOConfig` field is a flag. Prints the team reward and
the success rate on held-out puzzles before and after training; writes `<output_dir>/results.json`.
"""

import argparse
import json
import os
import time
from dataclasses import dataclass, field

import torch
from trl import TrlParser

from trl_marl import ATGRPOConfig, ATGRPOTrainer, default_model_path
from trl_marl.memory import peak_memory
from trl_marl.tasks.puzzles import PlanPathTask, SokobanTask, SudokuTask
from trl_marl.tasks.puzzles.tool_and_plan import PUZZLE_AGENTS

TASKS = {task.name: task for task in (PlanPathTask, SokobanTask, SudokuTask)}


@dataclass
class PuzzleArguments:
    task: str = field(default="plan_path", metadata={"help": "The puzzle.", "choices": sorted(TASKS)})
    difficulty: str = field(
        default="easy",
        metadata={"help": "Generator settings: easy (small boards) or paper.", "choices": ["easy", "paper"]},
    )
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Base model; defaults to the embedded SmolLM2-135M-Instruct."}
    )
    train_puzzles: int = field(default=64, metadata={"help": "Puzzles generated for training."})
    eval_puzzles: int = field(default=2, metadata={"help": "Held-out puzzles for the before/after figures."})


def figures(metrics: dict) -> dict:
    """Team reward (the mean shaped return of the scored candidates), the team reward each episode ended on,
    success rate and turns played, from `evaluate()`."""
    return {
        "team_reward": metrics.get("eval_reward"),
        "final_team_reward": metrics.get("eval_episodes/team_reward"),
        "success_rate": metrics.get("eval_episodes/success_rate"),
        "turns": metrics.get("eval_episodes/num_turns"),
    }


def main() -> None:
    choice = argparse.ArgumentParser(add_help=False)
    choice.add_argument("--task", default="plan_path", choices=sorted(TASKS))
    task_name = choice.parse_known_args()[0].task  # names the default output folder
    parser = TrlParser((PuzzleArguments, ATGRPOConfig))
    on_gpu = torch.cuda.is_available()
    parser.set_defaults(
        agents=PUZZLE_AGENTS,  # tool, then plan: the same roles for every puzzle
        scheduler="sequential",
        num_turns=2,  # ours, for the CPU (the paper's recipes use 4)
        output_dir=f"outputs/atgrpo-{task_name}",
        num_generations=2,  # K candidates per (puzzle, turn, agent); the paper's K is 4
        # One puzzle (K copies) per step: 2 copies x 2 agents x 2 turns = 8 rows. The CPU trains them in 2
        # micro-batches (a peak of 11.7 GiB in one); the same update with TRL's default `loss_type`. A GPU: one.
        per_device_train_batch_size=2 if on_gpu else 1,
        gradient_accumulation_steps=1 if on_gpu else 2,
        per_device_eval_batch_size=2,
        num_generations_eval=2,
        max_completion_length=48,
        max_steps=6,
        learning_rate=5e-4,
        lr_scheduler_type="constant",
        temperature=1.0,
        logging_steps=2,
        save_strategy="no",
        report_to="none",
        seed=0,
        use_cpu=not on_gpu,
        # TRL's default, on the CPU too: its 4-row micro-batches of long turns peaked at 7.98 GiB without it, 5.09
        # GiB with it, for 11.4 minutes of a 3-step run against 10.4 (docs/benchmarks.md)
        gradient_checkpointing=True,
    )
    script_args, args = parser.parse_args_and_config()
    task = TASKS[script_args.task](
        difficulty=script_args.difficulty,
        num_turns=args.num_turns,  # the task's turn limit (an unsolved episode fails after it) is the config's
        train_size=script_args.train_puzzles,
        eval_size=script_args.eval_puzzles,
    )
    model = script_args.model_name_or_path or default_model_path()
    trainer = ATGRPOTrainer(model, args=args, task=task, eval_dataset=task.dataset("eval"))

    start = time.perf_counter()
    before = figures(trainer.evaluate())
    print(f"Before training: {before}", flush=True)
    trainer.train()
    after = figures(trainer.evaluate())
    print(f"After {trainer.state.global_step} steps: {after}", flush=True)
    trainer.save_model(args.output_dir)
    minutes = (time.perf_counter() - start) / 60
    results = {"task": task.name, "difficulty": script_args.difficulty, "before": before, "after": after,
               "steps": trainer.state.global_step, "minutes": minutes, "team": args.output_dir}  # fmt: skip
    peak = peak_memory()  # the run's peak: host RSS on the CPU, torch's peaks on a GPU
    results.update(peak.as_dict())
    print(peak.describe())
    with open(os.path.join(args.output_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    print(f"Team saved in {args.output_dir}; results.json written ({minutes:.1f} min)")


if __name__ == "__main__":
    main()
