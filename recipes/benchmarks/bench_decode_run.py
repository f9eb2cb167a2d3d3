"""A whole quickstart-sized training run timed with eager `generate` and with the captured decode step, on the same
device, each in a fresh process: the first training step (where a captured path records or compiles its steps), the
steady step (the median of the later ones), the two evaluations and the run in all. Prints figures; not a test.

The run is `recipes/magrpo_quickstart.py`'s (two agents, 16 steps, evaluations before and after), with
`captured_decode=False` for the eager arm and `captured_decode=True` for the captured one (on CUDA the recorded CUDA
graphs, elsewhere the compiled step).

Usage, from the repository root:
    python recipes/benchmarks/bench_decode_run.py          # on a GPU: the quickstart's run, eager against captured
    HF_HUB_OFFLINE=1 python recipes/benchmarks/bench_decode_run.py --max_steps 2 --eval_questions 2   # a short check
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import trl_marl  # noqa: F401 (first: it filters a bitsandbytes notice that importing PEFT would print)

# isort: split
import torch
from transformers import TrainerCallback

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from magrpo_quickstart import quickstart_datasets, quickstart_defaults  # noqa: E402
from run_info import run_header  # noqa: E402

from trl_marl import MAGRPOConfig, MAGRPOTrainer, default_model_path  # noqa: E402
from trl_marl.tasks.toy import explain_ratio_reward  # noqa: E402

ARMS = {"eager": False, "captured": True}


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class StepTimes(TrainerCallback):
    """Wall-clock seconds of every training step."""

    def __init__(self):
        self.seconds, self._start = [], None

    def on_step_begin(self, args, state, control, **kwargs):
        synchronize()
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        synchronize()
        self.seconds.append(time.perf_counter() - self._start)


def run_arm(arm: str, max_steps: int, eval_questions: int, output_dir: str) -> dict:
    """One arm's run in this process: its times (seconds) and rewards."""
    started = time.perf_counter()
    settings = {**quickstart_defaults(torch.cuda.is_available()), "output_dir": output_dir, "max_steps": max_steps}
    args = MAGRPOConfig(**settings, captured_decode=ARMS[arm])
    train_dataset, eval_dataset = quickstart_datasets(args.seed, eval_questions)
    trainer = MAGRPOTrainer(
        default_model_path(), explain_ratio_reward, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset
    )
    steps = StepTimes()
    trainer.add_callback(steps)
    setup = time.perf_counter() - started
    timed = {}
    for phase in ("eval_before", "train", "eval_after"):
        synchronize()
        start = time.perf_counter()
        result = trainer.train() if phase == "train" else trainer.evaluate()
        synchronize()
        timed[phase] = time.perf_counter() - start
        if phase != "train":
            timed[f"{phase}_reward"] = result["eval_reward"]
    decoder = trainer.captured_decoder
    return {
        "arm": arm,
        "path": getattr(decoder, "path", "eager generate"),
        "setup_s": setup,
        **timed,
        "first_step_s": steps.seconds[0],
        "steady_step_s": statistics.median(steps.seconds[1:]) if len(steps.seconds) > 1 else None,
        "total_s": time.perf_counter() - started,
        "warmups_s": {f"{r}x{n}": s for (r, n), s in getattr(decoder, "warmups", {}).items()},
        "recordings": len(getattr(decoder, "recordings", [])),  # CUDA graphs recorded in the run, and their seconds
        "recordings_s": sum(getattr(decoder, "recordings", [])),
        "failure": getattr(decoder, "failure", None),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max_steps", type=int, default=16)
    parser.add_argument("--eval_questions", type=int, default=12)
    parser.add_argument("--arm", choices=list(ARMS), help="run one arm in this process (what the script starts)")
    parser.add_argument("--output", default=str(HERE / "results" / "bench_decode_run.json"))
    args = parser.parse_args()
    if args.arm:
        output_dir = f"outputs/bench-decode-run-{args.arm}"
        print("RESULT " + json.dumps(run_arm(args.arm, args.max_steps, args.eval_questions, output_dir)))
        return
    default_model_path()  # converted once per machine (the embedded model's first use), before either arm is timed
    arms = []
    for arm in ARMS:  # each in a fresh process: nothing recorded or compiled by the other carries over
        command = [sys.executable, __file__, "--arm", arm, "--max_steps", str(args.max_steps)]
        command += ["--eval_questions", str(args.eval_questions)]
        # its stderr (progress, warnings, a traceback) shows as it runs; its stdout (the result line) comes back
        output = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True).stdout
        arms.append(json.loads(next(line for line in output.splitlines() if line.startswith("RESULT "))[7:]))
        result = arms[-1]
        steady = result["steady_step_s"]
        print(
            f"{arm:8} ({result['path']}): first step {result['first_step_s']:.2f} s, steady step "
            f"{steady if steady is None else round(steady, 2)} s, evaluations {result['eval_before']:.1f} + "
            f"{result['eval_after']:.1f} s, in all {result['total_s']:.1f} s; reward "
            f"{result['eval_before_reward']:.3f} -> {result['eval_after_reward']:.3f}; warm-ups "
            f"{result['warmups_s']}, {result['recordings']} recordings in {result['recordings_s']:.1f} s"
            + (f"; FAILED, fell back: {result['failure']}" if result["failure"] else ""),
            flush=True,
        )
    eager, captured = arms
    print(f"the run in all: captured {eager['total_s'] / captured['total_s']:.2f}x faster than eager")
    if captured["steady_step_s"]:
        print(f"captured first step / steady step: {captured['first_step_s'] / captured['steady_step_s']:.2f}")
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    summary = {**run_header(gpu=gpu, torch=torch.__version__), "max_steps": args.max_steps, "arms": arms}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
