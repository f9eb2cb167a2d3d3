"""AT-GRPO on the CPU with the paper's math workflow: a tool agent answers with Python, a reasoner answers in words.

The AT-GRPO paper's tool + reasoner team (arXiv 2510.11062) at laptop scale: the embedded default model
(SmolLM2-135M-Instruct) with one LoRA adapter per agent, a few steps, generated multi-step arithmetic word problems
with exact answers (offline, seeded). Both agents answer; from the second turn each sees the other's answer and may
revise; the episode ends when they agree. The tool agent's program runs in the sandbox (bubblewrap; see
docs/sandbox.md). Rewards: each agent's exact correctness; the team's: both correct (docs/atgrpo_code_math.md).

    python recipes/atgrpo_math.py                                     # defaults below: ~7 min on 2 busy cores
    python recipes/atgrpo_math.py --steps 2 --max_number 10           # easier problems
    python recipes/atgrpo_math.py --source hub --max_steps 40          # GSM8K (needs the network or a Hub cache)

Prints the accuracy on held-out problems before and after training: the share of episodes whose final answers, the
tool agent's and the reasoner's, are both right, each agent answering once per turn (`num_generations_eval=1`, so
no candidate is chosen with the help of the expected answer). Paper scale: `trl-marl train
recipes/paper/atgrpo_math.yaml`. Every `ATGRPOConfig` / `GRPOConfig` field is a flag; writes
`<output_dir>/results.json`.
"""

import json
import os
import time
from dataclasses import dataclass, field

import torch
from trl import TrlParser

from trl_marl import ATGRPOConfig, ATGRPOTrainer, default_model_path
from trl_marl.memory import peak_memory
from trl_marl.tasks import task_defaults
from trl_marl.tasks.math_tool import MathTool


@dataclass
class RecipeArguments:
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Base model; defaults to the embedded SmolLM2-135M-Instruct."}
    )
    source: str = field(default="offline", metadata={"help": "offline (generated problems) or hub (GSM8K)."})
    steps: int = field(default=3, metadata={"help": "Operations per generated problem (difficulty)."})
    max_number: int = field(default=20, metadata={"help": "Largest starting amount and addend (difficulty)."})
    eval_problems: int = field(default=4, metadata={"help": "Held-out problems for the figures."})


def figures(metrics: dict) -> dict:
    """The task's figures from `evaluate()` metrics."""
    return {
        "accuracy": metrics.get("eval_episodes/success_rate"),
        "team_reward": metrics.get("eval_reward"),
        "final_team_reward": metrics.get("eval_episodes/team_reward"),
        "tool_accuracy": metrics.get("eval_math/tool_accuracy"),
        "reasoner_accuracy": metrics.get("eval_math/reasoner_accuracy"),
        "turns": metrics.get("eval_episodes/num_turns"),
    }


def main() -> None:
    parser = TrlParser((RecipeArguments, ATGRPOConfig))
    on_gpu = torch.cuda.is_available()
    parser.set_defaults(
        **{**task_defaults(MathTool()), "num_turns": 2},  # tool and reasoner, debate; 2 turns (the paper's 4)
        output_dir="outputs/atgrpo-math",
        num_generations=2,  # K: 2 candidates per (problem, turn, agent) (the paper's 4 cost twice the time)
        # Two problems per step: 4 copies, generated at once; 2 agents x 2 turns of each. The CPU trains their rows
        # in 4 micro-batches (a peak of 8.1 GiB in one); the same update with TRL's default `loss_type`. A GPU: one.
        per_device_train_batch_size=4 if on_gpu else 1,
        gradient_accumulation_steps=1 if on_gpu else 4,
        num_generations_eval=1,  # one answer per agent and turn: accuracy without choosing among candidates
        per_device_eval_batch_size=4,
        max_completion_length=64,
        max_steps=3,
        learning_rate=5e-4,
        lr_scheduler_type="constant",
        temperature=0.8,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=0,
        use_cpu=not on_gpu,
    )
    script_args, args = parser.parse_args_and_config()
    task = MathTool(script_args.source, steps=script_args.steps, max_number=script_args.max_number)
    model = script_args.model_name_or_path or default_model_path()
    eval_dataset = task.dataset("eval").select(range(script_args.eval_problems))
    trainer = ATGRPOTrainer(model, args=args, task=task, eval_dataset=eval_dataset)

    start = time.perf_counter()
    before = figures(trainer.evaluate())
    print(f"Before training: {before}", flush=True)
    trainer.train()
    after = figures(trainer.evaluate())
    print(f"After {trainer.state.global_step} steps: {after}", flush=True)
    trainer.save_model(args.output_dir)
    minutes = (time.perf_counter() - start) / 60
    results = {"task": task.name, "source": task.source, "before": before, "after": after,
               "steps": trainer.state.global_step, "minutes": minutes, "team": args.output_dir}  # fmt: skip
    peak = peak_memory()  # the run's peak: host RSS on the CPU, torch's peaks on a GPU
    results.update(peak.as_dict())
    print(peak.describe())
    with open(os.path.join(args.output_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    print(f"Team saved in {args.output_dir}; results.json written ({minutes:.1f} min)")


if __name__ == "__main__":
    main()
