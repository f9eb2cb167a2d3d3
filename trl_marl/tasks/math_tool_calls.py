"""The AT-GRPO paper's tool + reasoner math team on real tool calls: the `tool` agent calls `run_python(code)`, a
tool of the episode's environment that runs the program in trl_marl's sandbox and returns what it printed; the
`reasoner` then answers in words, seeing the tool agent's answer (`sequential` scheduler). One environment per
episode (`PythonRunner`), shared by the two agents (docs/training.md, "Tools and environments").

Reward (`math_tool_calls_reward`): half for a program the tool ran that printed the problem's answer (the episode's
environment says which), half for a reasoner's final answer (`Answer: <number>`) equal to it; answers compared exactly
(`math_tool.parse_number`). Problems: `math_tool`'s generated arithmetic word problems (offline, seeded).

The tool agent decides whether to call the tool, as TRL's tool loop lets any model: nothing forces a call. A base
that never calls it (the embedded 135M model) can first learn the format from written demonstrations
(`MathToolCalls.demonstrations`: TRL's SFT format, one conversation per training problem with its solving program).
"""

from __future__ import annotations

import json
import random

from datasets import Dataset
from transformers.utils import get_json_schema

from .base import Task
from .completions import completion_text
from .math_tool import (
    REASONER,
    REASONER_PROMPT,
    TOOL,
    TOOL_PROMPT,
    TRAIN_SEED,
    _correct,
    agent_answer,
    arithmetic_dataset,
    arithmetic_solution,
    final_answer,
    format_answer,
    math_prompt,
    run_tool,
)
from .sandbox_runs import shared_sandbox

TOOL_CALLS_PROMPT = (
    "You solve math word problems with Python. Call the run_python tool with a complete program that prints only the "
    "final answer (a whole number, or an exact fraction with fractions.Fraction). Then reply `Answer: <number>` with "
    "what it printed."
)
TOOL_CALLS_AGENTS = [
    {"name": TOOL, "system_prompt": TOOL_CALLS_PROMPT, "tools": ["run_python"]},
    {"name": REASONER, "system_prompt": REASONER_PROMPT, "tools": []},
]


class PythonRunner:
    """An episode's environment: `run_python` runs a program in trl_marl's sandbox (`math_tool.run_tool`: bubblewrap,
    10 s) and keeps the answer the last run printed (`printed`)."""

    def reset(self, **row) -> None:
        # A machine that cannot isolate code stops the episode here, naming what is missing: inside a call, the
        # failure would be one more tool error the model is shown, and the team would train on nothing but those.
        shared_sandbox()
        self.printed = None  # the answer the last program printed (a Fraction), or None
        self.runs = 0

    def run_python(self, code: str) -> str:
        """Run a Python program and return what it printed.

        Args:
            code: A complete Python program that prints only the final answer.
        """
        self.runs += 1
        self.printed, happened = run_tool(f"```python\n{code}\n```")
        return happened


def math_tool_calls_reward(prompts, completions, answer, environments=None, log_metric=None, **kwargs) -> list[float]:
    """Half for a program the tool agent ran (its episode's `PythonRunner`; without one, the program in its answer)
    that printed `answer`, half for the reasoner's final answer equal to it. In a trainer it logs
    `math/tool_accuracy`, `math/reasoner_accuracy` and `math/tool_runs` (programs run per episode)."""
    environments = environments or [None] * len(completions)
    tool = [  # without an environment (`recipes/atgrpo_math_tools.py --without_tools`), the program in its text
        _correct(env.printed if env is not None else agent_answer(TOOL, completion_text(c, TOOL)), expected)
        for env, c, expected in zip(environments, completions, answer)
    ]
    reasoner = [_correct(final_answer(completion_text(c, REASONER)), a) for c, a in zip(completions, answer)]
    if log_metric is not None and completions:
        count = len(completions)
        log_metric("math/tool_accuracy", sum(tool) / count)
        log_metric("math/reasoner_accuracy", sum(reasoner) / count)
        log_metric("math/tool_runs", sum(getattr(env, "runs", 0) for env in environments) / count)
    return [0.5 * t + 0.5 * r for t, r in zip(tool, reasoner)]


class MathToolCalls(Task):
    """Arithmetic word problems for a tool agent that calls `run_python` (the episode's `PythonRunner`) and a reasoner
    that answers after it; reward: half each for a correct program run and a correct final answer. Its environment
    (`environment_factory`) is the trainer's unless the trainer is given another."""

    name = "math_tool_calls"
    agents = TOOL_CALLS_AGENTS
    num_turns = 1
    scheduler = "sequential"  # the reasoner answers after the tool agent, seeing its answer
    reward_funcs = [math_tool_calls_reward]
    environment_factory = PythonRunner

    def __init__(self, steps: int = 3, max_number: int = 20):
        self.steps, self.max_number = steps, max_number

    def dataset(self, split: str = "train") -> Dataset:
        return arithmetic_dataset(split, self.steps, self.max_number)

    def demonstrations(self, count: int = 128, tools: bool = True) -> Dataset:
        """Written answers of the tool agent for the first `count` training problems, in TRL's conversational
        prompt-completion format (`SFTTrainer` renders it with the chat template it is given); no held-out problem is
        among them. The prompt is the agent's system prompt and the problem. With `tools`, the completion is a
        `run_python` call with the problem's solving program (`math_tool.arithmetic_solution`), the tool's result as
        the sandbox words it, and `Answer: <number>`, with a `tools` column; without, the same program in a fenced
        block under `math_tool`'s text prompt (the comparison arm, the program written as text)."""
        rng = random.Random(TRAIN_SEED)  # `arithmetic_dataset("train")`'s problems, in its order
        schema = json.dumps([get_json_schema(PythonRunner.run_python)])
        rows = {"prompt": [], "completion": [], **({"tools": []} if tools else {})}
        for _ in range(count):
            question, answer, program = arithmetic_solution(rng, self.steps, self.max_number)
            system = {"role": "system", "content": TOOL_CALLS_PROMPT if tools else TOOL_PROMPT}
            rows["prompt"].append([system, *math_prompt(question)])
            if not tools:
                rows["completion"].append([{"role": "assistant", "content": f"```python\n{program}\n```"}])
                continue
            call = {"type": "function", "function": {"name": "run_python", "arguments": {"code": program}}}
            printed = f"the program printed {format_answer(answer)!r}"
            rows["completion"].append(
                [
                    {"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "name": "run_python", "content": printed},
                    {"role": "assistant", "content": f"Answer: {format_answer(answer)}"},
                ]
            )
            rows["tools"].append(schema)
        return Dataset.from_dict(rows)
