"""The four gated levels of the writing tasks' team rewards (`rewards.py`): their constants, and small pure functions
of the two texts that score each level.

Every constant comes from the reference implementation of the paper, the CoMLRL project's writing experiments
(github.com/OpenMLRL/LLM_Collab_Writing, `rewards/tldr_rewards.py:tldr_combined_reward` and
`rewards/arxiv_rewards.py:arxiv_combined_reward`); the comment next to each says which. The code here is written
anew, as small pure functions per level; where it departs from the reference, the constant's comment says so.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

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
