"""The two writing-collaboration tasks of the MAGRPO paper (arXiv 2508.04652): `summaries` and `expansion`.

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

Every constant comes from the reference implementation of the paper, the CoMLRL project's writing experiments
(github.com/OpenMLRL/LLM_Collab_Writing, `rewards/tldr_rewards.py:tldr_combined_reward` and
`rewards/arxiv_rewards.py:arxiv_combined_reward`); the comment next to each says which. The code here is written
anew, as small pure functions per level; where it departs from the reference, the constant's comment says so.

Offline data (the default) comes from `pydoc_data.topics`, the reference prose that ships with Python, so the tasks
run without a network. `source="hub"` loads the paper's datasets instead (`trl-lib/tldr`, `OpenMLRL/arXiv_abstract`).
"""

from __future__ import annotations

import functools
import math
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from datasets import Dataset

from ..tasks import Task

# ---------------------------------------------------------------------------------------------------------------------
# Constants. "tldr" = rewards/tldr_rewards.py:tldr_combined_reward, "arxiv" = rewards/arxiv_rewards.py:
# arxiv_combined_reward, both in the CoMLRL writing project (OpenMLRL/LLM_Collab_Writing).
# ---------------------------------------------------------------------------------------------------------------------

# Points per level (tldr and arxiv alike): level 1 gives 0.5, level 2 up to 1.0, level 3 up to 0.5, level 4 up to 1.0.
STRUCTURE_POINTS = 0.5
COORDINATION_POINTS = 1.0
VOCABULARY_POINTS = 0.5
STYLE_POINTS = 1.0
# The nominal maximum, "Maximum reward: 3.0" in both reference docstrings. With the reference's transition formula
# (below) the style level peaks at 0.4 × 0.95 + 0.6 = 0.98, so the highest reachable total is 2.98.
MAX_REWARD = STRUCTURE_POINTS + COORDINATION_POINTS + VOCABULARY_POINTS + STYLE_POINTS

# Level 1, words per completion, inclusive, required of both agents. The reference calls them "tokens" but counts
# whitespace-separated words (`len(text.split())`); so does `word_count` here, with no tokenizer involved.
SUMMARY_WORD_RANGE = (8, 256)  # tldr: `8 <= token_count <= 256`
EXPANSION_WORD_RANGE = (128, 256)  # arxiv: `128 <= token_count <= 256`

# Level 3 counts distinct words (lower-cased `\b\w+\b` runs). The reference docstrings say "excluding stopwords", but
# their code calls `count_unique_words(text)` with `exclude_stopwords=False`: every word counts. We follow the code.
VOCABULARY_EXCLUDES_STOPWORDS = False

# Level 4, the style level (tldr and arxiv alike): 0.4 × transition score + 0.6 × normalised Jaccard overlap.
TRANSITION_WEIGHT = 0.4
JACCARD_WEIGHT = 0.6
# Transition score: 0 with no category found; 0.4 for one, plus 0.05 per further category (the extra capped at 0.6,
# the score at 1). With the 12 categories below it tops out at 0.4 + 11 × 0.05 = 0.95.
TRANSITION_BASE = 0.4
TRANSITION_STEP = 0.05
TRANSITION_EXTRA_CAP = 0.6
# The raw Jaccard overlap is capped and divided by the cap, so reaching the cap scores 1.
SUMMARY_JACCARD_CAP = 0.03  # tldr: `min(jaccard, 0.03) / 0.03`
EXPANSION_JACCARD_CAP = 0.23  # arxiv: `min(jaccard, 0.23) / 0.23`

# Stopwords left out of the content words compared by the Jaccard overlap: the reference's `STOPWORDS` set (the same
# in tldr and arxiv).
STOPWORDS = frozenset(
    """
    a all also an and any are as at bad be been being both but by can could did do does each few first for from good
    great had has have he her here him his how i if in is it its just last left little long low many may me might
    more most much must my new no not now of old on only or other our own right same shall should so some such than
    that the their them then there these they this those to too us very was we were what when where which who why
    will with would you your
    """.split()
)

# Transition words by category: the reference's `transition_words` (the same in tldr and arxiv). The reference finds
# a phrase anywhere in the lower-cased text, even inside a word ("as" in "has", "so" in "also"); here a phrase must
# stand as whole words, so that a category counts only when the writer used it.
TRANSITION_WORDS: dict[str, tuple[str, ...]] = {
    "elaboration": (
        "furthermore", "moreover", "additionally", "also", "besides", "in addition", "what is more", "not only",
        "as well as", "along with", "coupled with", "together with", "likewise", "similarly", "equally important",
        "by the same token", "in the same way", "correspondingly", "in like manner", "comparatively", "analogously",
    ),
    "examples": (
        "for example", "for instance", "specifically", "particularly", "namely", "such as", "including",
        "especially", "in particular", "to illustrate", "as an illustration", "case in point", "to demonstrate",
        "as evidence", "to exemplify", "notably", "markedly", "chiefly", "mainly", "primarily", "above all",
        "most importantly",
    ),
    "explanation": (
        "that is", "in other words", "to put it simply", "to clarify", "indeed", "in fact", "actually", "clearly",
        "obviously", "to put it another way", "to rephrase", "more precisely", "specifically speaking",
        "what this means is", "the point is", "essentially", "basically", "fundamentally", "at its core",
        "in essence", "simply put", "stated differently",
    ),
    "cause_effect": (
        "therefore", "thus", "consequently", "as a result", "hence", "accordingly", "for this reason", "due to this",
        "because of this", "so", "then", "thereby", "wherefore", "thence", "ergo", "as a consequence",
        "in consequence", "it follows that", "this leads to", "this results in", "this causes", "this brings about",
        "owing to", "on account of", "thanks to", "resulting from",
    ),
    "contrast": (
        "however", "nevertheless", "nonetheless", "on the other hand", "in contrast", "while", "whereas", "although",
        "even though", "despite this", "but", "yet", "still", "conversely", "on the contrary", "rather", "instead",
        "alternatively", "otherwise", "in opposition", "by contrast", "contrarily", "notwithstanding", "regardless",
        "all the same", "even so", "be that as it may", "in any case", "at any rate",
    ),
    "sequence": (
        "first", "second", "third", "next", "then", "after that", "finally", "lastly", "initially", "subsequently",
        "meanwhile", "to begin with", "to start with", "in the beginning", "at first", "at the outset", "primarily",
        "secondly", "thirdly", "following this", "afterward", "later", "later on", "in the meantime",
        "simultaneously", "concurrently", "at the same time", "in conclusion", "to conclude", "ultimately",
        "in the end", "to summarize", "in summary",
    ),
    "emphasis": (
        "indeed", "certainly", "surely", "undoubtedly", "without doubt", "definitely", "absolutely", "positively",
        "unquestionably", "indubitably", "of course", "naturally", "obviously", "clearly", "evidently", "manifestly",
        "undeniably", "admittedly", "granted", "to be sure", "in fact", "as a matter of fact", "notably",
        "significantly",
    ),
    "summary": (
        "in summary", "in conclusion", "to summarize", "to conclude", "in short", "in brief", "briefly", "to sum up",
        "on the whole", "overall", "all in all", "in essence", "essentially", "basically", "fundamentally",
        "in the final analysis", "after all", "ultimately", "in the end", "when all is said and done",
        "the bottom line is",
    ),
    "comparison": (
        "similarly", "likewise", "in the same way", "equally", "just as", "comparable to", "in comparison",
        "by the same token", "correspondingly", "in like manner", "along the same lines", "in similar fashion",
        "analogously", "by analogy", "just like", "much like", "as with",
    ),
    "concession": (
        "although", "though", "even though", "while", "whereas", "despite", "in spite of", "regardless of",
        "notwithstanding", "admittedly", "granted", "even if", "be that as it may", "nevertheless", "nonetheless",
        "however", "yet", "still", "all the same",
    ),
    "condition": (
        "if", "unless", "provided that", "assuming that", "supposing that", "in case", "in the event that",
        "on condition that", "given that", "as long as", "so long as", "only if", "even if", "whether or not",
        "should", "were", "had", "otherwise", "or else",
    ),
    "time": (
        "when", "while", "as", "after", "before", "until", "since", "during", "meanwhile", "simultaneously",
        "at the same time", "concurrently", "previously", "formerly", "earlier", "later", "afterward", "subsequently",
        "eventually", "finally", "recently", "lately", "nowadays", "currently", "presently", "immediately",
    ),
}  # fmt: skip

_WORD = re.compile(r"\b\w+\b")
# One pattern per category: any of its phrases as whole words; whitespace inside a phrase may be any run of it.
_TRANSITION_PATTERNS = {
    category: re.compile(
        r"(?<!\w)(?:" + "|".join(r"\s+".join(map(re.escape, p.split())) for p in phrases) + r")(?!\w)"
    )
    for category, phrases in TRANSITION_WORDS.items()
}


# ---------------------------------------------------------------------------------------------------------------------
# Level helpers: pure functions of the texts.
# ---------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Band:
    """A ratio's score shape for levels 2 and 3: 1 on `[optimal_low, optimal_high]`, rising linearly from 0 at `low`
    and falling linearly to 0 at `high`, 0 outside `[low, high]`. A ratio outside `[low, high]` fails the level's
    gate; one exactly on `low` or `high` passes it with score 0, as in the reference."""

    low: float
    optimal_low: float
    optimal_high: float
    high: float

    def __post_init__(self):
        if not self.low <= self.optimal_low <= self.optimal_high <= self.high:
            raise ValueError(
                f"A band needs low <= optimal_low <= optimal_high <= high; got {self.low}, {self.optimal_low}, "
                f"{self.optimal_high}, {self.high}."
            )

    def passes(self, ratio: float) -> bool:
        """Whether `ratio` passes the gate: it lies in the acceptable band `[low, high]`."""
        return self.low <= ratio <= self.high

    def score(self, ratio: float) -> float:
        """The score in [0, 1] of `ratio`."""
        if not self.passes(ratio):
            return 0.0
        if ratio < self.optimal_low:
            return (ratio - self.low) / (self.optimal_low - self.low)
        if ratio > self.optimal_high:
            return (self.high - ratio) / (self.high - self.optimal_high)
        return 1.0


# Level 2, the length ratio second / first in characters (the reference compares `len(c2) / len(c1)`).
SUMMARY_LENGTH_BAND = Band(1.1, 1.6, 3.2, 5.0)  # tldr: optimal 1.6-3.2x, acceptable 1.1-5.0x
# arxiv: optimal 1.0-1.3x, acceptable 0.8-1.5x, as in the reference's docstring and in most versions of its code (one
# version of rewards/arxiv_rewards.py uses 1.3-1.6x / 0.8-2.0x in the code while its docstring keeps 1.0-1.3x).
EXPANSION_LENGTH_BAND = Band(0.8, 1.0, 1.3, 1.5)
# Level 3, the ratio of distinct words second / first.
SUMMARY_VOCABULARY_BAND = Band(1.3, 2.0, math.inf, math.inf)  # tldr: >= 2.0x full, ramp from 1.3x, below stops
EXPANSION_VOCABULARY_BAND = Band(0.5, 0.7, 1.3, 1.7)  # arxiv: optimal 0.7-1.3x, acceptable 0.5-1.7x


def completion_text(completion: Any) -> str:
    """A completion's text: the string itself, or the contents of a list of chat messages joined."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list):
        return "".join(message.get("content") or "" for message in completion)
    raise TypeError(f"A completion must be a string or a list of chat messages, not {type(completion).__name__}.")


def word_count(text: str) -> int:
    """Whitespace-separated words in `text` (the reference's "token" count for level 1)."""
    return len(text.split())


def structure_gate(first: str, second: str, word_range: tuple[int, int]) -> bool:
    """Level 1's gate: both texts have between `word_range[0]` and `word_range[1]` words, inclusive."""
    low, high = word_range
    return low <= word_count(first) <= high and low <= word_count(second) <= high


def length_ratio(first: str, second: str) -> float:
    """Level 2's ratio: `len(second) / len(first)` in characters, 0 when `first` is empty."""
    return len(second) / len(first) if first else 0.0


def coordination_score(ratio: float, band: Band) -> float:
    """Level 2's score in [0, 1] for a length ratio: `band.score(ratio)`."""
    return band.score(ratio)


def words(text: str, exclude_stopwords: bool = False) -> set[str]:
    """The distinct lower-cased words (`\\b\\w+\\b` runs) of `text`, optionally without `STOPWORDS`."""
    found = set(_WORD.findall(text.lower()))
    return found - STOPWORDS if exclude_stopwords else found


def unique_word_ratio(first: str, second: str) -> float:
    """Level 3's ratio: distinct words of `second` over those of `first` (stopwords included, as in the reference's
    code; see `VOCABULARY_EXCLUDES_STOPWORDS`), 0 when `first` has none."""
    count = len(words(first, VOCABULARY_EXCLUDES_STOPWORDS))
    return len(words(second, VOCABULARY_EXCLUDES_STOPWORDS)) / count if count else 0.0


def vocabulary_score(ratio: float, band: Band) -> float:
    """Level 3's score in [0, 1] for a distinct-word ratio: `band.score(ratio)`."""
    return band.score(ratio)


def transition_categories(text: str) -> set[str]:
    """The categories of `TRANSITION_WORDS` with at least one phrase in `text` (whole words, any case)."""
    lowered = text.lower()
    return {category for category, pattern in _TRANSITION_PATTERNS.items() if pattern.search(lowered)}


def transition_score(num_categories: int) -> float:
    """The transition part of level 4, in [0, 1]: 0 with no category, else
    `min(1, 0.4 + min(0.05 × (num_categories − 1), 0.6))`."""
    if num_categories <= 0:
        return 0.0
    extra = min(TRANSITION_STEP * (num_categories - 1), TRANSITION_EXTRA_CAP)
    return min(1.0, TRANSITION_BASE + extra)


def content_jaccard(first: str, second: str) -> float:
    """The Jaccard overlap |A ∩ B| / |A ∪ B| of the two texts' content words (distinct words minus `STOPWORDS`);
    1 when neither has any, as in the reference."""
    a, b = words(first, exclude_stopwords=True), words(second, exclude_stopwords=True)
    if not a and not b:
        return 1.0
    return len(a & b) / len(a | b)


def jaccard_score(jaccard: float, cap: float) -> float:
    """The Jaccard part of level 4, in [0, 1]: `min(jaccard, cap) / cap`."""
    return min(jaccard, cap) / cap


def style_score(transition_text: str, first: str, second: str, jaccard_cap: float) -> float:
    """Level 4's score in [0, 1]: `0.4 × transition_score(categories in transition_text) + 0.6 ×
    jaccard_score(content_jaccard(first, second), jaccard_cap)`."""
    transitions = transition_score(len(transition_categories(transition_text)))
    return TRANSITION_WEIGHT * transitions + JACCARD_WEIGHT * jaccard_score(
        content_jaccard(first, second), jaccard_cap
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


# ---------------------------------------------------------------------------------------------------------------------
# Data: offline from Python's own documentation, or the paper's Hub datasets.
# ---------------------------------------------------------------------------------------------------------------------

SPLITS = ("train", "eval")
SOURCES = ("offline", "hub")
# The offline split: this share of the documentation's sections (and every passage drawn from them) is held out.
EVAL_FRACTION = 0.2
# Summaries' offline passages: consecutive prose paragraphs of one section, this many words (a few hundred, like the
# Reddit posts of TL;DR).
PASSAGE_WORDS = (100, 300)
# Expansion's offline "abstracts": the first one to three sentences of a section, this many words.
ABSTRACT_WORDS = (20, 80)
ABSTRACT_MAX_SENTENCES = 3
# The paper's datasets and the rows its runs used (the reference configs load `train[:1100]` and `test[:1100]` /
# `val[:1100]`; configs/magrpo_tldr_config.yaml and configs/magrpo_arxiv_config.yaml).
HUB_SUMMARIES = {"path": "trl-lib/tldr", "column": "prompt", "splits": {"train": "train", "eval": "test"}}
HUB_EXPANSION = {
    "path": "OpenMLRL/arXiv_abstract",
    "column": "abstract_text",
    "splits": {"train": "train", "eval": "val"},
}
HUB_ROWS = 1100

SUMMARY_PROMPT = "Summarize the following text.\n\nText:\n{text}"
EXPANSION_PROMPT = (
    "Based on the following abstract, expand its content into part of an introduction section.\n\n"
    "Abstract:\n{abstract}"
)

_HEADING_RULE = re.compile(r"^([*=\-~^+#])\1{2,}$")  # the underline of a reST-style title
# Paragraphs that are not running prose: lists, admonitions, version notes, footnotes, emphasised asides.
_NOT_PROSE = (
    "* ", "- ", "Note:", "See also:", "Changed in version", "New in version", "Added in version", "Deprecated",
    "Footnotes", "[", "Warning:", "Tip:", "Caution:", "Important:", "**", ">>>",
)  # fmt: skip
# reST emphasis around words ("*iterable*", "**PEP 8**"), not the asterisks of code in quotes ("*args", "**kwds").
_BOLD = re.compile(r"(?<![\w*\"])\*\*(\w[^*\"]*?)(?<!\s)\*\*(?![\w*])")
_EMPHASIS = re.compile(r"(?<![\w*\"])\*(\w[^*\"]*?)(?<!\s)\*(?![\w*\"])")
_SENTENCE_END = re.compile(r"(?:(?<=[.!?])|(?<=[.!?][\"”)]))\s+(?=[A-Z\"“])")


@dataclass(frozen=True)
class Section:
    """One titled section of Python's documentation topics, as cleaned prose paragraphs."""

    topic: str
    heading: str
    paragraphs: tuple[str, ...]


def clean_paragraph(lines: list[str]) -> str:
    """One paragraph as a single line of plain prose: hyphenated line breaks rejoined, footnote marks ("[5]") and
    emphasis asterisks ("*iterable*", "**PEP 8**") removed, whitespace collapsed."""
    text = ""
    for line in (line.strip() for line in lines):
        if text.endswith("-") and text[-2:-1].isalpha():
            text += line  # "built-" + "in" -> "built-in"
        else:
            text = f"{text} {line}" if text else line
    text = re.sub(r"\s*\[\d+\]", "", text)
    text = _BOLD.sub(r"\1", text)
    text = _EMPHASIS.sub(r"\1", text)
    return re.sub(r"\s+", " ", text).strip()


def topic_sections(topic: str, text: str) -> list[Section]:
    """A documentation topic's prose, section by section. Kept: unindented paragraphs that end a sentence; dropped:
    titles, code, grammar and definitions (indented), lists, notes, and paragraphs that lead into code (ending in
    ":" or ",")."""
    sections: list[Section] = []
    heading, paragraphs = topic, []
    for block in re.split(r"\n[ \t]*\n", text):
        lines = block.strip("\n").split("\n")
        if not block.strip():
            continue
        if len(lines) >= 2 and _HEADING_RULE.match(lines[1].strip()):
            if paragraphs:
                sections.append(Section(topic, heading, tuple(paragraphs)))
            heading, paragraphs = lines[0].strip(), []
            continue
        if lines[0][:1].isspace() or lines[0].startswith(_NOT_PROSE):
            continue
        paragraph = clean_paragraph(lines)
        if paragraph.endswith((".", "?", "!", '."', ".)", ".”")):
            paragraphs.append(paragraph)
    if paragraphs:
        sections.append(Section(topic, heading, tuple(paragraphs)))
    return sections


@functools.lru_cache(maxsize=1)
def documentation_sections() -> tuple[Section, ...]:
    """Every section of `pydoc_data.topics` with prose, topics in name order, each paragraph kept once.

    Topics repeat one another (`compound` holds the `if`, `for`, `try`... statements that are topics of their own),
    so a paragraph already seen, and a heading already seen, are skipped: no text reaches two sections, and hence
    not both splits. The topics are those of the running Python version, so the data may differ between versions.
    """
    from pydoc_data.topics import topics

    seen_paragraphs: set[str] = set()
    seen_headings: set[str] = set()
    sections = []
    for topic in sorted(topics):
        for section in topic_sections(topic, topics[topic]):
            if section.heading in seen_headings:
                continue
            fresh = tuple(p for p in section.paragraphs if p not in seen_paragraphs)
            if fresh:
                seen_headings.add(section.heading)
                seen_paragraphs.update(fresh)
                sections.append(Section(section.topic, section.heading, fresh))
    return tuple(sections)


def split_sections(split: str, seed: int = 0) -> list[Section]:
    """The documentation sections of `split`: shuffled with `seed`, the first `EVAL_FRACTION` are "eval", the rest
    "train" (disjoint, and the same for the same seed)."""
    _check_split(split)
    sections = list(documentation_sections())
    random.Random(seed).shuffle(sections)
    held_out = round(len(sections) * EVAL_FRACTION)
    return sections[:held_out] if split == "eval" else sections[held_out:]


def passages(section: Section, word_range: tuple[int, int] = PASSAGE_WORDS) -> list[str]:
    """Passages to summarise from one section: consecutive paragraphs joined while under `word_range[1]` words;
    a passage shorter than `word_range[0]` words is dropped (a single paragraph longer than the maximum is kept)."""
    low, high = word_range
    found, current, size = [], [], 0
    for paragraph in section.paragraphs:
        length = word_count(paragraph)
        if current and size + length > high:
            if size >= low:
                found.append(" ".join(current))
            current, size = [], 0
        current.append(paragraph)
        size += length
    if current and size >= low:
        found.append(" ".join(current))
    return found


def abstract(section: Section) -> str | None:
    """A short abstract-like text from one section: the first one to `ABSTRACT_MAX_SENTENCES` sentences of its first
    paragraph, stopping before `ABSTRACT_WORDS[1]` words; None when shorter than `ABSTRACT_WORDS[0]` words."""
    low, high = ABSTRACT_WORDS
    text = ""
    for sentence in _SENTENCE_END.split(section.paragraphs[0])[:ABSTRACT_MAX_SENTENCES]:
        longer = f"{text} {sentence}".strip()
        if text and word_count(longer) > high:
            break
        text = longer
    return text if low <= word_count(text) <= high else None


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"Unknown split {split!r}: the writing tasks have the splits {list(SPLITS)}.")


def _check_source(source: str) -> None:
    if source not in SOURCES:
        raise ValueError(f"Unknown data source {source!r}: use 'offline' (Python's documentation) or 'hub'.")


def _chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _hub_texts(spec: dict, split: str, rows: int) -> list[str]:
    """The first `rows` texts of a Hub dataset's split (needs the network or a local Hub cache)."""
    from datasets import load_dataset

    dataset = load_dataset(spec["path"], split=f"{spec['splits'][split]}[:{rows}]")
    if spec["column"] not in dataset.column_names:
        raise ValueError(
            f"The Hub dataset {spec['path']} has no column {spec['column']!r} (its columns: {dataset.column_names})."
        )
    return [str(text) for text in dataset[spec["column"]]]


def summaries_dataset(
    split: str = "train", seed: int = 0, source: str = "offline", hub_rows: int = HUB_ROWS
) -> Dataset:
    """The Summaries data: `prompt` (a chat asking for a summary), `text` (the text to summarise) and, offline,
    `topic` (its documentation section). Offline: passages of Python's documentation, split by section with `seed`;
    `source="hub"`: the first `hub_rows` posts of `trl-lib/tldr` (its "train" or "test" split)."""
    _check_split(split)
    _check_source(source)
    if source == "hub":
        texts = _hub_texts(HUB_SUMMARIES, split, hub_rows)
        return Dataset.from_dict({"prompt": [_chat(SUMMARY_PROMPT.format(text=t)) for t in texts], "text": texts})
    rows = [(s.heading, text) for s in split_sections(split, seed) for text in passages(s)]
    return Dataset.from_dict(
        {
            "prompt": [_chat(SUMMARY_PROMPT.format(text=text)) for _, text in rows],
            "text": [text for _, text in rows],
            "topic": [heading for heading, _ in rows],
        }
    )


def expansion_dataset(
    split: str = "train", seed: int = 0, source: str = "offline", hub_rows: int = HUB_ROWS
) -> Dataset:
    """The Expansion data: `prompt` (a chat asking to expand an abstract), `abstract` and, offline, `topic`.
    Offline: the opening sentences of Python's documentation sections, split by section with `seed`;
    `source="hub"`: the first `hub_rows` abstracts of `OpenMLRL/arXiv_abstract` (its "train" or "val" split)."""
    _check_split(split)
    _check_source(source)
    if source == "hub":
        texts = _hub_texts(HUB_EXPANSION, split, hub_rows)
        return Dataset.from_dict(
            {"prompt": [_chat(EXPANSION_PROMPT.format(abstract=t)) for t in texts], "abstract": texts}
        )
    rows = [(s.heading, text) for s in split_sections(split, seed) if (text := abstract(s)) is not None]
    return Dataset.from_dict(
        {
            "prompt": [_chat(EXPANSION_PROMPT.format(abstract=text)) for _, text in rows],
            "abstract": [text for _, text in rows],
            "topic": [heading for heading, _ in rows],
        }
    )


# ---------------------------------------------------------------------------------------------------------------------
# The tasks.
# ---------------------------------------------------------------------------------------------------------------------

SUMMARY_AGENTS = [
    {
        "name": "concise",
        "system_prompt": "You and a teammate both summarize the same text. You write the concise summary: one to "
        "three sentences, brief, focused, factual and informative.",
    },
    {
        "name": "detailed",
        "system_prompt": "You and a teammate both summarize the same text. Your teammate writes a summary of one to "
        "three sentences; you write the detailed summary, two to three times as long as theirs. Use a richer "
        "vocabulary than a short summary would, and transition words (for example, moreover, however, therefore) "
        "to connect the ideas.",
    },
]
EXPANSION_AGENTS = [
    {
        "name": "background",
        "system_prompt": "You and a teammate expand an abstract into an introduction section. You write about the "
        "background and motivation only, in 150 to 250 words; your teammate covers the method and its "
        "implications, so do not repeat those.",
    },
    {
        "name": "method",
        "system_prompt": "You and a teammate expand an abstract into an introduction section. You write about the "
        "method and its implications only, in 150 to 250 words; your teammate covers the background and "
        "motivation, so do not repeat those.",
    },
]


class Summaries(Task):
    """Summarize a text as a pair (the paper's TLDR task): `concise` writes a short summary, `detailed` a longer,
    richer one; team reward `summary_reward` (four gated levels, at most 3). Offline data: passages of Python's
    documentation; `Summaries(source="hub")` uses `trl-lib/tldr`."""

    name = "summaries"
    agents = SUMMARY_AGENTS
    num_turns = 1
    reward_funcs = [summary_reward]

    def __init__(self, source: str = "offline", seed: int = 0):
        _check_source(source)
        self.source, self.seed = source, seed

    def dataset(self, split: str = "train") -> Dataset:
        return summaries_dataset(split, seed=self.seed, source=self.source)


class Expansion(Task):
    """Expand an abstract as a pair (the paper's arXiv task): `background` writes the background and motivation,
    `method` the method and implications; team reward `expansion_reward` (four gated levels, at most 3). Offline
    data: opening sentences of Python's documentation; `Expansion(source="hub")` uses `OpenMLRL/arXiv_abstract`."""

    name = "expansion"
    agents = EXPANSION_AGENTS
    num_turns = 1
    reward_funcs = [expansion_reward]

    def __init__(self, source: str = "offline", seed: int = 0):
        _check_source(source)
        self.source, self.seed = source, seed

    def dataset(self, split: str = "train") -> Dataset:
        return expansion_dataset(split, seed=self.seed, source=self.source)
