"""Learning benchmark: does the team learn what its members cannot learn on their own rewards?

Two built-in tasks (`trl_marl/tasks/teamwork.py`) on the embedded default model (SmolLM2-135M-Instruct), on the
CPU; every method is trained with the same settings and seeds and scored on the same 64 held-out problems, greedily,
every few steps (step 0 is the untrained team: LoRA starts as the identity).

**distinct_items** (one turn, both teammates at once): each names 3 members of a category; the team reward counts the
distinct valid members of both lists.
- `magrpo`: `MAGRPOTrainer` on the team reward;
- `per_role`: each teammate trained on its own reward (valid members in its own list, the task's local reward):
  `ATGRPOTrainer` with one turn and α = 0, so a group is one teammate's candidates for one problem;
- `single`: one agent doing every part: MAGRPO with one shared adapter (the role prompts tell the parts apart).

**pick_new** (up to three turns, one teammate per turn): name options not named yet, until the team has two new ones.
- `at_grpo`: `ATGRPOTrainer` (K candidates per problem, turn and agent; greedy continuation; α · team + format);
- `single`: the same with one shared adapter;
- `magrpo`: `MAGRPOTrainer` on the same task (its tree of joint actions, team reward only);
- `alpha0`: AT-GRPO with α = 0 (the local format reward only);
- `coarse`: AT-GRPO with its groups coarsened to (turn, agent): every problem's candidates of one turn compared
  together, the ablation that shows whether grouping by problem matters.

    pip install -e ".[bench]"                                   # matplotlib, for the PNG
    python recipes/benchmarks/bench_learning.py                # both tasks, every method, seeds 0 1 2
    python recipes/benchmarks/bench_learning.py --task pick_new --methods at_grpo --seeds 0   # one run
    python recipes/benchmarks/bench_learning.py --report       # the tables and the PNG from the saved runs
    python recipes/benchmarks/bench_learning.py --keep_teams teams/   # also keep each run's final team

Each run is saved to `recipes/benchmarks/results/bench_learning.json` as it finishes (a run already there with the
same settings is skipped, so a long benchmark resumes where it stopped; `--fresh` forgets the saved runs). The
tables (scores, the claims of CLAIMS with their verdicts, diagnostics; also written to `bench_learning.md`) and the
curves (`bench_learning.png`) are regenerated from that file. With `--keep_teams DIR` each run's final team is kept
in `DIR/<task>/<method>/seed-<seed>` (a `save_model` folder: `trl_marl.load_team` loads it), so anyone can score
the trained teams on problems of their own; the run's record names the folder (`kept`).
Settings were chosen on the training split only (untrained samples read on training problems); the held-out split is
only ever scored.
"""

import argparse
import datetime
import gc
import json
import math
import os
import platform
import shutil
import statistics
import tempfile
import time

import torch
from transformers import TrainerCallback

import trl_marl
from trl_marl import ATGRPOConfig, ATGRPOTrainer, MAGRPOConfig, MAGRPOTrainer, default_model_path, load_team
from trl_marl.advantages import group_advantages
from trl_marl.tasks import task_defaults
from trl_marl.tasks.teamwork import (
    DistinctItems,
    PickNew,
    distinct_items_reward,
    named_members,
    new_option_gain,
    own_items_reward,
)

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
DEFAULT_RESULTS = os.path.join(RESULTS, "bench_learning.json")
DOCS = os.path.normpath(os.path.join(RESULTS, "..", "..", "..", "docs", "benchmarks.md"))
TASKS = {"distinct_items": DistinctItems, "pick_new": PickNew}
# method -> (algorithm, config fields); the first trained method of a task is the one the others are compared with
METHODS = {
    "distinct_items": {
        "magrpo": ("magrpo", {}),
        "per_role": ("at_grpo", {"team_reward_weight": 0.0}),
        "single": ("magrpo", {"adapter_mode": "shared"}),
    },
    "pick_new": {
        "at_grpo": ("at_grpo", {}),
        "single": ("at_grpo", {"adapter_mode": "shared"}),
        # its tree with G = 2 over 3 turns is 14 completions per problem (AT-GRPO's: 12), 2 problems a step as AT-GRPO
        "magrpo": ("magrpo", {"num_generations": 2, "per_device_train_batch_size": 4}),
        "alpha0": ("at_grpo", {"team_reward_weight": 0.0}),
        "coarse": ("at_grpo", {}),
    },
}
# MAGRPO sums a turn's rewards into returns: on pick_new it trains on each answer's gain, whose sum is the team reward
REWARDS = {("pick_new", "magrpo"): [new_option_gain]}
SETTINGS = {  # per task: tokens per answer, sampling temperature
    "distinct_items": {"max_completion_length": 16, "temperature": 0.7},
    "pick_new": {"max_completion_length": 6, "temperature": 0.7},
}
# per task: training steps and held-out evaluation every N steps (distinct_items' training reward still rose at step
# 16, and its steps cost a third of pick_new's)
SCHEDULE = {"distinct_items": (32, 8), "pick_new": (16, 4)}
COMMON = dict(
    num_generations=4,
    per_device_train_batch_size=8,  # two problems x four candidates per agent per step
    learning_rate=5e-4,
    lr_scheduler_type="constant",
    gradient_checkpointing=False,  # tiny batches: recomputing activations would only cost time
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    lora_r=16,
    lora_alpha=32,
    use_cpu=not torch.cuda.is_available(),
    bf16=torch.cuda.is_available(),
)
T_95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131]
T_95 += [2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]
T_95 = dict(enumerate(T_95, 1))  # two-sided 95 % quantiles of Student's t, by degrees of freedom
# the claims the benchmark tests, per task: (method expected to win, method it must beat)
CLAIMS = {
    "distinct_items": [("magrpo", "per_role"), ("magrpo", "single"), ("magrpo", "untrained")],
    "pick_new": [
        ("at_grpo", "single"),
        ("at_grpo", "coarse"),
        ("at_grpo", "untrained"),
        ("at_grpo", "magrpo"),
        ("at_grpo", "alpha0"),
    ],
}


# --- the coarse-key ablation ---


def coarsen_groups(rollout, baseline: str, scale_rewards: str, agent_names: list[str] | None = None) -> None:
    """Recompute an AT-GRPO rollout's advantages with groups keyed by (turn, agent) instead of (problem, turn, agent):
    every problem's candidates of one turn and agent are compared with each other (single process). With
    `agent_names`, the rollout's tied-group shares are those of the coarse groups."""
    groups: dict[tuple[int, int], list] = {}
    for sample, joint_action in zip(rollout.samples, rollout.joint_actions):
        groups.setdefault((sample.turn, sample.agent), []).append((sample, joint_action))
    width = max(len(members) for members in groups.values())
    rewards = torch.full((len(groups), width), math.nan)
    for i, members in enumerate(groups.values()):
        rewards[i, : len(members)] = torch.tensor([joint_action.reward for _, joint_action in members])
    advantages, group_std = group_advantages(rewards, baseline, scale_rewards)
    for (turn, agent), std in zip(groups, group_std[:, 0].tolist()):  # the tied share of the groups it trains on
        if agent_names is not None:
            rollout.metrics[f"turns/{turn}/agents/{agent_names[agent]}/frac_reward_zero_std"] = float(abs(std) < 1e-8)
    for i, members in enumerate(groups.values()):
        for k, (sample, joint_action) in enumerate(members):
            sample.group = i
            sample.advantage = joint_action.advantage = advantages[i, k].item()


class CoarseGroupsTrainer(ATGRPOTrainer):
    """AT-GRPO with (turn, agent) groups: the ablation of its grouping."""

    def _rollout(self, inputs, num_generations):
        rollout = super()._rollout(inputs, num_generations)
        coarsen_groups(rollout, self.args.baseline, self.args.scale_rewards, self.agent_names)
        return rollout


# --- held-out evaluation ---


def first_choice(state) -> str:
    """What the first teammate's first answer did: named a `new` option, `repeated` a named one, or was `invalid`."""
    _, choice, new = state["picks"][0]
    return "invalid" if choice is None else "new" if new else "repeated"


def score_team(task_name: str, folder: str, rows: list[dict], max_new_tokens: int) -> dict:
    """Play every held-out problem greedily with the team saved in `folder`: per-problem team rewards, diagnostics."""
    team = load_team(folder)
    try:
        runs = team.play(rows, max_new_tokens=max_new_tokens)
    finally:
        team.close()
    columns = {key: [row[key] for row in rows] for key in rows[0] if key != "prompt"}
    completions = [run.latest for run in runs]
    examples = completions[:4]
    if task_name == "distinct_items":
        scores = distinct_items_reward(None, completions, **columns)
        own = [own_items_reward(None, [c[name] for c in completions], **columns) for name in completions[0]]
        # members both teammates named: the per-role reward leaves them there, the team reward counts them once
        both = [
            len(set.intersection(*(set(named_members(text, *problem)) for text in completion.values())))
            for completion, problem in zip(
                completions, zip(columns["category"], columns["excluded"], columns["count"])
            )
        ]
        return {
            "scores": scores,
            "own": [statistics.mean(v) for v in own],
            "overlap": statistics.mean(both),
            "examples": examples,
        }
    scores = [min(1.0, run.state["new"] / row["goal"]) for run, row in zip(runs, rows)]
    second = {}  # the second teammate's first answer, by what the first one's did: the share that named a new option
    for run in runs:
        if len(run.state["picks"]) > 1:
            second.setdefault(first_choice(run.state), []).append(float(run.state["picks"][1][2]))
    return {
        "scores": scores,
        "success": statistics.mean(score == 1.0 for score in scores),
        "second_by_first": {key: [statistics.mean(values), len(values)] for key, values in sorted(second.items())},
        "turns": statistics.mean(len(run.turns) for run in runs),
        "examples": examples,
    }


class SaveEvery(TrainerCallback):
    """Saves the team after each of `steps`, for the held-out curve."""

    def __init__(self, trainer, steps: list[int], folder: str):
        self.trainer, self.steps, self.folder = trainer, set(steps), folder

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step in self.steps:
            self.trainer.save_model(os.path.join(self.folder, f"step-{state.global_step}"))


def training_diagnostics(log_history: list[dict]) -> dict:
    """Per training step: the team reward (`rewards/<team reward>/mean`, whatever the method trains on; AT-GRPO's
    `episodes/team_reward`, the team reward each episode ended on), and the share of groups whose rewards all tie
    and the chosen candidate's reward, per turn and per (turn, agent) (AT-GRPO; MAGRPO's groups are joint actions,
    so per turn)."""
    steps = [entry for entry in log_history if "train_runtime" not in entry and "reward" in entry]
    wanted = ("frac_reward_zero_std", "chosen_reward", "episodes/team_reward")
    keys = sorted(
        {
            key
            for entry in steps
            for key in entry
            if key.endswith(wanted) or (key.startswith("rewards/") and key.endswith("/mean"))
        }
    )
    return {key: [entry.get(key) for entry in steps] for key in keys}


def curve_mean(curves: list[list]) -> list[float]:
    """The mean over runs of same-length curves, step by step (steps where a run logged nothing left out)."""
    means = []
    for values in zip(*curves):
        present = [v for v in values if v is not None]
        means.append(statistics.mean(present) if present else math.nan)
    return means


def schedule(task_name: str, steps: int | None = None, eval_every: int | None = None) -> tuple[int, int]:
    """(training steps, evaluation interval): the ones given, else the task's."""
    default_steps, default_every = SCHEDULE[task_name]
    return steps or default_steps, eval_every or default_every


def run_settings(task_name: str, method: str, steps: int, eval_every: int) -> dict:
    """What makes two runs of a method comparable: the config fields it sets (COMMON's too), its reward, its
    evaluation steps."""
    fields = {**COMMON, **SETTINGS[task_name], **METHODS[task_name][method][1], "max_steps": steps}
    rewards = [func.__name__ for func in REWARDS.get((task_name, method), TASKS[task_name].reward_funcs)]
    return {**fields, "reward_funcs": rewards, "eval_every": eval_every}


def evaluation_steps(steps: int, eval_every: int) -> list[int]:
    """Step 0, every `eval_every` steps, and the last step."""
    return sorted({*range(0, steps + 1, eval_every), steps})


def keep_team(saved: str, keep_dir: str, task_name: str, method: str, seed: int) -> str:
    """Copy a run's final team (`save_model`'s folder, loadable with `trl_marl.load_team`) to
    `keep_dir/<task>/<method>/seed-<seed>`, replacing an earlier copy; its path."""
    kept = os.path.join(keep_dir, task_name, method, f"seed-{seed}")
    if os.path.isdir(kept):
        shutil.rmtree(kept)
    shutil.copytree(saved, kept)
    return kept


def run(task_name: str, method: str, seed: int, steps: int, eval_every: int, keep_dir: str | None = None) -> dict:
    task = TASKS[task_name]()
    algorithm, fields = METHODS[task_name][method]
    settings = {**SETTINGS[task_name], "max_steps": steps}
    rows = task.dataset("eval").to_list()
    config_class = ATGRPOConfig if algorithm == "at_grpo" else MAGRPOConfig
    trainer_class = (
        CoarseGroupsTrainer if method == "coarse" else ATGRPOTrainer if algorithm == "at_grpo" else MAGRPOTrainer
    )
    torch.manual_seed(seed)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as output_dir:
        fields = {**task_defaults(task), **COMMON, **settings, **fields, "seed": seed}
        args = config_class(output_dir=output_dir, **fields)
        trainer = trainer_class(default_model_path(), REWARDS.get((task_name, method)), args=args, task=task)
        saves = os.path.join(output_dir, "saves")
        trainer.save_model(os.path.join(saves, "step-0"))
        trainer.add_callback(SaveEvery(trainer, evaluation_steps(steps, eval_every), saves))
        trainer.train()
        diagnostics = training_diagnostics(trainer.state.log_history)
        del trainer
        gc.collect()
        train_minutes = (time.perf_counter() - started) / 60
        evaluations = []
        for step in evaluation_steps(steps, eval_every):
            result = score_team(
                task_name, os.path.join(saves, f"step-{step}"), rows, settings["max_completion_length"]
            )
            evaluations.append({"step": step, **result})
            print(f"   step {step}: held-out team reward {statistics.mean(result['scores']):.3f}", flush=True)
        kept = keep_team(os.path.join(saves, f"step-{steps}"), keep_dir, task_name, method, seed) if keep_dir else None
    return {
        "task": task_name,
        "method": method,
        "seed": seed,
        "steps": steps,
        "eval_every": eval_every,
        "settings": run_settings(task_name, method, steps, eval_every),
        "evaluations": evaluations,
        "training": diagnostics,
        "train_minutes": train_minutes,
        "minutes": (time.perf_counter() - started) / 60,
        **({"kept": kept} if kept else {}),
    }


# --- report ---


def interval(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95 % t-interval (0 for a single value)."""
    mean = statistics.mean(values)
    if len(values) < 2:
        return mean, 0.0
    return mean, T_95.get(len(values) - 1, 2.0) * statistics.stdev(values) / math.sqrt(len(values))


def paired_difference(runs_a: list[dict], runs_b: list[dict]) -> list[float]:
    """Per seed present in both: the mean over held-out problems of (score under A − score under B), at the end."""
    by_seed = {run["seed"]: run["evaluations"][-1]["scores"] for run in runs_b}
    return [
        statistics.mean(a - b for a, b in zip(run["evaluations"][-1]["scores"], by_seed[run["seed"]], strict=True))
        for run in runs_a
        if run["seed"] in by_seed
    ]


def untrained_runs(runs: list[dict]) -> list[dict]:
    """The untrained team of each run's seed (its step-0 evaluation), as runs of their own."""
    return [{**run, "method": "untrained", "evaluations": run["evaluations"][:1]} for run in runs]


def with_untrained(runs: list[dict], task_name: str) -> list[tuple[str, list[dict]]]:
    """(method, its runs) for the task's methods that have runs, after the untrained team of the first of them."""
    done = [(m, [r for r in runs if r["task"] == task_name and r["method"] == m]) for m in METHODS[task_name]]
    done = [(method, method_runs) for method, method_runs in done if method_runs]
    return [("untrained", untrained_runs(done[0][1]))] + done if done else []


def fmt(values: list[float]) -> str:
    if not values:
        return "-"
    mean, half = interval(values)
    return f"{mean:.3f} ± {half:.3f}" if len(values) > 1 else f"{mean:.3f}"


def table(runs: list[dict]) -> str:
    lines = [
        "| task | method | seeds | held-out team reward | success rate | paired difference: method − reference (seeds "
        "of both) | "
        "minutes per run |",
        "|---|---|---|---|---|---|---|",
    ]
    for task_name, methods in METHODS.items():
        reference = next(iter(methods))
        of_task = dict(with_untrained(runs, task_name))
        for method, done in of_task.items():
            finals = [statistics.mean(r["evaluations"][-1]["scores"]) for r in done]
            success = [r["evaluations"][-1]["success"] for r in done if "success" in r["evaluations"][-1]]
            difference = "-" if method == reference else fmt(paired_difference(done, of_task.get(reference, [])))
            minutes = "-" if method == "untrained" else f"{statistics.mean(r['minutes'] for r in done):.1f}"
            lines.append(
                f"| {task_name} | {method} | {len(done)} | {fmt(finals)} | {fmt(success)} | {difference} | {minutes} |"
            )
    return "\n".join(lines)


def verdict(differences: list[float]) -> str:
    """A claim "A beats B" holds when the 95 % interval of the paired difference A − B lies above 0."""
    if len(differences) < 2:
        return "needs 2 seeds or more"
    mean, half = interval(differences)
    if mean - half > 0:
        return "holds"
    return "does not hold: the other is better" if mean + half < 0 else "does not hold: the interval contains 0"


def claims_table(runs: list[dict]) -> str:
    """One line per claim of CLAIMS with runs of both methods: the paired difference and whether it is resolved."""
    lines = [
        "| task | claim | seeds of both | paired difference (held out) | by seed | verdict |",
        "|---|---|---|---|---|---|",
    ]
    for task_name, claims in CLAIMS.items():
        of_task = dict(with_untrained(runs, task_name))
        for winner, other in claims:
            if winner not in of_task or other not in of_task:
                continue
            differences = paired_difference(of_task[winner], of_task[other])
            by_seed = ", ".join(f"{d:+.3f}" for d in differences)
            lines.append(
                f"| {task_name} | {winner} beats {other} | {len(differences)} | {fmt(differences)} | {by_seed} | "
                f"{verdict(differences)} |"
            )
    return "\n".join(lines)


def plot(runs: list[dict], path: str) -> None:
    """Top: the held-out team reward at each evaluation, per method. Bottom: the training team reward per method
    (`distinct_items`), and AT-GRPO's chosen candidate's reward per (turn, agent), fine groups solid and coarse dashed
    (`pick_new`). Means over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, len(METHODS), figsize=(6 * len(METHODS), 8), squeeze=False)
    for column, (task_name, methods) in enumerate(METHODS.items()):
        held_out, training = axes[0][column], axes[1][column]
        for method in methods:
            done = [r for r in runs if r["task"] == task_name and r["method"] == method]
            if not done:
                continue
            steps = [e["step"] for e in done[0]["evaluations"]]
            scores = [[statistics.mean(e["scores"]) for e in r["evaluations"]] for r in done]
            held_out.plot(steps, curve_mean(scores), marker="o", label=f"{method} ({len(done)} seeds)")
            team_key = f"rewards/{TASKS[task_name].reward_funcs[0].__name__}/mean"
            if task_name == "distinct_items":
                # AT-GRPO's per-candidate mean scores the first agent's candidates before its teammate answers
                key = "episodes/team_reward" if "episodes/team_reward" in done[0]["training"] else team_key
                values = curve_mean([r["training"][key] for r in done if key in r["training"]])
                training.plot(range(1, len(values) + 1), values, label=method)
            elif method in ("at_grpo", "coarse"):
                for key in sorted(k for k in done[0]["training"] if k.endswith("chosen_reward")):
                    values = curve_mean([r["training"][key] for r in done if key in r["training"]])
                    label = f"{method}: {group_label(key)}"
                    training.plot(range(1, len(values) + 1), values, "-" if method == "at_grpo" else "--", label=label)
        held_out.set_title(f"{task_name}: held-out team reward (greedy)")
        held_out.set_xlabel("training step")
        training.set_title(
            f"{task_name}: "
            + ("training team reward" if task_name == "distinct_items" else "chosen candidate's reward")
        )
        training.set_xlabel("training step")
        for axis in (held_out, training):
            if axis.get_legend_handles_labels()[0]:
                axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def mean_of(values) -> str:
    values = [v for v in values if v is not None]
    return f"{statistics.mean(values):.2f}" if values else "-"


def pooled_rate(rates_and_counts: list[list | None]) -> str:
    """A rate over the episodes of every seed together, from each seed's (rate, episodes), "(n = episodes)" after it:
    seeds with few episodes of a kind weigh less than in a mean of rates."""
    pairs = [pair for pair in rates_and_counts if pair and pair[1]]
    episodes = sum(count for _, count in pairs)
    return f"{sum(rate * count for rate, count in pairs) / episodes:.2f} (n = {episodes})" if episodes else "-"


def group_label(key: str) -> str:
    """`turns/1/agents/second/frac_reward_zero_std` -> `turn 1 second`; the batch-wide key -> `all`."""
    parts = key.split("/")
    return "all" if len(parts) == 1 else f"turn {parts[1]}" + (f" {parts[3]}" if len(parts) > 3 else "")


def diagnostics_table(runs: list[dict]) -> str:
    """Per method, means over seeds (the second teammate's rates pooled over the seeds' episodes): what the teammates
    did on the held-out problems at the end, and how often a training group carried no signal (all its rewards
    tied)."""
    lines = [
        "| task | method | at the end, held out | share of groups with tied rewards in training |",
        "|---|---|---|---|",
    ]
    for task_name in METHODS:
        for method, done in with_untrained(runs, task_name):
            finals = [r["evaluations"][-1] for r in done]
            if task_name == "distinct_items":
                own = [mean_of(f["own"][i] for f in finals) for i in range(2)]
                overlap = mean_of(f.get("overlap") for f in finals)
                held_out = f"own reward first {own[0]}, second {own[1]}; members both named {overlap}"
            else:
                kinds = sorted({kind for f in finals for kind in f["second_by_first"]})
                after = [f"{kind}: {pooled_rate([f['second_by_first'].get(kind) for f in finals])}" for kind in kinds]
                turns = mean_of(f["turns"] for f in finals)
                held_out = f"second names a new option after the first's {', '.join(after)}; turns {turns}"
            if method == "untrained":
                lines.append(f"| {task_name} | {method} | {held_out} | - |")
                continue
            tied_keys = [k for k in done[0]["training"] if k.endswith("frac_reward_zero_std")]
            keys = sorted(k for k in tied_keys if "/agents/" in k) or sorted(
                k for k in tied_keys if k.startswith("turns/")
            )
            keys = keys or ["frac_reward_zero_std"]
            tied = [
                f"{group_label(key)} {mean_of(v for r in done for v in r['training'].get(key, []))}" for key in keys
            ]
            lines.append(f"| {task_name} | {method} | {held_out} | {', '.join(tied)} |")
    return "\n".join(lines)


def replace_between(path: str, marker: str, text: str) -> bool:
    """Put `text` between `<!-- marker:start -->` and `<!-- marker:end -->` in the file at `path`; False without
    them."""
    with open(path) as f:
        document = f.read()
    start, end = f"<!-- {marker}:start -->\n", f"<!-- {marker}:end -->"
    if start not in document or end not in document:
        return False
    head, rest = document.split(start, 1)
    with open(path, "w") as f:
        f.write(head + start + text + "\n" + end + rest.split(end, 1)[1])
    return True


def identity(run: dict) -> tuple[str, str, int]:
    return run["task"], run["method"], run["seed"]


def current(runs: list[dict], steps: int | None, eval_every: int | None) -> list[dict]:
    """The runs made with the settings a run of the same method would have now (another `--steps`, `--eval_every`,
    or older settings, kept in the file, are left out)."""
    return [
        r
        for r in runs
        if r.get("settings") == run_settings(r["task"], r["method"], *schedule(r["task"], steps, eval_every))
    ]


def report(record: dict, results: str, steps: int | None, eval_every: int | None) -> None:
    runs = current(record["runs"], steps, eval_every)
    text = table(runs) + "\n\n" + claims_table(runs) + "\n\n" + diagnostics_table(runs)
    print(text)
    stem = os.path.splitext(results)[0]
    with open(stem + ".md", "w") as f:
        f.write(text + "\n")
    plot(runs, stem + ".png")
    print(f"{len(runs)} of the {len(record['runs'])} runs in {results}; tables: {stem}.md; curves: {stem}.png")
    defaults = steps is None and eval_every is None
    if results == DEFAULT_RESULTS and defaults and replace_between(DOCS, "bench_learning", text):
        print(f"Tables updated in {DOCS}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=[*METHODS, "all"], default="all")
    parser.add_argument("--methods", nargs="+", help="Subset of the task's methods (default: all of them).")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, help="Training steps (default: the task's, in SCHEDULE).")
    parser.add_argument("--eval_every", type=int, help="Held-out evaluation every N steps (default: the task's).")
    parser.add_argument("--results", default=DEFAULT_RESULTS)
    parser.add_argument("--fresh", action="store_true", help="Forget the runs already in the results file.")
    parser.add_argument("--rerun", action="store_true", help="Run the chosen runs again, replacing saved ones.")
    parser.add_argument("--report", action="store_true", help="Only regenerate the table and the PNG.")
    parser.add_argument(
        "--keep_teams",
        metavar="DIR",
        help="Keep each run's final team in DIR/<task>/<method>/seed-<seed> (load it with trl_marl.load_team).",
    )
    options = parser.parse_args()

    record = {"runs": []}
    if os.path.exists(options.results) and not options.fresh:
        with open(options.results) as f:
            record = json.load(f)
    if options.report:
        return report(record, options.results, options.steps, options.eval_every)
    record.update(
        machine=f"{platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}, "
        + (torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"),
        trl_marl=trl_marl.__version__,
    )
    for task_name in list(METHODS) if options.task == "all" else [options.task]:
        for method in options.methods or METHODS[task_name]:
            if method not in METHODS[task_name]:
                raise SystemExit(f"--methods: {method!r} is not a method of {task_name} ({list(METHODS[task_name])}).")
            steps, eval_every = schedule(task_name, options.steps, options.eval_every)
            settings = run_settings(task_name, method, steps, eval_every)
            for seed in options.seeds:
                same = [
                    r for r in record["runs"] if identity(r) == (task_name, method, seed) and r["settings"] == settings
                ]
                if same and not options.rerun:
                    continue
                print(f"== {task_name} / {method} / seed {seed}", flush=True)
                result = run(task_name, method, seed, steps, eval_every, options.keep_teams)
                print(f"   {result['minutes']:.1f} min", flush=True)
                record["runs"] = [r for r in record["runs"] if r not in same] + [result]
                record["date"] = datetime.date.today().isoformat()
                os.makedirs(os.path.dirname(options.results), exist_ok=True)
                with open(options.results, "w") as f:
                    json.dump(record, f, indent=1)
    report(record, options.results, options.steps, options.eval_every)


if __name__ == "__main__":
    main()
