"""Training-step time on the CPU with bf16 autocast (TRL's default) against float32 (trl_marl's default with
`use_cpu=True`). Prints figures; not a test.

One AT-GRPO step on the `reach_target` puzzle with the default model: 1 problem, K candidates × 2 agents × 2 turns.
The two settings alternate over `--rounds` (each a fresh trainer, same seed), so the ratio comes from one run.

    python recipes/benchmarks/bench_bf16_cpu.py      # ~3.5 min per round on 2 CPU cores without native bf16
    python recipes/benchmarks/bench_bf16_cpu.py --rounds 2 --num_generations 4
"""

import argparse
import platform
import statistics
import tempfile
import time

import torch

from trl_marl import ATGRPOConfig, ATGRPOTrainer, default_model_path
from trl_marl.tasks.toy import ReachTarget


def one_step(bf16: bool, num_generations: int, output_dir: str) -> tuple[float, float]:
    """(seconds of the training step, seconds of its generation) for one fresh trainer."""
    task = ReachTarget()
    args = ATGRPOConfig.for_task(
        task,
        output_dir=output_dir,
        per_device_train_batch_size=num_generations,
        num_generations=num_generations,
        max_completion_length=8,
        max_steps=1,
        learning_rate=1e-3,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=bf16,
        seed=0,
    )
    trainer = ATGRPOTrainer(default_model_path(), args=args, train_dataset=task.dataset().select(range(4)), task=task)
    generate = trainer._generate_and_score_completions
    spent = {"generation": 0.0}

    def timed(inputs):
        start = time.perf_counter()
        output = generate(inputs)
        spent["generation"] += time.perf_counter() - start
        return output

    trainer._generate_and_score_completions = timed
    start = time.perf_counter()
    trainer.train()
    return time.perf_counter() - start, spent["generation"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num_generations", type=int, default=2)
    options = parser.parse_args()
    flags = " ".join(f"{name}={getattr(torch.backends.cpu, 'get_cpu_capability', lambda: '?')()}" for name in ["cpu"])
    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, capability {flags}")
    times = {True: [], False: []}
    with tempfile.TemporaryDirectory() as output_dir:
        for round_index in range(options.rounds):
            order = (False, True) if round_index % 2 == 0 else (True, False)
            for bf16 in order:
                total, generation = one_step(bf16, options.num_generations, output_dir)
                times[bf16].append((total, generation))
                print(f"round {round_index + 1}: bf16={bf16}: step {total:.1f} s (generation {generation:.1f} s)")
    rows = 4 * options.num_generations
    for bf16 in (False, True):
        step = statistics.median(total for total, _ in times[bf16])
        generation = statistics.median(gen for _, gen in times[bf16])
        print(f"bf16={bf16!s:5}  median step {step:7.1f} s  generation {generation:6.1f} s  ({rows} rows)")
    ratio = statistics.median(t for t, _ in times[True]) / statistics.median(t for t, _ in times[False])
    print(f"bf16 / float32 step time: {ratio:.1f}x")


if __name__ == "__main__":
    main()
