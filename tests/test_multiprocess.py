"""Two processes (torchrun, gloo on the CPU): prompt groups span processes and the rollout still lines up."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "two_process_train.py"


@pytest.mark.parametrize(("joint_mode", "per_call"), [("aligned", 2), ("cross", 2 * 4)])
def test_two_processes_train_with_groups_spanning_them(tiny_model_dir, tmp_path, joint_mode, per_call):
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    if torchrun is None:
        pytest.skip("torchrun is not installed next to this Python")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    command = [torchrun, "--nproc_per_node", "2", str(SCRIPT), tiny_model_dir, joint_mode, str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = [json.loads(line[len("REPORT ") :]) for line in result.stdout.splitlines() if line.startswith("REPORT ")]
    assert sorted(r["rank"] for r in reports) == [0, 1] and all(r["world"] == 2 for r in reports)
    for report in reports:
        # Each process scores the joint actions of its own 2 prompt copies: 2 aligned, 2 x G^(N-1) = 8 cross,
        # the latter built from completions gathered from both processes.
        assert report["joint_actions_per_call"] == [per_call, per_call]
