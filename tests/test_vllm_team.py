"""A saved team generating through vLLM outside training: `load_team(..., use_vllm=True).run`, `evaluate_task` and
`trl-marl evaluate --use_vllm` take the same backend as the trainer. Needs vLLM (see test_vllm.py); in a module of its
own so that the engines of test_vllm.py are shut down first."""

import json
import os
import subprocess
import sys

import pytest
import torch
from vllm_required import skip_without_vllm

skip_without_vllm()

from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from trl_marl import load_team  # noqa: E402
from trl_marl.cli.evaluation import evaluate_task  # noqa: E402
from trl_marl.generation.vllm_serving import SavedTeamEngine  # noqa: E402
from trl_marl.tasks import resolve_task  # noqa: E402
from trl_marl.team.saved import TEAM_FORMAT, write_team_file  # noqa: E402

pytestmark = pytest.mark.vllm

VLLM = {"use_vllm": True, "vllm_gpu_memory_utilization": 0.3, "vllm_max_model_length": 512}


@pytest.fixture(scope="module")
def saved_team(default_model_dir, tmp_path_factory):
    """The explain task's two agents, each with its own randomly initialised adapter, saved as `save_model` does, to
    play two turns."""
    folder = tmp_path_factory.mktemp("team")
    base = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")
    agents = resolve_task("explain").agents
    names = [agent["name"] for agent in agents]
    torch.manual_seed(1)  # LoRA A is drawn when an adapter is added, LoRA B below: the same adapters every run
    model = get_peft_model(base, config, adapter_name=names[0])
    model.add_adapter(names[1], config)
    for name, parameter in model.named_parameters():
        if "lora_B" in name:  # fresh LoRA B is zero: the adapters would be the base
            torch.nn.init.normal_(parameter, std=0.03)
    for name in names:
        model.save_pretrained(folder, selected_adapters=[name])
    AutoTokenizer.from_pretrained(default_model_dir).save_pretrained(folder)
    spec = {
        "format": TEAM_FORMAT,
        "algorithm": "MAGRPO",
        "base_model": default_model_dir,
        "agents": [{**agent, "adapter": agent["name"]} for agent in agents],
        "adapter_mode": "per_agent",
        "num_turns": 2,
        "joint_mode": "aligned",
        "discount": 1.0,
        "termination_threshold": None,
        "task": None,
        "transition": "trl_marl.rollout:default_transition",
        "scheduler": "parallel",
        "max_completion_length": 10,
        "chat_template_kwargs": {},
    }
    write_team_file(folder, spec)
    return folder


QUESTIONS = ["What is 3 plus 4?", "Name a planet."]


def test_a_loaded_team_plays_the_same_greedy_episodes_through_vllm_as_through_generate(saved_team):
    routed = load_team(saved_team, dtype=torch.float32)
    served = load_team(saved_team, dtype=torch.float32, **VLLM)
    try:
        assert isinstance(served.engine, SavedTeamEngine)
        assert served.engine.llm.llm_engine.vllm_config.model_config.dtype == torch.float32
        assert set(served.engine.lora_requests) == {"concise", "detailed"}
        for question in QUESTIONS:
            expected = routed.run([{"role": "user", "content": question}])
            run = served.run([{"role": "user", "content": question}])
            assert len(run.turns) == 2  # the second turn's prompts hold the first turn's answers
            assert run.turns == expected.turns
            assert run.observations == expected.observations
            assert run.turns[0]["concise"] != run.turns[0]["detailed"]  # each row served by its own adapter
    finally:
        served.close()
    assert served.engine is None


def test_evaluate_task_and_the_cli_generate_through_vllm(saved_team, default_model_dir):
    metrics = evaluate_task("explain", team=saved_team, limit=2, max_completion_length=8, use_cpu=True, **VLLM)
    assert 0.0 <= metrics["reward"] <= 1.0
    # vLLM sampled the rows, the model scored them: TRL's sampling metrics exist only on that path
    assert metrics["sampling/sampling_logp_difference/max"] < 1e-3

    distributed = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # TRL's engine set them here
    env = {key: value for key, value in os.environ.items() if key not in distributed}
    env.update(HF_HUB_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    command = [sys.executable, "-m", "trl_marl.cli", "evaluate", "explain", "--team", str(saved_team), "--limit", "2"]
    command += ["--max_completion_length", "8", "--use_vllm", "--vllm_max_model_length", "512"]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    printed = json.loads(result.stdout[result.stdout.index('{\n  "task"') :])  # after vLLM's own log lines
    assert printed["baseline"] == "team" and 0.0 <= printed["reward"] <= 1.0
    assert "sampling/sampling_logp_difference/max" in printed
