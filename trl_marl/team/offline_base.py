"""A second base model made offline, for trying a team on two bases (`bases.py`) without the network: a small
randomly initialised Qwen2 (another architecture than the embedded SmolLM2's Llama) with a byte-level BPE tokenizer
trained on local prose (Python's own pydoc topics) and a chat template of its own, so that its vocabulary, special
tokens and prompt format all differ from the default model's. It has learned nothing: it shows a two-base team
train, save and load end to end, not what a real second model would add."""

from __future__ import annotations

import os

SPECIAL_TOKENS = ("<|pad|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_offline_base(
    folder: str | os.PathLike,
    *,
    vocab_size: int = 700,
    hidden_size: int = 32,
    num_hidden_layers: int = 2,
    seed: int = 1,
) -> str:
    """Write the model and its tokenizer to `folder` (created) and return its path, loadable by `from_pretrained` or
    named as an agent's `model`. Deterministic for a `seed`."""
    from pydoc_data.topics import topics

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator([topics[key] for key in sorted(topics)], trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<|pad|>", eos_token="<|end|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)
