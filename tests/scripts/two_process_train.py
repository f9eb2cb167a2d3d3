"""Trained by tests/test_multiprocess.py under `torchrun --nproc_per_node 2` (accelerate MULTI_CPU on gloo)."""

import json
import sys

from datasets import Dataset

from trl_marl import MAGRPOConfig, MAGRPOTrainer

scored = []


def length_gap_reward(prompts, completions, **kwargs):
    scored.append(completions)
    return [float(len(c["concise"]) - len(c["detailed"])) for c in completions]


model_dir, joint_mode, output_dir = sys.argv[1:4]
args = MAGRPOConfig(
    output_dir=output_dir,
    agents=["concise", "detailed"],
    joint_mode=joint_mode,
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
trainer = MAGRPOTrainer(model_dir, length_gap_reward, args=args, train_dataset=dataset)
trainer.train()
report = {
    "rank": trainer.accelerator.process_index,
    "world": trainer.accelerator.num_processes,
    "joint_actions_per_call": [len(call) for call in scored],
}
print("REPORT " + json.dumps(report), flush=True)
