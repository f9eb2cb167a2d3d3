"""Quickstart: train a two-agent team with MAGRPO on the embedded default model, on the CPU, in minutes.

The task: for a short question, the `concise` agent gives the bare answer and the `detailed` agent explains it.
The team reward asks the explanation to be at least three times as long (in words) as the answer, so it depends on
both agents: neither can earn it alone. The untrained SmolLM2-135M-Instruct rambles in both roles; the team learns to
split the work.

    python recipes/magrpo_quickstart.py                      # defaults below
    python recipes/magrpo_quickstart.py --max_steps 60 --learning_rate 5e-4 --output_dir outputs/qs

Every `MAGRPOConfig` / `GRPOConfig` field is a command-line flag. Prints the team reward on held-out questions before
and after training and where the agents' adapters were saved; writes the same to `<output_dir>/results.json`.
"""

import json
import os
import time
from dataclasses import dataclass, field

import torch
from trl import TrlParser

from trl_marl import MAGRPOConfig, MAGRPOTrainer, default_model_path
from trl_marl.memory import peak_memory
from trl_marl.tasks.toy import EXPLAIN_AGENTS, explain_ratio_reward, question_dataset  # the `explain` task

AGENTS = EXPLAIN_AGENTS


@dataclass
class QuickstartArguments:
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Base model; defaults to the embedded SmolLM2-135M-Instruct."}
    )
    eval_questions: int = field(default=12, metadata={"help": "Held-out questions for the before/after reward."})


def quickstart_defaults(on_gpu: bool) -> dict:
    """The quickstart's `MAGRPOConfig` settings (also what `benchmarks/bench_decode_run.py` times)."""
    return dict(
        output_dir="outputs/magrpo-quickstart",
        agents=AGENTS,
        num_generations=4,
        per_device_train_batch_size=8,  # two questions x four completions per agent per step
        per_device_eval_batch_size=8,
        num_generations_eval=4,
        max_completion_length=40,
        max_steps=16,
        learning_rate=5e-4,
        lr_scheduler_type="constant",
        lora_r=16,
        lora_alpha=32,
        logging_steps=5,
        save_strategy="no",
        report_to="none",
        seed=0,
        use_cpu=not on_gpu,
        gradient_checkpointing=on_gpu,
    )


def quickstart_datasets(seed: int, eval_questions: int):
    """(training questions, held-out questions)."""
    questions = question_dataset(seed)
    return questions.select(range(eval_questions, len(questions))), questions.select(range(eval_questions))


def main() -> None:
    parser = TrlParser((QuickstartArguments, MAGRPOConfig))
    parser.set_defaults(**quickstart_defaults(torch.cuda.is_available()))
    script_args, args = parser.parse_args_and_config()

    train_dataset, eval_dataset = quickstart_datasets(args.seed, script_args.eval_questions)
    model = script_args.model_name_or_path or default_model_path()
    trainer = MAGRPOTrainer(
        model, explain_ratio_reward, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset
    )

    train_and_report(trainer, args.output_dir, len(eval_dataset))


def train_and_report(trainer: MAGRPOTrainer, output_dir: str, eval_size: int) -> None:
    """The held-out team reward before and after training, the adapters saved, printed and in `results.json`."""
    start = time.perf_counter()
    before = trainer.evaluate(metric_key_prefix="eval")["eval_reward"]
    print(f"Team reward before training: {before:.3f} (held-out questions: {eval_size})", flush=True)
    trainer.train()
    after = trainer.evaluate(metric_key_prefix="eval")["eval_reward"]
    trainer.save_model(output_dir)
    minutes = (time.perf_counter() - start) / 60
    adapters = {agent: os.path.join(output_dir, agent) for agent in trainer.agent_names}
    results = {
        "team_reward_before": before,
        "team_reward_after": after,
        "steps": trainer.state.global_step,
        "minutes": minutes,
        "adapters": adapters,
    }
    peak = peak_memory()  # the run's peak: host RSS on the CPU, torch's peaks on a GPU
    results.update(peak.as_dict())
    print(peak.describe())
    with open(os.path.join(output_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    print(f"Team reward after {trainer.state.global_step} steps: {after:.3f} (before: {before:.3f})")
    for agent, path in adapters.items():
        print(f"Adapter of agent '{agent}' saved in {path}")
    print(f"Results: {os.path.join(output_dir, 'results.json')} ({minutes:.1f} min)")


if __name__ == "__main__":
    main()
