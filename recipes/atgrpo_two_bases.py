"""AT-GRPO with the coder and the tester on two different base models: the paper's coder + unit-tester workflow
(arXiv 2510.11062, task `code_tester`), each agent a LoRA adapter on its own base, in one trainer.

    python recipes/atgrpo_two_bases.py        # CPU: the coder on the embedded SmolLM2-135M, the tester on a second
                                              # base made offline (trl_marl.team.offline_base: a tiny random Qwen2
                                              # with a tokenizer of its own); a few minutes on 2 cores
    python recipes/atgrpo_two_bases.py --model_name_or_path Qwen/Qwen2.5-Coder-1.5B-Instruct \\
        --tester_model HuggingFaceTB/SmolLM2-360M-Instruct --load_in_4bit true     # GPU: a coder and a small tester
                                                                                   # of another family, both 4-bit

On the CPU the second base has learned nothing: the run shows a team of two architectures and two tokenizers train,
save and load end to end, not what a real tester adds. The GPU variant at full length is
`trl-marl train recipes/two_bases_code_tester.yaml` (its memory prediction is in its header). Everything model-written
runs in the sandbox (bubblewrap; docs/sandbox.md). Every `ATGRPOConfig` field is a flag; writes
`<output_dir>/results.json` (the bases, the team reward before and after, the step time).
"""

import json
import os
import statistics
import time
from dataclasses import dataclass, field

import torch
from trl import TrlParser

from trl_marl import ATGRPOConfig, ATGRPOTrainer, default_model_path
from trl_marl.agents import normalize_agents
from trl_marl.memory import peak_memory
from trl_marl.precision import four_bit_config
from trl_marl.tasks import task_defaults
from trl_marl.tasks.coding.code_tester import CodeTester
from trl_marl.team.offline_base import make_offline_base


@dataclass
class RecipeArguments:
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "The coder's base (and the team's); defaults to the embedded SmolLM2-135M."}
    )
    tester_model: str | None = field(
        default=None, metadata={"help": "The tester's base; defaults to a second base made offline in output_dir."}
    )
    load_in_4bit: bool = field(default=False, metadata={"help": "Both bases in 4-bit NF4 (QLoRA)."})
    eval_problems: int = field(default=2, metadata={"help": "Held-out HumanEval problems for the figures."})


def main() -> None:
    parser = TrlParser((RecipeArguments, ATGRPOConfig))
    on_gpu = torch.cuda.is_available()
    task = CodeTester()
    parser.set_defaults(
        **{**task_defaults(task), "num_turns": 2},  # coder then tester, 2 turns (the paper's 4) for a short CPU step
        output_dir="outputs/atgrpo-two-bases",
        num_generations=2,
        per_device_train_batch_size=2,
        num_generations_eval=1,
        per_device_eval_batch_size=2,
        max_completion_length=48 if not on_gpu else 256,
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
    tester_model = script_args.tester_model or make_offline_base(os.path.join(args.output_dir, "offline-tester-base"))
    coder, tester = args.agents
    args.agents = normalize_agents([coder, {**tester, "model": tester_model}])  # the coder: on the trainer's model
    eval_dataset = task.dataset("eval").select(range(script_args.eval_problems))
    trainer = ATGRPOTrainer(
        script_args.model_name_or_path or default_model_path(),
        args=args,
        task=task,
        eval_dataset=eval_dataset,
        quantization_config=four_bit_config() if script_args.load_in_4bit else None,
    )
    bases = {base.name: [args.agent_names[i] for i in base.agents] for base in trainer.bases}
    print(f"Bases: {bases}", flush=True)

    before = trainer.evaluate().get("eval_reward")
    trainer.train()
    after = trainer.evaluate().get("eval_reward")
    trainer.save_model(args.output_dir)
    step_times = [log["step_time"] for log in trainer.state.log_history if "step_time" in log]
    results = {
        "bases": bases,
        "team_reward_before": before,
        "team_reward_after": after,
        "steps": trainer.state.global_step,
        "median_step_seconds": statistics.median(step_times) if step_times else None,
        "team": args.output_dir,
    }
    peak = peak_memory()  # the run's peak: host RSS on the CPU, torch's peaks on a GPU
    results.update(peak.as_dict())
    print(peak.describe())
    with open(os.path.join(args.output_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    print(f"Team reward on {script_args.eval_problems} held-out problems: {before} before, {after} after training")
    print(f"Team saved in {args.output_dir} (load it with trl_marl.load_team); results.json written")


if __name__ == "__main__":
    start = time.perf_counter()
    main()
    print(f"{(time.perf_counter() - start) / 60:.1f} min")
