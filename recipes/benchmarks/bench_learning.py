"""Learning benchmark: does a team trained with trl_marl beat its baselines on held-out problems?

Two cooperative tasks on the embedded default model (SmolLM2-135M-Instruct), on the CPU, each method run with
several seeds; every figure is measured on the task's held-out split after training.

**explain** (MAGRPO, one turn): for a short question `concise` gives the bare answer and `detailed` explains it; the
team reward (`explain_ratio_reward`) asks the explanation to be three times as long as the answer, so it needs both.
- `untrained`: the base model in both roles;
- `magrpo`: `MAGRPOTrainer` on the shared team reward;
- `independent`: each agent trained on its own reward, never seeing the team's: `concise` is rewarded for a short
  answer (at most 5 words, ramping to 0 at 15), `detailed` for two or three sentences. GRPO groups of one agent's
  candidates from one prompt (`ATGRPOTrainer` with one turn and `team_reward_weight=0`: r = the agent's own reward);
- `single`: one agent doing the whole job with TRL's own `GRPOTrainer` (one LoRA adapter), asked for the short answer
  on its first line and the explanation on the next ones; its first line stands for `concise`'s answer and the rest
  for `detailed`'s in the same team reward. It gets the team's token budget (2 x 40 new tokens).

**reach_target** (AT-GRPO, two turns): a counter must reach a target; `mover` then `finisher` add a number at each of
two turns (the built-in task, `trl_marl/tasks/toy.py`).
- `untrained`: the base model in both roles, one AT-GRPO episode per puzzle;
- `at_grpo`: `ATGRPOTrainer` (K candidates per agent and turn, greedy continuation, α · team + local reward);
- `single`: one agent asked for the one number that reaches the target, trained with TRL's `GRPOTrainer` on the same
  team reward and local format reward (`is_a_number`).

The team methods are scored by `trl_marl.evaluate_task` on the split (explain: the mean team reward over sampled joint
actions; reach_target, one AT-GRPO episode per puzzle: `episodes/team_reward`, the team reward of the joint action each
episode ends on, and `episodes/success_rate`); the single agent by `GRPOTrainer.evaluate` with the same reward
functions and sampling (temperature 1). Every run logs its training team reward each step, the curves in the PNG:
MAGRPO's mean over its sampled joint actions; for the AT-GRPO trainers (`at_grpo`, `independent`)
`episodes/team_reward`, the team reward of the joint action each episode ended on, along the greedy path (the best of K
candidates by the training reward at each step, so it runs above a sampled mean); the single agent's mean team reward.

    pip install -e ".[bench]"                                          # matplotlib, for the PNG
    python recipes/benchmarks/bench_learning.py                       # both tasks, every method, seeds 0 1 2
    python recipes/benchmarks/bench_learning.py --task explain --methods magrpo --seeds 0 --steps 4   # one run

Results go to `recipes/benchmarks/results/bench_learning.json` as each run finishes (a run already there is
skipped: delete the file, or pass `--fresh`, to start over), then the table is printed and the curves are drawn to
`recipes/benchmarks/results/bench_learning.png`.
"""

import argparse
import datetime
import gc
import json
import os
import platform
import re
import statistics
import tempfile
import time

import torch
from datasets import Dataset
from peft import LoraConfig
from trl import GRPOConfig, GRPOTrainer

import trl_marl
from trl_marl import ATGRPOConfig, ATGRPOTrainer, MAGRPOConfig, MAGRPOTrainer, default_model_path
from trl_marl.evaluation import evaluate_task
from trl_marl.tasks import task_defaults
from trl_marl.tasks.toy import Explain, ReachTarget, explain_ratio_reward, is_a_number, parse_move

TASKS = {"explain": Explain, "reach_target": ReachTarget}
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
METHODS = {
    "explain": ["untrained", "magrpo", "independent", "single"],
    "reach_target": ["untrained", "at_grpo", "single"],
}
# Shared by every trained method of a task (the quickstart's settings for explain, the recipe's for reach_target).
COMMON = dict(
    num_generations=4,
    per_device_train_batch_size=8,  # two problems x four completions per agent per step
    learning_rate=5e-4,
    lr_scheduler_type="constant",
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    use_cpu=not torch.cuda.is_available(),
    bf16=torch.cuda.is_available(),
)
LORA = dict(lora_r=16, lora_alpha=32)
TOKENS = {"explain": 40, "reach_target": 12}
STEPS = {"explain": 16, "reach_target": 12}


# --- explain: the independent agents' own rewards, and the single agent's format ---


def short_answer(prompts, completions, **kwargs):
    """`concise`'s own reward: 1 for 1-5 words, falling linearly to 0 at 15 words; 0 when silent."""
    words = [len(text.split()) for text in completions]
    return [0.0 if n == 0 else 1.0 if n <= 5 else max(0.0, (15 - n) / 10) for n in words]


def two_or_three_sentences(prompts, completions, **kwargs):
    """`detailed`'s own reward: 1 for two or three sentences, 0.5 for one or four, else 0."""
    counts = [len([s for s in re.split(r"[.!?]+", text) if s.strip()]) for text in completions]
    return [1.0 if n in (2, 3) else 0.5 if n in (1, 4) else 0.0 for n in counts]


class IndependentExplain(Explain):
    """The explain task with a reward per agent; with `team_reward_weight=0` the team reward is only logged."""

    scheduler = "parallel"
    local_reward_funcs = {"concise": [short_answer], "detailed": [two_or_three_sentences]}


SINGLE_EXPLAIN = (
    "Answer the question. On the first line write only the short answer, in a few words. On the next lines explain "
    "the answer in two or three sentences."
)
LABEL = re.compile(r"^\W*(answer|explanation)\W*:\s*", re.IGNORECASE)


def completion_text(completion) -> str:
    return completion[0]["content"] if isinstance(completion, list) else completion


def split_answer(text: str) -> dict[str, str]:
    """The first non-empty line as `concise`'s answer, the lines after it as `detailed`'s explanation (labels such
    as 'Answer:' dropped)."""
    lines = [LABEL.sub("", line) for line in text.strip().splitlines() if line.strip()]
    return {"concise": lines[0] if lines else "", "detailed": " ".join(lines[1:])}


def single_explain_reward(prompts, completions, **kwargs):
    """The team reward of the answer line and the explanation lines of one completion (0 without both)."""
    return explain_ratio_reward(prompts, [split_answer(completion_text(c)) for c in completions])


# --- reach_target: the single agent makes the one move ---

SINGLE_REACH = "You move the counter alone, once. Reply with only the whole number to add."


def reached_value(completion, start) -> int:
    move = parse_move(completion_text(completion))
    return start + (move or 0)


def single_reach_reward(prompts, completions, start, target, **kwargs):
    """`reach_target_reward` after the single agent's one move."""
    values = [reached_value(c, s) for c, s in zip(completions, start)]
    return [1.0 - min(1.0, abs(t - v) / max(1, abs(t - s))) for v, s, t in zip(values, start, target)]


def on_target(prompts, completions, start, target, **kwargs):
    """1 when the move lands on the target: the success rate (weight 0: logged, not trained on)."""
    return [float(reached_value(c, s) == t) for c, s, t in zip(completions, start, target)]


def single_format(prompts, completions, **kwargs):
    """The teams' local reward (`is_a_number`) on the single agent's answer."""
    return is_a_number(prompts, [completion_text(c) for c in completions])


def with_system(dataset: Dataset, system: str) -> Dataset:
    return dataset.map(lambda row: {"prompt": [{"role": "system", "content": system}, *row["prompt"]]})


# --- runs ---


def curve(trainer, key: str) -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if key in entry and "train_runtime" not in entry]


def evaluate_team(task, team_dir, seed, algorithm, tokens) -> dict:
    kwargs = {"team": team_dir} if team_dir else {}
    metrics = evaluate_task(
        task,
        baseline="team" if team_dir else task.scheduler,  # untrained: the base model in every role
        algorithm=algorithm,
        seed=seed,
        max_completion_length=tokens,
        use_cpu=COMMON["use_cpu"],
        **kwargs,
    )
    # AT-GRPO's "reward" averages every agent's turn (the first scored before its teammate answers): take the team
    # reward each episode ended on, which the single agent's reward (its one answer) compares with
    team_reward = metrics["episodes/team_reward"] if algorithm == "at_grpo" else metrics["reward"]
    return {"team_reward": team_reward, "success_rate": metrics.get("episodes/success_rate")}


def run_team(task_name: str, method: str, seed: int, steps: int, output_dir: str) -> dict:
    tokens = TOKENS[task_name]
    task = TASKS[task_name]()
    algorithm = "at_grpo" if task_name == "reach_target" else "magrpo"  # how the task's teams are evaluated
    if method == "untrained":
        return {**evaluate_team(task, None, seed, algorithm, tokens), "curve": []}
    if method == "independent":
        train_task = IndependentExplain()
        config_class, trainer_class, extra = ATGRPOConfig, ATGRPOTrainer, {"team_reward_weight": 0.0}
    elif method == "at_grpo":
        train_task = task
        config_class, trainer_class, extra = ATGRPOConfig, ATGRPOTrainer, {}
    else:
        train_task = task
        config_class, trainer_class, extra = MAGRPOConfig, MAGRPOTrainer, {}
    args = config_class(
        output_dir=output_dir,
        **task_defaults(train_task),
        **COMMON,
        **LORA,
        **extra,
        max_completion_length=tokens,
        max_steps=steps,
        seed=seed,
    )
    trainer = trainer_class(default_model_path(), args=args, task=train_task)
    trainer.train()
    trainer.save_model(output_dir)
    # The team reward of the joint actions training formed: MAGRPO's sampled ones; AT-GRPO's mean over every candidate
    # would count the first agent's candidates scored before its teammate answers, so the episodes' final joint actions
    training_curve = curve(
        trainer,
        "episodes/team_reward" if trainer_class is ATGRPOTrainer else f"rewards/{task.reward_funcs[0].__name__}/mean",
    )
    del trainer
    gc.collect()
    return {**evaluate_team(task, output_dir, seed, algorithm, tokens), "curve": training_curve}


def run_single(task_name: str, seed: int, steps: int, output_dir: str) -> dict:
    """One agent with TRL's GRPOTrainer and a LoRA adapter of the teams' size."""
    task = TASKS[task_name]()
    if task_name == "explain":
        system, reward_funcs, weights, tokens = SINGLE_EXPLAIN, [single_explain_reward], None, 2 * TOKENS["explain"]
        curve_key = "rewards/single_explain_reward/mean"
    else:
        system, tokens = SINGLE_REACH, TOKENS["reach_target"]
        reward_funcs, weights = [single_reach_reward, single_format, on_target], [1.0, 1.0, 0.0]
        curve_key = "rewards/single_reach_reward/mean"
    train, held_out = (with_system(task.dataset(split), system) for split in ("train", "eval"))
    args = GRPOConfig(
        output_dir=output_dir,
        **COMMON,
        max_completion_length=tokens,
        max_steps=steps,
        seed=seed,
        reward_weights=weights,
        num_generations_eval=2,
        per_device_eval_batch_size=8,
    )
    peft_config = LoraConfig(r=LORA["lora_r"], lora_alpha=LORA["lora_alpha"], target_modules="all-linear")
    trainer = GRPOTrainer(
        default_model_path(),
        reward_funcs,
        args=args,
        train_dataset=train,
        eval_dataset=held_out,
        peft_config=peft_config,
    )
    trainer.train()
    metrics = trainer.evaluate()
    training_curve = curve(trainer, curve_key)
    del trainer
    gc.collect()
    success = metrics.get("eval_rewards/on_target/mean")
    return {"team_reward": metrics[f"eval_{curve_key}"], "success_rate": success, "curve": training_curve}


def run(task_name: str, method: str, seed: int, steps: int) -> dict:
    torch.manual_seed(seed)
    steps = 0 if method == "untrained" else steps
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as output_dir:
        if method == "single":
            result = run_single(task_name, seed, steps, output_dir)
        else:
            result = run_team(task_name, method, seed, steps, output_dir)
    minutes = (time.perf_counter() - started) / 60
    return {**result, "task": task_name, "method": method, "seed": seed, "steps": steps, "minutes": minutes}


# --- report ---


def mean_std(values: list[float]) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} ± {std:.3f}"


def table(runs: list[dict]) -> str:
    lines = [
        "| task | method | seeds | held-out team reward | held-out success rate | training team reward, mean over "
        "steps | minutes per run |",
        "|---|---|---|---|---|---|---|",
    ]
    for task_name, methods in METHODS.items():
        for method in methods:
            done = [r for r in runs if r["task"] == task_name and r["method"] == method]
            if not done:
                continue
            minutes = statistics.mean(r["minutes"] for r in done)
            lines.append(
                f"| {task_name} | {method} | {len(done)} | {mean_std([r['team_reward'] for r in done])} | "
                f"{mean_std([r['success_rate'] for r in done])} | "
                f"{mean_std([statistics.mean(r['curve']) if r['curve'] else None for r in done])} | {minutes:.1f} |"
            )
    return "\n".join(lines)


def plot(runs: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(METHODS), figsize=(6 * len(METHODS), 4))
    for axis, (task_name, methods) in zip(axes, METHODS.items()):
        for method in methods:
            curves = [r["curve"] for r in runs if r["task"] == task_name and r["method"] == method and r["curve"]]
            if not curves:
                continue
            length = min(len(c) for c in curves)
            mean = [statistics.mean(c[i] for c in curves) for i in range(length)]
            axis.plot(range(1, length + 1), mean, label=f"{method} ({len(curves)} seeds)")
        axis.set_title(f"{task_name}: team reward while training (mean over seeds)")
        axis.set_xlabel("step")
        axis.set_ylabel("team reward")
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=[*METHODS, "all"], default="all")
    parser.add_argument("--methods", nargs="+", help="Subset of the task's methods (default: all of them).")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, help="Training steps (default: 16 for explain, 12 for reach_target).")
    parser.add_argument("--results", default=os.path.join(RESULTS, "bench_learning.json"))
    parser.add_argument("--fresh", action="store_true", help="Forget the runs already in the results file.")
    options = parser.parse_args()

    record = {"runs": []}
    if os.path.exists(options.results) and not options.fresh:
        with open(options.results) as f:
            record = json.load(f)
    record.update(
        machine=f"{platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}, "
        + (torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"),
        trl_marl=trl_marl.__version__,
        model=str(default_model_path()),
    )
    tasks = list(METHODS) if options.task == "all" else [options.task]
    for task_name in tasks:
        for method in options.methods or METHODS[task_name]:
            if method not in METHODS[task_name]:
                raise SystemExit(f"--methods: {method!r} is not a method of {task_name} ({METHODS[task_name]}).")
            for seed in options.seeds:
                steps = options.steps or STEPS[task_name]
                done = [r for r in record["runs"] if (r["task"], r["method"], r["seed"]) == (task_name, method, seed)]
                if done and done[0]["steps"] in (steps, 0):
                    continue
                print(f"== {task_name} / {method} / seed {seed}", flush=True)
                result = run(task_name, method, seed, steps)
                print(
                    f"   team reward {result['team_reward']:.3f}, success rate {result['success_rate']}, "
                    f"{result['minutes']:.1f} min",
                    flush=True,
                )
                record["runs"] = [r for r in record["runs"] if r not in done] + [result]
                record["date"] = datetime.date.today().isoformat()
                os.makedirs(os.path.dirname(options.results), exist_ok=True)
                with open(options.results, "w") as f:
                    json.dump(record, f, indent=1)
    print(table(record["runs"]))
    png = os.path.splitext(options.results)[0] + ".png"
    plot(record["runs"], png)
    print(f"Runs: {options.results}; curves: {png}")


if __name__ == "__main__":
    main()
