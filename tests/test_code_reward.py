"""The built-in `unit_tests` reward: team code joined in agent order, run in the sandbox, scored on hidden tests."""

import json

import pytest
from datasets import Dataset
from sandbox_helpers import require_bubblewrap

from trl_marl import MAGRPOConfig, MAGRPOTrainer
from trl_marl.registry import load_plugin
from trl_marl.sandbox import CallTest
from trl_marl.tasks.coding import unit_tests as code

TESTS = json.dumps([{"args": [2], "expected": 5}, {"args": [10], "expected": 21}, {"args": [0], "expected": 1}])
HELPER = "Here is the helper:\n```python\ndef double(x):\n    return 2 * x\n```"
MAIN = "```python\ndef solve(x):\n    return double(x) + 1\n```\nIt uses the helper."


@pytest.fixture(scope="module", autouse=True)
def bubblewrap():
    require_bubblewrap()


def test_code_is_taken_from_fenced_blocks_and_joined_in_agent_order():
    assert code.extract_code("text\n```python\na = 1\n```\nmore\n```\nb = 2\n```") == "a = 1\n\nb = 2"
    assert code.extract_code("x = 1") == "x = 1"
    joined = code.team_code({"helper": HELPER, "main": [{"role": "assistant", "content": MAIN}]})
    assert joined.index("def double") < joined.index("def solve")


def test_tests_cells_are_parsed_and_bad_ones_are_named():
    assert code.parse_tests(TESTS)[0] == CallTest((2,), 5)
    with pytest.raises(ValueError, match=r"tests\[1\] must be"):
        code.parse_tests([{"args": [1], "expected": 2}, {"input": [1]}])
    with pytest.raises(ValueError, match="empty"):
        code.parse_tests("[]")


def test_unit_tests_reward_from_its_entry_point_scores_joint_actions():
    reward = load_plugin("rewards", "unit_tests")
    completions = [
        {"helper": HELPER, "main": MAIN},  # cooperates: 3/3
        {"helper": "```python\ndef double(x):\n    return x + x if x else 5\n```", "main": MAIN},  # 2/3
        {"helper": "no helper", "main": MAIN},  # NameError in every call: 0
        {"helper": HELPER, "main": "```python\nimport os\nos._exit(0)\n```"},  # early exit: 0
        {"helper": HELPER, "main": "```python\ndef solve(x):\n    while True:\n        pass\n```"},  # timeout: 0
    ]
    rewards = reward(["p"] * 5, completions, entry_point=["solve"] * 5, tests=[TESTS] * 5)
    assert rewards == pytest.approx([1.0, 2 / 3, 0.0, 0.0, 0.0])


def test_trainer_uses_unit_tests_by_name_with_dataset_columns(tiny_model_dir, tmp_path, monkeypatch):
    checked = []
    sandbox = code.shared_sandbox()
    check_many = sandbox.check_many
    monkeypatch.setattr(sandbox, "check_many", lambda requests: checked.extend(requests) or check_many(requests))
    dataset = Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": "Write solve(x) = 2x + 1."}]] * 2,
            "entry_point": ["solve"] * 2,
            "tests": [TESTS] * 2,
        }
    )
    args = MAGRPOConfig(
        output_dir=str(tmp_path),
        agents=[{"name": "helper"}, {"name": "main"}],
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=8,
        max_steps=1,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        lora_r=4,
    )
    trainer = MAGRPOTrainer(tiny_model_dir, "unit_tests", args=args, train_dataset=dataset)
    trainer.train()
    assert len(checked) == 4 and all(name == "solve" and len(tests) == 3 for _, name, tests in checked)
    logged = [entry for entry in trainer.state.log_history if "rewards/unit_tests/mean" in entry]
    assert logged and logged[0]["rewards/unit_tests/mean"] == 0.0  # a random tiny model writes no working code
