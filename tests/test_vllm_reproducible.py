"""Training with `use_vllm=True` is reproducible: each vLLM request samples with its own seed, made from `seed`, the
step, the call, the process and the row, so two runs with one seed sample the same tokens and a resumed run samples
(and trains) as the uninterrupted one. The trainer closes its engine when `train()` returns, so a saved team then loads
with vLLM in the same process, and `evaluate()` starts the engine again. `load_team(..., use_vllm=True)` takes the
trainer's memory share by default and names `vllm_gpu_memory_utilization` when vLLM cannot start for memory. Needs
vLLM (see test_vllm.py); in a module of its own so that the engines of test_vllm.py are shut down first."""

import shutil
from dataclasses import dataclass, field
from unittest import mock

import pytest
import torch
from vllm_required import skip_without_vllm

skip_without_vllm()

from datasets import Dataset  # noqa: E402
from test_atgrpo_trainer import AGENTS  # noqa: E402
from test_trainer import lora_params  # noqa: E402
from tiny_run import TINY_RUN  # noqa: E402

from trl_marl import MAGRPOConfig, MAGRPOTrainer, load_team  # noqa: E402
from trl_marl.generation.vllm_serving import register_open_engine, unregister_open_engine  # noqa: E402

pytestmark = pytest.mark.vllm

# One prompt, four times: which rows a step draws cannot depend on the seed, only what vLLM samples for them can.
DATASET = Dataset.from_dict({"prompt": [[{"role": "user", "content": "Write about rain."}]] * 4})


def length_reward(prompts, completions, **kwargs):
    return [len(c["writer"]) / 10 + len(c["editor"]) / 20 for c in completions]


@dataclass
class Run:
    trainer: MAGRPOTrainer
    calls: list = field(default_factory=list)  # (global step, completion ids) of each vLLM call, in order

    def at_step(self, step: int) -> list:
        return [completions for at, completions in self.calls if at == step]


def train(model_dir, output_dir, seed, max_steps, resume_from_checkpoint=None, close=True, save=True) -> Run:
    """A 2-agent, 2-turn MAGRPO run (two vLLM calls a step: the tree's turns), a checkpoint every step if `save`."""
    args = MAGRPOConfig(
        **{**TINY_RUN, "save_strategy": "steps" if save else "no"},
        save_steps=1,
        output_dir=str(output_dir),
        agents=AGENTS,
        num_turns=2,
        use_vllm=True,
        vllm_gpu_memory_utilization=0.3,  # on the CPU, vLLM's share of the machine's memory
        vllm_max_model_length=512,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        num_generations=2,
        max_completion_length=6,
        max_steps=max_steps,
        bf16=False,
        seed=seed,
    )
    trainer = MAGRPOTrainer(
        model_dir, length_reward, args=args, train_dataset=DATASET, eval_dataset=DATASET.select([0])
    )
    run = Run(trainer)
    generate = trainer.vllm_generation.generate

    def recorded(*args, **kwargs):
        output = generate(*args, **kwargs)
        run.calls.append((trainer.state.global_step, [list(ids) for ids in output[1]]))
        return output

    trainer.vllm_generation.generate = recorded
    try:
        trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    finally:
        if close:  # the trainer closes it itself; closing here keeps the next test's engine free on older code too
            trainer.vllm_generation.close()
    return run


@pytest.fixture(scope="module")
def uninterrupted(default_model_dir, tmp_path_factory):
    """Seed 0, two steps, checkpoints after each; the engine is left as `train()` leaves it."""
    run = train(default_model_dir, tmp_path_factory.mktemp("uninterrupted"), seed=0, max_steps=2, close=False)
    run.adapters = {agent["name"]: lora_params(run.trainer.model, agent["name"]) for agent in AGENTS}
    return run


def test_training_closes_its_engine_so_a_saved_team_then_loads_with_vllm_and_evaluate_starts_it_again(uninterrupted):
    trainer = uninterrupted.trainer
    team = None
    try:
        assert trainer.vllm_generation.llm is None  # closed when train() returned: its memory is free
        # no vllm_gpu_memory_utilization: the trainer's default share, not vLLM's 0.92 of the machine
        team = load_team(f"{trainer.args.output_dir}/checkpoint-2", dtype=torch.float32, use_vllm=True)
        assert team.engine.llm.llm_engine.vllm_config.cache_config.gpu_memory_utilization == 0.3
        runs = []
        for _ in range(2):
            torch.manual_seed(0)  # sampling follows torch's generator, as `generate` does
            runs.append(team.run("Say something.", do_sample=True, max_new_tokens=8).turns)
        assert runs[0] == runs[1]
        team.close()
        metrics = trainer.evaluate()  # starts the trainer's engine again and sends it the adapters
        assert trainer.vllm_generation.llm is not None
        assert metrics["eval_sampling/sampling_logp_difference/max"] < 1e-3
    finally:
        if team is not None:
            team.close()
        trainer.vllm_generation.close()


def test_two_runs_with_one_seed_sample_the_same_tokens_and_another_seed_other_tokens(
    uninterrupted, default_model_dir, tmp_path
):
    first_step = uninterrupted.at_step(0)
    assert len(first_step) == 2  # the tree's two turns
    same = train(default_model_dir, tmp_path / "same", seed=0, max_steps=1, save=False)
    assert same.at_step(0) == first_step
    other = train(default_model_dir, tmp_path / "other", seed=1, max_steps=1, save=False)
    # the same prompt and, before any step, the same (base) model: only the seed differs
    assert other.at_step(0)[0] != first_step[0]


def test_a_run_resumed_from_a_checkpoint_samples_and_trains_as_the_uninterrupted_one(
    uninterrupted, default_model_dir, tmp_path
):
    shutil.copytree(f"{uninterrupted.trainer.args.output_dir}/checkpoint-1", tmp_path / "checkpoint-1")
    resumed = train(default_model_dir, tmp_path, seed=0, max_steps=2, resume_from_checkpoint=tmp_path / "checkpoint-1")
    assert [step for step, _ in resumed.calls] == [1, 1]  # step 2 only, its two turns
    assert resumed.at_step(1) == uninterrupted.at_step(1)
    for agent in AGENTS:
        after = lora_params(resumed.trainer.model, agent["name"])
        for name, value in uninterrupted.adapters[agent["name"]].items():
            assert torch.equal(after[name], value), name
    logged = [log["loss"] for log in uninterrupted.trainer.state.log_history if "loss" in log]
    assert [log["loss"] for log in resumed.trainer.state.log_history if "loss" in log] == logged  # step 1 restored


def test_a_vllm_start_short_of_memory_names_vllm_gpu_memory_utilization(uninterrupted):
    folder = f"{uninterrupted.trainer.args.output_dir}/checkpoint-2"
    # vLLM's own error: on the CPU its pool (99 % of the machine's memory) is more than is free
    with pytest.raises(ValueError, match=r"vllm_gpu_memory_utilization` = 0.99.*load_team\(\.\.\., vllm_gpu_m.*said"):
        load_team(folder, use_vllm=True, vllm_gpu_memory_utilization=0.99)


def test_a_vllm_start_beside_another_open_engine_names_the_call_that_closes_it(uninterrupted):
    class TrainerEngine:  # stands for a trainer's engine left open in this process
        close_call = "trainer.vllm_generation.close()"

    other = TrainerEngine()
    register_open_engine(other)
    error = ValueError("Available memory on node 0 (7.44/11.21 GiB) on startup is less than desired CPU memory ...")
    try:
        with (
            mock.patch("vllm.LLM", side_effect=error),
            pytest.raises(ValueError, match=r"another vLLM engine.*`trainer\.vllm_generation\.close\(\)`.*node 0"),
        ):
            load_team(f"{uninterrupted.trainer.args.output_dir}/checkpoint-2", use_vllm=True)
    finally:
        unregister_open_engine(other)
