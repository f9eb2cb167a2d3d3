"""The learning benchmark's own rewards and report (recipes/benchmarks/bench_learning.py); its runs are benchmarks,
not tests."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "recipes" / "benchmarks" / "bench_learning.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_learning", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_single_agent_answer_is_its_first_line_and_the_rest_its_explanation(bench):
    text = "Answer: 7\n\nExplanation: Three plus four is seven.\nCount on from three."
    assert bench.split_answer(text) == {"concise": "7", "detailed": "Three plus four is seven. Count on from three."}
    assert bench.split_answer("seven") == {"concise": "seven", "detailed": ""}


def test_single_agent_explain_reward_is_the_team_reward_of_its_two_parts(bench):
    # 1 word / 4 words: (4 / 1 - 1) / 2 = 1.5, clipped to 1; 2 words / 4 words: (2 - 1) / 2 = 0.5; no explanation: 0.
    completions = ["7\nThree plus four, seven.", "It's seven\nThree plus four, seven.", "seven"]
    assert bench.single_explain_reward(None, completions) == [1.0, 0.5, 0.0]
    conversational = [[{"role": "assistant", "content": "7\nThree plus four, seven."}]]
    assert bench.single_explain_reward(None, conversational) == [1.0]


def test_independent_rewards_score_each_role_alone(bench):
    # 0 words, 3 words, 10 words: (15 - 10) / 10 = 0.5, 20 words.
    assert bench.short_answer(None, ["", "a b c", " ".join("w" * 10), " ".join("w" * 20)]) == [0.0, 1.0, 0.5, 0.0]
    texts = ["One.", "One. Two!", "One. Two. Three?", "A. B. C. D.", "A. B. C. D. E.", ""]
    assert bench.two_or_three_sentences(None, texts) == [0.5, 1.0, 1.0, 0.5, 0.0, 0.0]


def test_single_agent_reach_reward_success_and_format(bench):
    # start 5, target 15: "+10" lands (1.0); "4" covers 4 of 10 (0.4); no number stays at 5 (0.0).
    completions, start, target = ["10", "I add 4", "no idea"], [5, 5, 5], [15, 15, 15]
    assert bench.single_reach_reward(None, completions, start=start, target=target) == [1.0, 0.4, 0.0]
    assert bench.on_target(None, completions, start=start, target=target) == [1.0, 0.0, 0.0]
    assert bench.single_format(None, completions) == [1.0, 0.5, 0.0]


def test_table_reports_mean_and_sample_std_over_seeds(bench):
    runs = [
        {
            "task": "explain",
            "method": "magrpo",
            "seed": s,
            "team_reward": r,
            "success_rate": None,
            "minutes": 4.0,
            "curve": [],
        }
        for s, r in enumerate([0.5, 0.7, 0.9])
    ]
    runs[0]["curve"], runs[1]["curve"], runs[2]["curve"] = [0.0, 1.0], [0.5], []  # means 0.5 and 0.5; none
    assert "| explain | magrpo | 3 | 0.700 ± 0.200 | - | 0.500 ± 0.000 | 4.0 |" in bench.table(runs).splitlines()
