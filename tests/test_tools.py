"""Tools in the built-in rollouts (`tools=`, `environment_factory=`, docs/training.md "Tools"): TRL's tool loop for a
team, each agent with its own tools, one environment per episode shared by its agents, and every fork of an episode
(a MAGRPO tree's joint actions, AT-GRPO's candidates) on its own copy."""

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from trl_marl import MAGRPOConfig, MAGRPOTrainer
from trl_marl.tool_templates import CHATML_TOOLS, prepare_response_parsing, tool_chat_template

PROMPTS = ["Add 2 and 3.", "Add 4 and 4.", "Add 1 and 6.", "Add 5 and 2."]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def tool_tokenizer(model_dir):
    """The default model's tokenizer made to render tools (ChatML with Hermes calls) and parse them back."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = tool_chat_template(tokenizer, CHATML_TOOLS)
    prepare_response_parsing(tokenizer, CHATML_TOOLS)
    return tokenizer


def scripted(tokenizer):
    """Completions as a function of the prompt and the row's place in the call, for both trainers alike: a prompt
    without a tool result calls `add` on every other row and answers on the others; an answer's length varies."""
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    call = tokenizer(CALL, add_special_tokens=False)["input_ids"] + [eos]

    def generate(prompt_ids, *args, **kwargs):
        completions = []
        for row, ids in enumerate(prompt_ids):
            after_tool = "<tool_response>" in tokenizer.decode(ids)
            if not after_tool and (sum(ids) + row) % 2 == 0:
                completions.append(list(call))
            else:
                words = " ok" * (1 + (len(ids) + row) % 4)
                completions.append(tokenizer(f"The sum is{words}.", add_special_tokens=False)["input_ids"] + [eos])
        return completions, None

    return generate


def final_answer_reward(prompts, completions, **kwargs):  # TRL's: the last message of each completion
    return [len(completion[-1]["content"]) / 10.0 for completion in completions]


def team_answer_reward(prompts, completions, **kwargs):
    return [len(completion["solo"]) / 10.0 for completion in completions]


def run(trainer_cls, config_cls, model_dir, reward, output_dir, **extra):
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS]})
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    args = config_cls(
        output_dir=str(output_dir), per_device_train_batch_size=4, num_generations=4, gradient_accumulation_steps=2,
        max_completion_length=64, max_steps=2, learning_rate=5e-2, loss_type="dapo", seed=11, logging_steps=1,
        report_to="none", save_strategy="no", use_cpu=True, bf16=False, **extra,
    )  # fmt: skip
    tokenizer = tool_tokenizer(model_dir)
    trainer = trainer_cls(
        model_dir, reward, args=args, train_dataset=dataset, peft_config=lora, processing_class=tokenizer, tools=[add]
    )
    trainer._generate_single_turn = scripted(tokenizer)
    masks = []
    compute_loss = trainer._compute_loss

    def keeping_masks(model, inputs):
        masks.append(inputs["tool_mask"][inputs["completion_mask"].bool()].tolist())
        return compute_loss(model, inputs)

    trainer._compute_loss = keeping_masks
    initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}
    trainer.train()
    final = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return initial, final, logs, masks


def test_one_agent_with_tools_trains_exactly_as_grpo_trainer_with_the_same_tools(tiny_model_dir, tmp_path):
    trl = run(GRPOTrainer, GRPOConfig, tiny_model_dir, final_answer_reward, tmp_path / "trl")
    marl = run(MAGRPOTrainer, MAGRPOConfig, tiny_model_dir, team_answer_reward, tmp_path / "marl", agents=["solo"])
    (trl_initial, trl_final, trl_logs, trl_masks), (_, marl_final, marl_logs, marl_masks) = trl, marl
    assert sorted(sum(trl_masks, [])) != sorted(sum(trl_masks, [1]))  # some tokens were masked: tool results
    assert sorted(sum(marl_masks, [])) == sorted(sum(trl_masks, []))  # the same masked tokens, row order aside
    for key in ("loss", "reward", "tools/call_frequency", "tools/failure_frequency"):
        assert [entry[key] for entry in marl_logs] == pytest.approx([entry[key] for entry in trl_logs], abs=1e-6), key
    assert trl_logs[0]["tools/call_frequency"] > 0
    as_trl = {name.replace(".solo.", ".default."): value for name, value in marl_final.items()}
    moved = max((trl_final[n] - trl_initial[n]).abs().max().item() for n in trl_final)
    assert moved > 1e-3
    for name in trl_final:
        torch.testing.assert_close(as_trl[name], trl_final[name], rtol=0, atol=1e-6)
