"""Learning benchmark: does the team learn what its members cannot learn on their own rewards?

Teamwork tasks (`trl_marl/tasks/teamwork.py`) on the embedded default model (SmolLM2-135M-Instruct), on the CPU;
every method of a task is trained with the same settings and seeds and scored on the same 64 held-out problems,
greedily, at step 0 (the untrained team: LoRA starts as the identity) and every few steps. Three versions
(docs/benchmarks.md#teamwork):

**Version 3** (round 3, the default; settings pre-registered in `settings/bench_learning_v3.json`): version 2's tasks,
methods and training, with the one-agent baseline held as strictly as the team (`exactly_two_new_options_reward`:
an answer naming more than two options scores 0, as a teammate's naming more than one does) and a second held-out
split, `unseen`: 64 problems of eight categories that no training problem comes from. Each run is scored on both.

**Version 2** (round 2, superseded by version 3; `settings/bench_learning_v2.json`, `--version 2`): tasks where the
team reward is provably needed.
- `congestion` (one turn, blind picks worth 4/3/2/1; the team scores its distinct picks): `at_grpo` (team reward
  alone), `per_role` (the same trainer, α = 0: each agent's own points), `magrpo`.
- `pick_new_hidden` (two turns whose second prompt hides the first pick): `at_grpo`, `shared` (one adapter),
  `coarse` ((turn, agent) groups), `alpha0` (format reward only), `solo` (one agent alone: TRL's `GRPOTrainer`).

**Version 1** (round 1; settings in the constants below): `distinct_items` (`magrpo`, `per_role`, `single`) and
`pick_new` (`at_grpo`, `single`, `magrpo`, `alpha0`, `coarse`); its tasks turned out unable to show the claims.

    pip install -e ".[bench]"                                    # matplotlib, for the PNG
    python recipes/benchmarks/bench_learning.py --pilot --seeds 0 --saves outputs/bench_learning_v2   # training only
    python recipes/benchmarks/bench_learning.py --saves outputs/bench_learning_v2 --keep_teams outputs/teams
    python recipes/benchmarks/bench_learning.py --task congestion --methods at_grpo --seeds 0    # one run
    python recipes/benchmarks/bench_learning.py --report        # the tables and the PNG from the saved runs
    python recipes/benchmarks/bench_learning.py --version 1     # round 1

Held-out runs of a version with a settings file refuse to start while the file differs from its last commit, and
record that commit in every result (pre-registration); `--pilot` runs train only, never score held out, and go to
their own file (`<results>_pilot.json`): settings are chosen on their training rewards. With `--saves DIR` each run's
saved steps are kept in `DIR/<task>/<method>/seed-<seed>`, and a later run with the same settings scores them
instead of training again (a pilot's training, scored once the settings are committed).

Each run is saved to `results/bench_learning_v<N>.json` (version 1: `bench_learning.json`) as it finishes, seed by
seed (a run already there with the same settings is skipped, so a long benchmark resumes where it stopped; `--fresh`
forgets the saved runs). The tables (scores; the claims of CLAIMS with their verdicts, seed SD and the seeds 80 %
power would need; diagnostics; also written next to the results as `.md`) and the curves (`.png`) are regenerated
from that file. With `--keep_teams DIR` each run's final team is kept in `DIR/<task>/<method>/seed-<seed>` (a
`save_model` folder: `trl_marl.load_team` loads it; `solo` keeps its PEFT adapter), so anyone can score the trained
teams on problems of their own; the run's record names the folder (`kept`).
"""

import argparse
import datetime
import gc
import hashlib
import json
import math
import os
import platform
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import trl_marl  # first: it filters a bitsandbytes notice that importing PEFT would print

# isort: split
import torch
from transformers import TrainerCallback

from trl_marl import (
    ATGRPOConfig,
    ATGRPOTrainer,
    IACConfig,
    IACTrainer,
    MAACConfig,
    MAACTrainer,
    MAGRPOConfig,
    MAGRPOTrainer,
    default_model_path,
    load_team,
)
from trl_marl.agents import agent_lora_config
from trl_marl.rollouts.advantages import group_advantages
from trl_marl.tasks import task_defaults
from trl_marl.tasks.teamwork import (
    congestion_reward,
    distinct_items_reward,
    named_members,
    own_items_reward,
    own_points_reward,
    picked,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from learning_report import report  # noqa: E402
from learning_versions import (  # noqa: E402
    COARSE,
    COMMONS,
    HELD_OUT,
    LATEST,
    METHODS,
    RESULTS,
    REWARDS,
    SEEDS,
    SETTINGS,
    SETTINGS_FILES,
    TASK_VARIANTS,
    TASKS,
    VERSION,
    code_commit,
    evaluation_steps,
    identity,
    registered_commit,
    results_file,
    run_settings,
    schedule,
    select_version,
    tasks_of,
)

ALGORITHMS = {  # a method's algorithm -> its team config and trainer
    "magrpo": (MAGRPOConfig, MAGRPOTrainer),
    "at_grpo": (ATGRPOConfig, ATGRPOTrainer),
    "iac": (IACConfig, IACTrainer),
    "maac": (MAACConfig, MAACTrainer),
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


def score_team(
    task_name: str, folder: str, rows: list[dict], max_new_tokens: int, captured_decode: bool | str | None = None
) -> dict:
    """Play every held-out problem greedily with the team saved in `folder` (generating as `captured_decode` says, as
    the run trained): per-problem team rewards, diagnostics."""
    team = load_team(folder, captured_decode=captured_decode)
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
    if task_name == "congestion":
        picks = [
            [picked(text, options) for text in completion.values()]
            for completion, options in zip(completions, columns["options"])
        ]
        return {
            "scores": congestion_reward(None, completions, **columns),
            "own": [
                statistics.mean(own_points_reward(None, [c[name] for c in completions], **columns))
                for name in completions[0]
            ],
            # both named the same option (the per-role optimum's outcome), or the top and the second (the team's)
            "collided": statistics.mean(a is not None and a == b for a, b in picks),
            "top_two": statistics.mean(
                {a, b} == set(options[:2]) for (a, b), options in zip(picks, columns["options"])
            ),
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


def score_solo(folder: str, rows: list[dict], max_new_tokens: int, reward_func) -> dict:
    """Answer every held-out one-agent problem greedily with the adapter saved in `folder` (TRL's `save_model`) on the
    default model, through the chat template as `GRPOTrainer` prompted it: per-problem rewards by `reward_func` (the
    reward the method trains on: the version's one-agent scorer)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_path(), padding_side="left")
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(default_model_path()), folder).eval()
    texts = [tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True) for row in rows]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        output = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False)
    completions = tokenizer.batch_decode(output[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    columns = {key: [row[key] for row in rows] for key in rows[0] if key != "prompt"}
    scores = reward_func(None, completions, **columns)
    return {
        "scores": scores,
        "success": statistics.mean(score == 1.0 for score in scores),
        "examples": completions[:4],
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


def keep_team(saved: str, keep_dir: str, task_name: str, method: str, seed: int) -> str:
    """Copy a run's final team (`save_model`'s folder, loadable with `trl_marl.load_team`) to
    `keep_dir/<task>/<method>/seed-<seed>`, replacing an earlier copy; its path."""
    kept = os.path.join(keep_dir, task_name, method, f"seed-{seed}")
    if os.path.isdir(kept):
        shutil.rmtree(kept)
    shutil.copytree(saved, kept)
    return kept


def make_task(task_name: str, method: str):
    """The task a method trains on: the task's, with the method's variant (TASK_VARIANTS) set on the instance."""
    task = TASKS[task_name]()
    for attribute, value in TASK_VARIANTS.get((task_name, method), {}).items():
        setattr(task, attribute, value)
    return task


def make_trainer(task_name: str, method: str, seed: int, steps: int, output_dir: str):
    """The method's trainer for one run: a team trainer, or (`solo`) TRL's `GRPOTrainer` with one LoRA adapter on the
    task's one-agent problems."""
    task = make_task(task_name, method)
    algorithm, fields = METHODS[task_name][method]
    fields = {**COMMONS[VERSION[task_name]], **SETTINGS[task_name], **fields, "max_steps": steps, "seed": seed}
    if algorithm == "solo":
        from trl import GRPOConfig, GRPOTrainer

        lora = agent_lora_config(fields.pop("lora_r"), fields.pop("lora_alpha"), 0.0, ["all-linear"])
        return GRPOTrainer(
            default_model_path(),
            REWARDS[(task_name, method)],
            args=GRPOConfig(output_dir=output_dir, **fields),
            train_dataset=task.solo_dataset("train"),
            peft_config=lora,
        )
    config_class, trainer_class = ALGORITHMS[algorithm]
    if (task_name, method) in COARSE:
        trainer_class = CoarseGroupsTrainer
    args = config_class(output_dir=output_dir, **{**task_defaults(task), **fields})
    return trainer_class(default_model_path(), REWARDS.get((task_name, method)), args=args, task=task)


def train(
    task_name: str, method: str, seed: int, steps: int, eval_every: int, saves: str, again: bool = False
) -> dict:
    """Train one method with one seed, saving the team (or adapter) at step 0 and at each evaluation step in
    `saves/step-<N>`; what the training logged. Saves already there from a finished run with the same settings (a
    pilot's, say) are read instead of training again, unless `again`."""
    trained = os.path.join(saves, "trained.json")
    settings = run_settings(task_name, method, steps, eval_every)
    if os.path.exists(trained) and not again:
        with open(trained) as f:
            done = json.load(f)
        if done["settings"] == settings:
            print(f"   trained before: {saves}", flush=True)
            return done
    if os.path.exists(trained):
        os.remove(trained)  # the steps below are overwritten: a training that stops half way is not a finished one
    torch.manual_seed(seed)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = make_trainer(task_name, method, seed, steps, output_dir)
        trainer.save_model(os.path.join(saves, "step-0"))
        trainer.add_callback(SaveEvery(trainer, evaluation_steps(steps, eval_every), saves))
        trainer.train()
        diagnostics = training_diagnostics(trainer.state.log_history)
        del trainer
        gc.collect()
    done = {"settings": settings, "training": diagnostics, "train_minutes": (time.perf_counter() - started) / 60}
    with open(trained, "w") as f:
        json.dump(done, f)
    return done


def run(
    task_name: str,
    method: str,
    seed: int,
    steps: int,
    eval_every: int,
    keep_dir: str | None = None,
    pilot: bool = False,
    saves_dir: str | None = None,
    again: bool = False,
) -> dict:
    """Train one method with one seed and score it on the held-out problems at its evaluation steps; a `pilot` run
    only trains (its training rewards are what settings may be chosen on). With `saves_dir`, the saves are kept in
    `saves_dir/<task>/<method>/seed-<seed>` (a later run with the same settings scores them without training)."""
    solo = METHODS[task_name][method][0] == "solo"
    splits = HELD_OUT[VERSION[task_name]]  # scored on each; the first split's scores are the record's own
    make_rows = TASKS[task_name]().solo_dataset if solo else TASKS[task_name]().dataset
    rows = {split: make_rows(split).to_list() for split in splits}
    generation = {**COMMONS[VERSION[task_name]], **SETTINGS[task_name], **METHODS[task_name][method][1]}
    max_new_tokens, captured_decode = generation["max_completion_length"], generation.get("captured_decode")
    evaluations, kept = [], None
    with tempfile.TemporaryDirectory() as scratch:
        saves = os.path.join(saves_dir, task_name, method, f"seed-{seed}") if saves_dir else scratch
        trained = train(task_name, method, seed, steps, eval_every, saves, again)
        scoring = time.perf_counter()
        for step in [] if pilot else evaluation_steps(steps, eval_every):
            folder = os.path.join(saves, f"step-{step}")
            evaluation = {"step": step}
            for split in splits:
                if solo:
                    result = score_solo(folder, rows[split], max_new_tokens, REWARDS[(task_name, method)][0])
                else:
                    result = score_team(task_name, folder, rows[split], max_new_tokens, captured_decode)
                if split == splits[0]:
                    evaluation.update(result)
                else:
                    evaluation[split] = result
                score = statistics.mean(result["scores"])
                print(f"   step {step}: held-out ({split}) team reward {score:.3f}", flush=True)
            evaluations.append(evaluation)
        if keep_dir and not pilot:
            kept = keep_team(os.path.join(saves, f"step-{steps}"), keep_dir, task_name, method, seed)
    return {
        "task": task_name,
        "method": method,
        "seed": seed,
        "steps": steps,
        "eval_every": eval_every,
        "settings": trained["settings"],
        "evaluations": evaluations,
        "training": trained["training"],
        "train_minutes": trained["train_minutes"],
        "minutes": trained["train_minutes"]
        + (time.perf_counter() - scoring) / 60,  # training (maybe earlier) + scoring
        "code_commit": code_commit(),
        **({"kept": kept} if kept else {}),
    }


def registered_as(path: str, registered: str) -> str:
    """`--registered COMMIT:BLOB`: COMMIT, once the settings file at `path` is checked to hash to BLOB (git's blob
    hash of its content); a `SystemExit` otherwise."""
    commit, _, blob = registered.partition(":")
    if not re.fullmatch(r"[0-9a-f]{40}", commit):
        raise SystemExit(
            f"--registered: {commit!r} is not a full commit hash (40 hex digits): give `git rev-parse` of it."
        )
    with open(path, "rb") as f:
        content = f.read()
    actual = hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()
    if not commit or actual != blob:
        raise SystemExit(
            f"--registered: {path} hashes to {actual}, not to the blob {blob!r} given with commit {commit!r}: these "
            "are not the registered settings (give `COMMIT:$(git rev-parse COMMIT:<settings file>)`)."
        )
    return commit


def merged(record: dict, files: list[str], commit: str | None = None) -> dict:
    """`record` with the runs of each results file in `files` added, a run already there (same task, method, seed and
    settings) replaced by the merged one; the machine, version and date of the last file. With `commit` (a registered
    version's results), a run made under other settings, a pilot's or an unregistered one, is refused."""
    for path in files:
        with open(path) as f:
            other = json.load(f)
        for run in other["runs"]:
            if commit and run.get("settings_commit") != commit:
                raise SystemExit(
                    f"--merge: {path} holds a run ({'/'.join(map(str, identity(run)))}) made under settings commit "
                    f"{run.get('settings_commit')}, not the registered {commit}: a pilot's, an unregistered or "
                    "another version's run never joins the registered results. Nothing was merged."
                )
            record["runs"] = [
                r for r in record["runs"] if (identity(r), r["settings"]) != (identity(run), run["settings"])
            ] + [run]
        record.update({key: other[key] for key in ("machine", "trl_marl", "date") if key in other})
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--version",
        type=int,
        choices=sorted(COMMONS),
        default=LATEST,
        help=f"Benchmark version (default: the latest, {LATEST}); 1 is the first round's tasks.",
    )
    parser.add_argument("--task", default="all", help="One task of the version (default: all of them).")
    parser.add_argument("--methods", nargs="+", help="Subset of the task's methods (default: all of them).")
    parser.add_argument("--seeds", nargs="+", type=int, help="Seeds (default: the version's).")
    parser.add_argument("--steps", type=int, help="Training steps (default: the task's, in SCHEDULE).")
    parser.add_argument("--eval_every", type=int, help="Held-out evaluation every N steps (default: the task's).")
    parser.add_argument("--results", help="Results file (default: results/bench_learning[_v<version>].json).")
    parser.add_argument("--fresh", action="store_true", help="Forget the runs already in the results file.")
    parser.add_argument("--rerun", action="store_true", help="Run the chosen runs again, replacing saved ones.")
    parser.add_argument("--report", action="store_true", help="Only regenerate the table and the PNG.")
    parser.add_argument(
        "--pilot",
        action="store_true",
        help="Train only, never score held out (the settings may still change): its own results file, training "
        "rewards only.",
    )
    parser.add_argument(
        "--unregistered",
        action="store_true",
        help="Score held out although the settings file is not committed (recorded as such; not a benchmark result).",
    )
    parser.add_argument(
        "--registered",
        metavar="COMMIT:BLOB",
        help="Where the settings file is not in a git checkout (a bundle on another machine): the commit it was "
        "registered at and its git blob hash (`git rev-parse COMMIT:<settings file>`); held-out runs start only if "
        "the file's content hashes to BLOB, and record COMMIT.",
    )
    parser.add_argument(
        "--merge",
        nargs="+",
        metavar="FILE",
        help="Add the runs of these results files (made apart: other machines, parallel runs) to the version's "
        "results file, then report.",
    )
    parser.add_argument(
        "--saves",
        metavar="DIR",
        help="Keep every run's saved steps in DIR/<task>/<method>/seed-<seed>; a run whose saves are there with the "
        "same settings is scored without training again (train with --pilot, commit the settings, then score).",
    )
    parser.add_argument(
        "--keep_teams",
        metavar="DIR",
        help="Keep each run's final team in DIR/<task>/<method>/seed-<seed> (load it with trl_marl.load_team).",
    )
    options = parser.parse_args()
    version = options.version
    select_version(version)
    tasks = tasks_of(version)
    if options.task != "all" and options.task not in tasks:
        raise SystemExit(f"--task: {options.task!r} is not a task of version {version} ({tasks}).")
    results = options.results or results_file(version)
    if options.pilot or options.unregistered:  # never beside the registered runs
        results = os.path.splitext(results)[0] + ("_pilot.json" if options.pilot else "_unregistered.json")

    record = {"runs": []}
    if os.path.exists(results) and not options.fresh:
        with open(results) as f:
            record = json.load(f)
    if options.merge:
        registered = SETTINGS_FILES[version] and results == results_file(version)
        record = merged(record, options.merge, registered_commit(SETTINGS_FILES[version]) if registered else None)
        with open(results, "w") as f:
            json.dump(record, f, indent=1)
    if options.report or options.merge:
        return report(record, results, options.steps, options.eval_every, version, options.pilot)
    settings_file = SETTINGS_FILES[version]
    commit = None
    if settings_file and not options.pilot and not options.unregistered:
        commit = (
            registered_as(settings_file, options.registered)
            if options.registered
            else registered_commit(settings_file)
        )
        other = sorted({r.get("settings_commit") for r in record["runs"]} - {commit}, key=str)
        if other:
            raise SystemExit(
                f"{results} holds runs made under settings commit {other[0]}, and {settings_file} has changed since "
                f"(now {commit}): a change after held-out scores is a new version (a new settings file)."
            )
        outside = sorted(set(options.seeds or []) - set(SEEDS[version]))
        if outside:
            raise SystemExit(
                f"--seeds: {outside} are not among version {version}'s registered seeds {SEEDS[version]} (more seeds "
                "are a change of the settings file, so a new version; --unregistered scores them apart)."
            )
    record.update(
        machine=f"{platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}, "
        + (torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"),
        trl_marl=trl_marl.__version__,
    )
    chosen = []  # seed by seed, so that the claims' pairs fill up together in a benchmark stopped half way
    for seed in options.seeds or SEEDS[version]:
        for task_name in tasks if options.task == "all" else [options.task]:
            for method in options.methods or METHODS[task_name]:
                if method not in METHODS[task_name]:
                    raise SystemExit(
                        f"--methods: {method!r} is not a method of {task_name} ({list(METHODS[task_name])})."
                    )
                chosen.append((task_name, method, seed))
    for task_name, method, seed in chosen:
        steps, eval_every = schedule(task_name, options.steps, options.eval_every)
        settings = run_settings(task_name, method, steps, eval_every)
        same = [r for r in record["runs"] if identity(r) == (task_name, method, seed) and r["settings"] == settings]
        if same and not options.rerun:
            continue
        print(f"== {task_name} / {method} / seed {seed}", flush=True)
        result = run(
            task_name, method, seed, steps, eval_every, options.keep_teams, options.pilot, options.saves, options.rerun
        )
        if settings_file:
            result.update(settings_file=os.path.relpath(settings_file, RESULTS), settings_commit=commit)
        result["machine"] = record["machine"]  # each run's own: runs made apart are merged into one file
        if options.registered and result["code_commit"] is None:  # outside a checkout: the tree sent is the commit's
            result["code_commit"] = f"{commit} (given with --registered)"
        print(f"   {result['minutes']:.1f} min", flush=True)
        record["runs"] = [r for r in record["runs"] if r not in same] + [result]
        record["date"] = datetime.date.today().isoformat()
        os.makedirs(os.path.dirname(results), exist_ok=True)
        with open(results, "w") as f:
            json.dump(record, f, indent=1)
    report(record, results, options.steps, options.eval_every, version, options.pilot)


if __name__ == "__main__":
    main()
