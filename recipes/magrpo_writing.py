"""Writing collaboration with MAGRPO on the CPU: the MAGRPO paper's two writing tasks at laptop scale.

- `summaries` (default): `concise` writes a short summary of a passage, `detailed` a longer, richer one;
- `expansion`: from a short abstract, `background` writes background and motivation, `method` the method.

The team reward is the paper's four gated levels (structure, length coordination, vocabulary, style; max 3). Passages
come offline from Python's own documentation (`pydoc_data.topics`); the embedded default model carries one LoRA
adapter per agent. Prints the team reward and its levels on held-out passages before and after training.

    python recipes/magrpo_writing.py                               # summaries, a few minutes on 2 CPU cores
    python recipes/magrpo_writing.py --task expansion --max_completion_length 160
    python recipes/magrpo_writing.py --max_steps 40 --output_dir outputs/writing

For the paper's scale see `recipes/paper/magrpo_tldr.yaml` and `magrpo_arxiv.yaml`. Every `MAGRPOConfig` /
`GRPOConfig` field is a flag; writes `<output_dir>/results.json`.
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
class WritingArguments:
    task: str = field(default="summaries", metadata={"help": "summaries or expansion."})
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Base model; defaults to the embedded SmolLM2-135M-Instruct."}
    )
    eval_passages: int = field(default=8, metadata={"help": "Held-out passages for the before/after figures."})


def figures(metrics: dict, reward_name: str) -> dict:
    """The team reward and each level's mean, from `evaluate()` metrics."""
    levels = ("structure", "coordination", "vocabulary", "style")
    return {"team_reward": metrics.get("eval_reward"),
            **{level: metrics.get(f"eval_rewards/{reward_name}/{level}") for level in levels}}  # fmt: skip


def main() -> None:
    parser = TrlParser((WritingArguments, MAGRPOConfig))
    on_gpu = torch.cuda.is_available()
    parser.set_defaults(
        **task_defaults(resolve_task("summaries")),
        output_dir="outputs/magrpo-writing",
        num_generations=2,
        # Two passages per step: 4 copies, generated at once, 8 rows of a passage and 96 tokens. The CPU trains them in
        # 2 micro-batches (a peak of 7.45 GiB in one, at the edge of a laptop's 8 GB); the same update with TRL's
        # default `loss_type`. A GPU trains them in one.
        per_device_train_batch_size=4 if on_gpu else 2,
        gradient_accumulation_steps=1 if on_gpu else 2,
        per_device_eval_batch_size=4,
        num_generations_eval=2,
        max_completion_length=96,
        max_steps=8,
        learning_rate=5e-4,
        lr_scheduler_type="constant",
        logging_steps=2,
        save_strategy="no",
        report_to="none",
        seed=0,
        use_cpu=not on_gpu,
    )
    script_args, args = parser.parse_args_and_config()
    task = resolve_task(script_args.task)
    args.agents = task_defaults(task)["agents"]
    reward_name = task.reward_funcs[0] if isinstance(task.reward_funcs[0], str) else task.reward_funcs[0].__name__
    model = script_args.model_name_or_path or default_model_path()
    eval_dataset = task.dataset("eval").select(range(script_args.eval_passages))
    trainer = MAGRPOTrainer(model, args=args, task=task, eval_dataset=eval_dataset)

    start = time.perf_counter()
    before = figures(trainer.evaluate(), reward_name)
    print(f"Before training: {before}", flush=True)
    trainer.train()
    after = figures(trainer.evaluate(), reward_name)
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
