"""Trained by tests/test_multiprocess.py under `torchrun --nproc_per_node 2` (accelerate MULTI_CPU on gloo)."""

import json
import os
import sys

import torch
from datasets import Dataset

from trl_marl import MAGRPOConfig, MAGRPOTrainer, NextTurn

scored = []


def length_gap_reward(prompts, completions, **kwargs):
    scored.append(completions)
    return [float(len(c["concise"]) - len(c["detailed"])) for c in completions]


def rank_zero_continues(prompt, joint_action, history, turn, **kwargs):
    """Only process 0's branches get a second turn: the processes' trees, and row counts, differ."""
    if os.environ["RANK"] != "0":
        return NextTurn(done=True)
    return [prompt, prompt]


model_dir, joint_mode, output_dir, num_turns = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
args = MAGRPOConfig(
    output_dir=output_dir,
    agents=["concise", "detailed"],
    joint_mode=joint_mode,
    num_turns=num_turns,
    num_generations=4,
    per_device_train_batch_size=2,  # a prompt group of 4 copies spans both processes
    max_completion_length=4,
    max_steps=2,
    learning_rate=1e-2,
    lora_r=2,
    report_to="none",
    save_strategy="no",
    use_cpu=True,
    bf16=False,
    gradient_checkpointing=False,
)
dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Say {i}."}] for i in range(8)]})
trainer = MAGRPOTrainer(model_dir, length_gap_reward, args=args, train_dataset=dataset, transition=rank_zero_continues)
generated_rows, trained_rows = [], []
generate, compute_loss = trainer._generate_and_score_completions, trainer._compute_loss


def counting_generate(inputs):
    output = generate(inputs)
    generated_rows.append([int((~output["is_padding"]).sum()), len(output["advantages"])])
    return output


def counting_loss(model, inputs):
    trained_rows.append([int((~inputs["is_padding"]).sum()), len(inputs["advantages"])])
    return compute_loss(model, inputs)


trainer._generate_and_score_completions, trainer._compute_loss = counting_generate, counting_loss
trainer.train()
report = {
    "rank": trainer.accelerator.process_index,
    "world": trainer.accelerator.num_processes,
    "joint_actions_per_call": [len(call) for call in scored],
    "generated_rows": generated_rows,
    "trained_rows": trained_rows,
}
with open(os.path.join(output_dir, f"report-{report['rank']}.json"), "w") as file:
    json.dump(report, file)
# Without this, gloo's threads may still be running when the interpreter exits, which aborts the process
# ("terminate called without an active exception") after the work is done.
torch.distributed.destroy_process_group()
# Even then a libtorch thread can abort the interpreter's teardown (seen under load, after every report was
# written): the files are closed, so leave without the teardown.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
