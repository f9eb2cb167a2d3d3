"""Train a team whose program calls a tool: one agent must call a calculator the program runs, the other answers with
its result, on the CPU, with the embedded SmolLM2-135M-Instruct.

For each question ("What is 47 plus 18?") the `calculator` agent is called with an `add` tool and `tool_choice:
required` (enforced while sampling: it can only write a call of `add` with two integers); the program runs the call;
the `writer` agent is shown the question, the call and its result (a tool exchange in its history) and answers. The
team reward is half for a call with the question's two numbers, half for an answer that states the tool's result:
neither agent earns it alone. Four episodes per question form MAGRPO's group (docs/programs.md, "Tools").

    python recipes/tool_team.py                            # defaults below
    python recipes/tool_team.py --max_steps 30 --output_dir outputs/tools

Every `MAGRPOConfig` / `GRPOConfig` field is a command-line flag. Prints the team reward on held-out questions (the
same program, evaluation mode) before and after training and where the adapters were saved; writes the same to
`<output_dir>/results.json`.
"""

import json
import os
import random
import re
import sys
from dataclasses import dataclass, field

import torch
from datasets import Dataset
from trl import TrlParser

from trl_marl import MAGRPOConfig, MAGRPOTrainer, default_model_path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from magrpo_quickstart import quickstart_defaults, train_and_report  # noqa: E402

AGENTS = [
    {"name": "calculator", "system_prompt": "Call the add tool with the two numbers of the question."},
    {"name": "writer", "system_prompt": "Answer the question with the tool's result, as a number."},
]
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}


def sum_questions(count: int, seed: int) -> Dataset:
    """`count` questions "What is A plus B?" with A, B from 10 to 99, and their numbers."""
    generator = random.Random(seed)
    pairs = [(generator.randint(10, 99), generator.randint(10, 99)) for _ in range(count)]
    prompts = [f"What is {a} plus {b}?" for a, b in pairs]
    return Dataset.from_dict({"prompt": prompts, "a": [a for a, _ in pairs], "b": [b for _, b in pairs]})


def calculate_then_answer(client, row) -> float:
    """One episode: `calculator` calls `add` (the program runs it), `writer` answers with its result."""
    question = [{"role": "user", "content": row["prompt"]}]
    called = client.chat.completions.create(
        model="calculator", messages=question, tools=[ADD], tool_choice="required", parallel_tool_calls=False
    )
    message = called.choices[0].message
    if not message.tool_calls:  # cut short inside the call: no tool ran, no result to give
        return 0.0
    call = message.tool_calls[0]
    arguments = json.loads(call.function.arguments)
    result = arguments["a"] + arguments["b"]  # the tool: the program runs it, never the trainer
    exchange = [
        *question,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": str(result)},
    ]
    answer = client.chat.completions.create(model="writer", messages=exchange).choices[0].message.content or ""
    right_call = {arguments["a"], arguments["b"]} == {row["a"], row["b"]}
    states_result = str(result) in re.findall(r"-?\d+", answer)
    return 0.5 * right_call + 0.5 * states_result


@dataclass
class ToolTeamArguments:
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Base model; defaults to the embedded SmolLM2-135M-Instruct."}
    )
    eval_questions: int = field(default=12, metadata={"help": "Held-out questions for the before/after reward."})
    train_questions: int = field(default=256, metadata={"help": "Generated training questions."})


def tool_team_defaults(on_gpu: bool) -> dict:
    """This recipe's `MAGRPOConfig` settings (also what `benchmarks/bench_soak.py` trains)."""
    # On the CPU the step's 8 question copies (16 rows of ~300 tokens: the tool's schema is in every prompt) are
    # generated at once and trained in 4 micro-batches of 4 rows: the same update with TRL's default `loss_type`
    # ("dapo": normalised over the whole generation batch; not so for "bnpo" or an entropy bonus), a peak of 4.8 GiB
    # instead of 13.7 (docs/memory.md, "A run's host memory"), at no measurable cost in step time here, where
    # generation takes most of a step. A GPU trains them in one micro-batch, with gradient checkpointing.
    return {
        **quickstart_defaults(on_gpu),
        "output_dir": "outputs/tool-team",
        "agents": AGENTS,
        "max_completion_length": 48,
        "per_device_train_batch_size": 8 if on_gpu else 2,
        "gradient_accumulation_steps": 1 if on_gpu else 4,
    }


def main() -> None:
    parser = TrlParser((ToolTeamArguments, MAGRPOConfig))
    parser.set_defaults(**tool_team_defaults(torch.cuda.is_available()))
    script_args, args = parser.parse_args_and_config()

    questions = sum_questions(script_args.eval_questions + script_args.train_questions, args.seed)
    eval_dataset = questions.select(range(script_args.eval_questions))
    train_dataset = questions.select(range(script_args.eval_questions, len(questions)))
    model = script_args.model_name_or_path or default_model_path()
    trainer = MAGRPOTrainer(
        model, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset, episode=calculate_then_answer
    )
    train_and_report(trainer, args.output_dir, len(eval_dataset))


if __name__ == "__main__":
    main()
