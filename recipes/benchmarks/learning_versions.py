"""The learning benchmark's versions (`bench_learning.py`): which tasks each benchmarks, with which methods, settings,
seeds and claims, and the pre-registration of a version's settings file.

Version 1 (the first round: distinct_items and pick_new) is the constants below. Later versions are settings files,
`settings/bench_learning_v<N>.json`, registered at import: held-out runs refuse to start while the file differs from
its last commit, and record that commit. A later version may benchmark an earlier one's tasks again (version 3 those
of version 2): the tables below hold one version's entries for a task at a time, the latest's after import;
`select_version` puts another's in force.
"""

import json
import os
import re
import subprocess

import torch

from trl_marl.tasks import teamwork
from trl_marl.tasks.teamwork import Congestion, DistinctItems, PickNew, PickNewHidden, PickNewSparse, new_option_gain

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

VERSION = dict.fromkeys(METHODS, 1)  # task -> the version that benchmarks it
COMMONS = {1: COMMON}
SEEDS = {1: [0, 1, 2]}
SETTINGS_FILES = {1: None}
HELD_OUT = {1: ["eval"]}  # per version: the held-out splits its runs are scored on, the first the claims' main one
# (task, method) -> attributes set on the task instance: `local_reward_funcs = {}` trains on the team reward alone
TASK_VARIANTS: dict[tuple[str, str], dict] = {}
SETTINGS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "settings")
NEW_TASKS = {"congestion": Congestion, "pick_new_hidden": PickNewHidden, "pick_new_sparse": PickNewSparse}


def register_version(path: str) -> int:
    """Add the tasks, methods and claims of a settings file to the tables above; its version number."""
    with open(path) as f:
        spec = json.load(f)
    number = spec["version"]
    COMMONS[number] = {
        **spec["common"],
        "use_cpu": not torch.cuda.is_available(),
        "bf16": torch.cuda.is_available(),
    }
    SEEDS[number], SETTINGS_FILES[number] = spec["seeds"], path
    HELD_OUT[number] = spec.get("held_out", ["eval"])
    for task_name, task in spec["tasks"].items():
        if VERSION.get(task_name) == 1:
            raise ValueError(f"{path}: task {task_name!r} is benchmarked by version 1, whose tables are constants.")
        for table in (REWARDS, TASK_VARIANTS):  # an earlier version's entries for the task
            for key in [key for key in table if key[0] == task_name]:
                del table[key]
        COARSE.difference_update({key for key in COARSE if key[0] == task_name})
        VERSION[task_name], TASKS[task_name] = number, NEW_TASKS[task_name]
        SETTINGS[task_name], SCHEDULE[task_name] = task["settings"], (task["steps"], task["eval_every"])
        CLAIMS[task_name] = [tuple(claim) for claim in task["claims"]]
        METHODS[task_name] = {}
        for method, entry in task["methods"].items():
            METHODS[task_name][method] = (entry["algorithm"], entry.get("fields", {}))
            if "reward_funcs" in entry:
                REWARDS[(task_name, method)] = [getattr(teamwork, name) for name in entry["reward_funcs"]]
            if entry.get("groups", "problem") == "coarse":
                COARSE.add((task_name, method))
            if not entry.get("local_rewards", True):
                TASK_VARIANTS[(task_name, method)] = {"local_reward_funcs": {}}
    return number


COARSE = {("pick_new", "coarse")}  # (task, method) trained with the coarse-key ablation's trainer
SETTINGS_NAMES = sorted(  # in version order: the latest's tables are in force after import
    (name for name in os.listdir(SETTINGS_DIR) if re.fullmatch(r"bench_learning_v\d+\.json", name)),
    key=lambda name: int(re.search(r"\d+", name).group()),
)
LATEST = max(register_version(os.path.join(SETTINGS_DIR, name)) for name in SETTINGS_NAMES)


def select_version(number: int) -> None:
    """Put version `number`'s tables in force for the tasks it benchmarks (the latest's are after import)."""
    if SETTINGS_FILES[number]:
        register_version(SETTINGS_FILES[number])


def code_commit() -> str | None:
    """The commit of the code a run is made with (`git rev-parse HEAD`), `-dirty` after it when trl_marl, the
    project file or the recipes (results aside) differ from it; None outside a git checkout."""
    folder = os.path.dirname(os.path.abspath(__file__))
    try:
        commit = git("rev-parse", "HEAD", cwd=folder, check=False)
        paths = ("../../trl_marl", "../../pyproject.toml", "..", ":!results")
        changed = git("status", "--porcelain", "--", *paths, cwd=folder, check=False) if commit else ""
    except OSError:
        return None
    return (commit + ("-dirty" if changed else "")) if commit else None


def tasks_of(version: int) -> list[str]:
    return [task_name for task_name in METHODS if VERSION[task_name] == version]


def results_file(version: int) -> str:
    return DEFAULT_RESULTS if version == 1 else os.path.join(RESULTS, f"bench_learning_v{version}.json")


def docs_marker(version: int) -> str:
    return "bench_learning" if version == 1 else f"bench_learning_v{version}"


def git(*arguments: str, cwd: str, check: bool = True) -> str:
    return subprocess.run(["git", *arguments], cwd=cwd, capture_output=True, text=True, check=check).stdout.strip()


def last_commit(path: str) -> str | None:
    """The commit that last changed the file at `path` (None outside a git checkout or before its first commit)."""
    try:
        return (
            git("log", "-1", "--format=%H", "--", os.path.basename(path), cwd=os.path.dirname(path), check=False)
            or None
        )
    except OSError:
        return None


def registered_commit(path: str) -> str:
    """The commit that last changed the settings file at `path`, which must not differ from it (pre-registration);
    a `SystemExit` saying what to do otherwise."""
    folder = os.path.dirname(path)
    try:
        changed = git("status", "--porcelain", "--", os.path.basename(path), cwd=folder)
    except (OSError, subprocess.CalledProcessError) as error:
        raise SystemExit(
            f"{path}: cannot read its commit ({error}); held-out runs need the settings file committed in a git "
            "checkout (or --unregistered, recorded as such)."
        ) from error
    commit = last_commit(path)
    if changed or not commit:
        raise SystemExit(
            f"{path} differs from its last commit: commit the settings before any held-out evaluation "
            "(pre-registration), or train with --pilot (training reward only, no held-out score)."
        )
    return commit


def schedule(task_name: str, steps: int | None = None, eval_every: int | None = None) -> tuple[int, int]:
    """(training steps, evaluation interval): the ones given, else the task's."""
    default_steps, default_every = SCHEDULE[task_name]
    return steps or default_steps, eval_every or default_every


def run_settings(task_name: str, method: str, steps: int, eval_every: int) -> dict:
    """What makes two runs of a method comparable: the config fields it sets (its version's common ones too), its
    reward, its task variant, its evaluation steps."""
    common = COMMONS[VERSION[task_name]]
    fields = {**common, **SETTINGS[task_name], **METHODS[task_name][method][1], "max_steps": steps}
    rewards = [func.__name__ for func in REWARDS.get((task_name, method), TASKS[task_name].reward_funcs)]
    variant = TASK_VARIANTS.get((task_name, method))
    settings = {**fields, "reward_funcs": rewards, "eval_every": eval_every}
    if VERSION[task_name] > 1:  # round 1's saved runs were recorded without these
        algorithm = METHODS[task_name][method][0]
        groups = "coarse" if (task_name, method) in COARSE else "problem"
        settings.update(algorithm=algorithm, groups=groups, task_variant=variant)
    elif variant:
        settings["task_variant"] = variant
    return settings


def evaluation_steps(steps: int, eval_every: int) -> list[int]:
    """Step 0, every `eval_every` steps, and the last step."""
    return sorted({*range(0, steps + 1, eval_every), steps})


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
