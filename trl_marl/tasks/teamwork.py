"""Teamwork tasks (docs/benchmarks.md#teamwork). The first two were meant to need the team's reward and turned out not
to (a per-role reward is nearly or exactly aligned with the team's: see the benchmark's "In hindsight"); the last two
are built so that it provably does.

- `distinct_items` (MAGRPO, one turn): two teammates each name `count` members of a category at once, without seeing
  each other. The team reward counts the distinct valid members of both lists together. Each one's natural own reward
  (valid members in my own list, `own_items_reward`, the task's local reward) is met in full when both name the same
  best-known members, which halves the team's score; but the team reward is the mean of the own rewards minus the
  overlap / 6, so the own rewards' best outcomes include the team's.
- `pick_new` (AT-GRPO, three turns): a category's options, some of them already named; `first` then `second` (then
  `first` again, if the team is not done) each name one option. The team must add `goal` new options: the second
  teammate's best answer depends on the one its teammate chose. The environment state (what has been named) is in
  every prompt, a solved episode stops, and an answer counts only when it names exactly one option, so repeating the
  prompt scores nothing. Its team reward is the running total (`new_options_reward`, what AT-GRPO scores each
  candidate's state with); MAGRPO, which sums a turn's rewards into returns, trains on each answer's gain
  (`new_option_gain`).

- `congestion` (MAGRPO, one turn): four options worth 4/3/2/1, two blind picks; the team scores its distinct picks,
  each agent's own reward its own pick. Per-role rewards lead both to the top option (4/7); the team's optimum is the
  top and the second (1.0), which needs the agents to answer the same prompt differently.
- `pick_new_hidden` (AT-GRPO, two turns): `pick_new` whose second prompt hides the first pick, so both agents get
  the same task text (only their system prompts differ) and must follow different conventions; with its one-agent
  baseline (`solo_dataset`).
- `pick_new_sparse` (MAAC / IAC / MAGRPO, four turns): `pick_new` with both teammates naming an option at every turn
  (blind to each other within a turn), the team to name all four options not yet named, and the team reward only at
  the episode's end (`final_new_options_reward`: 0 at every earlier turn): the long-horizon, sparse-reward regime a
  learned critic is for (docs/critics.md).

Offline data: the categories of `categories.py`; held-out problems are never trained on. `pick_new` and the tasks
after it have two held-out splits: `"eval"`, 64 problems of the training categories, and `"unseen"`, 64
problems of eight categories that no training problem comes from (`UNSEEN_CATEGORIES`).
"""

import itertools
import random
import re

from datasets import Dataset

from ..rollouts.rollout import NextTurn
from .base import Task
from .categories import CATEGORIES, UNSEEN_CATEGORIES, listed_items, mentioned

TEAMMATES = [
    {"name": "first", "system_prompt": "You are the first of two teammates."},
    {"name": "second", "system_prompt": "You are the second of two teammates."},
]
EVAL_PROBLEMS = 64
HELD_OUT_SPLITS = ("eval", "unseen")  # of the tasks that draw options from categories: see the module's docstring

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


def pick_dataset(size: int, seed: int, leave_out: set = frozenset(), categories: dict = CATEGORIES) -> list[tuple]:
    rng = random.Random(seed)
    problems, seen = [], set(leave_out)
    while len(problems) < size:
        category = rng.choice(list(categories))
        options = rng.sample(categories[category][:OPTIONS_FROM], min(OPTIONS, len(categories[category])))
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
        """`"train"`, `"eval"` (held out, of the training categories) or `"unseen"` (held out, of categories never
        trained on)."""
        check_split(split)
        held_out = pick_dataset(EVAL_PROBLEMS, seed=1)
        if split == "eval":
            problems = held_out
        elif split == "unseen":
            problems = pick_dataset(EVAL_PROBLEMS, seed=1, categories=UNSEEN_CATEGORIES)
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


# ----------------------------------------------------------------------------------------------------- congestion

POINTS = (4, 3, 2, 1)  # the options' worth, best first


def congestion_prompt(options: list[str]) -> list[dict]:
    listed = ", ".join(f"{option} ({points} points)" for option, points in zip(options, POINTS))
    content = (
        f"Options, best first: {listed}. Pick one option; your teammate picks one too, without seeing yours, and an "
        "option picked twice counts once. Reply with only that word."
    )
    return [{"role": "user", "content": content}]


def option_points(text: str, options: list[str]) -> int:
    """The points of the option an answer names, when it names exactly one; else 0."""
    choice = picked(text, options)
    return POINTS[options.index(choice)] if choice is not None else 0


def congestion_reward(prompts, completions, options, **kwargs) -> list[float]:
    """Team reward in [0, 1]: the points of the distinct options the team picked, over 7 (the best two, 4 + 3)."""
    rewards = []
    for completion, listed in zip(completions, options):
        choices = {picked(text, listed) for text in completion.values()} - {None}
        rewards.append(sum(POINTS[listed.index(choice)] for choice in choices) / (POINTS[0] + POINTS[1]))
    return rewards


def own_points_reward(prompts, completions, options, **kwargs) -> list[float]:
    """Each agent's own reward (a local reward): the points of its own pick, over 4; blind to its teammate's."""
    return [option_points(text, listed) / POINTS[0] for text, listed in zip(completions, options)]


class Congestion(Task):
    """A congestion game in which rewarding each agent for its own part provably misleads the team.

    Four options of a category are listed best first, worth 4, 3, 2 and 1 points; `first` and `second` pick one each,
    at once and blind to each other. The team scores the points of its *distinct* picks over 7
    (`congestion_reward`); each agent's own reward is its own pick's points over 4 (`own_points_reward`).

    Why the per-role reward misleads: an agent's own reward does not depend on its teammate's pick, and is largest
    for the top option whatever the teammate does, so taking the top option is each agent's dominant strategy. When
    both follow it they collide, and the team scores 4/7 ≈ 0.571. The team's optimum is the top option and the second
    (in either order), 7/7 = 1.0; it needs the two agents to pick *differently* from the same prompt, a convention
    that only the team reward pays for (against 4/7, the agent that gives up the top option loses 1/4 of its own
    reward). `tests/test_teamwork.py` checks both optima by enumerating every pair of picks.

    The problems are every choice of four members among a category's first twelve, in a shuffled order; 64 are held
    out for evaluation.
    """

    name = "congestion"
    agents = TEAMMATES
    scheduler = "parallel"
    reward_funcs = [congestion_reward]
    local_reward_funcs = {"first": [own_points_reward], "second": [own_points_reward]}

    def dataset(self, split: str = "train") -> Dataset:
        """`"train"`, `"eval"` (held out, training categories) or `"unseen"` (held out, categories never trained on).
        The first two come from one draw of ordered option lists, so an `"eval"` problem may list a training
        problem's options in another order (12 of the 64 do); `"unseen"` shares no option with training."""
        check_split(split)
        categories = UNSEEN_CATEGORIES if split == "unseen" else CATEGORIES
        size = EVAL_PROBLEMS if split == "unseen" else 512 + EVAL_PROBLEMS
        rng = random.Random(0)
        problems, seen = [], set()
        while len(problems) < size:
            category = rng.choice(list(categories))
            options = rng.sample(categories[category][:OPTIONS_FROM], len(POINTS))
            if tuple(options) not in seen:
                seen.add(tuple(options))
                problems.append(options)
        problems = problems[EVAL_PROBLEMS:] if split == "train" else problems[:EVAL_PROBLEMS]
        return Dataset.from_dict({"prompt": [congestion_prompt(options) for options in problems], "options": problems})


# ------------------------------------------------------------------------------------------------ pick_new_hidden


class PickNewHidden(PickNew):
    """`pick_new` in two turns whose prompts hide the first pick: `first`, then `second`, each name one option not yet
    named, and both get the same task text (the options and the two named before the team started; the
    `round_robin_blind` scheduler adds nothing said before; only the system prompt names the role). The team must add
    two new options, so the two agents must answer the same text differently: a convention (say, the first unnamed
    option for `first`, the second for `second`) that each must learn in its own role. A policy that answers the text
    alike in both roles solves no problem, and every answer the second agent gives that repeats the first's is lost:
    separate adapters can each learn one convention; one shared adapter must learn to tell the roles apart by their
    system prompt.

    `solo_dataset` and `two_new_options_reward` pose the same problems to one agent alone (the papers' single-agent
    baseline): name two options not yet named in one answer. `exactly_two_new_options_reward` holds that answer
    as strictly as the team's two answers are held (at most two options named); `two_new_options_reward`, the
    benchmark's version 2 scorer, took the first two options named and ignored the rest.
    """

    name = "pick_new_hidden"
    num_turns = 2
    scheduler = "round_robin_blind"  # each agent sees its prompt only, not what was said before

    def transition(self, state, options, named, goal, **kwargs):
        if state["new"] >= goal:
            return NextTurn(done=True)
        return [pick_prompt(options, named)] * len(self.agents)  # what was named before the team, not since

    def solo_dataset(self, split: str = "train") -> Dataset:
        """The same problems for one agent doing both picks: a TRL `GRPOTrainer` dataset."""
        problems = self.dataset(split)
        prompts = [two_picks_prompt(options, named) for options, named in zip(problems["options"], problems["named"])]
        return problems.remove_columns("prompt").add_column("prompt", prompts)


def two_picks_prompt(options: list[str], named: list[str]) -> list[dict]:
    content = (
        f"Options: {', '.join(options)}. Already named: {', '.join(named)}. Name two options that are not named yet. "
        "Reply with only those two words, separated by a comma."
    )
    return [{"role": "user", "content": content}]


def exactly_two_new_options_reward(prompts, completions, options, named, goal, **kwargs) -> list[float]:
    """The one-agent baseline's reward in [0, 1], a TRL reward function held as strictly as the team: an answer that
    names more than `goal` options scores 0 (as a teammate's answer that names more than one option counts for
    nothing, so that echoing the option list is worth nothing); otherwise the distinct options it names that were not
    named yet, over `goal` (as `new_options_reward` scores a team's `goal` picks: a repeat, or an option named before,
    adds nothing). Other words around the options are allowed, as they are in a teammate's answer."""
    rewards = []
    for completion, listed, already, target in zip(completions, options, named, goal):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        choices = mentioned(text, listed)
        new = [option for option in choices if option not in already] if len(choices) <= target else []
        rewards.append(min(1.0, len(new) / target))
    return rewards


def two_new_options_reward(prompts, completions, options, named, goal, **kwargs) -> list[float]:
    """The one-agent baseline's reward of the benchmark's version 2, kept to reproduce it; superseded by
    `exactly_two_new_options_reward`, because it is more lenient than the team's count: the distinct options not yet
    named among the first two the answer names, over `goal`, whatever else it names (echoing the prompt's option
    list scores 0.67 on average, where a team that does so scores 0)."""
    rewards = []
    for completion, listed, already, target in zip(completions, options, named, goal):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        first_two = [option for option in mentioned_in_order(text, listed)][:2]
        rewards.append(min(1.0, len({option for option in first_two if option not in already}) / target))
    return rewards


# ------------------------------------------------------------------------------------------------ pick_new_sparse


def sparse_prompt(options: list[str], named: list[str], turn: int, num_turns: int) -> list[dict]:
    """`pick_prompt` headed by the turn (1-based) and the episode's length: where a critic reads only the prompt, the
    same options and picks are worth less with fewer turns left."""
    content = pick_prompt(options, named)[0]["content"]
    return [{"role": "user", "content": f"Turn {turn + 1} of {num_turns}. {content}"}]


def final_new_options_reward(prompts, completions, state, goal, num_turns, turn, **kwargs) -> list[float]:
    """Sparse team reward: 0 until the episode's last turn (the team done, or turn `num_turns` − 1), then the new
    options the team named, over `goal` (`new_options_reward`'s value at the end). Summed over an episode's turns it is
    that final value, for the algorithms that sum a turn's rewards into returns (MAGRPO, the critics' λ-returns).
    `num_turns` is the dataset's column (the task's horizon); a turn past it is refused (a run longer than the task
    would be paid at every extra turn)."""
    late = [t for t, n in zip(turn, num_turns) if t >= n]
    if late:
        raise ValueError(
            f"final_new_options_reward: turn {late[0]} is past the episode's {num_turns[0]} turns (the dataset's "
            f"`num_turns` column): train pick_new_sparse with `num_turns={num_turns[0]}`, the task's own."
        )
    last = [s["new"] >= g or t >= n - 1 for s, g, n, t in zip(state, goal, num_turns, turn)]
    return [min(1.0, s["new"] / g) if end else 0.0 for s, g, end in zip(state, goal, last)]


class PickNewSparse(PickNew):
    """`pick_new` over four turns at which both teammates name an option at once (the `parallel_blind` scheduler: each
    is shown the turn, the options and those named so far, not what its teammate says); the team must name every option
    not named yet (`goal` = 4 of the 6), and is rewarded only at the end: `final_new_options_reward`, 0 at every
    earlier turn. Two blind picks of one turn that coincide, or a pick of an option already named, waste a turn's
    answer; the episode stops once the team is done. No reward at the turns before the last, so AT-GRPO (which scores
    each turn's candidates by the team reward at that turn) has no signal there: the task is for methods that credit a
    trajectory's end back to its turns, a learned critic or MAGRPO's tree of returns."""

    name = "pick_new_sparse"
    num_turns = 4
    scheduler = "parallel_blind"
    reward_funcs = [final_new_options_reward]
    local_reward_funcs = {}
    goal = OPTIONS - ALREADY_NAMED

    def dataset(self, split: str = "train") -> Dataset:
        """`pick_new`'s problems, each prompt headed by "Turn 1 of 4.", with the horizon as a column (`num_turns`)."""
        problems = super().dataset(split).remove_columns("prompt")
        prompts = [sparse_prompt(o, n, 0, self.num_turns) for o, n in zip(problems["options"], problems["named"])]
        return problems.add_column("prompt", prompts).add_column("num_turns", [self.num_turns] * len(problems))

    def transition(self, state, options, goal, turn, num_turns, **kwargs):
        if state["new"] >= goal:
            return NextTurn(done=True)
        return [sparse_prompt(options, state["named"], turn + 1, num_turns)] * len(self.agents)


def check_split(split: str) -> None:
    if split not in ("train", *HELD_OUT_SPLITS):
        raise ValueError(
            f"`split` must be 'train' or one of the held-out splits {list(HELD_OUT_SPLITS)}, got {split!r}."
        )


def mentioned_in_order(text: str, options: list[str]) -> list[str]:
    """The `options` that `text` names, in the order it names them."""
    found = mentioned(text, options)
    lowered = text.lower()
    return sorted(found, key=lambda option: lowered.find(option) if option in lowered else len(lowered))
