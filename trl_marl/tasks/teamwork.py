"""Two tasks built so that only the team's reward says what the team must do (docs/benchmarks.md#teamwork):

- `distinct_items` (MAGRPO, one turn): two teammates each name `count` members of a category at once, without seeing
  each other. The team reward counts the distinct valid members of both lists together. Each one's natural own reward
  (valid members in my own list, `own_items_reward`, the task's local reward) is met in full when both name the same
  best-known members, which halves the team's score: the division of labour can only be found through the team reward.
- `pick_new` (AT-GRPO, three turns): a category's options, some of them already named; `first` then `second` (then
  `first` again, if the team is not done) each name one option. The team must add `goal` new options: the second
  teammate's best answer depends on the one its teammate chose. The environment state (what has been named) is in
  every prompt, a solved episode stops, and an answer counts only when it names exactly one option, so repeating the
  prompt scores nothing. Its team reward is the running total (`new_options_reward`, what AT-GRPO scores each
  candidate's state with); MAGRPO, which sums a turn's rewards into returns, trains on each answer's gain
  (`new_option_gain`).

Offline data: the categories of `categories.py`; held-out problems are never trained on.
"""

import itertools
import random
import re

from datasets import Dataset

from ..rollout import NextTurn
from .base import Task
from .categories import CATEGORIES, listed_items, mentioned

TEAMMATES = [
    {"name": "first", "system_prompt": "You are the first of two teammates."},
    {"name": "second", "system_prompt": "You are the second of two teammates."},
]
EVAL_PROBLEMS = 64

# ------------------------------------------------------------------------------------------------- distinct_items

LIST_CATEGORIES = [name for name, members in CATEGORIES.items() if len(members) >= 20]
BEST_KNOWN = 8  # the excluded members of a problem are two of the category's first eight


def named_members(text: str, category: str, excluded: list[str], count: int) -> list[str]:
    """The valid members among the first `count` items of a listed answer, excluded ones and repeats left out."""
    members = set(CATEGORIES[category])
    found = [item for item in listed_items(text, category)[:count] if item in members and item not in excluded]
    return list(dict.fromkeys(found))


def distinct_items_reward(prompts, completions, category, excluded, count, **kwargs) -> list[float]:
    """Team reward in [0, 1]: the distinct valid members that the team named (each agent's first `count` items,
    excluded members not counted), over `count` × the number of agents."""
    rewards = []
    for completion, name, left_out, n in zip(completions, category, excluded, count):
        union = set().union(*(named_members(text, name, left_out, n) for text in completion.values()))
        rewards.append(len(union) / (n * len(completion)))
    return rewards


def own_items_reward(prompts, completions, category, excluded, count, **kwargs) -> list[float]:
    """Each agent's own reward (a local reward: one string per completion): the distinct valid members in its own
    first `count` items, over `count`; blind to what the teammate named."""
    return [len(named_members(text, *row)) / row[2] for text, row in zip(completions, zip(category, excluded, count))]


def list_prompt(category: str, excluded: list[str], count: int) -> list[dict]:
    content = (
        f"Name {count} {category}, but not {excluded[0]} or {excluded[1]}. Reply with the names only, separated by "
        "commas."
    )
    return [{"role": "user", "content": content}]


class DistinctItems(Task):
    """Two teammates each name three members of a category, at once; the team scores its distinct valid members."""

    name = "distinct_items"
    agents = TEAMMATES
    scheduler = "parallel"
    reward_funcs = [distinct_items_reward]
    local_reward_funcs = {"first": [own_items_reward], "second": [own_items_reward]}
    count = 3

    def dataset(self, split: str = "train") -> Dataset:
        problems = [
            (category, list(pair))
            for category in LIST_CATEGORIES
            for pair in itertools.combinations(CATEGORIES[category][:BEST_KNOWN], 2)
        ]
        random.Random(0).shuffle(problems)
        problems = problems[:EVAL_PROBLEMS] if split == "eval" else problems[EVAL_PROBLEMS:]
        return Dataset.from_dict(
            {
                "prompt": [list_prompt(category, excluded, self.count) for category, excluded in problems],
                "category": [category for category, _ in problems],
                "excluded": [excluded for _, excluded in problems],
                "count": [self.count] * len(problems),
            }
        )


# ------------------------------------------------------------------------------------------------------- pick_new

OPTIONS, ALREADY_NAMED, OPTIONS_FROM = 6, 2, 12  # options per problem, named before the team starts, drawn from


def pick_prompt(options: list[str], named: list[str]) -> list[dict]:
    content = (
        f"Options: {', '.join(options)}. Already named: {', '.join(named)}. Name one option that is not named yet. "
        "Reply with only that word."
    )
    return [{"role": "user", "content": content}]


def picked(text: str, options: list[str]) -> str | None:
    """The option an answer names, when it names exactly one; else None."""
    named = mentioned(text, options)
    return named[0] if len(named) == 1 else None


def new_options_reward(prompts, completions, state, goal, **kwargs) -> list[float]:
    """Team reward in [0, 1]: the new options the team has named so far, over `goal`; 1 once the team is done."""
    return [min(1.0, s["new"] / g) for s, g in zip(state, goal)]


def new_option_gain(prompts, completions, state, goal, **kwargs) -> list[float]:
    """What the latest answer added to `new_options_reward`: 1 / `goal` when it named a new option, else 0. Summed over
    an episode's turns it is the episode's `new_options_reward`, so it suits algorithms that sum a turn's rewards into
    returns (MAGRPO), where the running total would pay an episode more for solving later."""
    return [1.0 / g if s["picks"] and s["picks"][-1][2] else 0.0 for s, g in zip(state, goal)]


def one_option(prompts, completions, options, **kwargs) -> list[float]:
    """Local reward: 1 when the answer is one option and nothing else, 0.5 when it names exactly one option among other
    words, else 0 (no option, or several)."""
    rewards = []
    for text, listed in zip(completions, options):
        choice = picked(text, listed)
        words = re.sub(r"[^a-z]+", " ", text.lower()).split()
        bare = choice is not None and len(words) == len(choice.split())
        rewards.append(0.0 if choice is None else 1.0 if bare else 0.5)
    return rewards


def pick_dataset(size: int, seed: int, leave_out: set = frozenset()) -> list[tuple]:
    rng = random.Random(seed)
    problems, seen = [], set(leave_out)
    while len(problems) < size:
        category = rng.choice(list(CATEGORIES))
        options = rng.sample(CATEGORIES[category][:OPTIONS_FROM], min(OPTIONS, len(CATEGORIES[category])))
        named = rng.sample(options, ALREADY_NAMED)
        key = (category, frozenset(options), frozenset(named))
        if key not in seen:
            seen.add(key)
            problems.append((category, options, named))
    return problems


class PickNew(Task):
    """A category's options, two already named: `first`, `second`, then `first` again each name one option, until the
    team has named `goal` new ones. The state (what has been named) is in every prompt; a solved episode stops."""

    name = "pick_new"
    agents = TEAMMATES
    num_turns = 3
    scheduler = "round_robin"
    reward_funcs = [new_options_reward]
    local_reward_funcs = {"first": [one_option], "second": [one_option]}
    goal = 2
    train_problems = 512

    def dataset(self, split: str = "train") -> Dataset:
        held_out = pick_dataset(EVAL_PROBLEMS, seed=1)
        if split == "eval":
            problems = held_out
        else:
            keys = {(c, frozenset(o), frozenset(n)) for c, o, n in held_out}
            problems = pick_dataset(self.train_problems, seed=0, leave_out=keys)
        return Dataset.from_dict(
            {
                "prompt": [pick_prompt(options, named) for _, options, named in problems],
                "category": [category for category, _, _ in problems],
                "options": [options for _, options, _ in problems],
                "named": [named for _, _, named in problems],
                "goal": [self.goal] * len(problems),
            }
        )

    def reset(self, example):
        return {"options": list(example["options"]), "named": list(example["named"]), "new": 0, "picks": []}

    def step(self, state, agent, action, turn):
        choice = picked(action, state["options"])
        state["picks"].append((agent, choice, choice is not None and choice not in state["named"]))
        if state["picks"][-1][2]:
            state["named"].append(choice)
            state["new"] += 1
        return state

    def success(self, example, state, completions):
        return state["new"] >= example["goal"]

    def transition(self, state, options, goal, **kwargs):
        if state["new"] >= goal:
            return NextTurn(done=True)
        return [pick_prompt(options, state["named"])] * len(self.agents)
