"""The team rewards of the MAGRPO paper's two writing-collaboration tasks (arXiv 2508.04652): `summary_reward` and
`expansion_reward`. The tasks themselves and their data are in `summaries_expansion.py`, the levels' constants and
scoring functions in `levels.py`.

Two agents write about the same source text at once (one turn, in parallel), and one team reward scores the pair:

- **Summaries** (the paper's TLDR task): `concise` writes a short summary, `detailed` a longer, richer one.
- **Expansion** (the paper's arXiv task): from a short abstract, `background` writes the background and motivation
  of an introduction, `method` the method and its implications.

The team reward has four *gated levels*, worth 0.5 + 1 + 0.5 + 1 = 3 points; a failed gate stops the scoring there:

1. **structure** (0.5): both texts have a word count within the task's bounds; otherwise the reward is 0.
2. **coordination** (up to 1): the ratio of the second text's length to the first's (in characters) lies in an
   optimal band (1 point), ramping linearly to 0 at the edges of a wider acceptable band; outside it, stop.
3. **vocabulary** (up to 0.5): the same shape for the ratio of distinct words, second text to first; outside, stop.
4. **style** (up to 1): 0.4 × how many categories of transition words ("however", "for example", ...) appear, plus
   0.6 × the overlap (Jaccard) of the two texts' content words, capped and rescaled to [0, 1].

Every constant comes from the reference implementation of the paper (see `levels.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..completions import completion_text
from .levels import (
    COORDINATION_POINTS,
    EXPANSION_JACCARD_CAP,
    EXPANSION_LENGTH_BAND,
    EXPANSION_VOCABULARY_BAND,
    EXPANSION_WORD_RANGE,
    STRUCTURE_POINTS,
    STYLE_POINTS,
    SUMMARY_JACCARD_CAP,
    SUMMARY_LENGTH_BAND,
    SUMMARY_VOCABULARY_BAND,
    SUMMARY_WORD_RANGE,
    VOCABULARY_POINTS,
    Band,
    coordination_score,
    length_ratio,
    structure_gate,
    style_score,
    unique_word_ratio,
    vocabulary_score,
)

# ---------------------------------------------------------------------------------------------------------------------
# The leveled team rewards.
# ---------------------------------------------------------------------------------------------------------------------

LEVELS = ("structure", "coordination", "vocabulary", "style")


@dataclass(frozen=True)
class WritingSpec:
    """One task's constants for the leveled reward: its two agents (first, second), the word range of level 1, the
    bands of levels 2 and 3, the Jaccard cap of level 4, and where level 4 looks for transition words
    (`"second"`: the second text only, tldr; `"both"`: both texts, arxiv)."""

    agents: tuple[str, str]
    word_range: tuple[int, int]
    length_band: Band
    vocabulary_band: Band
    jaccard_cap: float
    transitions_in: str

    def __post_init__(self):
        if self.transitions_in not in ("second", "both"):
            raise ValueError(f"transitions_in must be 'second' or 'both', not {self.transitions_in!r}.")


SUMMARY_SPEC = WritingSpec(
    agents=("concise", "detailed"),
    word_range=SUMMARY_WORD_RANGE,
    length_band=SUMMARY_LENGTH_BAND,
    vocabulary_band=SUMMARY_VOCABULARY_BAND,
    jaccard_cap=SUMMARY_JACCARD_CAP,
    transitions_in="second",  # tldr: `check_transition_words(c2)`
)
EXPANSION_SPEC = WritingSpec(
    agents=("background", "method"),
    word_range=EXPANSION_WORD_RANGE,
    length_band=EXPANSION_LENGTH_BAND,
    vocabulary_band=EXPANSION_VOCABULARY_BAND,
    jaccard_cap=EXPANSION_JACCARD_CAP,
    # arxiv: `check_transition_words(c1 + c2)`; here joined by a newline so no word spans the seam
    transitions_in="both",
)


def level_scores(first: str, second: str, spec: WritingSpec) -> dict[str, float]:
    """The points each level gives the pair (`structure`, `coordination`, `vocabulary`, `style`) and their `total`.

    Levels are scored in order, and a failed gate stops there: the later levels score 0. Level 1's gate is the word
    range; levels 2 and 3 pass when their ratio lies in the band's acceptable range. Level 4 has no gate.
    """
    scores = dict.fromkeys(LEVELS, 0.0)
    if structure_gate(first, second, spec.word_range):
        scores["structure"] = STRUCTURE_POINTS
        ratio = length_ratio(first, second)
        if spec.length_band.passes(ratio):
            scores["coordination"] = COORDINATION_POINTS * coordination_score(ratio, spec.length_band)
            vocabulary = unique_word_ratio(first, second)
            if spec.vocabulary_band.passes(vocabulary):
                scores["vocabulary"] = VOCABULARY_POINTS * vocabulary_score(vocabulary, spec.vocabulary_band)
                transition_text = second if spec.transitions_in == "second" else f"{first}\n{second}"
                scores["style"] = STYLE_POINTS * style_score(transition_text, first, second, spec.jaccard_cap)
    scores["total"] = sum(scores[level] for level in LEVELS)
    return scores


def summary_levels(concise: str, detailed: str) -> dict[str, float]:
    """The Summaries reward of one pair, level by level (see `level_scores`), with its `total`."""
    return level_scores(concise, detailed, SUMMARY_SPEC)


def expansion_levels(background: str, method: str) -> dict[str, float]:
    """The Expansion reward of one pair, level by level (see `level_scores`), with its `total`."""
    return level_scores(background, method, EXPANSION_SPEC)


def _team_rewards(reward_name: str, spec: WritingSpec, completions: list[dict], kwargs: dict) -> list[float]:
    """Score each joint action with `spec`; logs each level's mean through TRL's `log_metric` when given one."""
    first_agent, second_agent = spec.agents
    breakdowns = []
    for completion in completions:
        missing = [agent for agent in spec.agents if agent not in completion]
        if missing:
            raise ValueError(
                f"{reward_name} scores the agents '{first_agent}' and '{second_agent}', but a completion has no "
                f"{', '.join(repr(a) for a in missing)} (its agents: {sorted(completion)}). Name the team's agents "
                "as the task does."
            )
        breakdowns.append(
            level_scores(completion_text(completion[first_agent]), completion_text(completion[second_agent]), spec)
        )
    log_metric: Callable[[str, float], None] | None = kwargs.get("log_metric")
    if callable(log_metric) and breakdowns:
        for level in LEVELS:
            log_metric(f"rewards/{reward_name}/{level}", sum(b[level] for b in breakdowns) / len(breakdowns))
    return [b["total"] for b in breakdowns]


def summary_reward(prompts, completions, **kwargs) -> list[float]:
    """Team reward of the Summaries task, in [0, 3]: four gated levels on `concise` (short) and `detailed`.

    Structure 0.5 (both 8-256 words), coordination up to 1 (detailed 1.6-3.2x as long in characters, ramping to 0
    at 1.1x and 5x), vocabulary up to 0.5 (2x the distinct words, ramping from 1.3x), style up to 1 (transition-word
    categories in `detailed`, content-word overlap). A failed gate stops the scoring. See `summary_levels`.
    """
    return _team_rewards("summary_reward", SUMMARY_SPEC, completions, kwargs)


def expansion_reward(prompts, completions, **kwargs) -> list[float]:
    """Team reward of the Expansion task, in [0, 3]: four gated levels on `background` and `method`.

    Structure 0.5 (both 128-256 words), coordination up to 1 (method 1.0-1.3x as long as background in characters,
    ramping to 0 at 0.8x and 1.5x), vocabulary up to 0.5 (0.7-1.3x the distinct words, ramping to 0 at 0.5x and
    1.7x), style up to 1 (transition-word categories in both, content-word overlap). A failed gate stops the
    scoring. See `expansion_levels`.
    """
    return _team_rewards("expansion_reward", EXPANSION_SPEC, completions, kwargs)
