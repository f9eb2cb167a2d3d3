"""Step time of training from an agent program against MAGRPO's own rollout, on the same work.

Two arms, the quickstart's `explain` team and settings on the embedded SmolLM2-135M-Instruct (2 questions x 4
completions per agent per step, at most 40 new tokens):

- `built_in`: `MAGRPOTrainer`'s own single-turn rollout (every agent answers each question, all rows in one routed
  `generate` call);
- `program`: the parity episode, the same work as an agent program: every agent answers the question once, both
  calls sent at once (threads) through the episode's `openai` client, so the server batches the step's rows as the
  built-in rollout does; the trainer records and trains on them.

Each arm trains `--steps` steps in its own process, one after the other (never two at once). Printed per arm: the
median step time after the first step (TRL's `step_time`), the first step's, and the mean completion length (the
two arms sample different tokens, so their work differs by that much); then program / built-in. The target
(docs/programs.md): the program's step at most 1.3x the built-in one's.

    python recipes/benchmarks/bench_program.py               # ~6 min on 2 idle CPU cores; --steps, --out
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def each_agent_at_once(client, row):
    """The parity episode: every agent answers the question once, the calls sent together."""
    answers = {}

    def answer(agent: str) -> None:
        reply = client.chat.completions.create(model=agent, messages=row["prompt"])
        answers[agent] = reply.choices[0].message.content

    calls = [threading.Thread(target=answer, args=(agent,)) for agent in ("concise", "detailed")]
    for call in calls:
        call.start()
    for call in calls:
        call.join()
    return answers


def train_arm(arm: str, steps: int) -> dict:
    """Train one arm in this process; its step times and completion lengths."""
    import torch
    from magrpo_quickstart import quickstart_datasets, quickstart_defaults

    from trl_marl import MAGRPOConfig, MAGRPOTrainer, default_model_path
    from trl_marl.tasks.toy import explain_ratio_reward

    settings = {**quickstart_defaults(torch.cuda.is_available()), "max_steps": steps, "logging_steps": 1}
    args = MAGRPOConfig(**{**settings, "output_dir": f"outputs/bench-program-{arm}"})
    train_dataset, _ = quickstart_datasets(args.seed, 12)
    episode = each_agent_at_once if arm == "program" else None
    trainer = MAGRPOTrainer(
        default_model_path(), explain_ratio_reward, args=args, train_dataset=train_dataset, episode=episode
    )
    trainer.train()
    logs = [log for log in trainer.state.log_history if "step_time" in log]
    return {
        "step_times": [log["step_time"] for log in logs],
        "completion_length": statistics.mean(log["completions/mean_length"] for log in logs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default="recipes/benchmarks/results/bench_program.json")
    parser.add_argument("--arm", choices=["built_in", "program"], help=argparse.SUPPRESS)  # one arm, in a child
    options = parser.parse_args()
    if options.arm:
        print(json.dumps(train_arm(options.arm, options.steps)))
        return
    import torch
    from run_info import run_header

    results = {**run_header(torch_threads=torch.get_num_threads()), "steps": options.steps, "arms": {}}
    for arm in ("built_in", "program"):
        command = [sys.executable, __file__, "--arm", arm, "--steps", str(options.steps)]
        output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        results["arms"][arm] = json.loads(output.strip().splitlines()[-1])
    for arm, figures in results["arms"].items():
        times = figures["step_times"]
        figures["first_step"], figures["median_step"] = times[0], statistics.median(times[1:])
        print(
            f"{arm:9s} first step {figures['first_step']:6.2f} s, median step {figures['median_step']:6.2f} s, "
            f"mean completion {figures['completion_length']:5.1f} tokens"
        )
    arms = results["arms"]
    results["ratio"] = arms["program"]["median_step"] / arms["built_in"]["median_step"]
    print(f"program / built-in median step: {results['ratio']:.2f} (target <= 1.3)")
    os.makedirs(os.path.dirname(options.out) or ".", exist_ok=True)
    with open(options.out, "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
