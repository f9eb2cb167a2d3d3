"""Turn schedulers: which agents act at each turn, in which order, and what each one sees (docs/design.md, §9.2).

A scheduler has two methods:

- `phases(turn, num_agents) -> list[list[int]]`: the acting agents of a turn, grouped in phases; the agents of one
  phase act at once (one `generate` call), a later phase sees what earlier phases said this turn.
- `observe(agent, prompt, history, current, names) -> prompt`: what `agent` is shown, given its task prompt for this
  turn (the dataset prompt at turn 0, then the transition's), `history` (what was said at each earlier turn: agent
  name -> text, acting agents only) and `current` (what earlier phases said this turn).

The built-ins are registered as entry points of the group `trl_marl.schedulers`; a scheduler plugin is an object (or
class) with these two methods.
"""

import operator
from collections.abc import Sequence

Prompt = str | list[dict]
Said = dict[str, str]


def with_feedback(prompt: Prompt, text: str) -> Prompt:
    """`prompt` followed by `text`: appended to a string prompt, or to the last user message of a conversation."""
    if isinstance(prompt, str):
        return f"{prompt}\n\n{text}"
    messages = [dict(message) for message in prompt]
    if messages and messages[-1]["role"] == "user" and isinstance(messages[-1]["content"], str):
        messages[-1]["content"] = f"{messages[-1]['content']}\n\n{text}"
    else:
        messages.append({"role": "user", "content": text})
    return messages


def transcript(turns: Sequence[Said], first_turn: int = 0) -> str:
    """What was said, one block per turn (`Turn k:`), one `[agent] text` line per speaker."""
    return "\n\n".join(
        f"Turn {first_turn + index + 1}:\n" + "\n".join(f"[{name}] {text.strip()}" for name, text in said.items())
        for index, said in enumerate(turns)
    )


class Parallel:
    """All agents act at once; each sees the task and everything said at earlier turns."""

    name = "parallel"

    def phases(self, turn: int, num_agents: int) -> list[list[int]]:
        return [list(range(num_agents))]

    def observe(self, agent: int, prompt: Prompt, history: list[Said], current: Said, names: list[str]) -> Prompt:
        said = [*history, current] if current else history  # `current` is only ever filled with several phases
        if not said:
            return prompt
        return with_feedback(
            prompt,
            f"Your team's answers so far:\n\n{transcript(said)}\n\nGive your answer for turn {len(history) + 1}.",
        )


class Sequential(Parallel):
    """Agents act one after another within a turn, in agent order; each sees earlier turns and what the agents
    before it said this turn."""

    name = "sequential"

    def phases(self, turn: int, num_agents: int) -> list[list[int]]:
        return [[agent] for agent in range(num_agents)]


class RoundRobin(Parallel):
    """One agent per turn, in agent order (turn t: agent t mod N); it sees the task and everything said before. The
    team reward sees every agent's latest answer (empty before its first turn)."""

    name = "round_robin"

    def phases(self, turn: int, num_agents: int) -> list[list[int]]:
        return [[turn % num_agents]]


class Debate(Parallel):
    """All agents act at once; from the second turn each sees the task and the *other* agents' answers of the
    previous turn, not its own earlier answers."""

    name = "debate"

    def observe(self, agent: int, prompt: Prompt, history: list[Said], current: Said, names: list[str]) -> Prompt:
        if not history:
            return prompt
        others = {name: text for name, text in history[-1].items() if name != names[agent]}
        lines = "\n".join(f"[{name}] {text.strip()}" for name, text in others.items())
        return with_feedback(
            prompt, f"The other agents answered:\n{lines}\n\nGive your answer for turn {len(history) + 1}."
        )


class RoundRobinBlind(RoundRobin):
    """One agent per turn, in agent order, shown only its task prompt for the turn (the transition's): nothing said
    before. For tasks whose transition decides what an agent may know of its teammates (`pick_new_hidden`)."""

    name = "round_robin_blind"

    def observe(self, agent: int, prompt: Prompt, history: list[Said], current: Said, names: list[str]) -> Prompt:
        return prompt


class ParallelBlind(Parallel):
    """All agents act at once, each shown only its task prompt for the turn (the transition's): nothing said before.
    For tasks whose transition puts what an agent may know in the prompt (`pick_new_sparse`: the options named so
    far)."""

    name = "parallel_blind"

    def observe(self, agent: int, prompt: Prompt, history: list[Said], current: Said, names: list[str]) -> Prompt:
        return prompt


parallel, sequential, round_robin, debate = Parallel(), Sequential(), RoundRobin(), Debate()
round_robin_blind, parallel_blind = RoundRobinBlind(), ParallelBlind()


def scheduled_phases(scheduler, num_agents: int, num_turns: int) -> list[list[list[int]]]:
    """Every turn's phases, checked: at least one agent acts, each an agent index, none twice in one turn (a group
    is one agent's candidates from one state: AT-GRPO keys it by (problem, turn, agent), MAGRPO keeps one answer per
    agent and turn). Raises a `ValueError` naming the scheduler, the turn and what is wrong."""
    schedule = []
    for turn in range(num_turns):
        phases = [list(phase) for phase in scheduler.phases(turn, num_agents)]
        acting = [agent for phase in phases for agent in phase]
        not_index = [agent for agent in acting if isinstance(agent, bool) or not hasattr(agent, "__index__")]
        outside = [agent for agent in acting if agent not in not_index and not 0 <= operator.index(agent) < num_agents]
        twice = [agent for index, agent in enumerate(acting) if agent in acting[:index]]
        problem = None
        if not acting:
            problem = "no agent acts"
        elif not_index:
            problem = f"{not_index[0]!r} is not an agent index (an integer)"
        elif outside:
            problem = f"agent index {int(outside[0])} is not one of the {num_agents} agents (0-{num_agents - 1})"
        elif twice:
            problem = f"agent {int(twice[0])} acts twice"
        if problem:
            raise ValueError(
                f"Scheduler {getattr(scheduler, 'name', type(scheduler).__name__)!r} returned the phases {phases} for "
                f"turn {turn} of {num_agents} agents: {problem}. An agent acts at most once per turn (its candidates "
                "from one state form one group); let it answer again at a later turn (`num_turns`)."
            )
        schedule.append([[operator.index(agent) for agent in phase] for phase in phases])
    return schedule


def resolve_scheduler(scheduler) -> object:
    """A scheduler object from a name (a registered plugin), a class, or an object with `phases` and `observe`."""
    if isinstance(scheduler, str):
        from ..registry import load_plugin

        scheduler = load_plugin("schedulers", scheduler)
    if isinstance(scheduler, type):
        scheduler = scheduler()
    if not (callable(getattr(scheduler, "phases", None)) and callable(getattr(scheduler, "observe", None))):
        raise TypeError(f"Scheduler {scheduler!r} needs `phases(turn, num_agents)` and `observe(...)` methods.")
    return scheduler
