"""Tasks: the `Task` base class of task plugins (`base`) and trl_marl's built-in tasks, by family, registered through
trl_marl's own entry points in `pyproject.toml` like anyone's:

- `toy`: `explain`, `describe_word`, `reach_target`, and the `answer_match` and `word_budget` rewards;
- `writing`: the MAGRPO paper's `summaries` and `expansion`;
- `coding`: the MAGRPO paper's `coop_coding` (and `coop_coding_multiturn`), the `unit_tests` reward, and the AT-GRPO
  paper's coder + tester (`code_tester`);
- `math_tool`: the AT-GRPO paper's tool agent + reasoner, and `math_tool_calls`: the same team on real tool calls;
- `puzzles`: the AT-GRPO paper's `plan_path`, `sokoban` and `sudoku`;
- `teamwork`: `distinct_items` (MAGRPO) and `pick_new` (AT-GRPO), built so that only the team reward says what the
  team must do, with the `distinct_items_reward`, `new_options_reward` and `new_option_gain` rewards.

Importing this package imports none of the built-in tasks: the registry loads each one when it is asked for by name.

May import: the foundation modules, `sandbox` and `rollouts` (a transition's records); nothing above.
"""

from .base import Task, local_rewards, resolve_task, task_defaults

__all__ = ["Task", "local_rewards", "resolve_task", "task_defaults"]
