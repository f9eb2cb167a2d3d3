"""The learning benchmark's own parts (recipes/benchmarks/bench_learning.py and its learning_versions.py and
learning_report.py): the coarse-key ablation, the versions and their pre-registration, the statistics and the report;
its runs are benchmarks, not tests."""

import importlib.util
import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "recipes" / "benchmarks" / "bench_learning.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_learning", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def report(bench):
    import learning_report  # importable once the script has put its folder on the path

    return learning_report


@pytest.fixture(scope="module")
def versions(bench):
    import learning_versions

    return learning_versions


def test_coarse_groups_compare_every_problems_candidates_of_one_turn_and_agent(bench):
    # (turn 0, first): problem 1 rewards [1, 0], problem 2 [0, 0]; (turn 1, second): [0.5, 0.5].
    # Coarse group of four: mean 0.25, unbiased std sqrt((0.75² + 3 · 0.25²) / 3) = 0.5, so (1 − 0.25) / 0.5001 and
    # (0 − 0.25) / 0.5001: problem 2's candidates are pushed down although they tied within their own problem.
    entries = [(0, 0, 1.0), (0, 0, 0.0), (0, 0, 0.0), (0, 0, 0.0), (1, 1, 0.5), (1, 1, 0.5)]
    samples = [SimpleNamespace(turn=t, agent=a, group=None, advantage=None) for t, a, _ in entries]
    joint_actions = [SimpleNamespace(reward=r, advantage=None) for _, _, r in entries]
    bench.coarsen_groups(SimpleNamespace(samples=samples, joint_actions=joint_actions), "mean", "group")
    expected = [0.75 / 0.5001, -0.25 / 0.5001, -0.25 / 0.5001, -0.25 / 0.5001, 0.0, 0.0]
    assert [s.advantage for s in samples] == pytest.approx(expected, abs=1e-5)
    assert [ja.advantage for ja in joint_actions] == pytest.approx(expected, abs=1e-5)
    assert [s.group for s in samples] == [0, 0, 0, 0, 1, 1]
    # with the agents' names, the tied-group shares logged are the coarse groups' (turn 1's group ties)
    rollout = SimpleNamespace(samples=samples, joint_actions=joint_actions, metrics={})
    bench.coarsen_groups(rollout, "mean", "group", ["first", "second"])
    assert rollout.metrics == {
        "turns/0/agents/first/frac_reward_zero_std": 0.0,
        "turns/1/agents/second/frac_reward_zero_std": 1.0,
    }


def test_every_run_is_scored_at_step_0_every_n_steps_and_its_last_step(versions):
    assert versions.evaluation_steps(16, 4) == [0, 4, 8, 12, 16]
    assert versions.evaluation_steps(10, 4) == [0, 4, 8, 10]


def test_the_report_keeps_only_runs_made_with_the_current_settings(versions):
    now = {
        "task": "pick_new",
        "method": "at_grpo",
        "seed": 0,
        "settings": versions.run_settings("pick_new", "at_grpo", 16, 4),
    }
    shorter = {**now, "settings": versions.run_settings("pick_new", "at_grpo", 4, 4)}
    older = {**now, "settings": None}
    assert versions.current([now, shorter, older], None, 4) == [now]
    assert versions.current([now, shorter, older], 4, 4) == [shorter]
    assert versions.run_settings("pick_new", "magrpo", 16, 4)["reward_funcs"] == ["new_option_gain"]
    assert versions.run_settings("pick_new", "magrpo", 16, 4)["num_generations"] == 2  # the method's over COMMON's 4


def test_a_saved_run_made_with_other_common_settings_is_not_current(versions, monkeypatch):
    made = {
        "task": "pick_new",
        "method": "at_grpo",
        "seed": 0,
        "settings": versions.run_settings("pick_new", "at_grpo", 16, 4),
    }
    assert versions.current([made], None, None) == [made]
    monkeypatch.setitem(versions.COMMON, "learning_rate", 1e-4)
    assert versions.current([made], None, None) == []


def test_interval_is_the_mean_and_the_95_percent_t_half_width(report):
    # mean 0.5, sample std 0.2, 3 values: 4.303 · 0.2 / sqrt(3) = 0.49687
    mean, half = report.interval([0.3, 0.5, 0.7])
    assert mean == pytest.approx(0.5) and half == pytest.approx(4.303 * 0.2 / 3**0.5)
    assert report.interval([0.4]) == (0.4, 0.0)


def run(method, seed, scores, success=None):
    final = {"step": 4, "scores": scores, **({"success": success} if success is not None else {})}
    start = {"step": 0, "scores": [0.0] * len(scores), **({"success": 0.0} if success is not None else {})}
    return {"task": "pick_new", "method": method, "seed": seed, "evaluations": [start, final], "minutes": 10.0}


def test_paired_difference_is_per_seed_mean_of_per_problem_differences(report):
    a = [run("at_grpo", 0, [1.0, 0.5]), run("at_grpo", 1, [1.0, 1.0]), run("at_grpo", 2, [0.5, 0.5])]
    b = [run("coarse", 0, [0.5, 0.5]), run("coarse", 2, [0.5, 0.0])]
    assert report.paired_difference(a, b) == [0.25, 0.25]  # seed 1 has no partner


def test_table_reports_untrained_from_step_0_the_methods_and_their_paired_differences(report):
    runs = [run("at_grpo", s, [1.0, v], success=v) for s, v in enumerate([0.0, 1.0, 0.5])]
    runs += [run("coarse", s, [0.5, v], success=0.0) for s, v in enumerate([0.0, 1.0, 0.5])]
    lines = report.table(runs).splitlines()
    # untrained − at_grpo: per-seed means -0.5, -1, -0.75
    assert "| pick_new | untrained | 3 | 0.000 ± 0.000 | 0.000 ± 0.000 | -0.750 ± 0.621 | - |" in lines
    # at_grpo: per-seed means 0.5, 1.0, 0.75 -> mean 0.75, std 0.25, half-width 4.303 · 0.25 / sqrt(3) = 0.621
    assert "| pick_new | at_grpo | 3 | 0.750 ± 0.621 | 0.500 ± 1.242 | - | 10.0 |" in lines
    # coarse − at_grpo on every problem: -0.5 and 0 -> -0.25 for each seed, no spread
    assert "| pick_new | coarse | 3 | 0.500 ± 0.621 | 0.000 ± 0.000 | -0.250 ± 0.000 | 10.0 |" in lines


def test_first_choice_says_what_the_first_answer_did(bench):
    assert bench.first_choice({"picks": [("first", None, False)]}) == "invalid"
    assert bench.first_choice({"picks": [("first", "red", False), ("second", "blue", True)]}) == "repeated"
    assert bench.first_choice({"picks": [("first", "red", True)]}) == "new"


def test_the_report_rewrites_only_what_lies_between_its_markers(report, tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n<!-- t:start -->\nold table\n<!-- t:end -->\nafter\n")
    assert report.replace_between(str(page), "t", "| new |")
    assert page.read_text() == "# Title\n<!-- t:start -->\n| new |\n<!-- t:end -->\nafter\n"
    assert not report.replace_between(str(page), "other", "| x |")


def test_diagnostics_name_each_group_and_what_the_second_teammate_did_after_the_first(report):
    assert report.group_label("turns/1/agents/second/frac_reward_zero_std") == "turn 1 second"
    assert report.group_label("turns/0/frac_reward_zero_std") == "turn 0"
    runs = [run("at_grpo", 0, [1.0, 0.0], success=0.5)]
    runs[0]["evaluations"][-1].update(second_by_first={"new": [0.5, 4], "repeated": [0.0, 2]}, turns=2.5)
    runs[0]["evaluations"][0].update(second_by_first={"invalid": [0.25, 8]}, turns=3.0)
    runs[0]["training"] = {"turns/0/agents/first/frac_reward_zero_std": [0.5, 0.0]}
    lines = report.diagnostics_table(runs).splitlines()
    assert (
        "| pick_new | untrained | second names a new option after the first's invalid: 0.25 (n = 8); turns 3.00 | - |"
        in lines
    )
    expected = (
        "| pick_new | at_grpo | second names a new option after the first's new: 0.50 (n = 4), "
        "repeated: 0.00 (n = 2); turns 2.50 | "
    )
    assert expected + "turn 0 first 0.25 |" in lines
    # pooled over seeds by episodes: (1.0 · 1 + 0.25 · 4) / 5 = 0.40 (a mean of the two rates would say 0.62)
    assert report.pooled_rate([[1.0, 1], [0.25, 4], None, [0.5, 0]]) == "0.40 (n = 5)"
    assert report.pooled_rate([None]) == "-"


def test_training_diagnostics_keep_the_team_reward_and_the_per_group_signals_step_by_step(bench, report):
    history = [
        {"reward": 0.5, "rewards/new_options_reward/mean": 0.25, "turns/0/agents/first/chosen_reward": 1.0, "loss": 0},
        {"reward": 0.7, "rewards/new_options_reward/mean": 0.5, "turns/1/agents/second/frac_reward_zero_std": 0.5},
        {"train_runtime": 10.0, "reward": 0.6},
    ]
    assert bench.training_diagnostics(history) == {
        "rewards/new_options_reward/mean": [0.25, 0.5],
        "turns/0/agents/first/chosen_reward": [1.0, None],
        "turns/1/agents/second/frac_reward_zero_std": [None, 0.5],
    }
    assert report.curve_mean([[1.0, None], [0.0, 0.5]]) == [0.5, 0.5]


def test_claims_table_says_plainly_whether_each_claim_holds(report):
    runs = [run("at_grpo", s, [1.0, v]) for s, v in enumerate([0.0, 1.0, 0.5])]
    runs += [run("coarse", s, [0.5, v]) for s, v in enumerate([0.0, 1.0, 0.5])]  # at_grpo − coarse: +0.25 each seed
    runs += [run("single", s, [v, v]) for s, v in enumerate([1.0, 0.5, 0.5])]  # at_grpo − single: -0.5, +0.5, +0.25
    lines = report.claims_table(runs).splitlines()
    # no spread: 2 seeds would do
    assert (
        "| pick_new | at_grpo beats coarse | 3 | 0.250 ± 0.000 | +0.250, +0.250, +0.250 | 0.000 | 2 | holds |" in lines
    )
    # mean 0.0833, std 0.5204, half-width 4.303 · 0.5204 / sqrt(3) = 1.293; 80 % power at this effect needs
    # (t.975 + t.80) · 0.5204 / sqrt(n) <= 0.0833 with n − 1 degrees of freedom: at 308, (1.9677 + 0.8428) · 0.5204 /
    # 17.578 = 0.08321 (at 307 seeds, 0.08334)
    expected = "| pick_new | at_grpo beats single | 3 | 0.083 ± 1.293 | -0.500, +0.500, +0.250 | 0.520 | 309 | "
    assert expected + "does not hold: the interval contains 0 |" in lines
    # the untrained team (step 0, every score 0): at_grpo − untrained = 0.5, 1.0, 0.75 (std 0.25: n = 4 gives
    # (3.182 + 0.978) · 0.25 / 2 = 0.52 <= 0.75, n = 3 gives (4.303 + 1.061) · 0.25 / 1.732 = 0.774 > 0.75)
    expected = (
        "| pick_new | at_grpo beats untrained | 3 | 0.750 ± 0.621 | +0.500, +1.000, +0.750 | 0.250 | 4 | holds |"
    )
    assert expected in lines
    assert not [line for line in lines if "magrpo" in line or "distinct_items" in line]  # no runs, no claim
    assert report.verdict([-0.5, -0.4, -0.6]) == "does not hold: the other is better"
    assert report.verdict([0.5]) == "needs 2 seeds or more"


def test_a_kept_team_is_the_runs_final_team_loadable_under_task_method_and_seed(bench, tiny_model_dir, tmp_path):
    from tiny_run import TINY_RUN

    from trl_marl import MAGRPOConfig, MAGRPOTrainer, load_team
    from trl_marl.tasks import resolve_task

    task = resolve_task("congestion")
    args = MAGRPOConfig(output_dir=str(tmp_path / "run"), agents=task.agents, num_generations=2, **TINY_RUN)
    trainer = MAGRPOTrainer(tiny_model_dir, args=args, task=task)
    final = tmp_path / "run" / "saves" / "step-16"
    trainer.save_model(str(final))
    kept = bench.keep_team(str(final), str(tmp_path / "teams"), "congestion", "magrpo", 3)
    assert kept == str(tmp_path / "teams" / "congestion" / "magrpo" / "seed-3")
    team = load_team(kept)
    assert team.agent_names == ["first", "second"] and team.spec["task"] == "congestion"
    # Kept again (a rerun), the copy is replaced, not merged.
    (Path(kept) / "stale.txt").write_text("from an earlier run")
    bench.keep_team(str(final), str(tmp_path / "teams"), "congestion", "magrpo", 3)
    assert not (Path(kept) / "stale.txt").exists()


def test_seeds_for_power_is_the_smallest_n_whose_t_test_has_80_percent_power_at_the_measured_effect(report):
    # mean 0.2, std 0.1: n = 4 gives (3.182 + 0.978) · 0.1 / 2 = 0.208 > 0.2; n = 5 gives (2.776 + 0.941) · 0.1 /
    # sqrt(5) = 0.166 <= 0.2
    assert report.seeds_for_power([0.1, 0.2, 0.3]) == "5"
    assert report.seeds_for_power([-0.1, -0.2, -0.3]) == "-"  # the other is ahead: no number of seeds shows the claim
    # beyond the table (30 degrees of freedom) the quantiles follow the normal's with Cornish-Fisher corrections
    assert report.t_quantile(0.975, 31) == pytest.approx(2.0395, abs=2e-4)
    assert report.t_quantile(0.975, 100) == pytest.approx(1.9840, abs=2e-4)
    assert report.t_quantile(0.8, 60) == pytest.approx(0.848, abs=5e-4)
    assert report.seeds_for_power([0.4]) == "-"
    assert report.seeds_for_power([0.0, 0.0]) == "-"
    assert report.seeds_for_power([0.0011, -0.001]) == "> 1000"  # mean 5e-5, SD 1.5e-3


@pytest.fixture
def version_2(versions):
    """Version 2's tables in force (version 3 benchmarks its tasks again), version 3's again afterwards."""
    versions.select_version(2)
    yield versions
    versions.select_version(3)  # version 3 holds these tasks after import


def test_version_2_comes_from_its_settings_file_and_changes_one_thing_per_claim(bench, version_2):
    versions = version_2
    assert versions.VERSION["congestion"] == versions.VERSION["pick_new_hidden"] == 2
    assert versions.tasks_of(1) == ["distinct_items", "pick_new"]
    assert versions.results_file(2).endswith("results/bench_learning_v2.json")
    # congestion: the same trainer on the team reward alone (no local reward) or on each agent's own points (α = 0)
    team, per_role = bench.make_task("congestion", "at_grpo"), bench.make_task("congestion", "per_role")
    assert team.local_reward_funcs == {} and per_role.local_reward_funcs["first"][0].__name__ == "own_points_reward"
    assert versions.run_settings("congestion", "at_grpo", 32, 16)["task_variant"] == {"local_reward_funcs": {}}
    assert versions.run_settings("congestion", "per_role", 32, 16)["team_reward_weight"] == 0.0
    per_role_settings = versions.run_settings("congestion", "per_role", 32, 16)
    assert per_role_settings["task_variant"] is None and per_role_settings["algorithm"] == "at_grpo"
    # what the trainer is belongs to a run's settings: a pilot's saves are not reused for another trainer
    assert versions.run_settings("pick_new_hidden", "coarse", 32, 16)["groups"] == "coarse"
    assert versions.run_settings("pick_new_hidden", "at_grpo", 32, 16)["groups"] == "problem"
    # every method of a task shares G, batch, steps, learning rate and KL; only its own fields differ
    shared = ("num_generations", "per_device_train_batch_size", "learning_rate", "beta", "max_steps", "eval_every")
    for task_name in versions.tasks_of(2):
        settings = [versions.run_settings(task_name, m, 32, 16) for m in versions.METHODS[task_name]]
        assert all(s[key] == settings[0][key] for s in settings for key in shared)
    solo = versions.run_settings("pick_new_hidden", "solo", 32, 16)
    assert solo["reward_funcs"] == ["two_new_options_reward"] and solo["max_completion_length"] == 12
    assert ("pick_new_hidden", "coarse") in versions.COARSE and ("pick_new", "coarse") in versions.COARSE
    # the first round's settings are what its saved runs were made with
    assert versions.run_settings("pick_new", "at_grpo", 16, 4)["learning_rate"] == 5e-4
    assert "beta" not in versions.run_settings("pick_new", "at_grpo", 16, 4)
    with open(versions.results_file(1)) as f:
        saved = json.load(f)["runs"]
    first_round = [(t, m, s) for t in versions.tasks_of(1) for m in versions.METHODS[t] for s in versions.SEEDS[1]]
    assert sorted(versions.identity(r) for r in versions.current(saved, None, None)) == sorted(first_round)


def test_version_3_is_version_2_with_a_strict_one_agent_scorer_and_a_held_out_split_of_unseen_categories(versions):
    assert versions.tasks_of(3) == ["congestion", "pick_new_hidden"]
    assert versions.HELD_OUT[3] == ["eval", "unseen"] and versions.HELD_OUT[2] == ["eval"]
    assert versions.results_file(3).endswith("results/bench_learning_v3.json")
    latest = {(t, m): versions.run_settings(t, m, 32, 16) for t in versions.tasks_of(3) for m in versions.METHODS[t]}
    versions.select_version(2)
    try:
        before = {key: versions.run_settings(*key, 32, 16) for key in latest}
    finally:
        versions.select_version(3)
    changed = {key for key in latest if latest[key] != before[key]}
    assert changed == {("pick_new_hidden", "solo")}  # every other run trains and is scored exactly as in version 2
    assert latest[("pick_new_hidden", "solo")]["reward_funcs"] == ["exactly_two_new_options_reward"]
    assert before[("pick_new_hidden", "solo")]["reward_funcs"] == ["two_new_options_reward"]


def test_a_run_is_scored_on_every_held_out_split_of_its_version_and_records_its_code_commit(bench, monkeypatch):
    trained = {"settings": {}, "training": {}, "train_minutes": 1.0}
    monkeypatch.setattr(bench, "train", lambda *args: trained)
    seen = []

    def score_team(task_name, folder, rows, max_new_tokens, captured_decode=None):
        seen.append((folder.rsplit("/", 1)[-1], rows[0]["options"]))
        return {"scores": [float(len(seen))]}

    monkeypatch.setattr(bench, "score_team", score_team)
    result = bench.run("congestion", "at_grpo", 0, 2, 2)
    eval_rows, unseen_rows = (bench.TASKS["congestion"]().dataset(split)[0]["options"] for split in ("eval", "unseen"))
    assert seen == [("step-0", eval_rows), ("step-0", unseen_rows), ("step-2", eval_rows), ("step-2", unseen_rows)]
    assert [(e["step"], e["scores"], e["unseen"]["scores"]) for e in result["evaluations"]] == [
        (0, [1.0], [2.0]),
        (2, [3.0], [4.0]),
    ]
    assert result["code_commit"] is None or len(result["code_commit"].removesuffix("-dirty")) == 40


def test_the_report_gives_each_held_out_split_its_own_tables(report):
    runs = []
    for seed, (seen_scores, unseen_scores) in enumerate([([1.0, 1.0], [0.5, 0.0]), ([1.0, 0.5], [0.5, 0.5])]):
        for method, shift in (("at_grpo", 0.0), ("solo", 0.5)):
            final = {"step": 32, "scores": [v - shift for v in seen_scores], "success": 0.0}
            final["unseen"] = {"scores": [v * 2 - shift for v in unseen_scores], "success": 0.0}
            start = {"step": 0, "scores": [0.0, 0.0], "success": 0.0, "unseen": {"scores": [0.0, 0.0], "success": 0.0}}
            runs.append({"task": "pick_new_hidden", "method": method, "seed": seed, "minutes": 1.0})
            runs[-1]["evaluations"] = [start, final]
    # at_grpo − solo is +0.5 on every problem of both splits; at_grpo's own means differ by split: seeds 0 and 1 score
    # 1.0 and 0.75 on the training categories (mean 0.875, half-width 12.706 · 0.177 / √2 = 1.588), 0.5 and 1.0 on
    # the unseen ones (0.750 ± 12.706 · 0.354 / √2 = 3.176)
    assert report.paired_difference(runs[0::2], runs[1::2], "unseen") == [0.5, 0.5]
    seen_lines = report.table(runs, ["pick_new_hidden"])
    unseen_lines = report.table(runs, ["pick_new_hidden"], "unseen")
    assert "| pick_new_hidden | at_grpo | 2 | 0.875 ± 1.588 |" in seen_lines
    assert "| pick_new_hidden | at_grpo | 2 | 0.750 ± 3.176 |" in unseen_lines


def test_held_out_runs_need_the_settings_file_committed_and_record_its_commit(versions, tmp_path):
    import subprocess

    def git(*arguments):
        return subprocess.run(["git", *arguments], cwd=tmp_path, check=True, capture_output=True, text=True).stdout

    git("init", "-q")
    git("config", "user.email", "bench@example.com")
    git("config", "user.name", "bench")
    settings = tmp_path / "bench_learning_v9.json"
    settings.write_text('{"version": 9}')
    with pytest.raises(SystemExit, match="differs from its last commit.*--pilot"):
        versions.registered_commit(str(settings))  # never committed
    git("add", settings.name)
    git("commit", "-q", "-m", "settings")
    assert versions.registered_commit(str(settings)) == git("rev-parse", "HEAD").strip()
    settings.write_text('{"version": 9, "changed": true}')
    with pytest.raises(SystemExit, match="bench_learning_v9.json differs from its last commit"):
        versions.registered_commit(str(settings))


def test_the_pilot_table_reads_training_rewards_only(report):
    rewards = [0.0, 0.2, 0.4, 0.6, 0.5, 0.5, 0.1, 0.1]  # quarters of 2 steps
    pilot = {"task": "congestion", "method": "magrpo", "seed": 0, "train_minutes": 3.0, "evaluations": []}
    pilot.update(
        settings={"reward_funcs": ["congestion_reward"]}, training={"rewards/congestion_reward/mean": rewards}
    )
    # first quarter 0.1, last 0.1, lowest 4-step mean after the first quarter: (0.5 + 0.5 + 0.1 + 0.1) / 4 = 0.3
    assert "| congestion | magrpo | 0 | 0.100 | 0.100 | 0.300 | 3.0 |" in report.pilot_table([pilot]).splitlines()
    # AT-GRPO's runs are read by the team reward their episodes ended on
    pilot["training"]["episodes/team_reward"] = [1.0] * 8
    assert report.training_team_reward(pilot) == [1.0] * 8


def test_held_out_runs_refuse_seeds_outside_the_registered_ones_and_results_of_another_settings_commit(
    bench, versions, tmp_path, monkeypatch
):
    if versions.last_commit(versions.SETTINGS_FILES[2]) is None or versions.git(
        "status", "--porcelain", "--", "bench_learning_v2.json", cwd=versions.SETTINGS_DIR
    ):
        pytest.skip("the version 2 settings file is not committed as it is here")
    results = tmp_path / "v2.json"
    argv = ["bench_learning.py", "--version", "2", "--seeds", "0", "7", "--results", str(results)]
    monkeypatch.setattr("sys.argv", argv)
    with pytest.raises(
        SystemExit, match=r"--seeds: \[7\] are not among version 2's registered seeds \[0, 1, 2, 3, 4\]"
    ):
        bench.main()
    results.write_text(json.dumps({"runs": [{"task": "congestion", "settings_commit": "0123abc"}]}))
    monkeypatch.setattr("sys.argv", ["bench_learning.py", "--version", "2", "--seeds", "0", "--results", str(results)])
    try:
        with pytest.raises(SystemExit, match="holds runs made under settings commit 0123abc.*a new version"):
            bench.main()
    finally:
        versions.select_version(3)
    assert json.loads(results.read_text())["runs"] == [{"task": "congestion", "settings_commit": "0123abc"}]


def test_diagnostics_say_whether_congestion_teams_collide_and_how_often_one_agent_names_two_new_options(report):
    final = {"step": 32, "scores": [1.0, 4 / 7], "own": [1.0, 0.625], "collided": 0.5, "top_two": 0.5}
    start = {"step": 0, "scores": [0.0, 0.0], "own": [0.25, 0.0], "collided": 0.0, "top_two": 0.0}
    congestion = {"task": "congestion", "method": "at_grpo", "seed": 0, "evaluations": [start, final], "minutes": 6.0}
    congestion["training"] = {"frac_reward_zero_std": [0.5, 0.25]}
    lines = report.diagnostics_table([congestion]).splitlines()
    assert "| congestion | untrained | own reward first 0.25, second 0.00; same pick 0.00; top two 0.00 | - |" in lines
    assert (
        "| congestion | at_grpo | own reward first 1.00, second 0.62; same pick 0.50; top two 0.50 | all 0.38 |"
        in lines
    )
    solo = {"task": "pick_new_hidden", "method": "solo", "seed": 0, "minutes": 3.0, "training": {}}
    solo["evaluations"] = [{"step": 0, "scores": [0.5], "success": 0.0}, {"step": 32, "scores": [1.0], "success": 1.0}]
    team = {**solo, "method": "at_grpo"}
    team["evaluations"] = [{**e, "second_by_first": {}, "turns": 2.0} for e in solo["evaluations"]]
    lines = report.diagnostics_table([team, solo]).splitlines()
    assert "| pick_new_hidden | solo | both picks new 1.00 | all - |" in lines


def test_version_4_pits_the_critics_against_magrpo_on_the_sparse_task_at_about_the_same_rollout_budget(versions):
    assert versions.LATEST == 4 and versions.tasks_of(4) == ["pick_new_sparse"]
    assert versions.HELD_OUT[4] == ["eval", "unseen"] and versions.SEEDS[4] == [0, 1, 2, 3, 4]
    settings = {m: versions.run_settings("pick_new_sparse", m, 16, 8) for m in ("maac", "iac", "magrpo")}
    assert [settings[m]["algorithm"] for m in settings] == ["maac", "iac", "magrpo"]
    assert {tuple(s["reward_funcs"]) for s in settings.values()} == {("final_new_options_reward",)}

    def most_completions(s):  # per agent and step: copies x G^t summed over the turns (one copy per tree root)
        problems = s["per_device_train_batch_size"] * s["gradient_accumulation_steps"] // s["num_generations"]
        if s["algorithm"] == "magrpo":
            return problems * sum(s["num_generations"] ** turn for turn in range(1, 5))
        return problems * s["num_generations"] * 4  # one trajectory per copy

    assert [most_completions(settings[m]) for m in settings] == [32, 32, 30]
    assert ("maac", "magrpo") in versions.CLAIMS["pick_new_sparse"]


def test_a_run_outside_a_checkout_is_registered_by_the_settings_files_blob(bench, tmp_path):
    settings = tmp_path / "bench_learning_v9.json"
    settings.write_text('{"version": 9}\n')
    blob = subprocess.run(["git", "hash-object", str(settings)], capture_output=True, text=True).stdout.strip()
    commit = "a" * 40
    assert bench.registered_as(str(settings), f"{commit}:{blob}") == commit
    with pytest.raises(SystemExit, match="'abc123' is not a full commit hash"):
        bench.registered_as(str(settings), f"abc123:{blob}")
    settings.write_text('{"version": 9, "seeds": [7]}\n')
    with pytest.raises(SystemExit, match=r"bench_learning_v9\.json hashes to [0-9a-f]{40}, not to the blob"):
        bench.registered_as(str(settings), f"{commit}:{blob}")


def test_merging_adds_runs_made_apart_and_replaces_the_same_run(bench, tmp_path):
    def run(method, seed, score):
        return {"task": "pick_new_sparse", "method": method, "seed": seed, "settings": {"x": 1}, "score": score}

    record = {"runs": [run("maac", 0, 0.1), run("iac", 0, 0.2)]}
    for name, runs in (("a.json", [run("maac", 0, 0.5)]), ("b.json", [run("magrpo", 1, 0.3)])):
        (tmp_path / name).write_text(json.dumps({"runs": runs, "machine": name}))
    merged = bench.merged(record, [str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    assert [(r["method"], r["seed"], r["score"]) for r in merged["runs"]] == [
        ("iac", 0, 0.2),
        ("maac", 0, 0.5),
        ("magrpo", 1, 0.3),
    ]
    assert merged["machine"] == "b.json"
    # into a registered version's results only runs of its settings commit: a pilot's run is refused, naming its file
    registered = {"runs": []}
    (tmp_path / "c.json").write_text(json.dumps({"runs": [{**run("iac", 2, 0.4), "settings_commit": "c" * 40}]}))
    assert bench.merged(registered, [str(tmp_path / "c.json")], "c" * 40)["runs"][0]["seed"] == 2
    (tmp_path / "pilot.json").write_text(json.dumps({"runs": [run("maac", 3, 0.9)]}))
    with pytest.raises(
        SystemExit, match=r"pilot\.json holds a run \(pick_new_sparse/maac/3\) made under settings commit None"
    ):
        bench.merged(registered, [str(tmp_path / "pilot.json")], "c" * 40)
