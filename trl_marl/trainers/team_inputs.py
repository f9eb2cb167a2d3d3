"""What a trainer's inputs resolve to, before any model loads: a task's rewards, data and transition; reward plugins by
name, each wrapped with its checks; and the dataset columns that rewards and transitions read."""

from ..registry import load_plugin
from ..tasks import resolve_task
from .reward_checks import (
    LOCAL_REWARD_ARGUMENTS,
    TEAM_REWARD_ARGUMENTS,
    TRANSITION_ARGUMENTS,
    check_dataset_columns,
    checked_team_reward,
)


def resolve_team_inputs(
    args, task, reward_funcs, train_dataset, eval_dataset, transition, environment_rewards: bool = False
) -> tuple:
    """`(task, reward_funcs, train_dataset, eval_dataset, transition)` of a trainer: the task (an object or plugin
    name) supplies what was not given (its eval split when evaluation is on); a reward given by name is a plugin.
    Fails before any model loads when there is no reward (unless `environment_rewards`: an environment may own it,
    TRL's `get_reward`, which TRL's init then checks), the transition is not callable, or a dataset lacks the `prompt`
    column or a column that a reward, local reward or transition reads.
    """
    # A task supplies what was not given: team rewards, training data, evaluation data, transition.
    task = resolve_task(task) if task is not None else None
    if task is not None:
        reward_funcs = reward_funcs if reward_funcs is not None else list(task.reward_funcs)
        train_dataset = train_dataset if train_dataset is not None else task.dataset("train")
        if eval_dataset is None and args.eval_strategy != "no":
            eval_dataset = task.dataset("eval")
        transition = transition or task.transition
    if eval_dataset is None and args.eval_strategy != "no":  # Trainer would say so only after the model loaded
        raise ValueError(
            f"`eval_strategy={args.eval_strategy.value!r}` needs evaluation data: pass `eval_dataset`, or a `task` "
            "(its eval split is used), or set `eval_strategy='no'`."
        )
    reward_funcs = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
    if reward_funcs == [None]:
        reward_funcs = []
    if not reward_funcs and not environment_rewards:
        raise ValueError("`reward_funcs` is empty: give at least one team reward function (or a task).")
    # A name is a reward plugin (`trl-marl list rewards`).
    reward_funcs = [load_plugin("rewards", f) if isinstance(f, str) else f for f in reward_funcs]
    reward_funcs = [checked_team_reward(func, args.reward_timeout) for func in reward_funcs]
    if transition is not None and not callable(transition):
        raise TypeError(f"`transition` must be callable, got {transition!r}.")
    # A column that a reward, local reward or transition reads and the data lacks fails here, not mid-training.
    consumers = [("Team reward", func, TEAM_REWARD_ARGUMENTS) for func in reward_funcs]
    for agent, funcs in (task.local_reward_funcs if task is not None else {}).items():
        consumers += [(f"Local reward of agent '{agent}'", func, LOCAL_REWARD_ARGUMENTS) for func in funcs]
    if transition is not None and args.num_turns > 1:
        consumers.append(("Transition", transition, TRANSITION_ARGUMENTS))
    check_dataset_columns(train_dataset, consumers, "train dataset")
    eval_datasets = eval_dataset if isinstance(eval_dataset, dict) else {"": eval_dataset}
    for name, dataset in eval_datasets.items():
        check_dataset_columns(dataset, consumers, f"eval dataset {name}".strip())
    return task, reward_funcs, train_dataset, eval_dataset, transition
