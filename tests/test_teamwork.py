"""The teamwork tasks (`distinct_items`, `pick_new`, `congestion`, `pick_new_hidden`): answers read leniently about
form and strictly about content, team rewards against hand-computed values, the per-role reward that misleads (by
enumeration for `congestion`), held-out problems never trained on, and `Team.play` over episodes that end at different
turns."""

import itertools

import pytest

from trl_marl import ATGRPOConfig, ATGRPOTrainer, MAGRPOConfig, MAGRPOTrainer, load_team
from trl_marl.rollouts.rollout import NextTurn
from trl_marl.tasks import resolve_task, task_defaults
from trl_marl.tasks.categories import ALIASES, CATEGORIES, UNSEEN_CATEGORIES, listed_items, mentioned
from trl_marl.tasks.teamwork import (
    EVAL_PROBLEMS,
    POINTS,
    PickNew,
    PickNewHidden,
    PickNewSparse,
    congestion_reward,
    distinct_items_reward,
    exactly_two_new_options_reward,
    final_new_options_reward,
    new_option_gain,
    new_options_reward,
    one_option,
    own_items_reward,
    own_points_reward,
    pick_prompt,
    picked,
    two_new_options_reward,
)

ROW = {"category": ["colours"], "excluded": [["black", "white"]], "count": [3]}


def test_a_listed_answer_is_read_through_numbering_markdown_articles_plurals_and_descriptions():
    text = "1. **Lions** (big cats)\n2. The Tigers - striped\n3. `mice` and a Zebra: stripes too\n4. Toyota"
    assert listed_items(text, "animals") == ["lion", "tiger", "mouse", "zebra", "toyota"]
    assert listed_items("Cherries, peaches", "fruits") == ["cherry", "peach"]
    # not a vegetable: kept as written, in its place; an alias ("bell pepper") counts as its member
    assert listed_items("Bell peppers, cherries; sweet potatoes", "vegetables") == [
        "pepper",
        "cherries",
        "sweet potato",
    ]
    assert listed_items("Red | Grays | Blue", "colours") == ["red", "grey", "blue"]
    assert listed_items("Chimps, Bunnies, Wolves, Hippopotamuses", "animals") == [
        "chimpanzee",
        "rabbit",
        "wolf",
        "hippo",
    ]


@pytest.mark.parametrize(
    "answer",
    [
        "Here are three fruits:\n1. Apple\n2. Banana\n3. Cherry",  # a preamble takes no place
        "Sure! Here are 3 fruits: apple, banana, cherry.",  # label: items
        "Fruit 1: Apple\nFruit 2: Banana\nFruit 3: Cherry",
        "1 - Apple\n2 - Banana\n(3) Cherry",
        "1. Apple (red or green)\n2. Banana: yellow, long\n3. Cherry",  # asides and descriptions add no item
        "Apple, Banana, And Cherry",
    ],
)
def test_the_forms_small_models_list_in_all_read_as_the_same_three_members(answer):
    assert listed_items(answer, "fruits") == ["apple", "banana", "cherry"]


def test_team_reward_counts_distinct_valid_members_of_both_lists_over_count_times_agents():
    same = {"first": "Red, Blue, Green", "second": "red, blue, green"}
    split = {"first": "Red, Blue, Green", "second": "Yellow, Pink, Orange"}
    # excluded members, non-members and items past the third do not count; a repeat within one list counts once
    messy = {"first": "Black, Red, Red, Blue", "second": "White, Toyota, Purple, Pink"}
    rewards = distinct_items_reward(None, [same, split, messy], **{k: v * 3 for k, v in ROW.items()})
    assert rewards == [3 / 6, 6 / 6, 2 / 6]


def test_the_per_role_reward_is_full_when_both_name_the_same_members_the_team_reward_is_half():
    first, second = "Red, Blue, Green", "Red, Blue, Green"
    assert own_items_reward(None, [first, second], **{k: v * 2 for k, v in ROW.items()}) == [1.0, 1.0]
    assert distinct_items_reward(None, [{"first": first, "second": second}], **ROW) == [0.5]


def test_distinct_items_holds_out_64_problems_never_trained_on():
    task = resolve_task("distinct_items")
    train, held_out = task.dataset("train"), task.dataset("eval")
    assert len(held_out) == EVAL_PROBLEMS and len(train) > 2 * EVAL_PROBLEMS
    key = lambda row: (row["category"], tuple(row["excluded"]))  # noqa: E731
    assert not {key(row) for row in train} & {key(row) for row in held_out}
    row = held_out[0]
    assert row["excluded"][0] in CATEGORIES[row["category"]] and row["count"] == 3
    assert f"but not {row['excluded'][0]} or {row['excluded'][1]}" in row["prompt"][0]["content"]


def test_an_answer_picks_an_option_only_when_it_names_exactly_one():
    options = ["red", "blue", "green", "cherry"]
    assert picked("Blue.", options) == "blue"
    assert picked("I pick cherries", options) == "cherry"
    assert picked("red or blue", options) is None
    assert picked("Options: red, blue, green, cherry.", options) is None  # repeating the prompt names them all
    assert picked("purple", options) is None
    assert mentioned("Greens and REDS", options) == ["red", "green"]
    assert picked("Gray", ["grey", "red"]) == "grey" and picked("Feet.", ["foot", "hand"]) == "foot"  # aliases
    assert one_option(None, ["Blue", "I pick blue", "red, blue", "nothing"], [options] * 4) == [1.0, 0.5, 0.0, 0.0]


def play(task, row, answers):
    """Step `answers` (agent, text) through the task's environment; the team reward after each, and the transition."""
    state, rewards = task.reset(row), []
    for turn, (agent, text) in enumerate(answers):
        state = task.step(state, agent, text, turn)
        rewards.append(new_options_reward(None, [None], state=[state], goal=[row["goal"]])[0])
    return state, rewards


def test_pick_new_rewards_new_options_only_and_stops_once_the_team_has_two():
    task = PickNew()
    row = {"options": ["red", "blue", "green", "pink", "grey", "black"], "named": ["blue", "grey"], "goal": 2}
    answers = [("first", "blue"), ("second", "Red."), ("first", "red"), ("second", "pink")]
    state, rewards = play(task, row, answers)
    assert rewards == [0.0, 0.5, 0.5, 1.0]  # a named option and a repeat add nothing
    # each answer's gain (MAGRPO's turn rewards) sums to the running total at every turn
    gains, replay = [], task.reset(row)
    for turn, (agent, text) in enumerate(answers):
        replay = task.step(replay, agent, text, turn)
        gains += new_option_gain(None, [None], state=[replay], goal=[2])
    assert gains == [0.0, 0.5, 0.0, 0.5]
    assert state["named"] == ["blue", "grey", "red", "pink"]
    assert [new for _, _, new in state["picks"]] == [False, True, False, True]
    assert task.success(row, state, {}) is True
    assert task.transition(state=state, **row) == NextTurn(done=True)
    unsolved, _ = play(task, row, [("first", "red")])
    prompts = task.transition(state=unsolved, **row)
    assert len(prompts) == 2 and "Already named: blue, grey, red." in prompts[0][0]["content"]


def test_pick_new_sparse_pays_the_team_only_at_the_end_of_its_episode():
    task = PickNewSparse()
    assert (task.num_turns, task.scheduler, task.goal) == (4, "parallel_blind", 4)
    row = task.dataset("eval")[0]
    unnamed = [option for option in row["options"] if option not in row["named"]]
    # turn 0: both name the same new option (one counts); turn 1: a named one and a new one; turn 2: the last two
    turns = [[unnamed[0], unnamed[0]], [row["named"][0], unnamed[1]], [unnamed[2], unnamed[3]]]
    state, rewards = task.reset(row), []
    for turn, answers in enumerate(turns):
        for agent, text in zip(("first", "second"), answers):
            state = task.step(state, agent, text, turn)
        kwargs = {"goal": [row["goal"]], "num_turns": [row["num_turns"]], "turn": [turn]}
        rewards += final_new_options_reward(None, [None], state=[state], **kwargs)
        if turn < 2:  # not done: both act again, shown the next turn's number and what has been named
            prompts = task.transition(state=state, turn=turn, **row)
            assert len(prompts) == 2 and prompts[0][0]["content"].startswith(f"Turn {turn + 2} of 4. Options: ")
            assert f"Already named: {', '.join(state['named'])}." in prompts[0][0]["content"]
    assert rewards == [0.0, 0.0, 1.0]  # nothing before the end; solved at turn 2, which ends the episode
    assert task.transition(state=state, turn=2, **row) == NextTurn(done=True)
    assert row["prompt"][0]["content"].startswith("Turn 1 of 4. Options: ")
    # an episode that runs out of turns is paid what it named, at its last turn only
    state = task.reset(row)
    state = task.step(state, "first", unnamed[0], 0)
    ends = [final_new_options_reward(None, [None], [state], [4], [4], [turn])[0] for turn in range(4)]
    assert ends == [0.0, 0.0, 0.0, 0.25]
    with pytest.raises(ValueError, match=r"turn 4 is past the episode's 4 turns .*`num_turns=4`"):
        final_new_options_reward(None, [None], [state], [4], [4], [4])  # a run longer than the task


def test_pick_new_holds_out_64_problems_never_trained_on():
    task = PickNew()
    train, held_out = task.dataset("train"), task.dataset("eval")
    assert len(held_out) == EVAL_PROBLEMS and len(train) == task.train_problems
    key = lambda row: (row["category"], frozenset(row["options"]), frozenset(row["named"]))  # noqa: E731
    assert not {key(row) for row in train} & {key(row) for row in held_out}
    assert all(set(row["named"]) < set(row["options"]) for row in held_out)


def tiny_run(trainer_class, task, model_dir, folder):
    """One training step of `task`'s team on the tiny model (its trainer, for what it logged)."""
    config_class = ATGRPOConfig if trainer_class is ATGRPOTrainer else MAGRPOConfig
    args = config_class(
        output_dir=str(folder), **task_defaults(task), per_device_train_batch_size=2, num_generations=2,
        max_completion_length=4, max_steps=1, lora_r=4, lora_alpha=8, report_to="none", save_strategy="no",
        use_cpu=True,
    )  # fmt: skip
    trainer = trainer_class(model_dir, args=args, task=task)
    trainer.train()
    return trainer


def trained_team(task, model_dir, tmp_path):
    """`task`'s team after one AT-GRPO step on the tiny model, saved and loaded back."""
    tiny_run(ATGRPOTrainer, task, model_dir, tmp_path / "out").save_model(str(tmp_path / "team"))
    return load_team(tmp_path / "team")


@pytest.fixture
def pick_new_team(tiny_model_dir, tmp_path):
    return trained_team(PickNew(), tiny_model_dir, tmp_path)


def test_team_play_plays_each_row_to_its_own_end_and_returns_its_state(pick_new_team, monkeypatch):
    rows = PickNew().dataset("eval").select(range(3)).to_list()

    def answers(model_inputs, agent_index, max_new_tokens, do_sample, environments=None):
        # row 0 names its free options in order (done after 2 turns); row 1 repeats a named one; row 2 says nothing
        texts = []
        for messages in model_inputs:
            prompt = messages[-1]["content"]
            options = prompt.split("Options: ")[1].split(".")[0].split(", ")
            named = prompt.split("Already named: ")[1].split(".")[0].split(", ")
            row = next(i for i, r in enumerate(rows) if r["options"] == options)
            free = [o for o in options if o not in named]
            texts.append([free[0], named[0], "hmm"][row])
        return [[1]] * len(texts), [[2]] * len(texts), texts

    monkeypatch.setattr(pick_new_team, "_generate", answers)
    runs = pick_new_team.play(rows)
    assert [len(run.turns) for run in runs] == [2, 3, 3]
    assert [run.state["new"] for run in runs] == [2, 0, 0]
    assert runs[0].turns[1] == {"second": runs[0].state["named"][-1]}
    assert set(runs[0].latest) == {"first", "second"} and runs[2].latest["first"] == "hmm"
    single = pick_new_team.run(rows[1]["prompt"], **{k: v for k, v in rows[1].items() if k != "prompt"})
    assert single.turns == runs[1].turns and single.state == runs[1].state
    assert "Already named" in runs[0].observations[1]["second"][-1]["content"]


# congestion


def test_congestion_rewards_by_hand():
    options = [["apple", "pear", "plum", "fig"]]
    team = lambda first, second: congestion_reward(None, [{"first": first, "second": second}], options)[0]  # noqa: E731
    assert team("Apple", "pear.") == 1.0  # 4 + 3 of 7
    assert team("apple", "apple") == 4 / 7  # picked twice, counted once
    assert team("fig", "I pick plum") == 3 / 7
    assert team("apple and pear", "nothing") == 0.0  # two options is no pick
    assert own_points_reward(None, ["apple", "plum", "apples", "kiwi"], options * 4) == [1.0, 0.5, 1.0, 0.0]


def test_congestion_per_role_rewards_lead_both_to_the_top_option_which_the_team_reward_does_not():
    """The argument of `Congestion`'s docstring, by enumeration of every pair of answers (each option, or none)."""
    options = ["apple", "pear", "plum", "fig"]
    answers = [*options, "no idea"]
    own = {answer: own_points_reward(None, [answer], [options])[0] for answer in answers}
    team = {
        (first, second): congestion_reward(None, [{"first": first, "second": second}], [options])[0]
        for first, second in itertools.product(answers, answers)
    }
    # Per role: an agent's own reward reads only its own answer and is largest, uniquely, on the top option: taking it
    # is best whatever the teammate answers (a dominant strategy) ...
    assert [answer for answer in answers if own[answer] == max(own.values())] == ["apple"]
    # ... so per-role optimisers meet at (top, top), where the team scores 4/7.
    assert team[("apple", "apple")] == pytest.approx(4 / 7)
    # The team's optimum is the top and the second option, in either order, and only those.
    best = max(team.values())
    assert best == 1.0 and {pair for pair, value in team.items() if value == best} == {
        ("apple", "pear"),
        ("pear", "apple"),
    }


def test_congestion_holds_out_64_problems_never_trained_on():
    task = resolve_task("congestion")
    train, held_out = task.dataset("train"), task.dataset("eval")
    assert len(held_out) == EVAL_PROBLEMS and len(train) == 512
    assert not {tuple(o) for o in held_out["options"]} & {tuple(o) for o in train["options"]}
    content = held_out[0]["prompt"][0]["content"]
    assert all(f"{option} ({points} points)" in content for option, points in zip(held_out[0]["options"], POINTS))


# pick_new_hidden


def test_pick_new_hidden_shows_both_agents_the_same_text_so_the_same_answer_twice_solves_nothing():
    task = resolve_task("pick_new_hidden")
    assert isinstance(task, PickNewHidden) and task.num_turns == 2
    row = {"options": ["red", "blue", "green", "pink", "grey", "black"], "named": ["blue", "grey"], "goal": 2}
    first_prompt = pick_prompt(row["options"], row["named"])
    state, rewards = play(task, row, [("first", "red")])
    assert task.transition(state=state, **row) == [first_prompt, first_prompt]  # the first pick is hidden
    _, same = play(task, row, [("first", "red"), ("second", "red")])
    _, different = play(task, row, [("first", "red"), ("second", "pink")])
    assert same == [0.5, 0.5] and different == [0.5, 1.0]


def test_the_one_agent_baseline_poses_the_same_problems_and_scores_both_picks_alike():
    task = resolve_task("pick_new_hidden")
    team, solo = task.dataset("eval"), task.solo_dataset("eval")
    assert solo["options"] == team["options"] and solo["named"] == team["named"]
    assert "Name two options that are not named yet" in solo[0]["prompt"][0]["content"]
    row = {"options": [["red", "blue", "green", "pink"]], "named": [["blue", "grey"]], "goal": [2]}
    score = lambda text: two_new_options_reward(None, [[{"role": "assistant", "content": text}]], **row)[0]  # noqa: E731
    assert score("red, pink") == 1.0
    assert score("Red and blue") == 0.5  # blue was named already
    assert score("red, red") == 0.5
    assert score("pink, green, red") == 1.0  # the first two
    assert score("blue, green, red") == 0.5  # the first two: blue (named) and green


def test_the_strict_one_agent_scorer_holds_one_answer_as_the_team_holds_two():
    row = {"options": [["red", "blue", "green", "pink"]], "named": [["blue", "grey"]], "goal": [2]}

    def score(text):
        return exactly_two_new_options_reward(None, [[{"role": "assistant", "content": text}]], **row)[0]

    assert score("red, pink") == 1.0
    assert score("I pick red and then pink.") == 1.0  # words around the options are allowed, as in a teammate's
    assert score("Red and blue") == 0.5  # blue was named already: as a teammate repeating a named option
    assert score("red, red") == 0.5  # a repeat adds nothing, as the second teammate repeating the first
    assert score("green") == 0.5  # one option: as one teammate answering and the other naming none
    assert score("pink, green, red") == 0.0  # three options: as a teammate naming two, it counts for nothing
    assert score("Options: red, blue, green, pink") == 0.0  # echoing the list scores 0 (0.5 on the old scorer)
    assert two_new_options_reward(None, ["Options: red, blue, green, pink"], **row) == [0.5]


def test_echoing_the_prompt_scored_two_thirds_for_one_agent_alone_and_scores_nothing_now():
    solo = resolve_task("pick_new_hidden").solo_dataset("eval")
    columns = {key: solo[key] for key in ("options", "named", "goal")}
    echoes = [row["prompt"][0]["content"].split(". Already")[0] for row in solo]  # "Options: a, b, c, d, e, f"
    assert sum(two_new_options_reward(None, echoes, **columns)) / len(echoes) == pytest.approx(0.672, abs=5e-4)
    assert exactly_two_new_options_reward(None, echoes, **columns) == [0.0] * len(echoes)


@pytest.mark.parametrize("task_name", ["congestion", "pick_new", "pick_new_hidden", "pick_new_sparse"])
def test_the_unseen_split_draws_its_problems_from_categories_no_training_problem_comes_from(task_name):
    task = resolve_task(task_name)
    train, eval_split, unseen = (task.dataset(split) for split in ("train", "eval", "unseen"))
    assert len(eval_split) == len(unseen) == 64
    trained_options = {option for options in train["options"] for option in options}
    unseen_options = {option for options in unseen["options"] for option in options}
    assert not trained_options & unseen_options
    assert unseen_options <= {member for members in UNSEEN_CATEGORIES.values() for member in members}
    assert len({tuple(options) for options in unseen["options"]}) == 64
    with pytest.raises(ValueError, match="`split` must be 'train' or one of the held-out splits.*'test'"):
        task.dataset("test")


def test_no_unseen_member_shares_a_word_with_a_training_category_or_an_alias():
    training_words = {word for members in CATEGORIES.values() for member in members for word in member.split()}
    training_words |= {word for alias in (*ALIASES, *ALIASES.values()) for word in alias.split()}
    for category, members in UNSEEN_CATEGORIES.items():
        assert len(members) >= 12, category
        assert not {word for member in members for word in member.split()} & training_words, category


def test_pick_new_hidden_trains_with_at_grpo_and_plays_both_turns_on_the_same_text(
    tiny_model_dir, tmp_path, monkeypatch
):
    task = resolve_task("pick_new_hidden")
    team = trained_team(task, tiny_model_dir, tmp_path)
    rows = task.dataset("eval").select(range(2)).to_list()

    def first_free_option(model_inputs, agent_index, max_new_tokens, do_sample, environments=None):
        texts = []
        for messages in model_inputs:
            prompt = messages[-1]["content"]
            options = prompt.split("Options: ")[1].split(".")[0].split(", ")
            named = prompt.split("Already named: ")[1].split(".")[0].split(", ")
            texts.append(next(option for option in options if option not in named))
        return [[1]] * len(texts), [[2]] * len(texts), texts

    monkeypatch.setattr(team, "_generate", first_free_option)
    runs = team.play(rows)
    for run in runs:
        # The second agent saw the first turn's text, so one convention in both roles names the same option twice.
        assert run.observations[1]["second"][-1]["content"] == run.observations[0]["first"][-1]["content"]
        assert len(run.turns) == 2 and run.state["new"] == 1 and run.turns[0]["first"] == run.turns[1]["second"]


def test_congestion_runs_with_magrpo_scored_by_its_team_reward(tiny_model_dir, tmp_path):
    """The plumbing (the `options` column reaches the team reward through MAGRPO's rollout); a tiny random model
    rarely names an option, so whether it learns is the benchmark's question, not this test's."""
    task = resolve_task("congestion")
    trainer = tiny_run(MAGRPOTrainer, task, tiny_model_dir, tmp_path)
    assert trainer.args.agent_names == ["first", "second"] and trainer.args.scheduler == "parallel"
    logged = trainer.state.log_history[0]
    assert 0.0 <= logged["rewards/congestion_reward/mean"] <= 1.0
