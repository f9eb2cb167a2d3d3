"""The toy tasks, small and offline, usable by name (`MAGRPOTrainer(task="explain")`, `trl-marl train`): `explain`,
`describe_word` and `reach_target`; and two general team rewards, `answer_match` and `word_budget`."""

import random
import re

from datasets import Dataset

from .base import Task
from .completions import completion_text

EXPLAIN_AGENTS = [
    {"name": "concise", "system_prompt": "Give only the short answer, in a few words."},
    {"name": "detailed", "system_prompt": "Explain the answer in two or three sentences."},
]
TARGET_RATIO = 3.0


def explain_ratio_reward(prompts, completions, **kwargs):
    """Team reward in [0, 1]: 0 when either agent is silent, else `clip((w_detailed / w_concise - 1) / 2, 0, 1)`
    with `w` the word counts, so 1 once the explanation is three times as long as the answer."""
    rewards = []
    for completion in completions:
        concise, detailed = len(completion["concise"].split()), len(completion["detailed"].split())
        if concise == 0 or detailed == 0:
            rewards.append(0.0)
            continue
        rewards.append(min(1.0, max(0.0, (detailed / concise - 1.0) / (TARGET_RATIO - 1.0))))
    return rewards


def question_dataset(seed: int = 0) -> Dataset:
    """Short factual questions, generated offline (arithmetic, opposites, colours, counts), shuffled with `seed`."""
    opposites = ["hot", "big", "fast", "happy", "early", "light", "open", "full", "strong", "old", "up", "wet"]
    colours = ["grass", "snow", "the sky", "a banana", "coal", "a tomato", "milk", "an orange", "blood", "the sun"]
    counts = [
        ("days", "week"),
        ("months", "year"),
        ("minutes", "hour"),
        ("hours", "day"),
        ("legs", "spider"),
        ("wheels", "bicycle"),
        ("sides", "triangle"),
        ("seconds", "minute"),
    ]
    questions = [f"What is {a} plus {b}?" for a in (3, 7, 12, 25) for b in (4, 9, 16)]
    questions += [f"What is the opposite of {word}?" for word in opposites]
    questions += [f"What colour is {thing}?" for thing in colours]
    questions += [f"How many {small} are in a {big}?" for small, big in counts]
    random.Random(seed).shuffle(questions)
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": q}] for q in questions]})


class Explain(Task):
    """Short questions: `concise` answers, `detailed` explains; rewarded when the explanation is 3x the answer."""

    name = "explain"
    agents = EXPLAIN_AGENTS
    reward_funcs = [explain_ratio_reward]
    eval_questions = 12

    def dataset(self, split: str = "train") -> Dataset:
        questions = question_dataset(0)
        held_out = range(self.eval_questions)
        return questions.select(held_out if split == "eval" else range(self.eval_questions, len(questions)))


DESCRIBE_AGENTS = [
    {"name": "plain", "system_prompt": "Describe the word simply, as for a child."},
    {"name": "precise", "system_prompt": "Describe the word precisely, like a dictionary."},
]
WORDS = (
    "apple bridge candle desert engine feather garden harbor island jacket kettle ladder magnet needle ocean pencil "
    "planet river saddle tunnel umbrella violin window yogurt zipper anchor basket castle dolphin forest glacier "
    "hammer lantern mirror orchard pillow rocket shovel tiger volcano wallet"
).split()


def word_count(text: str) -> int:
    return len(text.split())


def follows_the_rules(text: str, word: str, limit: int) -> bool:
    return 0 < word_count(text) <= limit and word.lower() not in text.lower()


def brief_description_reward(prompts, completions, word, word_limit, **kwargs):
    """Share of agents whose answer is non-empty, has at most `word_limit` words and does not contain `word`."""
    return [
        sum(follows_the_rules(text, w, limit) for text in completion.values()) / len(completion)
        for completion, w, limit in zip(completions, word, word_limit)
    ]


def word_count_feedback(prompt, joint_action, history, turn, word, word_limit, **kwargs):
    """External feedback between turns, private to each agent: what its own answer did wrong."""
    prompts = []
    for name, text in joint_action.items():
        problems = []
        if word_count(text) > word_limit:
            problems.append(f"it has {word_count(text)} words, more than {word_limit}")
        if word.lower() in text.lower():
            problems.append(f"it uses the word '{word}' itself")
        if word_count(text) == 0:
            problems.append("it is empty")
        verdict = "it breaks the rules: " + "; ".join(problems) if problems else "it follows the rules"
        feedback = f"Checker: your answer ([{name}]) {verdict}."
        prompts.append([*prompt[:-1], {"role": "user", "content": f"{prompt[-1]['content']}\n\n{feedback}"}])
    return prompts


def word_dataset(words: list[str], limit: int) -> Dataset:
    return Dataset.from_dict(
        {
            "prompt": [
                [{"role": "user", "content": f"Describe '{w}' in at most {limit} words, without using the word."}]
                for w in words
            ],
            "word": words,
            "word_limit": [limit] * len(words),
        }
    )


class DescribeWord(Task):
    """Describe a word in a few words without using it, in two turns with a checker's private feedback between."""

    name = "describe_word"
    agents = DESCRIBE_AGENTS
    num_turns = 2
    reward_funcs = [brief_description_reward]
    word_limit = 8
    eval_words = 6

    def dataset(self, split: str = "train") -> Dataset:
        words = list(WORDS)
        random.Random(0).shuffle(words)
        words = words[: self.eval_words] if split == "eval" else words[self.eval_words :]
        return word_dataset(words, self.word_limit)

    def transition(self, **kwargs):
        return word_count_feedback(**kwargs)


REACH_AGENTS = [
    {"name": "mover", "system_prompt": "You move the counter first. Reply with only the whole number to add."},
    {"name": "finisher", "system_prompt": "You move after your teammate. Reply with only the whole number to add."},
]
MOVE = re.compile(r"[-+]?\d+")
MAX_MOVE = 1000


def parse_move(text: str) -> int | None:
    """The first whole number in `text` (clamped to ±1000), or None."""
    match = MOVE.search(text)
    return None if match is None else max(-MAX_MOVE, min(MAX_MOVE, int(match.group())))


def reach_target_reward(prompts, completions, state, start, target, **kwargs):
    """Team reward in [0, 1]: how much of the way from `start` to `target` the counter has come,
    `1 − min(1, |target − value| / |target − start|)`; 1 exactly on target."""
    return [
        1.0 - min(1.0, abs(goal - s["value"]) / max(1, abs(goal - first)))
        for s, first, goal in zip(state, start, target)
    ]


def is_a_number(prompts, completions, **kwargs):
    """Local reward: 1 when the answer is a whole number and nothing else, 0.5 when it contains one, else 0."""
    return [
        1.0 if re.fullmatch(r"\s*[-+]?\d+\s*\.?\s*", text) else 0.5 if MOVE.search(text) else 0.0
        for text in completions
    ]


def reach_target_dataset(size: int, seed: int) -> Dataset:
    rng = random.Random(seed)
    starts = [rng.randint(0, 20) for _ in range(size)]
    targets = [start + rng.randint(3, 20) for start in starts]
    prompts = [
        [
            {
                "role": "user",
                "content": f"A counter starts at {start}. The team must bring it to exactly {target}. Each move adds "
                "one whole number (it may be negative). What number do you add?",
            }
        ]
        for start, target in zip(starts, targets)
    ]
    return Dataset.from_dict({"prompt": prompts, "start": starts, "target": targets})


class ReachTarget(Task):
    """A generated puzzle with an environment state: a counter starts at `start`; the agents take turns adding whole
    numbers to it (`mover`, then `finisher`, who sees the move) and succeed when it reads `target`. Team reward: the
    share of the distance covered; each agent's local reward: answering with a number. Two turns. A small example of
    an environment state; the default model rarely answers with a number, so the AT-GRPO benchmark uses `pick_new`
    (`teamwork.py`) instead."""

    name = "reach_target"
    agents = REACH_AGENTS
    num_turns = 2
    scheduler = "sequential"
    reward_funcs = [reach_target_reward]
    local_reward_funcs = {"mover": [is_a_number], "finisher": [is_a_number]}

    def dataset(self, split: str = "train") -> Dataset:
        return reach_target_dataset(16 if split == "eval" else 128, seed=1 if split == "eval" else 0)

    def reset(self, example):
        return {"value": example["start"], "moves": []}

    def step(self, state, agent, action, turn):
        move = parse_move(action)
        state["moves"].append((agent, move))
        if move is not None:
            state["value"] += move
        return state

    def success(self, example, state, completions):
        return state["value"] == example["target"]

    def transition(self, prompt, state, target, **kwargs):
        content = (
            f"The counter now reads {state['value']}. The team must bring it to exactly {target}. What number do you "
            "add?"
        )
        return [[{"role": "user", "content": content}]] * len(self.agents)


# ---------------------------------------------------------------------------------------------------------- rewards
# General team rewards, usable by name with any dataset that has their columns. Each is
# `f(prompts, completions, **kwargs) -> list[float | None]`, where a completion maps agent name -> text and kwargs
# carry the dataset columns.


def answer_match(prompts, completions, answer, **kwargs) -> list[float]:
    """Share of agents whose answer contains the dataset's `answer` column as a whole word (case-insensitive)."""
    rewards = []
    for completion, expected in zip(completions, answer):
        pattern = re.compile(rf"(?<!\w){re.escape(str(expected).strip())}(?!\w)", re.IGNORECASE)
        rewards.append(
            sum(bool(pattern.search(completion_text(text))) for text in completion.values()) / len(completion)
        )
    return rewards


def word_budget(prompts, completions, word_limit, **kwargs) -> list[float]:
    """Share of agents whose answer is non-empty and has at most `word_limit` words (a dataset column)."""
    return [
        sum(0 < len(completion_text(text).split()) <= limit for text in completion.values()) / len(completion)
        for completion, limit in zip(completions, word_limit)
    ]
