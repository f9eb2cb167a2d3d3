"""Training a team with `use_vllm=True`: both algorithms, every adapter moving, TRL's importance-sampling correction
fed with vLLM's log-probs. In a module of its own so that the engine of test_vllm.py is shut down first (on the CPU
vLLM's memory share counts everything the process holds)."""

import pytest
import torch
from vllm_required import skip_without_vllm

skip_without_vllm()

from test_atgrpo_trainer import AGENTS, Notebook  # noqa: E402
from test_trainer import lora_params  # noqa: E402

from trl_marl import ATGRPOConfig, ATGRPOTrainer, MAGRPOConfig, MAGRPOTrainer  # noqa: E402
from trl_marl.generation.vllm_generation import TeamVLLMGeneration  # noqa: E402

pytestmark = pytest.mark.vllm


def train_with_vllm(trainer_class, config_class, model_dir, tmp_path, **kwargs):
    args = config_class(
        output_dir=str(tmp_path / "out"),
        agents=AGENTS,
        num_turns=1,
        use_vllm=True,
        vllm_gpu_memory_utilization=0.3,  # on the CPU, vLLM's share of the machine's memory
        vllm_max_model_length=512,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=8,
        max_steps=2,
        learning_rate=5e-3,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        seed=0,
        **kwargs,
    )
    trainer = trainer_class(model_dir, args=args, task=Notebook())  # rewards longer answers
    before = {name: lora_params(trainer.model, name) for name in ("writer", "editor")}
    trainer.train()
    return trainer, before


@pytest.mark.parametrize("trainer_class, config_class", [(MAGRPOTrainer, MAGRPOConfig), (ATGRPOTrainer, ATGRPOConfig)])
def test_a_two_agent_team_trains_with_vllm_and_logs_the_importance_sampling_correction(
    default_model_dir, tmp_path, trainer_class, config_class
):
    trainer, before = train_with_vllm(trainer_class, config_class, default_model_dir, tmp_path)
    for name in ("writer", "editor"):
        after = lora_params(trainer.model, name)
        assert any(not torch.equal(before[name][n], p) for n, p in after.items()), f"adapter {name} did not move"
    engine = trainer.vllm_generation
    assert isinstance(engine, TeamVLLMGeneration)
    assert engine.version == 1  # the step-1 rollout was served by the adapters after the first optimizer step
    for step_log in trainer.state.log_history[:2]:
        # vLLM and the trainer compute the same model in float32 here: the sampler's log-probs are the trainer's
        assert step_log["sampling/sampling_logp_difference/max"] < 1e-3
        assert step_log["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, abs=1e-3)
    engine.close()  # the next engine needs the memory of this one's KV cache


def test_an_agent_program_trains_on_the_teams_vllm_engine_with_its_log_probs(default_model_dir, tmp_path):
    """Episodes with `use_vllm=True` (docs/programs.md): the programs' calls are served by the trainer's vLLM engine
    with this step's adapters, and each recorded completion's vLLM log-probs (after temperature, as the trainer
    computes its own) feed TRL's importance-sampling correction."""
    pytest.importorskip("fastapi", reason="programs are served by the `serve` extra (FastAPI, uvicorn)")
    pytest.importorskip("openai", reason="episodes call the agents with the `openai` client")
    from datasets import Dataset

    def ask(client, agent, content, **kwargs):
        messages = [{"role": "user", "content": content}]
        return client.chat.completions.create(model=agent, messages=messages, **kwargs).choices[0].message.content

    def episode(client, row):
        draft = ask(client, "writer", row["prompt"])
        edit = ask(client, "editor", f"Edit: {draft}", logprobs=True, top_logprobs=5)
        return len(edit) / 40

    args = MAGRPOConfig(
        output_dir=str(tmp_path / "out"),
        agents=AGENTS,
        use_vllm=True,
        vllm_gpu_memory_utilization=0.3,
        vllm_max_model_length=512,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        temperature=0.7,  # vLLM's raw log-probs (before temperature) would differ from the trainer's by far more
        max_steps=2,
        learning_rate=5e-3,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        seed=0,
        episode_timeout=300,
    )
    data = Dataset.from_dict({"prompt": ["Write about rain.", "Write about owls."]})
    trainer = MAGRPOTrainer(default_model_dir, args=args, episode=episode, train_dataset=data)
    before = {name: lora_params(trainer.model, name) for name in ("writer", "editor")}
    engine = trainer.vllm_generation
    server_open_at_close, close = [], engine.close
    engine.close = lambda: (server_open_at_close.append(trainer._episode_runner is not None), close())
    trainer.train()
    for name in ("writer", "editor"):
        after = lora_params(trainer.model, name)
        assert any(not torch.equal(before[name][n], p) for n, p in after.items()), f"adapter {name} did not move"
    assert engine.version == 1  # the second batch's episodes were served by the adapters of step 1
    # the episode server's thread let go of the vLLM engine before `train()` closed it, so its memory is freed
    assert server_open_at_close == [False] and engine.llm is None
    for step_log in trainer.state.log_history[:2]:
        assert step_log["episodes/calls_mean"] == 2.0 and step_log["episodes/failed"] == 0.0
        assert step_log["sampling/sampling_logp_difference/max"] < 1e-3
        assert step_log["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, abs=1e-3)


def test_the_tool_loops_rounds_are_generated_by_vllm_through_each_agents_adapter(default_model_dir, tmp_path):
    """Tools with `use_vllm=True` (docs/training.md, "Tools and environments"): every first answer is read as a call
    to `add` (SmolLM2-135M writes none by itself), its result appended, and the row's second round generated by the
    vLLM engine through its agent's LoRA; vLLM's log-probs of both rounds are the trainer's, the tool result's tokens
    left out of the ratio."""
    from test_tools import add, calls_add_once, tool_tokenizer

    args = MAGRPOConfig(
        output_dir=str(tmp_path / "out"),
        agents=AGENTS,
        use_vllm=True,
        vllm_gpu_memory_utilization=0.3,
        vllm_max_model_length=1024,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=64,
        generation_kwargs={"max_tokens": 6},  # 6 tokens a round: room for the tool result and a second round
        max_steps=2,
        learning_rate=5e-3,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        seed=0,
    )
    tokenizer = tool_tokenizer(default_model_dir)
    trainer = MAGRPOTrainer(default_model_dir, args=args, task=Notebook(), processing_class=tokenizer, tools=[add])
    trainer.team_generation.tool_calling.parse = calls_add_once(tokenizer)
    engine = trainer.vllm_generation
    calls, generate = [], engine.generate
    engine.generate = lambda *a, **k: calls.append(1) or generate(*a, **k)
    before = {name: lora_params(trainer.model, name) for name in ("writer", "editor")}
    trainer.train()
    for name in ("writer", "editor"):
        after = lora_params(trainer.model, name)
        assert any(not torch.equal(before[name][n], p) for n, p in after.items()), f"adapter {name} did not move"
    assert len(calls) == 4  # 2 rollouts of 2 rounds, each round one call for both agents' rows
    for step_log in trainer.state.log_history[:2]:
        assert step_log["tools/call_frequency"] == 1.0
        assert step_log["sampling/sampling_logp_difference/max"] < 1e-3
        assert step_log["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, abs=1e-3)
    engine.close()
