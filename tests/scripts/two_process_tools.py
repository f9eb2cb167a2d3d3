"""Trained by tests/test_multiprocess.py under `torchrun --nproc_per_node 2`: a round-robin team whose second agent,
the only one with a tool, acts at the second turn, which only process 0's episodes reach: process 1 holds no row of
an agent with tools."""

import json
import os
import sys

import torch
from datasets import Dataset
from transformers import AutoTokenizer

from trl_marl import MAGRPOConfig, MAGRPOTrainer, NextTurn
from trl_marl.generation.tool_templates import CHATML_TOOLS, prepare_response_parsing, tool_chat_template


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def answer_length(prompts, completions, **kwargs):
    return [len(completion["writer"]) / 10.0 + len(completion["caller"]) / 20.0 for completion in completions]


def rank_zero_continues(prompt, joint_action, history, turn, **kwargs):
    if os.environ["RANK"] != "0":
        return NextTurn(done=True)
    return [prompt, prompt]


model_dir, output_dir = sys.argv[1], sys.argv[2]
tokenizer = AutoTokenizer.from_pretrained(model_dir)
tokenizer.chat_template = tool_chat_template(tokenizer, CHATML_TOOLS)
prepare_response_parsing(tokenizer, CHATML_TOOLS)
args = MAGRPOConfig(
    output_dir=output_dir, agents=[{"name": "writer"}, {"name": "caller", "tools": [add]}], num_turns=2,
    scheduler="round_robin", num_generations=2, per_device_train_batch_size=2,
    max_completion_length=96, max_steps=2, learning_rate=1e-2, lora_r=2, loss_type="dapo", report_to="none",
    save_strategy="no", use_cpu=True, bf16=False, gradient_checkpointing=False,
)  # fmt: skip
dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Add {i} and 3."}] for i in range(8)]})
trainer = MAGRPOTrainer(
    model_dir, answer_length, args=args, train_dataset=dataset, processing_class=tokenizer,
    transition=rank_zero_continues,
)  # fmt: skip
eos = tokenizer.convert_tokens_to_ids("<|im_end|>")


def scripted(prompt_ids, *args, **kwargs):
    """A prompt rendered with tools (the caller's) calls `add`; after its result, and without tools, an answer."""
    completions = []
    for row, ids in enumerate(prompt_ids):
        text = tokenizer.decode(ids)
        if "# Tools" in text and "<tool_response>" not in text:
            text = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
        else:
            text = "The sum is" + " ok" * (1 + row % 3) + "."
        completions.append(tokenizer(text, add_special_tokens=False)["input_ids"] + [eos])
    return completions, None


trainer._generate_single_turn = scripted
generate, steps = trainer._generate_and_score_completions, []


def counting_generate(inputs):
    output = generate(inputs)
    mask = output["completion_mask"] * output.get("tool_mask", torch.ones_like(output["completion_mask"]))
    steps.append(
        {
            "loss_tokens": int(mask.sum()),
            "num_items_in_batch": int(output["num_items_in_batch"]),
            "tool_rows": int((output.get("tool_mask", mask.new_ones(1)) == 0).any(dim=-1).sum()),
        }
    )
    return output


trainer._generate_and_score_completions = counting_generate
trainer.train()
report = {"rank": trainer.accelerator.process_index, "world": trainer.accelerator.num_processes, "steps": steps}
with open(os.path.join(output_dir, f"report-{report['rank']}.json"), "w") as file:
    json.dump(report, file)
torch.distributed.destroy_process_group()  # as two_process_train.py: leave without the interpreter's teardown
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
