"""Step time of a team on two bases against the same team on one base (`trl_marl.team.bases`), in one run.

Three configurations of one 2-agent MAGRPO team (the `explain` task's `concise` and `detailed` agents and reward),
trained in this process one after another with the same seed, data and settings:

1. `one base`: both agents on the embedded SmolLM2-135M-Instruct (one model, one `generate` call per turn, one
   forward per micro-batch);
2. `two bases, same model`: `detailed` on a copy of the same weights saved to another folder, so a second base is
   loaded: the same work, split in two `generate` calls and two forwards per micro-batch. Its ratio to (1) is the cost
   of a second base itself;
3. `two bases, small second`: `detailed` on the tiny second base of `trl_marl.team.offline_base` (another architecture
   and tokenizer): what a smaller second model saves.

Every completion is exactly `--tokens` new tokens (`min_new_tokens`), so what either agent learns cannot change the
amount of work. Measured: the median of TRL's logged `step_time` over the steps after the first (model load and
warm-up excluded).

    python recipes/benchmarks/bench_two_bases.py            # ~5 min on 2 CPU cores; --steps, --tokens, --rows
"""

import argparse
import statistics
import tempfile
import time

from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_marl import MAGRPOConfig, MAGRPOTrainer, default_model_path
from trl_marl.tasks import resolve_task
from trl_marl.team.offline_base import make_offline_base


def step_seconds(second_base: str | None, args, folder: str) -> float:
    task = resolve_task("explain")
    agents = [dict(agent) for agent in task.agents]
    if second_base is not None:
        agents[1]["model"] = second_base
    config = MAGRPOConfig(
        output_dir=folder,
        agents=agents,
        num_generations=2,
        per_device_train_batch_size=args.rows,
        max_completion_length=args.tokens,
        generation_kwargs={"min_new_tokens": args.tokens},
        max_steps=args.steps + 1,
        learning_rate=1e-5,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        seed=0,
    )
    trainer = MAGRPOTrainer(default_model_path(), args=config, task=task)
    trainer.train()
    times = [log["step_time"] for log in trainer.state.log_history if "step_time" in log][1:]
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="measured steps (after one warm-up step)")
    parser.add_argument("--tokens", type=int, default=16, help="new tokens of every completion")
    parser.add_argument("--rows", type=int, default=4, help="prompt copies per step (per_device_train_batch_size)")
    args = parser.parse_args()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        copy = f"{folder}/smollm2-copy"
        AutoModelForCausalLM.from_pretrained(default_model_path()).save_pretrained(copy)
        AutoTokenizer.from_pretrained(default_model_path()).save_pretrained(copy)
        small = make_offline_base(f"{folder}/offline-base")
        results = {
            "one base": step_seconds(None, args, f"{folder}/one"),
            "two bases, same model": step_seconds(copy, args, f"{folder}/two-same"),
            "two bases, small second": step_seconds(small, args, f"{folder}/two-small"),
        }
    one = results["one base"]
    setting = f"{args.rows} prompt copies x G=2, {args.tokens} new tokens, CPU; median of {args.steps} steps"
    print(f"\nMAGRPO, 2 agents, {setting}")
    for name, seconds in results.items():
        print(f"{name:<24} {seconds:6.2f} s/step   {seconds / one:5.2f}x one base")
    print(f"({(time.perf_counter() - start) / 60:.1f} min)")


if __name__ == "__main__":
    main()
