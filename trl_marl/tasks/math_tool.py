"""Math with a tool agent and a reasoner, the AT-GRPO paper's math workflow (arXiv 2510.11062, §5.1): `tool` answers
by writing a Python program that prints the answer (run in the sandbox), `reasoner` answers in words, ending with
`Answer: <number>`. Each then sees the other's answer and may revise; the episode ends when the two agree, or at the
turn limit (`num_turns`).

Rewards (constants below): each agent's local reward is `CORRECT` when its answer equals the problem's; the team
reward is `BOTH_CORRECT` when both agents' latest answers do. Answers are compared exactly, as `fractions.Fraction`:
`7/2`, `3.5` and `\\frac{7}{2}` are the same answer, `0.333` is not `1/3`, and nothing is rounded.

Problems: generated multi-step arithmetic word problems with exact answers (offline, seeded; `steps` and
`max_number` set the difficulty), or `source="hub"` for GSM8K (`openai/gsm8k`, the answer after `####`).
"""

from __future__ import annotations

import random
import re
from fractions import Fraction

from datasets import Dataset

from ..rollouts.rollout import NextTurn
from ..rollouts.scheduling import with_feedback
from ..sandbox import ExecutionResult, Limits
from .base import Task
from .completions import completion_text
from .sandbox_runs import SandboxResultCache, extract_code, shared_sandbox

TOOL, REASONER = "tool", "reasoner"

CORRECT = 1.0  # an agent's local reward when its answer is the problem's (the reference's `agent_reward = is_correct`)
BOTH_CORRECT = 1.0  # the team reward when both agents' answers are the problem's
NUM_TURNS = 4  # the turn limit: PettingLLMs config/math/math_L1_prompt.yaml `env.max_turns: 4`
# The reference runs the tool's code with `timeout=10.0` (multi_agent_env/math/agents/tool_agent.py).
TOOL_LIMITS = Limits(wall_time_s=10.0)

TOOL_PROMPT = (
    "You solve math word problems by writing Python. Write a complete program that computes the answer and prints "
    "only the final answer: a whole number, or an exact fraction (use fractions.Fraction, which prints as 7/2). Only "
    "the standard library is available. Reply with only the program in a ```python block."
)
REASONER_PROMPT = (
    "You solve math word problems by reasoning step by step in words, without code. End your reply with a last line "
    "`Answer: <number>`, the number a whole number or an exact fraction such as 7/2."
)
MATH_AGENTS = [{"name": TOOL, "system_prompt": TOOL_PROMPT}, {"name": REASONER, "system_prompt": REASONER_PROMPT}]
SOURCES = ("offline", "hub")


# ---------------------------------------------------------------------------------------------------------- answers

_GROUPED = r"\d{1,3}(?:,\d{3})+(?![\d,])"  # 1,234,567: commas only as thousands separators
_INTEGER = rf"(?:{_GROUPED}|\d+)"
_NUMBER = re.compile(rf"(-?)\s*({_INTEGER}(?:\.\d+)?)(?:\s*/\s*(-?)\s*({_INTEGER}))?")
_LATEX_FRACTION = re.compile(r"(-?)\s*\\[dt]?frac\s*\{\s*(-?)\s*(\d+)\s*\}\s*\{\s*(-?)\s*(\d+)\s*\}")
_MARKERS = re.compile(r"\\boxed\s*\{|Answer\s*:|####", re.IGNORECASE)


def parse_number(text: str) -> Fraction | None:
    """The first number in `text`, exactly: an integer (`-12`, `1,234`), a decimal (`3.25`), a fraction (`7/2`,
    `-7/2`, `\\frac{7}{2}`); None when there is none, a denominator is 0, or it has more digits than Python converts
    (`sys.get_int_max_str_digits()`). Dollar signs and LaTeX spacing are ignored; a comma that does not separate
    thousands ends the number (`3, 4` is 3)."""
    text = text.replace("\u2212", "-").replace("\\$", "").replace("$", "").replace("\\!", "").replace("\\,", "")
    number, fraction = _NUMBER.search(text), _LATEX_FRACTION.search(text)
    try:
        if fraction is not None and (number is None or fraction.start() <= number.start()):
            negative = [fraction.group(i) for i in (1, 2, 4)].count("-") % 2 == 1
            value = Fraction(int(fraction.group(3)), int(fraction.group(5)))
            return -value if negative else value
        if number is None:
            return None
        value = Fraction(number.group(2).replace(",", ""))
        if number.group(4) is not None:
            value /= Fraction(number.group(4).replace(",", ""))
        return -value if (number.group(1) == "-") != (number.group(3) == "-") else value
    except (ValueError, ZeroDivisionError):
        return None


def _boxed_content(text: str, start: int) -> str:
    """What a `\\boxed{` opened at `start` (just after its brace) holds, braces balanced."""
    depth = 1
    for index in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[index], 0)
        if depth == 0:
            return text[start:index]
    return text[start:]


def final_answer(text: str) -> Fraction | None:
    """A text answer's final answer: the first number after its last answer marker, `\\boxed{...}`, `Answer: ...` or
    GSM8K's `#### ...` (the rest of that line); None without a marker or a number after it."""
    markers = list(_MARKERS.finditer(text))
    if not markers:
        return None
    last = markers[-1]
    if last.group().startswith("\\"):
        return parse_number(_boxed_content(text, last.end()))
    return parse_number(text[last.end() :].split("\n", 1)[0])


def format_answer(value: Fraction) -> str:
    """`7/2`, `-3`: the exact answer as text (the dataset's `answer` column)."""
    return str(value)


_RUNS = SandboxResultCache(size=4096)  # programs run: rewards, the transition and `success` ask about the same ones


def run_tool(text: str) -> tuple[Fraction | None, str]:
    """Run the tool agent's program (its fenced code, else the whole text) in the sandbox: `(answer, what happened)`,
    the answer being the first number of the last line it printed (None when the run did not end ok, printed
    nothing, or no number)."""
    program = extract_code(text)

    def run() -> tuple[tuple[Fraction | None, str], ExecutionResult]:
        result = shared_sandbox().run(program, limits=TOOL_LIMITS)
        lines = [line for line in result.stdout.splitlines() if line.strip()]
        if not result.ok:
            error = [line for line in result.stderr.splitlines() if line.strip()]
            return (None, f"the program failed: {error[-1][:200] if error else result.reason}"), result
        if not lines:
            return (None, "the program printed nothing"), result
        answer = final_answer(lines[-1]) if _MARKERS.search(lines[-1]) else parse_number(lines[-1])
        return (answer, f"the program printed {lines[-1][:200]!r}"), result

    return _RUNS.get_or_run(program, run)


def agent_answer(agent: str, text: str) -> Fraction | None:
    """An agent's answer: the tool's program's printed answer, the reasoner's final answer."""
    return run_tool(text)[0] if agent == TOOL else final_answer(text)


def _correct(answer: Fraction | None, expected: str) -> bool:
    return answer is not None and answer == Fraction(expected)


# ---------------------------------------------------------------------------------------------------------- rewards


def tool_correct(prompts, completions, answer, **kwargs) -> list[float]:
    """The tool agent's local reward: `CORRECT` when its program prints the problem's `answer` (a dataset column,
    exact), else 0. `completions`: the tool's texts (or team mappings, of which the `tool` text counts)."""
    return [CORRECT * _correct(agent_answer(TOOL, completion_text(c, TOOL)), a) for c, a in zip(completions, answer)]


def reasoner_correct(prompts, completions, answer, **kwargs) -> list[float]:
    """The reasoner's local reward: `CORRECT` when its final answer is the problem's `answer`, else 0."""
    return [CORRECT * _correct(final_answer(completion_text(c, REASONER)), a) for c, a in zip(completions, answer)]


def math_both_correct(prompts, completions, answer, log_metric=None, **kwargs) -> list[float]:
    """Team reward: `BOTH_CORRECT` when the tool's and the reasoner's latest answers both equal `answer`, else 0.
    In a trainer it logs `math/accuracy` (share of joint actions with both correct), `math/tool_accuracy`,
    `math/reasoner_accuracy` and `math/agreement` (both answered, the same number)."""
    tool = [agent_answer(TOOL, completion_text(c, TOOL)) for c in completions]
    reasoner = [agent_answer(REASONER, completion_text(c, REASONER)) for c in completions]
    both = [_correct(t, a) and _correct(r, a) for t, r, a in zip(tool, reasoner, answer)]
    if log_metric is not None and both:
        count = len(both)
        log_metric("math/accuracy", sum(both) / count)
        log_metric("math/tool_accuracy", sum(_correct(t, a) for t, a in zip(tool, answer)) / count)
        log_metric("math/reasoner_accuracy", sum(_correct(r, a) for r, a in zip(reasoner, answer)) / count)
        log_metric("math/agreement", sum(t is not None and t == r for t, r in zip(tool, reasoner)) / count)
    return [BOTH_CORRECT * b for b in both]


# ---------------------------------------------------------------------------------------------------------- data

TRAIN_SEED, EVAL_SEED = 0, 1  # offline problems: train and eval come from different seeds (and share no question)
TRAIN_SIZE, EVAL_SIZE = 1000, 100
MAX_FACTOR = 5  # multipliers and divisors are drawn from 2..5
NAMES = ("Ava", "Ben", "Chloe", "Dev", "Elena", "Farid", "Grace", "Hugo", "Iris", "Jonas", "Keiko", "Liam", "Maya",
         "Noor", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tariq")  # fmt: skip
GOODS = (("liters", "juice"), ("kilograms", "rice"), ("meters", "rope"), ("liters", "milk"), ("kilograms", "flour"),
         ("meters", "ribbon"), ("cups", "sugar"), ("liters", "paint"), ("kilograms", "clay"))  # fmt: skip
# One sentence per operation, stating its one number in digits; a multiplication by 2 or 3 may say it in a word.
ADD = ("{name} buys {n} more {unit}.", "A neighbour gives {name} another {n} {unit}.", "{name} adds {n} {unit}.")
SUBTRACT = ("{name} uses {n} {unit}.", "{name} gives {n} {unit} to a friend.", "{name} spills {n} {unit}.")
MULTIPLY = "The amount {name} has becomes {n} times as large."
MULTIPLY_WORDS = {2: "The amount doubles.", 3: "The amount triples."}
OPERATORS = {"add": "+", "subtract": "-", "multiply": "*", "divide": "/"}  # each operation in a solving program
DIVIDE = (  # "with k friends": k + 1 equal shares
    "{name} splits it equally into {n} jars and keeps one jar.",
    "{name} shares it equally with {friends}, keeping one equal share.",
)


def arithmetic_problem(rng: random.Random, steps: int = 3, max_number: int = 20) -> tuple[str, Fraction]:
    """One word problem and its exact answer: a starting amount (1..`max_number`) and `steps` operations on it (add or
    subtract 1..`max_number`, never below 0; multiply or divide by 2..`MAX_FACTOR`, so answers may be fractions)."""
    question, answer, _ = arithmetic_solution(rng, steps, max_number)
    return question, answer


def arithmetic_solution(rng: random.Random, steps: int = 3, max_number: int = 20) -> tuple[str, Fraction, str]:
    """`arithmetic_problem`'s problem and answer (the same random draws), with a Python program that solves it, one
    line per sentence, and prints the answer (`Fraction` arithmetic): a written demonstration for the tool agent."""
    if steps < 1 or max_number < 1:
        raise ValueError(
            f"A problem needs steps >= 1 and max_number >= 1, got steps={steps}, max_number={max_number}."
        )
    name, (unit, item) = rng.choice(NAMES), rng.choice(GOODS)
    amount = Fraction(rng.randint(1, max_number))
    sentences = [f"{name} has {amount} {unit} of {item}."]
    program = ["from fractions import Fraction", "", f"amount = Fraction({amount})"]
    for _ in range(steps):
        operation = rng.choice(("add", "subtract", "multiply", "divide"))
        if operation == "subtract" and amount < 1:
            operation = "add"
        if operation in ("add", "subtract"):
            n = rng.randint(1, max_number if operation == "add" else min(max_number, int(amount)))
            amount += n if operation == "add" else -n
            template = rng.choice(ADD if operation == "add" else SUBTRACT)
        elif operation == "multiply":
            n = rng.randint(2, MAX_FACTOR)
            amount *= n
            template = MULTIPLY_WORDS[n] if n in MULTIPLY_WORDS and rng.random() < 0.5 else MULTIPLY
        else:
            n = rng.randint(2, MAX_FACTOR)
            amount /= n
            template = rng.choice(DIVIDE)
        friends = f"{n - 1} friend" + ("s" if n > 2 else "")
        sentences.append(template.format(name=name, n=n, friends=friends, unit=unit))
        program.append(f"amount {OPERATORS[operation]}= {n}")
    sentences.append(f"How many {unit} of {item} does {name} have now?")
    program.append("print(amount)")
    return " ".join(sentences), amount, "\n".join(program)


def math_prompt(question: str) -> list[dict]:
    return [{"role": "user", "content": f"Problem: {question}"}]


def _rows(questions: list[str], answers: list[Fraction]) -> Dataset:
    return Dataset.from_dict(
        {
            "prompt": [math_prompt(q) for q in questions],
            "question": questions,
            "answer": [format_answer(a) for a in answers],
        }
    )


def arithmetic_dataset(split: str = "train", steps: int = 3, max_number: int = 20) -> Dataset:
    """Generated problems: `train` (`TRAIN_SIZE`, seed `TRAIN_SEED`) or `eval` (`EVAL_SIZE`, seed `EVAL_SEED`, without
    any question that `train` has). Columns: `prompt` (chat), `question`, `answer` (exact, e.g. `7/2`)."""
    if split not in ("train", "eval"):
        raise ValueError(f"Unknown split {split!r}: math_tool has 'train' and 'eval'.")

    def generate(seed: int, size: int) -> list[tuple[str, Fraction]]:
        rng = random.Random(seed)
        return [arithmetic_problem(rng, steps, max_number) for _ in range(size)]

    train = generate(TRAIN_SEED, TRAIN_SIZE)
    if split == "train":
        problems = train
    else:
        seen = {question for question, _ in train}
        problems = [(q, a) for q, a in generate(EVAL_SEED, 2 * EVAL_SIZE) if q not in seen][:EVAL_SIZE]
    return _rows([q for q, _ in problems], [a for _, a in problems])


def gsm8k_dataset(split: str = "train") -> Dataset:
    """GSM8K from the Hub (`openai/gsm8k`, config `main`; `eval` is its test split): the same columns as the offline
    problems, the answer being the number after `####` (needs the network or a Hub cache)."""
    from datasets import load_dataset

    rows = load_dataset("openai/gsm8k", "main", split="test" if split == "eval" else "train")
    answers = [parse_number(solution.split("####")[-1]) for solution in rows["answer"]]
    if any(answer is None for answer in answers):
        raise ValueError("A GSM8K row has no number after `####`: the dataset is not the expected one.")
    return _rows(list(rows["question"]), answers)


# ---------------------------------------------------------------------------------------------------------- episodes


def _describe(agent: str, text: str) -> str:
    if agent == TOOL:
        answer, happened = run_tool(text)
        return f"{format_answer(answer)} ({happened})" if answer is not None else f"none ({happened})"
    answer = final_answer(text)
    return format_answer(answer) if answer is not None else "none (no `Answer: <number>` line)"


def math_feedback(prompt, state, turn, **kwargs) -> NextTurn | dict:
    """The transition: `NextTurn(done=True)` once both agents answered the same number; otherwise each agent's next
    prompt is the problem with its own answer and the other's (the problem's answer is never shown)."""
    tool, reasoner = agent_answer(TOOL, state[TOOL]), agent_answer(REASONER, state[REASONER])
    if tool is not None and tool == reasoner:
        return NextTurn(done=True)
    answers = {TOOL: _describe(TOOL, state[TOOL]), REASONER: _describe(REASONER, state[REASONER])}
    who = {TOOL: "the tool agent (Python)", REASONER: "the reasoner"}
    prompts = {}
    for agent, other in ((TOOL, REASONER), (REASONER, TOOL)):
        report = (
            f"After turn {turn + 1} the team disagrees. Your answer: {answers[agent]}. The answer of {who[other]}: "
            f"{answers[other]}.\nCheck the problem again: keep your answer if you are sure of it, else correct it."
        )
        prompts[agent] = with_feedback(prompt, report)
    return prompts


class MathTool(Task):
    """Arithmetic word problems with a tool agent (Python, run in the sandbox) and a reasoner (words): both answer,
    then each sees the other's answer and may revise, until they agree or `num_turns` (4) is reached. Local rewards:
    each agent's exact correctness; team: both correct. Offline generated problems by default (`steps`,
    `max_number`); `MathTool(source="hub")` loads GSM8K."""

    name = "math_tool"
    agents = MATH_AGENTS
    num_turns = NUM_TURNS
    scheduler = "debate"  # both answer at once; from the second turn each sees the other's previous answer
    reward_funcs = [math_both_correct]
    local_reward_funcs = {TOOL: [tool_correct], REASONER: [reasoner_correct]}

    def __init__(self, source: str = "offline", steps: int = 3, max_number: int = 20):
        if source not in SOURCES:
            raise ValueError(f"Unknown math_tool data source {source!r}: use one of {list(SOURCES)}.")
        arithmetic_problem(random.Random(0), steps, max_number)  # checks the difficulty settings now
        self.source, self.steps, self.max_number = source, steps, max_number

    def dataset(self, split: str = "train") -> Dataset:
        if self.source == "hub":
            return gsm8k_dataset(split)
        return arithmetic_dataset(split, self.steps, self.max_number)

    def reset(self, example: dict) -> dict:
        """Each agent's latest answer: none yet."""
        return {TOOL: "", REASONER: ""}

    def step(self, state: dict, agent: str, action: str, turn: int) -> dict:
        """An agent's answer replaces its previous one; an agent with another name (the `single` evaluation baseline's
        lone agent) stands for both."""
        if agent != REASONER:
            state[TOOL] = action
        if agent != TOOL:
            state[REASONER] = action
        return state

    def success(self, example: dict, state: dict, completions: dict) -> bool:
        """Both agents' final answers are the problem's."""
        expected = example["answer"]
        return _correct(agent_answer(TOOL, state[TOOL]), expected) and _correct(
            final_answer(state[REASONER]), expected
        )

    def transition(self, **kwargs):
        return math_feedback(**kwargs)
