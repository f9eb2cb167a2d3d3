"""Two processes (torchrun, gloo on the CPU): prompt groups span processes, the rollout still lines up, and the
advantages and the trained adapters are those of one process with the same global batch."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parent / "scripts" / "two_process_train.py"


def train_on_two_processes(model_dir, output_dir, joint_mode, num_turns):
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    if torchrun is None:
        pytest.skip("torchrun is not installed next to this Python")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    command = [torchrun, "--nproc_per_node", "2", str(SCRIPT), model_dir, joint_mode, str(output_dir), str(num_turns)]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = [json.loads(path.read_text()) for path in Path(output_dir).glob("report-*.json")]
    assert sorted(r["rank"] for r in reports) == [0, 1] and all(r["world"] == 2 for r in reports)
    return sorted(reports, key=lambda report: report["rank"])


@pytest.mark.slow
@pytest.mark.parametrize(("joint_mode", "per_call"), [("aligned", 2), ("cross", 2 * 4)])
def test_two_processes_train_with_groups_spanning_them(tiny_model_dir, tmp_path, joint_mode, per_call):
    for report in train_on_two_processes(tiny_model_dir, tmp_path, joint_mode, num_turns=1):
        # Each process scores the joint actions of its own 2 prompt copies: 2 aligned, 2 x G^(N-1) = 8 cross,
        # the latter built from completions gathered from both processes.
        assert report["joint_actions_per_call"] == [per_call, per_call]


@pytest.mark.slow
def test_two_processes_train_trees_of_different_sizes(tiny_model_dir, tmp_path):
    rank0, rank1 = train_on_two_processes(tiny_model_dir, tmp_path, "aligned", num_turns=2)
    # Per step: process 0 scores its 2 root joint actions, then 2 child nodes of G=4; process 1 stops after the root.
    assert rank0["joint_actions_per_call"] == [2, 8, 2, 8]
    assert rank1["joint_actions_per_call"] == [2, 2]
    # [tree rows, rows with padding]: 2 copies x 2 agents at the root, plus 8 x 2 in the children on process 0;
    # process 1 pads its 4 rows to process 0's 20, so TRL's loss gathers equal row counts.
    assert rank0["generated_rows"] == [[20, 20], [20, 20]]
    assert rank1["generated_rows"] == [[4, 20], [4, 20]]
    for report in (rank0, rank1):
        assert report["trained_rows"] == report["generated_rows"]  # one micro-batch per generation


def test_a_process_holding_no_tool_row_joins_the_token_count_of_one_that_does(tiny_model_dir, tmp_path):
    """A round-robin team's tool agent acts at the second turn, which only process 0's episodes reach: process 1 holds
    no row of an agent with tools, yet both join the count of loss tokens (tool results left out) that `dapo` divides
    by, and it is the sum of both processes' (process 1 once skipped the collective: mismatched, the run failed)."""
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    if torchrun is None:
        pytest.skip("torchrun is not installed next to this Python")
    script = Path(__file__).parent / "scripts" / "two_process_tools.py"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    command = [torchrun, "--nproc_per_node", "2", str(script), tiny_model_dir, str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rank0, rank1 = (json.loads((tmp_path / f"report-{r}.json").read_text())["steps"] for r in (0, 1))
    assert len(rank0) == len(rank1) == 2
    for mine, theirs in zip(rank0, rank1):
        assert mine["tool_rows"] > 0 and theirs["tool_rows"] == 0
        total = mine["loss_tokens"] + theirs["loss_tokens"]
        assert mine["num_items_in_batch"] == theirs["num_items_in_batch"] == total


def test_two_processes_compute_the_advantages_of_one_process_and_end_with_identical_adapters(tiny_model_dir, tmp_path):
    script = Path(__file__).parent / "scripts" / "equivalence_train.py"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    single = subprocess.run([sys.executable, str(script), tiny_model_dir, str(tmp_path / "one")], capture_output=True,
                            text=True, env=env, timeout=600)  # fmt: skip
    assert single.returncode == 0, single.stderr[-3000:]
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    two = subprocess.run([torchrun, "--nproc_per_node", "2", str(script), tiny_model_dir, str(tmp_path / "two")],
                         capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert two.returncode == 0, two.stderr[-3000:]

    expected = json.loads((tmp_path / "one" / "report-0.json").read_text())["advantages"]
    rank0, rank1 = (json.loads((tmp_path / "two" / f"report-{r}.json").read_text()) for r in (0, 1))
    assert rank0["world"] == rank1["world"] == 2
    # Each process computed advantages for its own rows only; together they are the single process's, row by row.
    assert rank0["advantages"].keys().isdisjoint(rank1["advantages"])
    assert {**rank0["advantages"], **rank1["advantages"]} == pytest.approx(expected, abs=1e-5)
    assert len(expected) == 3 * 8 * 2 and sum(abs(a) > 0.1 for a in expected.values()) > len(expected) // 2
    # DDP keeps the processes' adapters identical, and they equal the single process's up to summation order.
    one = torch.load(tmp_path / "one" / "adapters-0.pt")
    first, second = (torch.load(tmp_path / "two" / f"adapters-{r}.pt") for r in (0, 1))
    assert first.keys() == second.keys() == one.keys()
    for name in one:
        assert torch.equal(first[name], second[name]), name
        torch.testing.assert_close(first[name], one[name], rtol=1e-5, atol=1e-6, msg=name)
    assert any(not torch.equal(one[name], torch.zeros_like(one[name])) for name in one if "lora_B" in name)


@pytest.mark.slow
def test_two_processes_resumed_mid_epoch_in_the_second_epoch_equal_the_uninterrupted_run(tiny_model_dir, tmp_path):
    """4 prompts, 2 per step: an epoch is 2 steps. Stopped at step 3 (epoch 1.5) and resumed, the two processes must
    see epoch 1's shuffle, not epoch 0's: accelerate's `set_epoch` does not reach the sampler of a data loader rebuilt
    to skip the batches already trained when it is sharded over processes."""
    script = Path(__file__).parent / "scripts" / "equivalence_train.py"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))

    def run(output_dir, *flags):
        command = [torchrun, "--nproc_per_node", "2", str(script), tiny_model_dir, str(output_dir)]
        result = subprocess.run([*command, "--dataset_size", "4", "--max_steps", "4", *flags], capture_output=True,
                                text=True, env=env, timeout=600)  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        return [json.loads((output_dir / f"report-{r}.json").read_text()) for r in (0, 1)]

    uninterrupted = run(tmp_path / "a")
    run(tmp_path / "b", "--stop_at", "3")
    resumed = run(tmp_path / "b", "--resume")
    for rank in (0, 1):
        expected_prompts = uninterrupted[rank]["step_prompts"]
        assert set(expected_prompts["2"]) != set(expected_prompts["0"]), "epoch 1 should be shuffled otherwise"
        assert resumed[rank]["step_prompts"] == {"3": expected_prompts["3"]}
        expected, final = (torch.load(folder / f"adapters-{rank}.pt") for folder in (tmp_path / "a", tmp_path / "b"))
        for name in expected:
            torch.testing.assert_close(final[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize(("config", "kind"), [("multi_gpu.yaml", "MULTI_GPU"), ("deepspeed_zero2.yaml", "DEEPSPEED")])
def test_the_documented_accelerate_configs_are_valid(config, kind):
    from accelerate.commands.config.config_args import load_config_from_file

    loaded = load_config_from_file(str(Path(__file__).resolve().parents[1] / "recipes" / "accelerate" / config))
    assert loaded.distributed_type.value == kind and loaded.num_processes == 2 and loaded.mixed_precision == "bf16"
    assert kind != "DEEPSPEED" or loaded.deepspeed_config["zero_stage"] == 2
