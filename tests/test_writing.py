"""The writing-collaboration tasks (`summaries`, `expansion`): each reward level against values computed by hand, the
gates, the offline datasets, and discovery by name. No model, no network."""

import math

import datasets
import pytest

from trl_marl.registry import load_plugin
from trl_marl.tasks import resolve_task, task_defaults
from trl_marl.tasks.writing import summaries_expansion as writing_tasks
from trl_marl.tasks.writing.levels import (
    EXPANSION_LENGTH_BAND,
    EXPANSION_VOCABULARY_BAND,
    SUMMARY_LENGTH_BAND,
    SUMMARY_VOCABULARY_BAND,
    Band,
    content_jaccard,
    jaccard_score,
    length_ratio,
    structure_gate,
    style_score,
    transition_categories,
    transition_score,
    unique_word_ratio,
)
from trl_marl.tasks.writing.rewards import expansion_levels, expansion_reward, summary_levels, summary_reward
from trl_marl.tasks.writing.summaries_expansion import Expansion, Summaries

ZERO = {"structure": 0.0, "coordination": 0.0, "vocabulary": 0.0, "style": 0.0, "total": 0.0}


def tokens(prefix: str, count: int, start: int = 0) -> list[str]:
    """`count` distinct 4-character words: prefix + a 3-digit number (no stopword, no transition word)."""
    return [f"{prefix}{i:03d}" for i in range(start, start + count)]


def spaced(words: list[str]) -> str:
    """Each word followed by one space: len = 5 × words for 4-character words."""
    return "".join(f"{word} " for word in words)


# --- Level helpers ---------------------------------------------------------------------------------------------------


def test_structure_gate_bounds_are_inclusive_word_counts():
    eight, seven = " ".join(tokens("a", 8)), " ".join(tokens("a", 7))
    assert structure_gate(eight, " ".join(tokens("b", 256)), (8, 256))
    assert not structure_gate(seven, eight, (8, 256))
    assert not structure_gate(eight, " ".join(tokens("b", 257)), (8, 256))
    assert structure_gate(" ".join(tokens("a", 128)), " ".join(tokens("b", 256)), (128, 256))
    assert not structure_gate(" ".join(tokens("a", 127)), " ".join(tokens("b", 200)), (128, 256))


@pytest.mark.parametrize(
    "band, ratio, score",
    [
        # Summaries, level 2: 0 at 1.1, 1 on 1.6-3.2, 0 at 5.0; midway on each ramp 0.5
        (SUMMARY_LENGTH_BAND, 1.1, 0.0),
        (SUMMARY_LENGTH_BAND, 1.35, 0.5),  # (1.35 - 1.1) / 0.5
        (SUMMARY_LENGTH_BAND, 1.6, 1.0),
        (SUMMARY_LENGTH_BAND, 3.2, 1.0),
        (SUMMARY_LENGTH_BAND, 4.1, 0.5),  # 1 - (4.1 - 3.2) / 1.8
        (SUMMARY_LENGTH_BAND, 3.25, 1 - 0.05 / 1.8),
        (SUMMARY_LENGTH_BAND, 5.0, 0.0),
        (SUMMARY_LENGTH_BAND, 5.5, 0.0),
        (SUMMARY_LENGTH_BAND, 1.0, 0.0),
        # Summaries, level 3: ramp 1.3 -> 2.0, then flat
        (SUMMARY_VOCABULARY_BAND, 1.3, 0.0),
        (SUMMARY_VOCABULARY_BAND, 1.65, 0.5),  # (1.65 - 1.3) / 0.7
        (SUMMARY_VOCABULARY_BAND, 2.0, 1.0),
        (SUMMARY_VOCABULARY_BAND, 10.0, 1.0),
        (SUMMARY_VOCABULARY_BAND, 1.2, 0.0),
        # Expansion, level 2: 0 at 0.8, 1 on 1.0-1.3, 0 at 1.5
        (EXPANSION_LENGTH_BAND, 0.8, 0.0),
        (EXPANSION_LENGTH_BAND, 0.9, 0.5),
        (EXPANSION_LENGTH_BAND, 1.0, 1.0),
        (EXPANSION_LENGTH_BAND, 1.3, 1.0),
        (EXPANSION_LENGTH_BAND, 1.4, 0.5),
        (EXPANSION_LENGTH_BAND, 1.5, 0.0),
        (EXPANSION_LENGTH_BAND, 1.6, 0.0),
        # Expansion, level 3: 0 at 0.5, 1 on 0.7-1.3, 0 at 1.7
        (EXPANSION_VOCABULARY_BAND, 0.6, 0.5),
        (EXPANSION_VOCABULARY_BAND, 0.7, 1.0),
        (EXPANSION_VOCABULARY_BAND, 1.5, 0.5),
        (EXPANSION_VOCABULARY_BAND, 1.7, 0.0),
    ],
)
def test_band_scores_at_edges_and_midway(band, ratio, score):
    assert band.score(ratio) == pytest.approx(score)


def test_band_gates_include_the_acceptable_edges_only():
    assert SUMMARY_LENGTH_BAND.passes(1.1) and SUMMARY_LENGTH_BAND.passes(5.0)
    assert not SUMMARY_LENGTH_BAND.passes(1.09) and not SUMMARY_LENGTH_BAND.passes(5.01)
    assert SUMMARY_VOCABULARY_BAND.passes(1.3) and SUMMARY_VOCABULARY_BAND.passes(math.inf)
    assert not SUMMARY_VOCABULARY_BAND.passes(1.29)
    assert EXPANSION_VOCABULARY_BAND.passes(0.5) and not EXPANSION_VOCABULARY_BAND.passes(1.71)
    with pytest.raises(ValueError, match="low <= optimal_low"):
        Band(1.0, 0.5, 2.0, 3.0)


def test_ratios_count_characters_and_distinct_words():
    assert length_ratio("abcd", "abcdefgh") == 2.0
    assert length_ratio("", "abc") == 0.0
    # distinct lower-cased words, stopwords included: {the, cat, sat, on, mat} / {the, cat, sat}
    assert unique_word_ratio("The cat sat", "the CAT sat on the mat.") == pytest.approx(5 / 3)
    assert unique_word_ratio("...", "words") == 0.0


def test_transition_categories_match_whole_words_and_phrases():
    # "however" is both contrast and concession; "for example" is examples
    assert transition_categories("However, we moved on. For example, this.") == {"contrast", "concession", "examples"}
    assert transition_categories("She has pencils and a bass.") == set()  # no "as" inside "has" or "bass"
    assert transition_categories("In\naddition to that") == {"elaboration"}
    assert transition_categories("We first sort, then merge.") == {"sequence", "cause_effect"}  # "then": both
    assert [transition_score(n) for n in (0, 1, 2, 6, 12, 20)] == pytest.approx([0.0, 0.4, 0.45, 0.65, 0.95, 1.0])


def test_content_jaccard_ignores_stopwords_and_is_capped():
    # {python, lists, mutable} vs {tuples, immutable, unlike, lists}: 1 shared of 6
    assert content_jaccard("Python lists are mutable", "Tuples are immutable, unlike lists") == pytest.approx(1 / 6)
    assert content_jaccard("the a", "of") == 1.0  # no content words on either side
    assert content_jaccard("alpha", "beta") == 0.0
    assert jaccard_score(0.015, 0.03) == pytest.approx(0.5)
    assert jaccard_score(0.5, 0.03) == 1.0
    assert jaccard_score(0.115, 0.23) == pytest.approx(0.5)
    # "however" gives 2 categories (contrast, concession): 0.4 × 0.45 + 0.6 × min(1/6, 0.23) / 0.23
    expected = 0.4 * 0.45 + 0.6 * (1 / 6) / 0.23
    assert style_score("however", "Python lists are mutable", "Tuples are immutable unlike lists", 0.23) == (
        pytest.approx(expected)
    )


# --- Summaries: the full leveled reward ------------------------------------------------------------------------------

CONCISE = "Python lists store ordered items and can grow or shrink."  # 10 words, 56 characters, 10 distinct words
# 177 characters; 29 distinct words; content words: 20, sharing all 7 of CONCISE's (python, lists, store, ordered,
# items, grow, shrink); transitions: moreover (elaboration), however (contrast, concession), for example (examples),
# third (sequence), therefore (cause_effect) = 6 categories
DETAILED = (
    "Python lists store ordered items of any type. Moreover, a list can grow or shrink. However, indexing by "
    "position is fast, for example the third item. Therefore lists suit tasks."
)


def test_well_formed_summary_pair_scores_the_hand_computed_sum():
    assert (len(CONCISE), len(DETAILED)) == (56, 177)  # ratio 3.16: inside 1.6-3.2
    assert unique_word_ratio(CONCISE, DETAILED) == pytest.approx(2.9)
    levels = summary_levels(CONCISE, DETAILED)
    style = 0.4 * (0.4 + 5 * 0.05) + 0.6 * 1.0  # 6 categories; Jaccard 7/20 = 0.35 >= the 0.03 cap
    assert levels == pytest.approx(
        {"structure": 0.5, "coordination": 1.0, "vocabulary": 0.5, "style": style, "total": 2.86}
    )
    assert summary_reward(None, [{"concise": CONCISE, "detailed": DETAILED}]) == pytest.approx([2.86])


def test_summary_pair_on_the_coordination_ramp():
    detailed = DETAILED.replace("suit tasks", "suit many tasks")  # +5 characters: 182 / 56 = 3.25
    assert summary_levels(CONCISE, detailed)["coordination"] == pytest.approx(1 - (3.25 - 3.2) / 1.8)
    assert summary_levels(CONCISE, detailed)["total"] == pytest.approx(0.5 + (1 - 0.05 / 1.8) + 0.5 + 0.86)


def test_summary_pair_on_the_ramps_of_levels_2_and_3():
    concise = spaced(tokens("c", 20))  # 100 characters, 20 distinct words
    # 45 two-character words + spaces = 135 characters (ratio 1.35); 33 of them distinct (ratio 1.65)
    two = [f"{chr(97 + i // 10)}{i % 10}" for i in range(33)]
    detailed = spaced(two + two[:12])
    levels = summary_levels(concise, detailed)
    # coordination (1.35 - 1.1) / 0.5 = 0.5; vocabulary 0.5 × (1.65 - 1.3) / 0.7 = 0.25; no transitions, no overlap
    assert levels == pytest.approx(
        {"structure": 0.5, "coordination": 0.5, "vocabulary": 0.25, "style": 0.0, "total": 1.25}
    )


def test_a_failed_structure_gate_scores_zero():
    short = "Lists store ordered items that can grow."  # 7 words
    assert summary_levels(short, DETAILED) == ZERO
    assert summary_levels(CONCISE, " ".join(tokens("d", 257))) == ZERO
    assert summary_reward(None, [{"concise": "", "detailed": DETAILED}]) == [0.0]


def test_a_failed_coordination_gate_stops_before_vocabulary_and_style():
    concise = spaced(tokens("c", 20))  # 100 characters
    detailed = "However, for example, " + spaced(tokens("d", 130))  # 672 characters: ratio 6.72 > 5.0
    assert style_score(detailed, concise, detailed, 0.03) > 0  # levels 3 and 4 alone would score
    assert unique_word_ratio(concise, detailed) > 2
    assert summary_levels(concise, detailed) == {**ZERO, "structure": 0.5, "total": 0.5}


def test_a_failed_vocabulary_gate_stops_before_style():
    concise = spaced(tokens("c", 20))  # 100 characters, 20 distinct words
    detailed = concise * 2  # ratio 2.0 (full coordination), but the same 20 words: ratio 1.0 < 1.3
    assert jaccard_score(content_jaccard(concise, detailed), 0.03) == 1.0  # style alone would score 0.6
    assert summary_levels(concise, detailed) == {**ZERO, "structure": 0.5, "coordination": 1.0, "total": 1.5}


# --- Expansion -------------------------------------------------------------------------------------------------------


def expansion_pair() -> tuple[str, str]:
    """150 words each and 753 characters each: "However," + 149 words / "Finally," + 149 words, 30 words shared."""
    background = " ".join(["However,", *tokens("w", 149)])
    method = " ".join(["Finally,", *tokens("w", 30), *tokens("m", 119)])
    return background, method


def test_well_formed_expansion_pair_scores_the_hand_computed_sum():
    background, method = expansion_pair()
    assert (len(background), len(method)) == (753, 753)  # 8 + 149 × 5: ratio 1.0, inside 1.0-1.3
    # distinct words 150 / 150 = 1.0 (inside 0.7-1.3); transitions in both texts: however (contrast, concession),
    # finally (sequence, time) = 4 categories -> 0.4 + 3 × 0.05 = 0.55; Jaccard: 30 shared of 270 = 1/9, cap 0.23
    style = 0.4 * 0.55 + 0.6 * (1 / 9) / 0.23
    levels = expansion_levels(background, method)
    assert levels == pytest.approx(
        {"structure": 0.5, "coordination": 1.0, "vocabulary": 0.5, "style": style, "total": 2.0 + style}
    )
    assert expansion_reward(None, [{"background": background, "method": method}]) == pytest.approx([2.0 + style])
    assert levels["total"] == pytest.approx(2.509855, abs=1e-6)


def test_expansion_gates():
    background, method = expansion_pair()
    assert expansion_levels(" ".join(tokens("w", 127)), method) == ZERO  # 127 words < 128
    longer = " ".join(["Finally,", *tokens("m", 199)])  # 200 words, 1003 characters: ratio 1.33
    assert expansion_levels(background, longer)["coordination"] == pytest.approx(1 - (1003 / 753 - 1.3) / 0.2)
    too_long = " ".join(tokens("m", 240))  # 1199 characters: ratio 1.59 > 1.5
    assert expansion_levels(background, too_long) == {**ZERO, "structure": 0.5, "total": 0.5}
    # same length (753 characters) but only 38 distinct words: ratio 38 / 150 < 0.5 stops at level 3
    repeated = " ".join(["Finally,", *(tokens("m", 37) * 5)[:149]])
    assert len(repeated) == 753
    assert expansion_levels(background, repeated) == {**ZERO, "structure": 0.5, "coordination": 1.0, "total": 1.5}


# --- The reward functions as trl_marl team rewards -------------------------------------------------------------------


def test_team_rewards_take_batches_chat_messages_and_log_levels():
    logged = {}
    completions = [
        {"concise": CONCISE, "detailed": DETAILED},
        {"concise": [{"role": "assistant", "content": CONCISE}], "detailed": "Too short."},
    ]
    rewards = summary_reward(["p", "p"], completions, log_metric=lambda name, value: logged.update({name: value}))
    assert rewards == pytest.approx([2.86, 0.0])
    assert logged == pytest.approx(
        {
            "rewards/summary_reward/structure": 0.25,
            "rewards/summary_reward/coordination": 0.5,
            "rewards/summary_reward/vocabulary": 0.25,
            "rewards/summary_reward/style": 0.43,
        }
    )


def test_team_rewards_name_the_missing_agent():
    with pytest.raises(ValueError, match="'detailed'.*'concise', 'summary'"):
        summary_reward(None, [{"concise": CONCISE, "summary": DETAILED}])
    with pytest.raises(ValueError, match="'background'"):
        expansion_reward(None, [{"method": "text"}])


# --- Offline data ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "build, column", [(writing_tasks.summaries_dataset, "text"), (writing_tasks.expansion_dataset, "abstract")]
)
def test_offline_datasets_are_deterministic_disjoint_and_chat_formatted(build, column):
    train, eval_ = build("train"), build("eval")
    writing_tasks.documentation_sections.cache_clear()  # rebuild from pydoc_data, not from the cache
    assert build("train").to_dict() == train.to_dict() and build("eval").to_dict() == eval_.to_dict()
    assert len(train) >= 40 and len(eval_) >= 10
    assert {"prompt", column, "topic"} <= set(train.column_names)
    assert not set(train[column]) & set(eval_[column])
    assert not set(train["topic"]) & set(eval_["topic"])  # split by documentation section
    for row in train:
        assert row["prompt"] == [{"role": "user", "content": row["prompt"][0]["content"]}]
        assert row[column] in row["prompt"][0]["content"]
        assert "\n" not in row[column] and "**PEP" not in row[column]
    assert build("train", seed=1)[column] != train[column]


def test_offline_passages_and_abstracts_have_the_intended_sizes():
    summaries, abstracts = writing_tasks.summaries_dataset("train"), writing_tasks.expansion_dataset("train")
    assert all(len(text.split()) >= writing_tasks.PASSAGE_WORDS[0] for text in summaries["text"])
    low, high = writing_tasks.ABSTRACT_WORDS
    assert all(low <= len(text.split()) <= high for text in abstracts["abstract"])


def test_cleaning_removes_rest_markup_but_keeps_code_asterisks():
    lines = ["A *mapping* maps *hashable* keys (see **PEP 8**) [3]; the built-", 'in "f(*args, **kwds)" and "4*0.7".']
    assert (
        writing_tasks.clean_paragraph(lines)
        == 'A mapping maps hashable keys (see PEP 8); the built-in "f(*args, **kwds)" and "4*0.7".'
    )


def test_unknown_split_or_source_is_an_error_naming_the_choices():
    with pytest.raises(ValueError, match="'train', 'eval'"):
        writing_tasks.summaries_dataset("test")
    with pytest.raises(ValueError, match="'offline'.*'hub'"):
        Expansion(source="web")


def test_hub_source_loads_the_papers_datasets(monkeypatch):
    calls = []

    def fake_load_dataset(path, split):
        calls.append((path, split))
        column = "prompt" if path == "trl-lib/tldr" else "abstract_text"
        return datasets.Dataset.from_dict({column: ["A source text."]})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    summaries = Summaries(source="hub").dataset("eval")
    expansion = Expansion(source="hub").dataset("train")
    assert calls == [("trl-lib/tldr", "test[:1100]"), ("OpenMLRL/arXiv_abstract", "train[:1100]")]
    assert summaries["text"] == ["A source text."] and expansion["abstract"] == ["A source text."]
    assert "A source text." in expansion[0]["prompt"][0]["content"]


# --- Registry --------------------------------------------------------------------------------------------------------


def test_tasks_and_rewards_are_discoverable_by_name():
    assert load_plugin("tasks", "summaries") is Summaries
    assert load_plugin("tasks", "expansion") is Expansion
    assert load_plugin("rewards", "summary_reward") is summary_reward
    assert load_plugin("rewards", "expansion_reward") is expansion_reward
    summaries, expansion = resolve_task("summaries"), resolve_task("expansion")
    assert [a["name"] for a in summaries.agents] == ["concise", "detailed"]
    assert [a["name"] for a in expansion.agents] == ["background", "method"]
    assert task_defaults(summaries)["num_turns"] == 1 and summaries.reward_funcs == [summary_reward]
    assert expansion.reward_funcs == [expansion_reward]
    assert len(summaries.dataset("eval")) > 0
