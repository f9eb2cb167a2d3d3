"""What a critic costs per step: MAGRPO against IAC and MAAC, each arm alone in its own process, on the embedded
default model.

Two shapes:

- `quickstart` (the default): `recipes/magrpo_quickstart.py`'s settings, one turn, 2 questions x 4 completions per
  agent per step. With one turn a trajectory is a MAGRPO tree of one level, so the three arms generate and train on
  the same rollout: the difference is the critics' cost (their values after the rollout, the value loss's forward and
  backward, their adapters' and heads' optimizer step).
- `sparse`: the critics benchmark's own runs (`bench_learning.py --version 4`, `pick_new_sparse`), each arm as
  registered there: what one of its steps costs.

Prints, per arm, seconds per step (the median of the steps after the first) and the process's peak memory (RSS on the
CPU; torch's peak allocated on a GPU), and saves them to `results/bench_critics_<shape>[_gpu].json`.

    python recipes/benchmarks/bench_critics.py --steps 4                   # the quickstart shape, all three arms
    python recipes/benchmarks/bench_critics.py --shape sparse --steps 3 --arms maac magrpo
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ARMS = ("magrpo", "iac", "maac")


def one_arm(shape: str, arm: str, steps: int) -> dict:
    """Train `arm` for `steps` steps in this process: its step times and peak memory."""
    import torch

    sys.path[:0] = [str(HERE), str(HERE.parent)]
    import bench_learning
    from gpu_check import StepTimes  # the recipes' step timer

    from trl_marl import default_model_path
    from trl_marl.memory import peak_memory

    with tempfile.TemporaryDirectory() as output_dir:
        if shape == "sparse":
            trainer = bench_learning.make_trainer("pick_new_sparse", arm, 0, steps, output_dir)
        else:
            from magrpo_quickstart import quickstart_datasets, quickstart_defaults

            from trl_marl.tasks.toy import explain_ratio_reward

            config_class, trainer_class = bench_learning.ALGORITHMS[arm]
            settings = {**quickstart_defaults(torch.cuda.is_available()), "output_dir": output_dir, "max_steps": steps}
            train, _ = quickstart_datasets(0, 12)
            args = config_class(**settings)
            trainer = trainer_class(default_model_path(), explain_ratio_reward, args=args, train_dataset=train)
        timer = StepTimes()
        trainer.add_callback(timer)
        trainer.train()
    peak = peak_memory()
    return {
        "arm": arm,
        "step_seconds": timer.times,
        "seconds_per_step": statistics.median(timer.times[1:] or timer.times),
        **peak.as_dict(),
        "peak": peak.describe(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=("quickstart", "sparse"), default="quickstart")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--steps", type=int, default=4, help="Training steps per arm (the first is not timed).")
    parser.add_argument("--results", help="Results file (default: results/bench_critics_<shape>[_gpu].json).")
    parser.add_argument("--arm", help=argparse.SUPPRESS)  # one arm, in a worker process
    options = parser.parse_args()
    if options.arm:
        print("RESULT " + json.dumps(one_arm(options.shape, options.arm, options.steps)), flush=True)
        return
    import torch

    on_gpu = torch.cuda.is_available()
    results = options.results or str(
        HERE / "results" / f"bench_critics_{options.shape}{'_gpu' if on_gpu else ''}.json"
    )
    record = {
        "shape": options.shape,
        "steps": options.steps,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}, "
        + (torch.cuda.get_device_name() if on_gpu else "no GPU"),
        "command": "python recipes/benchmarks/bench_critics.py " + " ".join(sys.argv[1:]),
        "arms": {},
    }
    for arm in options.arms:  # one process each: its own peak, nothing else running beside it
        command = [sys.executable, __file__, "--shape", options.shape, "--steps", str(options.steps), "--arm", arm]
        done = subprocess.run(command, capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode or not lines:
            raise SystemExit(f"{arm} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        result = json.loads(lines[-1].removeprefix("RESULT "))
        record["arms"][arm] = result
        print(f"{arm}: {result['seconds_per_step']:.2f} s/step; {result['peak']}", flush=True)
    base = record["arms"].get("magrpo")
    for arm, result in record["arms"].items():
        if base and arm != "magrpo":
            ratio = result["seconds_per_step"] / base["seconds_per_step"]
            print(f"{arm} / magrpo: {ratio:.2f}x the time per step", flush=True)
    os.makedirs(os.path.dirname(results), exist_ok=True)
    with open(results, "w") as f:
        json.dump(record, f, indent=1)
    print(f"Saved {results}")


if __name__ == "__main__":
    main()
