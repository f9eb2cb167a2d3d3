"""Peak memory of every training recipe on the embedded default model, with its default settings, on the CPU. Prints
figures; not a test.

Each recipe runs in its own process, one after the other, shortened where its defaults would take long (fewer steps,
fewer held-out problems; the settings of a training step, which set its peak, are the recipe's own), and prints its
peak at the end (`trl_marl.memory.peak_memory`: the resident set's high-water mark). The target
(docs/benchmarks.md): every recipe under 8 GB (7.45 GiB), so that a 16 GB laptop runs it with room.

    python recipes/benchmarks/bench_recipe_memory.py                       # every recipe, ~1 h on 2 idle CPU cores
    python recipes/benchmarks/bench_recipe_memory.py --only tool_team      # some
    ... [--out PATH]                                                       # default results/bench_recipe_memory.json
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run_info import run_header  # noqa: E402

RECIPES_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET_GIB = 8e9 / 1024**3
# recipe -> the flags that shorten it (steps, held-out problems); a training step keeps the recipe's own settings
RECIPES = {
    "magrpo_quickstart": ["--max_steps", "3", "--eval_questions", "4"],
    "magrpo_multiturn": ["--max_steps", "3", "--eval_words", "2"],
    "magrpo_writing": ["--max_steps", "3", "--eval_passages", "2"],
    "magrpo_coding": ["--max_steps", "3"],
    "program_team": ["--max_steps", "3", "--eval_questions", "4"],
    "tool_team": ["--max_steps", "3", "--eval_questions", "4"],
    "atgrpo_reach_target": ["--max_steps", "3", "--eval_puzzles", "2"],
    "atgrpo_math": ["--max_steps", "3"],
    "atgrpo_math_tools": ["--max_steps", "2", "--eval_problems", "4", "--warm_start_epochs", "0.25"],
    "atgrpo_code_tester": ["--max_steps", "3"],
    "atgrpo_puzzles": ["--max_steps", "3"],
    "atgrpo_two_bases": ["--max_steps", "3"],
}
PEAK = re.compile(r"Peak memory.*?([0-9.]+) GiB resident")  # the host's, on the CPU or beside a GPU's peaks


def run_recipe(name: str, flags: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as output_dir:
        command = [sys.executable, os.path.join(RECIPES_DIR, f"{name}.py"), *flags, "--output_dir", output_dir]
        started = time.perf_counter()
        finished = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        minutes = (time.perf_counter() - started) / 60
    peaks = PEAK.findall(finished.stdout)
    if finished.returncode != 0 or not peaks:
        raise RuntimeError(f"{name} failed (exit {finished.returncode}):\n{finished.stderr[-3000:]}")
    return {"flags": flags, "peak_resident_gib": float(peaks[-1]), "minutes": minutes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=list(RECIPES), default=list(RECIPES))
    parser.add_argument("--out", default=None)
    options = parser.parse_args()
    results = {**run_header(), "target_gib": TARGET_GIB, "recipes": {}}
    out = options.out or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results", "bench_recipe_memory.json"
    )
    for name in options.only:
        try:
            figures = results["recipes"][name] = run_recipe(name, RECIPES[name])
        except RuntimeError as error:  # the others still run; the failure is in the results
            results["recipes"][name] = {"flags": RECIPES[name], "error": str(error)[-3000:]}
            print(f"{name:22s} FAILED: {str(error).splitlines()[0]}", flush=True)
        else:
            verdict = "under" if figures["peak_resident_gib"] < TARGET_GIB else "OVER"
            print(
                f"{name:22s} peak {figures['peak_resident_gib']:5.2f} GiB ({verdict} 8 GB), "
                f"{figures['minutes']:.1f} min",
                flush=True,
            )
        with open(out, "w") as file:  # after every recipe: an interrupted run keeps what it measured
            json.dump(results, file, indent=2)
    print(f"Written: {out}")


if __name__ == "__main__":
    main()
