"""The peer benchmark's own arithmetic and report (recipes/benchmarks/bench_peer.py); its runs are benchmarks, not
tests, and no virtual environment is created here."""

import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO_ROOT / "recipes" / "benchmarks"


def load(name):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    return load("bench_peer")


@pytest.fixture(scope="module")
def runner():
    return load("peer_comlrl_runner")


def report(step_end_times, load_peak, train_peak, baseline=0, lengths=(40, 40), reward=0.5):
    return {
        "start_time": 0.0,
        "step_end_times": step_end_times,
        "completion_lengths": list(lengths),
        "mean_team_reward": reward,
        "memory_baseline_bytes": baseline,
        "memory_load_peak_bytes": load_peak,
        "memory_train_peak_bytes": train_peak,
        "rss_file_end_bytes": 0,
    }


def test_seconds_per_prompt_leaves_out_everything_before_the_first_step_end(bench):
    # Steps end at 10, 13, 17, 19 s: (19 - 10) / 3 = 3 s per prompt; the 10 s of load and first step do not count.
    assert bench.seconds_per_prompt([10.0, 13.0, 17.0, 19.0]) == pytest.approx(3.0)
    assert bench.seconds_per_prompt([10.0, 14.0], prompts_per_step=2) == pytest.approx(2.0)


def test_seconds_per_prompt_needs_two_steps(bench):
    with pytest.raises(ValueError, match="at least 2 steps"):
        bench.seconds_per_prompt([5.0])


def test_figures_take_the_larger_peak_net_of_the_baseline(bench):
    gib = 2**30
    row = bench.figures(report([4.0, 6.0, 8.0], load_peak=3 * gib, train_peak=2 * gib, baseline=gib, lengths=(8, 6)))
    assert row["seconds_per_prompt"] == pytest.approx(2.0)
    assert row["first_step_seconds"] == pytest.approx(4.0)
    assert row["peak_memory_gib"] == pytest.approx(2.0)  # max(3, 2) - 1
    assert row["train_peak_memory_gib"] == pytest.approx(1.0)
    assert row["mean_completion_tokens"] == pytest.approx(7.0)
    assert row["prompts_timed"] == 2


def test_ratios_are_comlrl_over_trl_marl_and_judged_against_the_targets(bench):
    peer = {"seconds_per_prompt": 10.0, "peak_memory_gib": 5.0}
    ours = {"seconds_per_prompt": 2.0, "peak_memory_gib": 1.25}
    assert bench.ratios(peer, ours) == pytest.approx({"time": 5.0, "memory": 4.0})
    assert bench.verdict("time", 5.0) == "PASS"  # target >= 4x
    assert bench.verdict("memory", 4.0) == "MISS"  # target >= 5x
    assert bench.verdict("memory", 5.0) == "PASS"


def test_table_shows_ratios_verdicts_and_why_a_configuration_was_skipped(bench):
    peer = {**bench.figures(report([0.0, 10.0], 5 * 2**30, 5 * 2**30)), "mean_team_reward": None}
    ours = bench.figures(report([0.0, 2.0], 2**30, 2**30))
    text = bench.table({"comlrl": peer, "trl_marl": ours}, {"trl_marl_4bit": "no bitsandbytes"})
    lines = text.splitlines()
    trl_marl_row = next(line for line in lines if line.startswith("trl_marl (LoRA, shared base)"))
    assert "5.00x PASS (>=4x)" in trl_marl_row and "5.00x PASS (>=5x)" in trl_marl_row
    assert any(line.startswith("trl_marl (LoRA, 4-bit base)") and "skipped: no bitsandbytes" in line for line in lines)
    assert "PASS" not in next(line for line in lines if line.startswith("CoMLRL"))


def test_worker_report_is_the_last_json_line_of_its_output(bench):
    assert bench.last_json_line('loading...\n{"side": "a"}\nnoise\n{"side": "b"}\n') == {"side": "b"}
    with pytest.raises(ValueError, match="no JSON report"):
        bench.last_json_line("Traceback ...")


def test_a_local_build_tag_is_the_same_release(bench):
    assert bench.same_release("2.13.0+cpu", "2.13.0")
    assert not bench.same_release("2.14.1", "2.13.0")


def test_comlrl_reward_adapter_passes_joint_actions_in_agent_order(runner):
    def team_reward(prompts, completions, **kwargs):
        return [float(len(c["concise"]) - len(c["detailed"])) for c in completions]

    reward = runner.comlrl_team_reward(team_reward, ["concise", "detailed"])
    assert reward(["a", "bbb"], ["cc", "d"]) == [-1.0, 2.0]
    assert reward.history == [-1.0, 2.0]


def test_the_floor_row_shows_ceilings_not_verdicts_and_stays_out_of_the_judged_ratios(bench):
    gib = 2**30
    peer = bench.figures(report([0.0, 9.0], 5 * gib, 5 * gib))
    floor = bench.figures(report([0.0, 3.0], gib // 2, gib // 2))
    ours = bench.figures(report([0.0, 6.0], gib, gib))
    text = bench.table({"comlrl": peer, "trl_marl": ours, "floor": floor}, {})
    floor_row = next(line for line in text.splitlines() if line.startswith(bench.CONFIGURATIONS["floor"]))
    assert "3.00x ceiling" in floor_row and "10.00x ceiling" in floor_row  # 9 / 3 s, 5 / 0.5 GiB
    assert "PASS" not in floor_row and "MISS" not in floor_row
    trl_marl_row = next(line for line in text.splitlines() if line.startswith("trl_marl (LoRA, shared base)"))
    assert "1.50x MISS (>=4x)" in trl_marl_row and "5.00x PASS (>=5x)" in trl_marl_row


def test_comlrls_environment_goes_inside_the_checkout_in_an_ignored_folder(bench):
    venv = bench.DEFAULT_COMLRL_VENV
    assert venv.is_relative_to(REPO_ROOT), f"{venv} is outside the checkout {REPO_ROOT}"
    if shutil.which("git") is None or not (REPO_ROOT / ".git").exists():
        pytest.skip("needs git and a git checkout to ask whether the folder is ignored")
    ignored = subprocess.run(["git", "check-ignore", "-q", str(venv / "bin" / "python")], cwd=REPO_ROOT)
    assert ignored.returncode == 0, f"{venv.relative_to(REPO_ROOT)} is not in .gitignore"
