"""Built-in team rewards. Each is `f(prompts, completions, **kwargs) -> list[float | None]`, where a completion maps
agent name -> text and kwargs carry the dataset columns."""

import re


def _text(completion) -> str:
    return completion if isinstance(completion, str) else "".join(m.get("content") or "" for m in completion)


def answer_match(prompts, completions, answer, **kwargs) -> list[float]:
    """Share of agents whose answer contains the dataset's `answer` column as a whole word (case-insensitive)."""
    rewards = []
    for completion, expected in zip(completions, answer):
        pattern = re.compile(rf"(?<!\w){re.escape(str(expected).strip())}(?!\w)", re.IGNORECASE)
        rewards.append(sum(bool(pattern.search(_text(text))) for text in completion.values()) / len(completion))
    return rewards


def word_budget(prompts, completions, word_limit, **kwargs) -> list[float]:
    """Share of agents whose answer is non-empty and has at most `word_limit` words (a dataset column)."""
    return [
        sum(0 < len(_text(text).split()) <= limit for text in completion.values()) / len(completion)
        for completion, limit in zip(completions, word_limit)
    ]
