"""Trains two agents for a few steps, on one process or under `torchrun --nproc_per_node 2` (gloo on the CPU), with
the same global batch, for tests/test_multiprocess.py.

    equivalence_train.py MODEL OUTPUT_DIR [--dataset_size N] [--max_steps N] [--stop_at N | --resume]

Generation is replaced by a deterministic function of (prompt, how many times that prompt came before in the global
batch), so that one process and two processes produce the same completions; everything after it (team rewards
gathered across processes, advantages, each process's slice, the loss, DDP's gradient averaging) is the real thing.
Each process writes `report-<rank>.json` (its rows' advantages, the prompts of each step) and `adapters-<rank>.pt`
(its LoRA weights). `--stop_at N` saves a checkpoint at step N and stops there; `--resume` resumes from the latest.
"""

import argparse
import hashlib
import json
import os
import sys
from collections import Counter

import torch
from accelerate.utils import gather_object
from datasets import Dataset
from transformers import TrainerCallback

from trl_marl import MAGRPOConfig, MAGRPOTrainer

parser = argparse.ArgumentParser()
parser.add_argument("model_dir")
parser.add_argument("output_dir")
parser.add_argument("--dataset_size", type=int, default=8)
parser.add_argument("--max_steps", type=int, default=3)
parser.add_argument("--stop_at", type=int)
parser.add_argument("--resume", action="store_true")
options = parser.parse_args()
model_dir, output_dir = options.model_dir, options.output_dir
world = int(os.environ.get("WORLD_SIZE", "1"))
GLOBAL_COPIES = 8  # prompt copies per step over all processes: 2 prompts x G=4


def length_gap_reward(prompts, completions, **kwargs):
    return [float(len(c["detailed"]) - len(c["concise"])) for c in completions]


args = MAGRPOConfig(
    output_dir=output_dir,
    agents=["concise", "detailed"],
    num_generations=4,
    per_device_train_batch_size=GLOBAL_COPIES // world,  # the same global batch; with 2 processes a group spans both
    max_completion_length=6,
    max_steps=options.max_steps,
    learning_rate=1.0,
    optim="sgd",  # updates linear in the gradient: Adam would blow float summation-order noise up to ~lr
    lora_r=2,
    report_to="none",
    save_strategy="steps" if options.stop_at else "no",
    save_steps=options.stop_at or 500,
    use_cpu=True,
    gradient_checkpointing=False,
    seed=7,
)
prompts = [[{"role": "user", "content": f"Say {i}."}] for i in range(options.dataset_size)]
trainer = MAGRPOTrainer(model_dir, length_gap_reward, args=args, train_dataset=Dataset.from_dict({"prompt": prompts}))


class StopAt(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = state.global_step == options.stop_at


if options.stop_at:
    trainer.add_callback(StopAt())
eos = trainer.processing_class.eos_token_id


def deterministic_generate(prompt_ids, images, multimodal_fields, num_generations, *rest, **kwargs):
    """Completions that depend only on the prompt and its global occurrence: the rows of lower ranks come first."""
    local = [tuple(ids) for ids in prompt_ids]
    everyone = gather_object([local]) if world > 1 else [local]
    seen = Counter(ids for rank_rows in everyone[: trainer.accelerator.process_index] for ids in rank_rows)
    completions = []
    for ids in local:
        digest = hashlib.sha256(repr((ids, seen[ids])).encode()).digest()
        seen[ids] += 1
        length = 1 + digest[0] % 5
        completions.append([100 + b for b in digest[1 : 1 + length]] + [eos])
    return completions, None


advantages, step_prompts = {}, {}
score = trainer._generate_and_score_completions


def recording_score(inputs):
    step_prompts[trainer.state.global_step] = [row["prompt"][0]["content"] for row in inputs]
    output = score(inputs)
    for prompt, prompt_mask, completion, completion_mask, agent, advantage, padding in zip(
        output["prompt_ids"], output["prompt_mask"], output["completion_ids"], output["completion_mask"],
        output["agent_index"], output["advantages"], output["is_padding"],
    ):  # fmt: skip
        if not padding:
            tokens = (prompt[prompt_mask.bool()].tolist(), completion[completion_mask.bool()].tolist())
            key = repr((int(agent), *tokens, trainer.state.global_step))
            advantages[key] = advantage.item()
    return output


trainer._generate_single_turn, trainer._generate_and_score_completions = deterministic_generate, recording_score
trainer.train(resume_from_checkpoint=True if options.resume else None)
rank = trainer.accelerator.process_index
with open(os.path.join(output_dir, f"report-{rank}.json"), "w") as file:
    json.dump({"world": world, "advantages": advantages, "step_prompts": step_prompts}, file)
adapters = {n: p.detach().cpu() for n, p in trainer.model.named_parameters() if "lora_" in n}
torch.save(adapters, os.path.join(output_dir, f"adapters-{rank}.pt"))
if world > 1:
    torch.distributed.destroy_process_group()  # let gloo's threads stop before the interpreter exits
    # Even then a libtorch thread can abort the interpreter's teardown (seen under load, after every report was
    # written): the files are closed, so leave without the teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
