"""Checkpoints and resume: a resumed run equals the uninterrupted one, a crash never leaves an unusable latest
checkpoint, and a process killed while saving resumes from the last complete checkpoint."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback

from trl_marl import MAGRPOConfig, MAGRPOTrainer, load_team
from trl_marl.trainers.checkpoints import COMPLETE_MARKER, last_complete_checkpoint

SCRIPT = Path(__file__).parent / "scripts" / "train_until_killed.py"
PROMPTS = ["Name a colour.", "Name a fruit.", "Count to three.", "Say hello.", "Name a tree.", "Name a city."]


def team_reward(prompts, completions, **kwargs):
    """Varied enough that every group has non-zero advantages: the detailed answer's length over the concise one's."""
    return [len(c["detailed"]) / (1 + len(c["concise"])) for c in completions]


def make_trainer(model_dir, output_dir, **overrides):
    settings = dict(
        output_dir=str(output_dir),
        agents=[{"name": "concise", "system_prompt": "Be brief."}, {"name": "detailed", "system_prompt": "Explain."}],
        num_generations=2,
        per_device_train_batch_size=2,
        steps_per_generation=2,  # one generation serves two optimizer steps: resuming at an odd step is mid-buffer
        max_completion_length=6,
        learning_rate=5e-2,
        lr_scheduler_type="linear",
        max_steps=6,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        seed=3,
    )
    dataset_size = overrides.pop("dataset_size", len(PROMPTS))
    quantization_config = overrides.pop("quantization_config", None)
    settings.update(overrides)
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS[:dataset_size]]})
    return MAGRPOTrainer(
        model_dir,
        team_reward,
        args=MAGRPOConfig(**settings),
        train_dataset=dataset,
        quantization_config=quantization_config,
    )


class StopAt(TrainerCallback):
    """Stops training after `step` (a checkpoint saved at that step is written first)."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def adapters(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}


def logged_after(trainer, step):
    """{(step, key): value} of the logged loss and team reward after `step`."""
    return logged_after_history(trainer.state.log_history, step)


def logged_after_history(log_history, step):
    return {
        (log["step"], key): log[key]
        for log in log_history
        for key in ("loss", "reward")
        if key in log and log["step"] > step
    }


def test_stopping_and_resuming_equals_the_uninterrupted_run(tiny_model_dir, tmp_path):
    uninterrupted = make_trainer(tiny_model_dir, tmp_path / "a")
    uninterrupted.train()

    first = make_trainer(tiny_model_dir, tmp_path / "b", save_strategy="steps", save_steps=3)
    first.add_callback(StopAt(3))
    first.train()
    assert first.state.global_step == 3 and (tmp_path / "b" / "checkpoint-3" / COMPLETE_MARKER).is_file()
    resumed = make_trainer(tiny_model_dir, tmp_path / "b")
    resumed.train(resume_from_checkpoint=True)

    assert resumed.state.global_step == 6
    expected, final = adapters(uninterrupted), adapters(resumed)
    assert (
        expected.keys() == final.keys()
        and any(".concise." in n for n in final)
        and any(".detailed." in n for n in final)
    )
    for name in expected:
        torch.testing.assert_close(final[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)
    # What was logged after resuming is what the uninterrupted run logged: the loss of step 4 (trained on completions
    # generated at step 3, restored from the checkpoint's generation buffer) and of steps 5-6, and the team reward of
    # the generation at step 5.
    after, expected_logs = logged_after(resumed, 3), logged_after(uninterrupted, 3)
    assert sorted(after) == [(4, "loss"), (5, "loss"), (5, "reward"), (6, "loss")]
    assert after == pytest.approx(expected_logs, rel=1e-5, abs=1e-7)


def test_load_best_model_at_end_loads_every_agents_adapter_from_the_best_checkpoint(tiny_model_dir, tmp_path):
    """The team's eval reward is made best at step 1 (it falls with the step), so the best checkpoint is not the last
    one; every agent's adapter must come back from it, and `save_model` must write those adapters."""
    from safetensors.torch import load_file

    def falling_eval_reward(prompts, completions, split, trainer_state, **kwargs):
        if split[0] == "eval":
            return [1.0 / (1 + trainer_state.global_step)] * len(completions)
        return team_reward(prompts, completions)

    settings = dict(
        output_dir=str(tmp_path),
        agents=[{"name": "concise"}, {"name": "detailed"}],
        num_generations=2,
        num_generations_eval=2,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        max_completion_length=4,
        learning_rate=5e-2,
        max_steps=3,
        eval_strategy="steps",
        eval_steps=1,
        save_strategy="steps",
        save_steps=1,
        load_best_model_at_end=True,
        metric_for_best_model="reward",
        report_to="none",
        use_cpu=True,
        seed=3,
    )
    prompts = [[{"role": "user", "content": p}] for p in PROMPTS]
    trainer = MAGRPOTrainer(
        tiny_model_dir,
        falling_eval_reward,
        args=MAGRPOConfig(**settings),
        train_dataset=Dataset.from_dict({"prompt": prompts, "split": ["train"] * len(prompts)}),
        eval_dataset=Dataset.from_dict({"prompt": prompts[:1], "split": ["eval"]}),
    )
    trainer.train()
    assert trainer.state.best_model_checkpoint == str(tmp_path / "checkpoint-1")

    def saved(folder, agent):
        return load_file(folder / agent / "adapter_model.safetensors")

    model = dict(trainer.model.named_parameters())
    for agent in ("concise", "detailed"):
        best, last = saved(tmp_path / "checkpoint-1", agent), saved(tmp_path / "checkpoint-3", agent)
        assert any(not torch.equal(best[key], last[key]) for key in best), f"{agent} did not train after step 1"
        for key, value in best.items():
            name = key.replace(".weight", f".{agent}.weight")
            torch.testing.assert_close(model[name].detach(), value, rtol=0, atol=0, msg=name)
            assert model[name].requires_grad, name
    trainer.save_model()
    for agent in ("concise", "detailed"):
        best, written = saved(tmp_path / "checkpoint-1", agent), saved(tmp_path, agent)
        assert all(torch.equal(best[key], written[key]) for key in best), f"save_model wrote {agent}'s last adapter"


@pytest.fixture(scope="module")
def three_epochs(tiny_model_dir, tmp_path_factory):
    """An uninterrupted run over 3 epochs of 4 prompts: 2 prompts per generation, each generation serving 2 steps, so
    an epoch is 4 steps (boundaries after steps 4 and 8)."""
    settings = dict(max_steps=12, dataset_size=4)
    trainer = make_trainer(tiny_model_dir, tmp_path_factory.mktemp("uninterrupted"), **settings)
    trainer.train()
    assert trainer.state.epoch == 3.0
    return settings, adapters(trainer), trainer.state.log_history


@pytest.mark.parametrize(
    "stop", [3, 4, 6, 8], ids=["mid-epoch-0", "at-first-boundary", "mid-epoch-1", "at-second-boundary"]
)
def test_resuming_before_at_and_after_an_epoch_boundary_equals_the_uninterrupted_run(
    tiny_model_dir, tmp_path, three_epochs, stop
):
    settings, expected, expected_log = three_epochs
    first = make_trainer(tiny_model_dir, tmp_path, save_strategy="steps", save_steps=stop, **settings)
    first.add_callback(StopAt(stop))
    first.train()
    resumed = make_trainer(tiny_model_dir, tmp_path, **settings)
    resumed.train(resume_from_checkpoint=True)

    assert resumed.state.global_step == 12
    final = adapters(resumed)
    for name in expected:
        torch.testing.assert_close(final[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)
    after = logged_after(resumed, stop)
    assert after == pytest.approx(logged_after_history(expected_log, stop), rel=1e-5, abs=1e-7)


def test_resume_true_takes_the_latest_complete_checkpoint_and_an_incomplete_one_is_refused(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path, max_steps=2, save_strategy="steps", save_steps=1)
    trainer.train()
    # what a process killed while writing checkpoint-3 leaves: weights written, no completion marker
    partial = tmp_path / "checkpoint-3"
    partial.mkdir()
    (partial / "trainer_state.json").write_text("{")
    assert last_complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-2")

    with pytest.raises(ValueError, match=r"checkpoint-3 is not a complete trl_marl checkpoint.*checkpoint-2"):
        make_trainer(tiny_model_dir, tmp_path, max_steps=3).train(resume_from_checkpoint=str(partial))
    resumed = make_trainer(tiny_model_dir, tmp_path, max_steps=3)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 3


def test_resume_true_without_a_complete_checkpoint_says_so(tiny_model_dir, tmp_path):
    (tmp_path / "checkpoint-1").mkdir()
    with pytest.raises(ValueError, match="holds no complete checkpoint"):
        make_trainer(tiny_model_dir, tmp_path).train(resume_from_checkpoint=True)


def test_save_total_limit_rotates_only_after_the_new_checkpoint_is_complete(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path, max_steps=3, save_strategy="steps", save_steps=1,
                           save_total_limit=1)  # fmt: skip
    trainer.train()
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-3"]
    marker = json.loads((tmp_path / "checkpoint-3" / COMPLETE_MARKER).read_text())
    assert marker == {"global_step": 3, "num_processes": 1}


def run_script(model_dir, output_dir, *flags):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    command = [sys.executable, str(SCRIPT), model_dir, str(output_dir), *flags]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.slow
def test_a_process_killed_while_saving_resumes_from_the_last_complete_checkpoint(tiny_model_dir, tmp_path):
    killed = run_script(tiny_model_dir, tmp_path, "--kill_while_saving", "3")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    # checkpoint-3 was being written (its weights are there, its optimizer state is not); checkpoint-2 is intact
    assert (tmp_path / "checkpoint-3" / "concise" / "adapter_model.safetensors").is_file()
    assert not (tmp_path / "checkpoint-3" / COMPLETE_MARKER).exists()
    assert last_complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-2")

    resumed = run_script(tiny_model_dir, tmp_path, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    report = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert report == {"resumed_from": str(tmp_path / "checkpoint-2"), "global_step": 5}
    assert last_complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-5")
    # the checkpoint it resumed from still loads as a team
    team = load_team(tmp_path / "checkpoint-2")
    assert [agent["name"] for agent in team.spec["agents"]] == ["concise", "detailed"]
