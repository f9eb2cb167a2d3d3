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

With `--tools`, two other arms, `recipes/tool_team.py`'s team and task (the calculator, the writer; settings as the
recipe's):

- `tool_program`: the recipe's episode: the calculator called with an `add` tool and `tool_choice: required`
  (constrained decoding), the program running the call, the writer shown the tool exchange;
- `plain_program`: the same two calls without tools: the calculator answers in text, the writer is shown that answer.

Printed as above, and each arm's step time per completion token (the arms write different answers); the target
(docs/benchmarks.md): the tool-calling step at most 1.3x the plain one's for the same tokens.

    python recipes/benchmarks/bench_program.py --tools       # ~8 min on 2 idle CPU cores
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


ARMS = ("built_in", "program", "plain_program", "tool_program")


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


def calculate_then_answer_in_text(client, row) -> float:
    """`tool_team.py`'s episode without tools: the calculator answers in text, the writer is shown that answer."""
    question = [{"role": "user", "content": row["prompt"]}]
    worked = client.chat.completions.create(model="calculator", messages=question).choices[0].message.content
    shown = [*question, {"role": "assistant", "content": worked}, {"role": "user", "content": "So, the result?"}]
    answer = client.chat.completions.create(model="writer", messages=shown).choices[0].message.content
    total = str(row["a"] + row["b"])
    return 0.5 * (total in re.findall(r"-?\d+", worked)) + 0.5 * (total in re.findall(r"-?\d+", answer))


def train_arm(arm: str, steps: int) -> dict:
    """Train one arm in this process; its step times and completion lengths."""
    import torch
    from magrpo_quickstart import quickstart_datasets, quickstart_defaults

    from trl_marl import MAGRPOConfig, MAGRPOTrainer, default_model_path
    from trl_marl.tasks.toy import explain_ratio_reward

    settings = {**quickstart_defaults(torch.cuda.is_available()), "max_steps": steps, "logging_steps": 1}
    if arm in ("tool_program", "plain_program"):
        from tool_team import AGENTS, calculate_then_answer, sum_questions

        overrides = {"output_dir": f"outputs/bench-program-{arm}", "agents": AGENTS, "max_completion_length": 48}
        args = MAGRPOConfig(**{**settings, **overrides})
        episode = calculate_then_answer if arm == "tool_program" else calculate_then_answer_in_text
        trainer = MAGRPOTrainer(
            default_model_path(), args=args, train_dataset=sum_questions(256, args.seed), episode=episode
        )
    else:
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
    parser.add_argument("--out", default=None, help="default: results/bench_program.json (--tools: _tools.json)")
    parser.add_argument("--tools", action="store_true", help="a tool-calling program against the same without tools")
    parser.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)  # one arm, in a child
    options = parser.parse_args()
    if options.arm:
        print(json.dumps(train_arm(options.arm, options.steps)))
        return
    import torch
    from run_info import run_header

    results = {**run_header(torch_threads=torch.get_num_threads()), "steps": options.steps, "arms": {}}
    pair = ("plain_program", "tool_program") if options.tools else ("built_in", "program")
    for arm in pair:
        command = [sys.executable, __file__, "--arm", arm, "--steps", str(options.steps)]
        output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        results["arms"][arm] = json.loads(output.strip().splitlines()[-1])
    for arm, figures in results["arms"].items():
        times = figures["step_times"]
        figures["first_step"], figures["median_step"] = times[0], statistics.median(times[1:])
        figures["step_per_token"] = figures["median_step"] / figures["completion_length"]
        print(
            f"{arm:13s} first step {figures['first_step']:6.2f} s, median step {figures['median_step']:6.2f} s, "
            f"mean completion {figures['completion_length']:5.1f} tokens, "
            f"{1000 * figures['step_per_token']:.0f} ms of step per completion token"
        )
    arms, (base, other) = results["arms"], pair
    results["ratio"] = arms[other]["median_step"] / arms[base]["median_step"]
    results["ratio_per_token"] = arms[other]["step_per_token"] / arms[base]["step_per_token"]
    print(
        f"{other} / {base} median step: {results['ratio']:.2f}; per completion token: "
        f"{results['ratio_per_token']:.2f} (target <= 1.3)"
    )
    name = "bench_program_tools.json" if options.tools else "bench_program.json"
    options.out = options.out or os.path.join("recipes", "benchmarks", "results", name)
    os.makedirs(os.path.dirname(options.out) or ".", exist_ok=True)
    with open(options.out, "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
