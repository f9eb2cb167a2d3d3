"""A completion as text: the one helper with which every built-in task and reward reads what an agent said."""

from __future__ import annotations

from typing import Any


def completion_text(completion: Any, agent: str | None = None, *, fallback_to_last: bool = False) -> str:
    """The text of a completion: a string as it is, chat messages with their contents joined, None as "".

    A joint action (a mapping agent name -> completion) gives `agent`'s text, so that a local reward also works as a
    team reward; "" when it has no `agent`, or with `fallback_to_last` its last agent's text (the lone agent of a
    `single` evaluation baseline, standing for every role). Raises TypeError for a joint action without `agent`, or
    for anything else that is not a completion."""
    if isinstance(completion, dict):
        if agent is None:
            raise TypeError(
                f"A joint action (agents {sorted(completion)}) has one completion per agent: pass `agent` to say "
                "whose text to take."
            )
        if agent in completion:
            completion = completion[agent]
        else:
            completion = list(completion.values())[-1] if fallback_to_last else ""
    if completion is None:
        return ""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list):
        return "".join(message.get("content") or "" for message in completion)
    raise TypeError(f"A completion must be a string or a list of chat messages, not {type(completion).__name__}.")
