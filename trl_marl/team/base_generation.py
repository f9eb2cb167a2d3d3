"""Each base of a team generating its own agents' rows: a base other than the trainer's given its own tokenizer,
router, captured decoder and `TeamGeneration` (`other_base`), its prompts tokenized and its completions generated as
TRL does for its model (`tokenize_text_prompts`, `base_single_turn`), a batch's rows handed to their own base
(`generate_by_base`) and their log-probs computed on it (`logps_by_base`).

A row never crosses bases; everything agents exchange is text. The trainer's generation settings are the first
base's: another base gets its own special tokens, and the first base's token ids in other settings carried over by
their text (`base_generation_config`, `carried_token_ids`). Which agents sit on which base, and how each base loads,
is `bases.py`.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence

import torch
from trl.data_utils import is_conversational
from trl.models.utils import disable_gradient_checkpointing

from .bases import BasePlan, TeamBase, base_tokenizer

# The generation settings that hold token ids (nested lists of ids; `sequence_bias` maps id sequences to biases): the
# trainer's are the first base's ids, carried to another base by their text (`base_generation_config`).
TOKEN_ID_SETTINGS = (
    "suppress_tokens",
    "begin_suppress_tokens",
    "bad_words_ids",
    "force_words_ids",
    "sequence_bias",
    "forced_bos_token_id",
    "forced_eos_token_id",
)


def other_base(
    plan: BasePlan,
    model,
    *,
    first_tokenizer,
    agent_adapters: Sequence[str],
    agent_names: Sequence[str],
    generation_config,
    captured: bool | str | None,
    chat_template_kwargs: dict,
    tools,
    pad_to_multiple_of: int | None,
    gradient_checkpointing_kwargs: dict | None,
    max_completion_length: int,
    profile: Callable,
) -> TeamBase:
    """A base other than TRL's model: its tokenizer, router, captured decoder (`captured`: the `captured_decode`
    setting, False for eager `generate`) and `TeamGeneration`, which tokenizes and generates as TRL does for its model
    (`tokenize_text_prompts`, `base_single_turn`) with this base's tokenizer, chat template and special tokens. Raises
    `ValueError` when one of the first base and this one has a chat template and the other has none."""
    from ..generation.captured_decode import captured_decoder
    from ..generation.routing import AdapterRouter
    from ..generation.team_generation import TeamGeneration, position_limit

    # A loaded base (`base_models`) has its tokenizer where the model was loaded from, as TRL finds the trainer's.
    loaded_from = plan.source if isinstance(plan.source, str) else model.get_base_model().config._name_or_path
    tokenizer = base_tokenizer(loaded_from)
    if (tokenizer.chat_template is None) != (first_tokenizer.chat_template is None):
        first = getattr(first_tokenizer, "name_or_path", "") or "the first base"
        with_template, without = (plan.name, first) if tokenizer.chat_template else (first, plan.name)
        raise ValueError(
            f"`agents`: {with_template} has a chat template and {without} has none, but one team's prompts are "
            "either conversations or plain text for every agent. Put the agents on bases that agree (e.g. both "
            "instruct models)."
        )
    router = AdapterRouter(model, [agent_adapters[i] for i in plan.agents])
    decoder = captured_decoder(model, router, captured) if captured is not False else None
    config = base_generation_config(generation_config, model, tokenizer, first_tokenizer)
    generation = TeamGeneration(
        router,
        agent_adapters,
        agent_names,
        tokenize=functools.partial(tokenize_text_prompts, tokenizer, chat_template_kwargs, tools),
        generate_single_turn=base_single_turn(
            model,
            decoder,
            tokenizer,
            config,
            pad_to_multiple_of=pad_to_multiple_of,
            gradient_checkpointing_kwargs=gradient_checkpointing_kwargs,
            profile=profile,
        ),
        processing_class=tokenizer,
        position_limit=position_limit(model.config, None),
        max_completion_length=max_completion_length,
    )
    eos_token_ids = list(config.eos_token_id)
    return TeamBase(plan.name, model, tokenizer, plan.agents, router, decoder, generation, eos_token_ids, plan.loading)


def base_eos_token_ids(model, tokenizer) -> list[int]:
    """TRL's `eos_token_ids` for a base: its tokenizer's EOS first, then its generation config's."""
    eos = model.generation_config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    return eos if tokenizer.eos_token_id in eos else [tokenizer.eos_token_id, *eos]


def base_generation_config(generation_config, model, tokenizer, first_tokenizer):
    """The trainer's generation config (the first base's, `first_tokenizer`'s ids) for another base: its own special
    tokens (pad, BOS, EOS), as TRL builds them for the trainer's model, and the first base's token ids in every other
    setting (`TOKEN_ID_SETTINGS`) carried over by their text (`carried_token_ids`): a single token as one token, a
    sequence (`bad_words_ids`, `force_words_ids`, `sequence_bias`'s keys) as a whole, however the other base splits
    its text. Raises `ValueError` naming the setting when a token or sequence cannot be carried, or for `constraints`,
    objects holding the first base's ids."""
    config = copy.deepcopy(generation_config)
    config.pad_token_id = tokenizer.pad_token_id
    config.bos_token_id = tokenizer.bos_token_id
    config.eos_token_id = base_eos_token_ids(model, tokenizer)
    if getattr(config, "constraints", None):
        raise ValueError(
            "`constraints` hold the first base's token ids, which another base's tokenizer does not share, and a team "
            "on several bases cannot carry them over. Leave `constraints` out of `generation_kwargs`."
        )
    for setting in TOKEN_ID_SETTINGS:
        value = getattr(config, setting, None)
        if value is None:
            continue

        def token(token_id: int, setting=setting) -> int:
            return carried_token_ids([token_id], first_tokenizer, tokenizer, setting, one_token=True)[0]

        def sequences(value, setting=setting):  # a sequence of ids, or nested lists of sequences
            if all(isinstance(token_id, int) for token_id in value):
                return type(value)(carried_token_ids(value, first_tokenizer, tokenizer, setting))
            return type(value)(sequences(inner) for inner in value)

        if isinstance(value, int):  # forced_bos_token_id, forced_eos_token_id
            setattr(config, setting, token(value))
        elif setting in ("suppress_tokens", "begin_suppress_tokens", "forced_eos_token_id"):
            setattr(config, setting, type(value)(token(token_id) for token_id in value))
        elif setting == "sequence_bias" and isinstance(value, dict):
            setattr(config, setting, {sequences(ids): bias for ids, bias in value.items()})
        elif setting == "sequence_bias":  # [[ids, bias], ...]
            setattr(config, setting, [[sequences(ids), bias] for ids, bias in value])
        else:  # bad_words_ids, force_words_ids: lists of sequences (force_words_ids also lists of alternatives)
            setattr(config, setting, [sequences(ids) for ids in value])
    return config


# Short texts put before a token or sequence to read or write its text as it reads inside a text: a SentencePiece
# tokenizer (Llama-2, Mistral) drops the leading space of the first token it decodes ("▁the" alone decodes to "the")
# and adds one before the text it encodes. A tokenizer's anchor is the first of these that it writes and reads back
# exactly (a vocabulary without "\n" writes it as its unknown token).
ANCHOR_TEXTS = ("\n", "a", ".")


def anchors(tokenizer) -> list[list[int]]:
    """The ids of each of `ANCHOR_TEXTS` that `tokenizer` writes and reads back exactly."""
    found = []
    for text in ANCHOR_TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if ids and tokenizer.unk_token_id not in ids and tokenizer.decode(ids) == text:
            found.append(ids)
    return found


def text_of(tokenizer, ids: Sequence[int]) -> str | None:
    """The text `tokenizer` reads `ids` as inside a text (after its first anchor: leading spaces kept); None when it
    has no anchor or the anchor's text does not lead what it reads."""
    for anchor in anchors(tokenizer)[:1]:
        prefix, text = tokenizer.decode(anchor), tokenizer.decode([*anchor, *ids])
        if text.startswith(prefix):
            return text[len(prefix) :]
    return None


def ids_of(tokenizer, text: str) -> list[int] | None:
    """The ids `tokenizer` writes `text` as inside a text (after an anchor, whose ids are taken off), read back as
    exactly `text` (`text_of`); None when no anchor gives that."""
    for anchor in anchors(tokenizer):
        ids = tokenizer.encode(tokenizer.decode(anchor) + text, add_special_tokens=False)
        if ids[: len(anchor)] == anchor and len(ids) > len(anchor) and text_of(tokenizer, ids[len(anchor) :]) == text:
            return ids[len(anchor) :]
    return None


def carried_token_ids(
    ids: Sequence[int], first_tokenizer, tokenizer, setting: str, one_token: bool = False
) -> list[int]:
    """The ids `tokenizer` writes the text of the sequence `ids` of `first_tokenizer` as: the text each tokenizer reads
    inside a text (`text_of`, `ids_of`: a SentencePiece token's leading space kept), which `first_tokenizer` writes as
    exactly `ids` and `tokenizer` reads back as exactly that text; with `one_token`, a single token. Raises
    `ValueError` naming `setting`, the ids and their text otherwise (a token the other base splits where one token is
    needed, a token that is no text on its own, such as part of a character)."""
    ids = list(ids)
    text = text_of(first_tokenizer, ids)
    carried = None if text is None else ids_of(tokenizer, text)
    exact = text is not None and ids_of(first_tokenizer, text) == ids and carried is not None
    if exact and (len(carried) == 1 or not one_token):
        return carried
    first = getattr(first_tokenizer, "name_or_path", "") or "the first base"
    other = getattr(tokenizer, "name_or_path", "") or "another base"
    what = f"token id {ids[0]}" if len(ids) == 1 else f"the token ids {ids}"
    if exact:
        written = f"writes as {carried}, not as one token: it holds single tokens"
    elif text is not None and carried is not None:
        written = "cannot carry exactly: the first base's tokenizer does not write that text as those ids"
    else:
        written = "cannot write as exactly that text"
    raise ValueError(
        f"`{setting}` holds {what} ({text!r}) of the first base's tokenizer ({first}), which the tokenizer of {other} "
        f"{written}; a team on several bases cannot carry it to that base. Remove it from "
        f"`generation_kwargs['{setting}']`, or put these agents on bases whose tokenizers share it."
    )


def tokenize_text_prompts(tokenizer, chat_template_kwargs: dict, tools, prompts: list):
    """TRL's `_tokenize_prompts` for text prompts, with a base's own tokenizer and chat template."""
    if is_conversational({"prompt": prompts[0]}):
        prompt_ids = tokenizer.apply_chat_template(
            conversation=prompts,
            tools=tools or None,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            **chat_template_kwargs,
        )["input_ids"]
    else:
        prompt_ids = tokenizer(text=prompts)["input_ids"]
    return prompt_ids, None, {}


def base_single_turn(
    model,
    decoder,
    tokenizer,
    generation_config,
    *,
    pad_to_multiple_of: int | None,
    gradient_checkpointing_kwargs: dict | None,
    profile: Callable,
) -> Callable:
    """TRL's `_generate_single_turn` (text, without vLLM) for a base other than the trainer's: its prompts
    left-padded with its pad token, `generate` (or its captured decoder) with its special tokens, completions cut
    after its first EOS."""
    from ..generation.team_generation import completions_through_eos, left_padded

    eos_token_ids = list(generation_config.eos_token_id)

    def single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if images is not None or multimodal_fields:
            raise ValueError("A base other than the trainer's first generates text only.")
        device = next(model.parameters()).device
        input_ids, attention_mask = left_padded(prompt_ids, tokenizer.pad_token_id, pad_to_multiple_of, device)
        with (
            profile("transformers.generate"),
            disable_gradient_checkpointing(model, gradient_checkpointing_kwargs),
            torch.no_grad(),
        ):
            if decoder is not None:
                output = decoder.generate(input_ids, attention_mask, generation_config)
            else:
                output = model.generate(
                    input_ids=input_ids, attention_mask=attention_mask, generation_config=generation_config
                )
        return completions_through_eos(output[:, input_ids.size(1) :], eos_token_ids), None

    return single_turn


def generate_by_base(
    bases: Sequence[TeamBase], agent_base: Sequence[int], model_inputs: list, agent_index: list[int], **kwargs
):
    """The rollouts' `generate` hook over several bases: each base's rows in one call of its own generation, the
    results back in row order (prompt ids, completion ids, texts)."""
    prompt_ids, completion_ids, texts = [None] * len(agent_index), [None] * len(agent_index), [None] * len(agent_index)
    for base_index, base in enumerate(bases):
        rows = [row for row, agent in enumerate(agent_index) if agent_base[agent] == base_index]
        if not rows:
            continue
        out = base.generation.generate(
            [model_inputs[row] for row in rows], [agent_index[row] for row in rows], **kwargs
        )
        for position, row in enumerate(rows):
            prompt_ids[row], completion_ids[row], texts[row] = out[0][position], out[1][position], out[2][position]
    return prompt_ids, completion_ids, texts


def logps_by_base(
    bases: Sequence[TeamBase],
    base_of_row: torch.Tensor,
    agent_index: torch.Tensor,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    routed_logps: Callable,
    logits_to_keep: int,
    batch_size: int,
    **kwargs,
):
    """TRL's `(log-probs, entropies, aux loss)` of a batch whose rows sit on several bases: each base's rows through
    its own model (`routed_logps(base_index, base, agent_index, input_ids, attention_mask, logits_to_keep,
    batch_size, **kwargs)`), with its own padding (another base's pad token may lie outside its vocabulary) and
    trimmed to its rows' longest prompt, then put back in row order (differentiably)."""
    logps = entropies = None
    aux_losses = []
    for index, base in enumerate(bases):
        rows = (base_of_row == index).nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        ids, mask = input_ids[rows], attention_mask[rows]
        start = int(mask.argmax(dim=1).min())  # the left padding every row of this base has
        ids, mask = ids[:, start:].masked_fill(mask[:, start:] == 0, base.pad_token_id), mask[:, start:]
        part_logps, part_entropies, part_aux = routed_logps(
            index, base, agent_index[rows], ids, mask, logits_to_keep, batch_size, **kwargs
        )
        if logps is None:
            logps = part_logps.new_zeros((input_ids.size(0), *part_logps.shape[1:]))
            entropies = None if part_entropies is None else part_entropies.new_zeros(logps.shape)
        logps = logps.index_copy(0, rows, part_logps)
        if entropies is not None:
            entropies = entropies.index_copy(0, rows, part_entropies)
        if part_aux is not None:
            aux_losses.append(part_aux)
    return logps, entropies, torch.stack(aux_losses).mean() if aux_losses else None
