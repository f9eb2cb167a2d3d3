"""The learning benchmark's report (`bench_learning.py --report`): statistics over seeds, the tables (scores, claims
with their verdicts and power, diagnostics, the pilot's training rewards) and the curves, from the saved runs."""

import math
import os
import statistics

from learning_versions import (
    CLAIMS,
    DOCS,
    HELD_OUT,
    METHODS,
    REWARDS,
    SETTINGS_FILES,
    TASKS,
    VERSION,
    current,
    docs_marker,
    identity,
    last_commit,
    results_file,
    tasks_of,
)

T_95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131]
T_95 += [2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]
T_95 = dict(enumerate(T_95, 1))  # two-sided 95 % quantiles of Student's t, by degrees of freedom
T_80 = [1.376, 1.061, 0.978, 0.941, 0.920, 0.906, 0.896, 0.889, 0.883, 0.879, 0.876, 0.873, 0.870, 0.868, 0.866]
T_80 += [0.865, 0.863, 0.862, 0.861, 0.860, 0.859, 0.858, 0.858, 0.857, 0.856, 0.856, 0.855, 0.855, 0.854, 0.854]
T_80 = dict(enumerate(T_80, 1))  # one-sided 80 % quantiles of Student's t (power 0.8), by degrees of freedom
NORMAL = {0.975: 1.959964, 0.8: 0.841621}  # the standard normal's quantiles
SPLIT_TITLES = {
    "eval": "64 problems of the training categories",
    "unseen": "64 problems of eight categories never trained on",
}


def t_quantile(probability: float, degrees: int) -> float:
    """Student's t quantile (0.975 or 0.8): the table up to 30 degrees of freedom, beyond it the normal's with its
    first two Cornish-Fisher corrections (within 1e-4 of the exact value at 31)."""
    table = T_95 if probability == 0.975 else T_80
    if degrees in table:
        return table[degrees]
    z = NORMAL[probability]
    return z + (z**3 + z) / (4 * degrees) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * degrees**2)


def curve_mean(curves: list[list]) -> list[float]:
    """The mean over runs of same-length curves, step by step (steps where a run logged nothing left out)."""
    means = []
    for values in zip(*curves):
        present = [v for v in values if v is not None]
        means.append(statistics.mean(present) if present else math.nan)
    return means


def interval(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95 % t-interval (0 for a single value)."""
    mean = statistics.mean(values)
    if len(values) < 2:
        return mean, 0.0
    return mean, t_quantile(0.975, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))


def scored(evaluation: dict, split: str = "eval") -> dict:
    """An evaluation's result on a held-out split: the record's own for `"eval"` (every version's first split), the
    entry under the split's name for another."""
    return evaluation if split == "eval" else evaluation[split]


def at_end(run: dict, split: str = "eval") -> dict:
    """A run's last evaluation, on `split`."""
    return scored(run["evaluations"][-1], split)


def paired_difference(runs_a: list[dict], runs_b: list[dict], split: str = "eval") -> list[float]:
    """Per seed present in both: the mean over held-out problems of (score under A − score under B), at the end."""
    by_seed = {run["seed"]: at_end(run, split)["scores"] for run in runs_b}
    return [
        statistics.mean(a - b for a, b in zip(at_end(run, split)["scores"], by_seed[run["seed"]], strict=True))
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


def table(runs: list[dict], tasks: list[str] | None = None, split: str = "eval") -> str:
    lines = [
        "| task | method | seeds | held-out team reward | success rate | paired difference: method − reference (seeds "
        "of both) | "
        "minutes per run |",
        "|---|---|---|---|---|---|---|",
    ]
    for task_name in tasks or METHODS:
        reference = next(iter(METHODS[task_name]))
        of_task = dict(with_untrained(runs, task_name))
        for method, done in of_task.items():
            finals = [statistics.mean(at_end(r, split)["scores"]) for r in done]
            success = [at_end(r, split)["success"] for r in done if "success" in at_end(r, split)]
            reference_runs = of_task.get(reference, [])
            difference = "-" if method == reference else fmt(paired_difference(done, reference_runs, split))
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


def seeds_for_power(differences: list[float]) -> str:
    """How many seeds a paired t-test (two-sided, 5 %) needs for 80 % power to show the claim if the true difference
    and its seed SD were the ones measured: the smallest n with (t.975 + t.80, n − 1 degrees of freedom) · SD / √n ≤
    mean. "-" when the measured difference is not in the claim's favour (no number of seeds would show it)."""
    if len(differences) < 2:
        return "-"
    mean, spread = statistics.mean(differences), statistics.stdev(differences)
    if mean <= 0:
        return "-"
    if spread == 0:
        return "2"
    for n in range(2, 1001):
        if (t_quantile(0.975, n - 1) + t_quantile(0.8, n - 1)) * spread / math.sqrt(n) <= mean:
            return str(n)
    return "> 1000"


def claims_table(runs: list[dict], tasks: list[str] | None = None, split: str = "eval") -> str:
    """One line per claim of CLAIMS with runs of both methods: the paired difference, whether it is resolved, the
    seeds' SD and how many seeds would give 80 % power at the measured effect."""
    lines = [
        "| task | claim | seeds of both | paired difference (held out) | by seed | SD over seeds | seeds for 80 % "
        "power | verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for task_name in tasks or METHODS:
        of_task = dict(with_untrained(runs, task_name))
        for winner, other in CLAIMS[task_name]:
            if winner not in of_task or other not in of_task:
                continue
            differences = paired_difference(of_task[winner], of_task[other], split)
            by_seed = ", ".join(f"{d:+.3f}" for d in differences)
            spread = f"{statistics.stdev(differences):.3f}" if len(differences) > 1 else "-"
            lines.append(
                f"| {task_name} | {winner} beats {other} | {len(differences)} | {fmt(differences)} | {by_seed} | "
                f"{spread} | {seeds_for_power(differences)} | {verdict(differences)} |"
            )
    return "\n".join(lines)


def plot(runs: list[dict], path: str, tasks: list[str] | None = None) -> None:
    """Top: the held-out team reward at each evaluation, per method. Bottom: the training team reward per method
    (`distinct_items`), and AT-GRPO's chosen candidate's reward per (turn, agent), fine groups solid and coarse dashed
    (`pick_new`). Means over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = tasks or list(METHODS)
    figure, axes = plt.subplots(2, len(tasks), figsize=(6 * len(tasks), 8), squeeze=False)
    for column, task_name in enumerate(tasks):
        methods = METHODS[task_name]
        held_out, training = axes[0][column], axes[1][column]
        for method in methods:
            done = [r for r in runs if r["task"] == task_name and r["method"] == method]
            if not done:
                continue
            steps = [e["step"] for e in done[0]["evaluations"]]
            scores = [[statistics.mean(e["scores"]) for e in r["evaluations"]] for r in done]
            held_out.plot(steps, curve_mean(scores), marker="o", label=f"{method} ({len(done)} seeds)")
            reward = REWARDS.get((task_name, method), TASKS[task_name].reward_funcs)[0]
            team_key = f"rewards/{reward.__name__}/mean"
            if task_name != "pick_new":
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
            f"{task_name}: " + ("training team reward" if task_name != "pick_new" else "chosen candidate's reward")
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


def diagnostics_table(runs: list[dict], tasks: list[str] | None = None, split: str = "eval") -> str:
    """Per method, means over seeds (the second teammate's rates pooled over the seeds' episodes): what the teammates
    did on the held-out problems at the end, and how often a training group carried no signal (all its rewards
    tied)."""
    lines = [
        "| task | method | at the end, held out | share of groups with tied rewards in training |",
        "|---|---|---|---|",
    ]
    for task_name in tasks or METHODS:
        for method, done in with_untrained(runs, task_name):
            finals = [at_end(r, split) for r in done]
            if task_name == "distinct_items":
                own = [mean_of(f["own"][i] for f in finals) for i in range(2)]
                overlap = mean_of(f.get("overlap") for f in finals)
                held_out = f"own reward first {own[0]}, second {own[1]}; members both named {overlap}"
            elif task_name == "congestion":
                own = [mean_of(f["own"][i] for f in finals) for i in range(2)]
                collided, top_two = mean_of(f["collided"] for f in finals), mean_of(f["top_two"] for f in finals)
                held_out = f"own reward first {own[0]}, second {own[1]}; same pick {collided}; top two {top_two}"
            elif "second_by_first" not in finals[0]:  # one agent alone
                held_out = f"both picks new {mean_of(f['success'] for f in finals)}"
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


def training_team_reward(run: dict) -> list[float]:
    """A run's training team reward per step: the team reward its episodes ended on (AT-GRPO), else the mean of the
    reward it trains on (MAGRPO's team reward, the one agent's reward)."""
    training = run["training"]
    if "episodes/team_reward" in training:
        return training["episodes/team_reward"]
    return training[f"rewards/{run['settings']['reward_funcs'][0]}/mean"]


def pilot_table(runs: list[dict]) -> str:
    """Training rewards only (what settings may be chosen on): per run, the mean training team reward over the first
    and the last quarter of its steps, and the lowest mean over any 4 consecutive steps after the first quarter."""
    lines = ["| task | method | seed | first quarter | last quarter | lowest 4 steps after | minutes |", "|---|" * 7]
    lines[1] = "|---|---|---|---|---|---|---|"
    for run in sorted(runs, key=identity):
        values = [v for v in training_team_reward(run) if v is not None]
        quarter = max(1, len(values) // 4)
        later = values[quarter:]
        lowest = min(statistics.mean(later[i : i + 4]) for i in range(max(1, len(later) - 3))) if later else math.nan
        lines.append(
            f"| {run['task']} | {run['method']} | {run['seed']} | {statistics.mean(values[:quarter]):.3f} | "
            f"{statistics.mean(values[-quarter:]):.3f} | {lowest:.3f} | {run['train_minutes']:.1f} |"
        )
    return "\n".join(lines)


def report(record: dict, results: str, steps: int | None, eval_every: int | None, version: int, pilot: bool) -> None:
    runs = [r for r in current(record["runs"], steps, eval_every) if VERSION.get(r["task"]) == version]
    if SETTINGS_FILES[version] and results == results_file(version):
        # a registered version's report reads only the runs made under its settings file as committed now
        commit = last_commit(SETTINGS_FILES[version])
        runs = [r for r in runs if r.get("settings_commit") == commit]
    if pilot:
        text = pilot_table(runs)
        print(text)
        return
    tasks = tasks_of(version)
    parts = []
    for split in HELD_OUT[version]:
        tables = [table(runs, tasks, split), claims_table(runs, tasks, split), diagnostics_table(runs, tasks, split)]
        if len(HELD_OUT[version]) > 1:
            tables.insert(0, f"**Held out: {SPLIT_TITLES.get(split, split)}** (`{split}`)")
        parts.append("\n\n".join(tables))
    text = "\n\n".join(parts)
    print(text)
    stem = os.path.splitext(results)[0]
    with open(stem + ".md", "w") as f:
        f.write(text + "\n")
    try:
        plot(runs, stem + ".png", tasks)
        curves = f"curves: {stem}.png"
    except ImportError:  # matplotlib comes with the `bench` extra
        curves = "no curves (matplotlib is not installed: pip install -e '.[bench]')"
    print(f"{len(runs)} of the {len(record['runs'])} runs in {results}; tables: {stem}.md; {curves}")
    defaults = steps is None and eval_every is None
    if results == results_file(version) and defaults and replace_between(DOCS, docs_marker(version), text):
        print(f"Tables updated in {DOCS}")
