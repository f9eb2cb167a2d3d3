"""The two writing-collaboration tasks of the MAGRPO paper (arXiv 2508.04652) and their data: `summaries` and
`expansion`. Their team rewards (four gated levels, at most 3) are in `rewards.py`.

- **Summaries** (the paper's TLDR task): `concise` writes a short summary, `detailed` a longer, richer one.
- **Expansion** (the paper's arXiv task): from a short abstract, `background` writes the background and motivation
  of an introduction, `method` the method and its implications.

Offline data (the default) comes from `pydoc_data.topics`, the reference prose that ships with Python, so the tasks
run without a network. `source="hub"` loads the paper's datasets instead (`trl-lib/tldr`, `OpenMLRL/arXiv_abstract`).
"""

from __future__ import annotations

import functools
import random
import re
from collections.abc import Callable
from dataclasses import dataclass

from datasets import Dataset

from ..base import Task
from .levels import word_count
from .rewards import expansion_reward, summary_reward

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


class _WritingTask(Task):
    """A one-turn writing task of a pair: its data come from `build_dataset(split, seed=, source=)`."""

    num_turns = 1
    build_dataset: Callable[..., Dataset]

    def __init__(self, source: str = "offline", seed: int = 0):
        _check_source(source)
        self.source, self.seed = source, seed

    def dataset(self, split: str = "train") -> Dataset:
        return self.build_dataset(split, seed=self.seed, source=self.source)


class Summaries(_WritingTask):
    """Summarize a text as a pair (the paper's TLDR task): `concise` writes a short summary, `detailed` a longer,
    richer one; team reward `summary_reward` (four gated levels, at most 3). Offline data: passages of Python's
    documentation; `Summaries(source="hub")` uses `trl-lib/tldr`."""

    name = "summaries"
    agents = SUMMARY_AGENTS
    reward_funcs = [summary_reward]
    build_dataset = staticmethod(summaries_dataset)


class Expansion(_WritingTask):
    """Expand an abstract as a pair (the paper's arXiv task): `background` writes the background and motivation,
    `method` the method and implications; team reward `expansion_reward` (four gated levels, at most 3). Offline
    data: opening sentences of Python's documentation; `Expansion(source="hub")` uses `OpenMLRL/arXiv_abstract`."""

    name = "expansion"
    agents = EXPANSION_AGENTS
    reward_funcs = [expansion_reward]
    build_dataset = staticmethod(expansion_dataset)
