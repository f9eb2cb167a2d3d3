"""AT-GRPO on the CPU with the paper's tool + reasoner math team on real tool calls: the tool agent calls `run_python`,
a tool of each episode's environment that runs its program in the sandbox; the reasoner answers after it.

The built-in task `math_tool_calls` (trl_marl/tasks/math_tool_calls.py) with the embedded SmolLM2-135M-Instruct, one
LoRA adapter per agent, a few steps, generated arithmetic word problems with exact answers. The tool agent's prompts
carry the `run_python` tool (rendered by the ChatML tool template: SmolLM2's own drops tools), its calls run in each
episode's own `PythonRunner` (bubblewrap sandbox, docs/sandbox.md), their results are masked out of its loss
(docs/training.md, "Tools and environments"). Reward: half for a program run that printed the answer, half for the
reasoner's correct final answer.

The embedded 135M model never calls a tool on its own, so the tool agent's adapter first learns the call format from
written demonstrations (`--warm_start_demonstrations`, `MathToolCalls.demonstrations`) with TRL's `SFTTrainer`; the
RL steps start from there. `--without_tools` warm-starts on the same programs written as text. `0` skips it (a base
that already calls tools needs none).

    python recipes/atgrpo_math_tools.py                      # defaults below
    python recipes/atgrpo_math_tools.py --without_tools      # the same team and reward, the program written as text

Prints the held-out team reward of the base, after the warm start and after the RL steps, and the median step time;
writes `<output_dir>/results.json`. Every `ATGRPOConfig` / `GRPOConfig` field is a flag.
"""

import copy
import json
import os
import statistics
import time
from dataclasses import dataclass, field

import torch
from trl import SFTConfig, SFTTrainer, TrlParser

from trl_marl import ATGRPOConfig, ATGRPOTrainer, default_model_path
from trl_marl.generation.tool_templates import tool_chat_template
from trl_marl.memory import peak_memory
from trl_marl.memory.host import ReleaseFreeMemory
from trl_marl.tasks import task_defaults
from trl_marl.tasks.math_tool import TOOL, TOOL_PROMPT
from trl_marl.tasks.math_tool_calls import MathToolCalls


@dataclass
class RecipeArguments:
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Base model; defaults to the embedded SmolLM2-135M-Instruct."}
    )
    without_tools: bool = field(
        default=False, metadata={"help": "No tools: the tool agent writes its program as text (the comparison arm)."}
    )
    eval_problems: int = field(default=16, metadata={"help": "Held-out problems for the figures."})
    warm_start_demonstrations: int = field(
        default=128, metadata={"help": "Written tool-call demonstrations the tool agent learns first (0: none)."}
    )
    warm_start_epochs: float = field(default=2.0, metadata={"help": "Epochs over the demonstrations."})
    warm_start_learning_rate: float = field(default=5e-4, metadata={"help": "The warm start's learning rate."})


def warm_start(trainer: ATGRPOTrainer, agent: str, demonstrations, script_args, args) -> None:
    """Supervised fine-tuning of one agent's adapter with TRL's `SFTTrainer`, on the team's own model (an agent on the
    trainer's model): PEFT's `set_adapter` makes that adapter the active one (and the only one with gradients) while
    the team's router routes nothing; `trainer.adapters_changed()` then gives the team's adapters their gradients back
    and has vLLM, if used, serve the new weights. Demonstrations render with the chat template the team renders tools
    with (`tool_chat_template`), so the warm start sees the prompts the RL steps will."""
    model = trainer.model
    model.set_adapter(trainer.agent_adapters[trainer.agent_names.index(agent)])
    tokenizer = copy.deepcopy(trainer.processing_class)
    tokenizer.chat_template = tool_chat_template(tokenizer) or tokenizer.chat_template
    sft_args = SFTConfig(
        output_dir=os.path.join(args.output_dir, "warm_start"),
        num_train_epochs=script_args.warm_start_epochs,
        learning_rate=script_args.warm_start_learning_rate,
        lr_scheduler_type="constant",
        per_device_train_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,  # the RL steps' batch: 8 demonstrations a step
        logging_steps=4,
        save_strategy="no",
        report_to="none",
        seed=args.seed,
        use_cpu=args.use_cpu,
        bf16=args.bf16,
        fp16=args.fp16,  # the team's accelerator is already set up: the same mixed precision
        gradient_checkpointing=args.gradient_checkpointing,
        gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs,
    )
    callbacks = [ReleaseFreeMemory()]  # as the team trainer's steps: free memory back to the system after each step
    SFTTrainer(
        model=model, args=sft_args, train_dataset=demonstrations, processing_class=tokenizer, callbacks=callbacks
    ).train()
    trainer.adapters_changed()


def main() -> None:
    parser = TrlParser((RecipeArguments, ATGRPOConfig))
    on_gpu = torch.cuda.is_available()
    parser.set_defaults(
        **task_defaults(MathToolCalls()),
        output_dir="outputs/atgrpo-math-tools",
        num_generations=4,
        # 8 copies a step (2 problems x K = 4), generated at once; on the CPU trained in 8 micro-batches of 2 rows
        # (TRL shuffles the rows before it splits them): the same update as one micro-batch with TRL's default
        # `loss_type` ("dapo": normalised over the whole generation batch; not so for "bnpo" or an entropy bonus), at
        # a fraction of the peak memory (docs/memory.md, "A run's host memory"). Settings v5 (2026-11-29); v4 trained
        # them in 4 micro-batches (7.51 GiB, over the 8 GB aim), v3 in one, as a GPU still does (with checkpointing).
        per_device_train_batch_size=8 if on_gpu else 1,
        gradient_accumulation_steps=1 if on_gpu else 8,
        per_device_eval_batch_size=8,
        num_generations_eval=1,
        max_completion_length=128,
        max_tool_calling_iterations=2,
        max_steps=4,
        learning_rate=5e-4,
        lr_scheduler_type="constant",
        lora_r=16,
        lora_alpha=32,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=0,
        use_cpu=not on_gpu,
        gradient_checkpointing=on_gpu,
    )
    script_args, args = parser.parse_args_and_config()
    task = MathToolCalls()
    environment_factory = task.environment_factory
    if script_args.without_tools:  # the comparison arm: no tools, the tool agent's program in its text
        args.agents = [
            {**agent, "tools": [], **({"system_prompt": TOOL_PROMPT} if agent["name"] == "tool" else {})}
            for agent in args.agents
        ]
        environment_factory = None
        task.environment_factory = None
    eval_dataset = task.dataset("eval").select(range(script_args.eval_problems))
    trainer = ATGRPOTrainer(
        script_args.model_name_or_path or default_model_path(),
        args=args,
        task=task,
        eval_dataset=eval_dataset,
        environment_factory=environment_factory,
    )
    start = time.perf_counter()
    base = trainer.evaluate()
    print(f"Held-out team reward of the base: {base['eval_reward']:.3f} ({len(eval_dataset)} problems)")
    before = base
    if script_args.warm_start_demonstrations:
        demonstrations = task.demonstrations(
            script_args.warm_start_demonstrations, tools=not script_args.without_tools
        )
        warm_start(trainer, TOOL, demonstrations, script_args, args)
        before = trainer.evaluate()
        print(f"Held-out team reward after the warm start: {before['eval_reward']:.3f}")
    trainer.train()
    after = trainer.evaluate()
    trainer.save_model(args.output_dir)
    step_times = [entry["step_time"] for entry in trainer.state.log_history if "step_time" in entry]
    results = {
        "tools": not script_args.without_tools,
        "warm_start_demonstrations": script_args.warm_start_demonstrations,
        "team_reward_base": base["eval_reward"],
        "team_reward_before": before["eval_reward"],
        "team_reward_after": after["eval_reward"],
        "tool_calls_per_row_before": before.get("eval_tools/call_frequency"),
        "tool_calls_per_row_after": after.get("eval_tools/call_frequency"),
        "median_step_seconds": statistics.median(step_times[1:] or step_times),
        "steps": trainer.state.global_step,
        "minutes": (time.perf_counter() - start) / 60,
    }
    print(f"Held-out team reward after {trainer.state.global_step} steps: {after['eval_reward']:.3f}")
    print(json.dumps(results, indent=2))
    peak = peak_memory()  # the run's peak: host RSS on the CPU, torch's peaks on a GPU
    results.update(peak.as_dict())
    print(peak.describe())
    with open(os.path.join(args.output_dir, "results.json"), "w") as file:
        json.dump(results, file, indent=2)


if __name__ == "__main__":
    main()
