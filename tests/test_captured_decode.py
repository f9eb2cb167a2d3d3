"""The captured decode step (`trl_marl.generation.captured_decode`): the same tokens as eager `generate`, for routed
teams of 1, 2 and 4 agents (in train mode too, LoRA dropout live), a 4-bit base and the trainer; the same greedy
tokens as a forward without cache for full, sliding-window and hybrid attention; caches and graphs reused across calls
without leaking rows.

Compiling costs ~10 s per shape on 2 CPU cores: the default run proves the mechanism on tiny models (the "static"
path, the same loop with an eager step, where compiling adds nothing to what is checked); the compiled path and the
default model's equality checks are in the slow set.
"""

import weakref

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from tiny_run import TINY_RUN
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Lfm2Config,
    Llama4TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
)

from trl_marl import MAGRPOConfig, MAGRPOTrainer
from trl_marl.agents import keep_4bit_weights_trainable
from trl_marl.generation import captured_decode, decode_support
from trl_marl.generation.captured_decode import (
    CapturedDecoder,
    bucket_length,
    bucket_rows,
    captured_decoder,
    describe,
)
from trl_marl.generation.decode_support import choose_path
from trl_marl.generation.routing import BASE, AdapterRouter

NAMES = ["a", "b", "c", "d"]


def tiny_base(vocab: int = 128) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    return LlamaForCausalLM(config).eval()


def tiny_team(agents: int):
    """A tiny random Llama with `agents` LoRA adapters whose B is random (so every agent differs from the base)."""
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    team = get_peft_model(tiny_base(), lora, adapter_name=NAMES[0])
    for name in NAMES[1:agents]:
        team.add_adapter(name, lora)
    return team


def left_padded(rows: int, width: int, seed: int, vocab: int = 128):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab, (rows, width), generator=generator)
    attention_mask = torch.ones(rows, width, dtype=torch.long)
    for row in range(rows):
        padding = int(torch.randint(0, width - 1, (1,), generator=generator))
        input_ids[row, :padding] = 0
        attention_mask[row, :padding] = 0
    return input_ids, attention_mask


def generate_both(team, router, decoder, adapters, input_ids, attention_mask, seed=None, **settings):
    """Eager `generate`'s output and the decoder's for the same rows and settings (each after `torch.manual_seed(seed)`
    when a seed is given)."""
    settings = {"max_new_tokens": 10, "pad_token_id": 0, "eos_token_id": 5, **settings}
    outputs = []
    for generate in (team.generate, decoder.generate):
        if seed is not None:
            torch.manual_seed(seed)
        if router is not None:
            router.route(adapters)
        try:
            with torch.no_grad():
                outputs.append(generate(input_ids=input_ids, attention_mask=attention_mask, **settings))
        finally:
            if router is not None:
                router.route(None)
    return outputs


@pytest.mark.parametrize("agents", [1, 2, 4])
def test_greedy_tokens_equal_eager_generate_for_routed_teams(agents):
    team = tiny_team(agents)
    router = AdapterRouter(team, NAMES[:agents]) if agents > 1 else None
    decoder = CapturedDecoder(team, router, path="static")
    input_ids, attention_mask = left_padded(6, 9, seed=agents)
    adapters = [NAMES[row % agents] for row in range(6)]
    eager, captured = generate_both(team, router, decoder, adapters, input_ids, attention_mask, do_sample=False)
    assert eager.shape == captured.shape
    assert torch.equal(eager, captured)
    # The agents really differ: the same rows through one agent's adapter give other tokens.
    if agents > 1:
        eager_one, _ = generate_both(team, router, decoder, ["a"] * 6, input_ids, attention_mask, do_sample=False)
        assert not torch.equal(eager_one, eager)


def test_rows_routed_to_the_base_and_generation_settings_keep_their_meaning():
    team = tiny_team(2)
    router = AdapterRouter(team, NAMES[:2])
    decoder = CapturedDecoder(team, router, path="static")
    input_ids, attention_mask = left_padded(5, 7, seed=11)
    adapters = ["a", BASE, "b", "b", BASE]
    # Greedy under a repetition penalty and a minimum length: processors of generate's own preparation.
    settings = {"do_sample": False, "repetition_penalty": 1.7, "min_new_tokens": 6, "max_new_tokens": 12}
    eager, captured = generate_both(team, router, decoder, adapters, input_ids, attention_mask, **settings)
    assert torch.equal(eager, captured)
    # Top-k of one is greedy, whatever the temperature.
    sampled = {**settings, "do_sample": True, "top_k": 1, "temperature": 0.7}
    _, top1 = generate_both(team, router, decoder, adapters, input_ids, attention_mask, **sampled)
    assert torch.equal(top1, eager)


def test_eos_ends_each_row_and_the_call_stops_when_every_row_has():
    team = tiny_team(2)
    router = AdapterRouter(team, NAMES[:2])
    decoder = CapturedDecoder(team, router, path="static")
    input_ids, attention_mask = left_padded(2, 6, seed=3)
    adapters = ["a", "b"]
    eager, _ = generate_both(
        team, router, decoder, adapters, input_ids, attention_mask, do_sample=False, max_new_tokens=40
    )
    # Make a token both rows emit, at different steps, the end of sequence: the rows stop apart, then the call stops.
    first_at = [{int(token): step for step, token in reversed(list(enumerate(row[6:])))} for row in eager]
    eos = min(set(first_at[0]) & set(first_at[1]), key=lambda token: max(first_at[0][token], first_at[1][token]))
    eager, captured = generate_both(
        team,
        router,
        decoder,
        adapters,
        input_ids,
        attention_mask,
        do_sample=False,
        eos_token_id=eos,
        max_new_tokens=40,
    )
    assert torch.equal(eager, captured)
    assert captured.shape[1] == 6 + max(first_at[0][eos], first_at[1][eos]) + 1  # stopped with the last row to finish
    for row, steps in zip(captured, first_at):
        assert row[6 + steps[eos]] == eos and (row[6 + steps[eos] + 1 :] == 0).all()  # then padding


def test_sampling_with_a_fixed_seed_is_reproducible_and_seeds_differ():
    team = tiny_team(2)
    router = AdapterRouter(team, NAMES[:2])
    decoder = CapturedDecoder(team, router, path="static")
    input_ids, attention_mask = left_padded(6, 8, seed=5)

    def sample(seed):
        torch.manual_seed(seed)
        router.route(["a", "b"] * 3)
        try:
            return decoder.generate(input_ids, attention_mask, max_new_tokens=12, do_sample=True, pad_token_id=0)
        finally:
            router.route(None)

    assert torch.equal(sample(0), sample(0))
    assert not torch.equal(sample(0), sample(1))


def test_a_reused_cache_and_graph_never_leak_one_calls_rows_into_the_next():
    team = tiny_team(4)
    router = AdapterRouter(team, NAMES)
    first_rows, second_rows = left_padded(5, 9, seed=1), left_padded(7, 6, seed=2)
    first_adapters, second_adapters = ["a", "b", "c", "d", "a"], ["d", "d", "c", BASE, "b", "a", "a"]

    def call(decoder, rows, adapters):
        router.route(adapters)
        try:
            return decoder.generate(*rows, max_new_tokens=9, do_sample=False, pad_token_id=0)
        finally:
            router.route(None)

    reused = CapturedDecoder(team, router, path="static")
    first, second = call(reused, first_rows, first_adapters), call(reused, second_rows, second_adapters)
    assert len(reused._caches) == 1  # both calls ran on the one cache of their shape (8 rows, 256 positions)
    assert torch.equal(first, call(CapturedDecoder(team, router, path="static"), first_rows, first_adapters))
    assert torch.equal(second, call(CapturedDecoder(team, router, path="static"), second_rows, second_adapters))


def test_adapters_trained_between_calls_are_read_anew():
    team = tiny_team(2)
    router = AdapterRouter(team, NAMES[:2])
    decoder = CapturedDecoder(team, router, path="static")
    rows = left_padded(4, 6, seed=8)
    before = generate_both(team, router, decoder, ["a", "b"] * 2, *rows, do_sample=False)[1]
    with torch.no_grad():
        for name, parameter in team.named_parameters():
            if "lora_B.b" in name:
                parameter.mul_(-3.0)  # an optimizer step, in place
    eager, captured = generate_both(team, router, decoder, ["a", "b"] * 2, *rows, do_sample=False)
    assert torch.equal(eager, captured)
    assert not torch.equal(captured[1::2], before[1::2])  # agent b's rows changed with its adapter
    assert torch.equal(captured[0::2], before[0::2])  # agent a's did not


def test_shapes_are_bucketed_so_a_handful_of_graphs_serve_every_call():
    assert [bucket_rows(n) for n in (1, 8, 9, 16, 33, 64, 65, 256, 257)] == [8, 8, 16, 16, 64, 64, 128, 256, 512]
    assert [bucket_length(n) for n in (1, 256, 257, 700)] == [256, 256, 512, 768]


def test_a_team_whose_routing_cannot_be_captured_is_refused_when_asked_and_falls_back_otherwise():
    team = tiny_team(1)
    team.add_adapter("dora", LoraConfig(r=4, target_modules="all-linear", use_dora=True))
    router = AdapterRouter(team, ["a", "dora"])
    with pytest.raises(ValueError, match="cannot be captured.*PEFT's per-row Python path.*captured_decode=False"):
        captured_decoder(team, router, True)
    assert captured_decoder(team, router, None) is None  # the CPU default: eager, nothing to refuse
    with pytest.raises(ValueError, match="max_new_tokens"):
        CapturedDecoder(team, None, path="static").generate(*left_padded(2, 4, seed=0))


@pytest.mark.parametrize("path", ["static", pytest.param("compiled", marks=pytest.mark.slow)])
def test_a_4bit_base_decodes_the_same_tokens_captured(tmp_path, path):
    pytest.importorskip("bitsandbytes")
    from transformers import BitsAndBytesConfig

    tiny_base().save_pretrained(tmp_path)
    quantization = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
    )
    base = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=quantization)
    team = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"), adapter_name="a")
    team.add_adapter("b", LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    keep_4bit_weights_trainable(team)  # as the trainer and load_team do: bitsandbytes' kernel of training
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in team.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator))
    router = AdapterRouter(team, ["a", "b"])
    decoder = CapturedDecoder(team, router, path="static")
    eager, captured = generate_both(
        team, router, decoder, ["a", "b", "b"], *left_padded(3, 6, seed=4), do_sample=False
    )
    assert torch.equal(eager, captured)


def trainer_run(model_dir, tmp_path, captured_decode, tools=False):
    """Two steps of a two-agent team. With `tools`, each agent has `add` and every answer is read as a call to it (the
    tiny random model writes none): each row's tool result is appended and its second round of generation goes
    through the same path as the first."""
    prompts = [[{"role": "user", "content": p}] for p in ["Name a colour.", "Name a fruit.", "Say hi.", "Count."]]
    # with tools: 6 tokens a round (`max_new_tokens`), room for the tool result and a second round in a completion
    with_tools = dict(generation_kwargs={"max_new_tokens": 6}) if tools else {}
    args = MAGRPOConfig(
        output_dir=str(tmp_path / f"out-{captured_decode}"),
        agents=["writer", "checker"],
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=64 if tools else 6,
        max_steps=2,
        captured_decode=captured_decode,
        **TINY_RUN,
        seed=3,
        **with_tools,
    )
    reward = lambda prompts, completions, **kw: [len(c["writer"]) - len(c["checker"]) / 2 for c in completions]  # noqa: E731
    dataset = Dataset.from_dict({"prompt": prompts})
    if tools:
        from test_tools import add, calls_add_once, tool_tokenizer

        tokenizer = tool_tokenizer(model_dir)
        trainer = MAGRPOTrainer(
            model_dir, reward, args=args, train_dataset=dataset, processing_class=tokenizer, tools=[add]
        )
        trainer.team_generation.tool_calling.parse = calls_add_once(tokenizer)
    else:
        trainer = MAGRPOTrainer(model_dir, reward, args=args, train_dataset=dataset)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in trainer.model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
    initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}
    trainer.train()
    return trainer, {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}, initial


def assert_trained_alike(captured_adapters, eager_adapters, initial):
    assert captured_adapters.keys() == eager_adapters.keys() == initial.keys()
    for name, value in captured_adapters.items():
        assert torch.equal(value, eager_adapters[name]), name
    for agent in ("writer", "checker"):
        assert any(
            not torch.equal(value, initial[name]) for name, value in captured_adapters.items() if f".{agent}." in name
        ), f"{agent}'s adapter did not train"


@pytest.mark.slow
def test_the_trainer_on_the_compiled_path_trains_exactly_as_on_eager_generate(tiny_model_dir, tmp_path):
    captured, captured_adapters, initial = trainer_run(tiny_model_dir, tmp_path, True)
    eager, eager_adapters, _ = trainer_run(tiny_model_dir, tmp_path, False)
    assert captured.captured_decoder is not None and captured.captured_decoder.path == "compiled"
    assert captured.router._tensor_routing is not None  # it generated through the captured step
    assert not captured.captured_decoder._caches  # released when each rollout ended
    assert eager.captured_decoder is None
    assert_trained_alike(captured_adapters, eager_adapters, initial)


def test_the_trainer_uses_the_decoder_it_chose(tiny_model_dir, tmp_path, monkeypatch):
    """The seam: without vLLM, the trainer's generation goes through its decoder (here the static path, fast on the
    CPU) and trains every adapter exactly as eager `generate` does: 8 rows per call fill their bucket, so sampling
    draws the same numbers on both paths, from the same probabilities."""
    monkeypatch.setattr("trl_marl.generation.captured_decode.choose_path", lambda requested, device: "static")
    captured, captured_adapters, initial = trainer_run(tiny_model_dir, tmp_path, None)
    monkeypatch.undo()
    eager, eager_adapters, _ = trainer_run(tiny_model_dir, tmp_path, False)
    assert captured.captured_decoder.path == "static" and captured.router._tensor_routing is not None
    assert not captured.captured_decoder._caches  # released when each rollout ended: training has the memory
    assert_trained_alike(captured_adapters, eager_adapters, initial)


@pytest.mark.slow
def test_with_tools_the_tool_loops_rounds_go_through_the_decoder_and_train_exactly_as_on_eager_generate(
    tiny_model_dir, tmp_path, monkeypatch
):
    calls, generate = [], CapturedDecoder.generate
    monkeypatch.setattr(CapturedDecoder, "generate", lambda self, *a, **k: calls.append(1) or generate(self, *a, **k))
    monkeypatch.setattr("trl_marl.generation.captured_decode.choose_path", lambda requested, device: "static")
    captured, captured_adapters, initial = trainer_run(tiny_model_dir, tmp_path, None, tools=True)
    monkeypatch.undo()
    eager, eager_adapters, _ = trainer_run(tiny_model_dir, tmp_path, False, tools=True)
    assert captured.captured_decoder.path == "static" and eager.captured_decoder is None
    assert len(calls) == 4  # 2 rollouts, each of 2 rounds (the answers, then every row after its tool result)
    for trainer in (captured, eager):
        logs = [entry for entry in trainer.state.log_history if "tools/call_frequency" in entry]
        assert [entry["tools/call_frequency"] for entry in logs] == [1.0, 1.0]  # every row called, then went on
    assert_trained_alike(captured_adapters, eager_adapters, initial)


@pytest.mark.slow
@pytest.mark.parametrize("agents", [1, 2, 4])
def test_the_default_model_decodes_the_same_greedy_tokens_compiled(default_model_dir, agents):
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
    team = get_peft_model(model, lora, adapter_name="a")
    for name in NAMES[1:agents]:
        team.add_adapter(name, lora)
    router = AdapterRouter(team, NAMES[:agents]) if agents > 1 else None
    decoder = CapturedDecoder(team, router, path="compiled")
    questions = ["Name a colour.", "What is 2 + 3?", "Say hello to Ada.", "Name a river.", "Count to four."]
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in questions
    ]
    batch = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left")
    adapters = [NAMES[row % agents] for row in range(len(texts))]
    eager, captured = generate_both(
        team,
        router,
        decoder,
        adapters,
        batch["input_ids"],
        batch["attention_mask"],
        do_sample=False,
        max_new_tokens=24,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    assert torch.equal(eager, captured)


def test_a_failing_captured_step_falls_back_to_eager_generate_by_default_and_raises_when_asked_for(caplog):
    """The default (`captured_decode=None`) must not break a run on a device or model where capturing fails: the
    failure is logged once and sampling goes on eagerly; `captured_decode=True` raises it."""
    team = tiny_team(2)
    router = AdapterRouter(team, NAMES[:2])
    rows = left_padded(3, 6, seed=9)

    def failing_step(*args):
        raise RuntimeError("CUDA graph capture failed")  # what an untried device may answer

    for fall_back in (True, False):
        decoder = CapturedDecoder(team, router, path="static", fall_back=fall_back)
        decoder._step = failing_step
        if not fall_back:
            with pytest.raises(RuntimeError, match="capture failed"):
                generate_both(team, router, decoder, ["a", "b", "a"], *rows, do_sample=False)
            continue
        with caplog.at_level("WARNING", logger="trl_marl.generation.captured_decode"):
            eager, fell_back = generate_both(team, router, decoder, ["a", "b", "a"], *rows, do_sample=False)
        assert torch.equal(eager, fell_back)  # routed as ever: each row through its agent's adapter
        assert "captured decode step failed (RuntimeError: CUDA graph capture failed)" in caplog.text
        assert describe(decoder).startswith("eager generate (the captured step failed")
        assert torch.equal(generate_both(team, router, decoder, ["a", "b", "a"], *rows, do_sample=False)[1], eager)


def test_calls_the_loop_does_not_serve_go_eager_by_default_and_are_refused_when_asked_for():
    team = tiny_team(2)
    router = AdapterRouter(team, NAMES[:2])
    rows = left_padded(3, 6, seed=2)
    for settings, named in (
        ({"num_return_sequences": 2, "do_sample": True}, "num_return_sequences=2"),
        ({"num_beams": 2}, "num_beams=2"),
    ):
        strict = CapturedDecoder(team, router, path="static")
        router.route(["a", "b", "b"])
        with pytest.raises(ValueError, match=f"cannot serve this call: `{named}`.*captured_decode=False"):
            strict.generate(*rows, max_new_tokens=5, **settings)
        router.route(None)
    # By default such a call is eager `generate`'s own (here beams: deterministic), and the decoder stays captured.
    # (Beams with rows routed to several adapters fail in eager `generate` too: PEFT's routing does not follow the
    # beams, so this runs on PEFT's active adapter, without the router.)
    lenient = CapturedDecoder(team, None, path="static", fall_back=True)
    eager, served = generate_both(team, None, lenient, None, *rows, num_beams=2)
    assert torch.equal(eager, served) and lenient.failure is None
    lenient = CapturedDecoder(team, router, path="static", fall_back=True)
    # Disabled adapters: the captured forwards would add LoRA deltas that eager `generate` leaves out.
    with team.disable_adapter():
        eager, served = generate_both(team, router, lenient, ["a", "b", "b"], *rows, do_sample=False)
        assert torch.equal(eager, served)
        with pytest.raises(ValueError, match=r"disabled \(`disable_adapter\(\)`\)"):
            generate_both(team, router, CapturedDecoder(team, router, path="static"), ["a", "b", "b"], *rows)


def test_a_model_whose_generation_config_names_a_cache_implementation_still_decodes_captured():
    team = tiny_team(2)
    team.get_base_model().generation_config.cache_implementation = "static"  # as some checkpoints ship it
    router = AdapterRouter(team, NAMES[:2])
    decoder = CapturedDecoder(team, router, path="static")
    eager, captured = generate_both(team, router, decoder, ["a", "b"], *left_padded(2, 5, seed=1), do_sample=False)
    assert torch.equal(eager, captured)
    assert team.get_base_model().generation_config.cache_implementation == "static"  # given back


def test_stop_strings_end_rows_as_in_eager_generate_which_serves_them(tiny_model_dir):
    """`generate` does not hand a custom decoding loop the tokenizer that stop strings need: such calls are eager
    `generate`'s, by default, and refused by name when the captured step is asked for."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    team = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(), lora, adapter_name="a")
    team.add_adapter("b", lora)
    router = AdapterRouter(team, ["a", "b"])
    batch = tokenizer(["Say one word.", "Name a colour."], return_tensors="pt", padding=True, padding_side="left")
    settings = {"do_sample": False, "max_new_tokens": 30, "pad_token_id": tokenizer.pad_token_id}
    decoder = CapturedDecoder(team, router, path="static", fall_back=True)
    free, _ = generate_both(team, router, decoder, ["a", "b"], **batch, **settings)
    # A stop string taken from what row 0 generates at its fourth token: it must end there, as in eager generate.
    stop = tokenizer.decode(free[0, batch["input_ids"].shape[1] + 3 : batch["input_ids"].shape[1] + 4])
    stopping = {**settings, "stop_strings": [stop], "tokenizer": tokenizer}
    eager, captured = generate_both(team, router, decoder, ["a", "b"], **batch, **stopping)
    width, pad = batch["input_ids"].shape[1], tokenizer.pad_token_id
    assert torch.equal(eager, captured)
    assert (captured[0, width + 4 :] == pad).all() and not (free[0, width + 4 :] == pad).all()  # row 0 stopped
    assert decoder.failure is None
    with pytest.raises(ValueError, match="`stop_strings=.*` is not served"):
        generate_both(team, router, CapturedDecoder(team, router, path="static"), ["a", "b"], **batch, **stopping)


def test_a_call_that_is_wrong_in_itself_raises_and_leaves_the_decoder_captured():
    team = tiny_team(2)
    router = AdapterRouter(team, NAMES[:2])
    decoder = CapturedDecoder(team, router, path="static", fall_back=True)
    input_ids, attention_mask = left_padded(3, 5, seed=3)
    router.route(["a", "b"])
    with pytest.raises(ValueError, match="routes 2 rows but the call has 3"):  # eager generate refuses it too
        decoder.generate(input_ids, attention_mask, max_new_tokens=4)
    router.route(None)
    out_of_vocabulary = input_ids.clone()
    out_of_vocabulary[0, -1] = 10_000  # eager generate fails on it too: the call's own error
    with pytest.raises(IndexError):
        generate_both(team, router, decoder, ["a", "b", "a"], out_of_vocabulary, attention_mask, do_sample=False)
    assert decoder.failure is None
    eager, captured = generate_both(team, router, decoder, ["a", "b", "a"], input_ids, attention_mask, do_sample=False)
    assert torch.equal(eager, captured)


# Tiny sizes for the attention-layout tests; a wide initialisation keeps greedy choices far from ties.
TINY_SIZES = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=None,  # greedy runs the whole length, as the reference does
    pad_token_id=0,
)
WINDOW = 8
ATTENTION_LAYOUTS = {
    "mistral-every-layer-sliding": lambda: MistralConfig(**TINY_SIZES, sliding_window=WINDOW),
    "phi3-every-layer-sliding": lambda: Phi3Config(**TINY_SIZES, sliding_window=WINDOW),
    "qwen2-full-then-sliding": lambda: Qwen2Config(
        **TINY_SIZES,
        use_sliding_window=True,
        sliding_window=WINDOW,
        layer_types=["full_attention", "sliding_attention"],
    ),
    "qwen2-sliding-then-full": lambda: Qwen2Config(
        **TINY_SIZES,
        use_sliding_window=True,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
    ),
    "llama-full": lambda: LlamaConfig(**TINY_SIZES),
}


def greedy_without_cache(model, input_ids, attention_mask, new_tokens: int) -> torch.Tensor:
    """Greedy decoding with no cache at all: each token is the argmax of a forward over the whole sequence so far (the
    positions counted past the left padding, as `generate` counts them)."""
    with torch.no_grad():
        for _ in range(new_tokens):
            position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
            logits = model(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
            ).logits
            input_ids = torch.cat([input_ids, logits[:, -1].argmax(-1, keepdim=True)], dim=-1)
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(attention_mask), 1)], dim=-1)
    return input_ids


def assert_greedy_tokens_equal_the_reference_across_the_window(model, decoder):
    """Prompts shorter than the window with completions that cross it, and prompts longer than it: the captured step
    decodes the reference's tokens; on a sliding layout, the window really changes them."""
    for width, new_tokens in ((6, 20), (12, 12)):
        input_ids, attention_mask = left_padded(3, width, seed=width)
        reference = greedy_without_cache(model, input_ids, attention_mask, new_tokens)
        with torch.no_grad():
            captured = decoder.generate(input_ids, attention_mask, max_new_tokens=new_tokens, do_sample=False)
        assert torch.equal(captured, reference), (width, new_tokens)
        if getattr(model.config, "sliding_window", None) is not None:
            window, model.config.sliding_window = model.config.sliding_window, 10_000
            try:
                assert not torch.equal(greedy_without_cache(model, input_ids, attention_mask, new_tokens), reference)
            finally:
                model.config.sliding_window = window


@pytest.mark.parametrize("layout", ATTENTION_LAYOUTS)
def test_greedy_tokens_equal_a_no_cache_reference_for_sliding_hybrid_and_full_attention(layout):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(ATTENTION_LAYOUTS[layout]()).eval()
    assert_greedy_tokens_equal_the_reference_across_the_window(model, CapturedDecoder(model, path="static"))


@pytest.mark.slow
def test_an_every_layer_sliding_model_decodes_the_reference_tokens_compiled():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(ATTENTION_LAYOUTS["mistral-every-layer-sliding"]()).eval()
    decoder = CapturedDecoder(model, path="compiled")
    assert_greedy_tokens_equal_the_reference_across_the_window(model, decoder)  # one shape: one compile
    assert decoder.failure is None


@pytest.mark.parametrize(
    ("config", "layer_type"),
    [
        (
            lambda: Llama4TextConfig(
                **TINY_SIZES, intermediate_size_mlp=64, head_dim=8, attention_chunk_size=WINDOW, num_local_experts=1
            ),
            "chunked_attention",
        ),
        (lambda: Lfm2Config(**TINY_SIZES, layer_types=["conv", "full_attention"]), "conv"),
    ],
    ids=["chunked", "convolution"],
)
def test_a_model_with_other_attention_layers_goes_eager_by_default_and_is_refused_by_name_when_asked_for(
    monkeypatch, config, layer_type
):
    """The decoder's cache holds full and sliding-window attention only; the layer types are read as transformers reads
    them, or, in releases without its reader, from `layer_types` and the config's window fields."""
    model = AutoModelForCausalLM.from_config(config()).eval()
    monkeypatch.setattr("trl_marl.generation.captured_decode.choose_path", lambda requested, device: "static")
    for reader in (decode_support.get_layer_types_and_kwargs, None):
        monkeypatch.setattr(decode_support, "get_layer_types_and_kwargs", reader)
        assert captured_decoder(model, None, None) is None
        with pytest.raises(ValueError, match=f"cannot be captured: .*`{layer_type}` layers.*captured_decode=False"):
            captured_decoder(model, None, True)


def test_in_train_mode_each_row_gets_its_own_adapters_dropout_as_in_eager_generate():
    """TRL samples in train mode, so LoRA dropout is live while sampling. An adapter the router does not route, listed
    first in the model with a heavy dropout, must not touch the routed rows: with the same seed, eager `generate` and
    the captured step sample the same tokens (8 rows fill their bucket, so both draw the same numbers)."""
    unrouted = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False, lora_dropout=0.9)
    team = get_peft_model(tiny_base(), unrouted, adapter_name="unrouted")
    for name in NAMES[:2]:
        team.add_adapter(name, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))
    router = AdapterRouter(team, NAMES[:2])
    decoder = CapturedDecoder(team, router, path="static")
    team.train()
    eager, captured = generate_both(
        team, router, decoder, ["a", "b"] * 4, *left_padded(8, 6, seed=12), seed=7, do_sample=True, max_new_tokens=12
    )
    assert torch.equal(eager, captured)


def test_flash_attention_goes_eager_by_default_and_is_refused_by_name_when_asked_for(monkeypatch):
    """The loop's mask marks the cache's unwritten positions as attended (the causal mask hides them); flash attention
    reads a mask of ones as none and would attend to them, so it is not captured."""
    model = tiny_base().eval()
    monkeypatch.setattr("trl_marl.generation.captured_decode.choose_path", lambda requested, device: "static")
    assert captured_decoder(model, None, True) is not None  # sdpa: served
    monkeypatch.setattr(model.config, "_attn_implementation_internal", "flash_attention_2", raising=False)
    assert model.config._attn_implementation == "flash_attention_2"
    assert captured_decoder(model, None, None) is None
    with pytest.raises(ValueError, match="cannot be captured: attention `flash_attention_2`.*captured_decode=False"):
        captured_decoder(model, None, True)


# -- the recorded step (CUDA graphs on a GPU): everything but the recording itself, on the CPU


def emulate_recording(monkeypatch) -> list[tuple[int, int]]:
    """Replace CUDA-graph recording by its CPU stand-in: the warm-ups and their `restore` as `record_step` runs them,
    then a "replay" that runs the step again on the same buffers (what a graph does). The shapes recorded, in order."""
    recorded = []

    def record_step(step, restore, pool, warmup_steps=2):
        for _ in range(warmup_steps):
            step()
            restore()
        output = step()  # the recording's run: its keys and values written, as a warm-up's were
        restore()
        recorded.append(tuple(output.shape))
        return step

    monkeypatch.setattr(captured_decode, "record_step", record_step)
    return recorded


@pytest.mark.parametrize("agents", [1, 2, 4])
def test_the_recorded_step_decodes_eager_generates_tokens_and_records_once_per_shape(monkeypatch, agents):
    recorded = emulate_recording(monkeypatch)
    team = tiny_team(agents)
    router = AdapterRouter(team, NAMES[:agents])
    decoder = CapturedDecoder(team, router, path="cuda-graphs")
    adapters = [NAMES[row % agents] for row in range(6)]
    for seed in (1, 2):  # the second call replays the first call's recording: same shape, same cache and buffers
        eager, captured = generate_both(team, router, decoder, adapters, *left_padded(6, 7, seed=seed))
        assert torch.equal(eager, captured)
    assert len(recorded) == 1 and set(decoder.warmups) == {(8, 256)}
    assert decoder.failure is None


def test_a_recorded_step_is_recorded_again_when_its_cache_or_routing_buffers_were_replaced(monkeypatch):
    recorded = emulate_recording(monkeypatch)
    team = tiny_team(2)
    router = AdapterRouter(team, NAMES[:2])
    decoder = CapturedDecoder(team, router, path="cuda-graphs")
    call = lambda rows, width, new: generate_both(  # noqa: E731
        team,
        router,
        decoder,
        ["a", "b"] * (rows // 2),
        *left_padded(rows, width, seed=rows + width),
        max_new_tokens=new,
    )
    for rows, width, new in ((8, 6, 10), (16, 6, 10), (8, 6, 10), (8, 250, 10), (8, 6, 10)):
        eager, captured = call(rows, width, new)
        assert torch.equal(eager, captured), (rows, width, new)
    # 8 rows; 16 rows (its routing mask grows: a new buffer); 8 rows again, recorded again on the grown mask; 8 rows
    # needing 260 positions (a longer cache replaces the 8-row one); 8 rows again on that cache, replayed
    assert recorded == [(8, 128), (16, 128), (8, 128), (8, 128)]
    assert set(decoder.warmups) == {(8, 256), (16, 256), (8, 512)}
    assert len(decoder.recordings) == 4 and all(seconds > 0 for seconds in decoder.recordings)
    decoder.release()
    call(8, 6, 10)
    assert len(recorded) == 5  # released: its cache is gone, the step is recorded on the new one


def test_a_released_decoder_records_into_a_new_memory_pool(monkeypatch):
    """PyTorch's allocator frees a graph pool with the last graph recorded into it and refuses to record into it again
    (an internal assert, `use_count > 0`: seen on an H200 at the second rollout of a training run, after the first
    one's end had released the recordings). The stand-in counts each pool's live graphs as the allocator does."""
    live, pools = {}, []

    def record_step(step, restore, pool, warmup_steps=2):
        if live.get(pool, None) == 0:
            raise RuntimeError("it->second->use_count > 0 INTERNAL ASSERT FAILED")
        live[pool] = live.get(pool, 0) + 1
        for _ in range(warmup_steps):
            step()
            restore()
        step()
        restore()
        replay = lambda: step()  # noqa: E731
        weakref.finalize(replay, lambda: live.__setitem__(pool, live[pool] - 1))
        return replay

    def graph_pool(device):
        pools.append(object())
        return pools[-1]

    monkeypatch.setattr(captured_decode, "record_step", record_step)
    monkeypatch.setattr(captured_decode, "graph_pool", graph_pool)
    team = tiny_team(2)
    router = AdapterRouter(team, NAMES[:2])
    decoder = CapturedDecoder(team, router, path="cuda-graphs")
    for rollout in range(3):  # each ends as a training rollout does, its recordings released
        eager, captured = generate_both(team, router, decoder, ["a", "b"] * 3, *left_padded(6, 7, seed=rollout))
        assert torch.equal(eager, captured)
        assert live[pools[-1]] == 1  # one shape, one graph, in the pool of this rollout
        decoder.release()
        assert live[pools[-1]] == 0
    assert len(pools) == 3 and len(decoder.recordings) == 3 and decoder.failure is None


def test_the_decode_step_traces_as_one_graph_with_no_host_sync_or_data_dependent_branch(monkeypatch):
    """What a CUDA graph cannot hold (a `.item()`, a branch on a tensor's value) breaks a `fullgraph` trace: the step
    of a routed team traces whole, with torch.compile's eager backend (no code generated, so it is fast)."""
    team = tiny_team(2)
    router = AdapterRouter(team, NAMES[:2])
    decoder = CapturedDecoder(team, router, path="static")
    traced = torch.compile(decoder._step_function, backend="eager", fullgraph=True)
    monkeypatch.setattr(decoder, "_step", traced)
    eager, captured = generate_both(team, router, decoder, ["a", "b"] * 3, *left_padded(6, 7, seed=3))
    assert torch.equal(eager, captured)


@pytest.mark.parametrize("layout", ["qwen2-full-then-sliding", "mistral-every-layer-sliding"])
def test_the_step_traces_as_one_graph_on_sliding_and_hybrid_layouts(monkeypatch, layout):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(ATTENTION_LAYOUTS[layout]()).eval()
    decoder = CapturedDecoder(model, path="static")
    monkeypatch.setattr(decoder, "_step", torch.compile(decoder._step_function, backend="eager", fullgraph=True))
    assert_greedy_tokens_equal_the_reference_across_the_window(model, decoder)


def test_eager_attention_gets_an_additive_mask_and_decodes_the_reference_tokens():
    torch.manual_seed(0)
    config = ATTENTION_LAYOUTS["qwen2-full-then-sliding"]()
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config).eval()
    assert model.config._attn_implementation == "eager"
    assert_greedy_tokens_equal_the_reference_across_the_window(model, CapturedDecoder(model, path="static"))


def test_the_step_mask_sees_written_keys_within_the_window_and_never_padding():
    key_mask = torch.tensor([[False, True, True, True, True, True], [True] * 6])
    mask = captured_decode.step_attention_mask(key_mask, torch.tensor(3), None, None)
    assert mask.shape == (2, 1, 1, 6)
    assert mask[:, 0, 0].tolist() == [[False, True, True, True, False, False], [True, True, True, True, False, False]]
    sliding = captured_decode.step_attention_mask(key_mask, torch.tensor(3), 2, None)  # keys 2 and 3
    assert sliding[:, 0, 0].tolist() == [[False, False, True, True, False, False]] * 2
    additive = captured_decode.step_attention_mask(key_mask, torch.tensor(3), 2, torch.float32)
    assert (
        additive[1, 0, 0].tolist() == [torch.finfo(torch.float32).min] * 2 + [0.0, 0.0] + [-3.4028234663852886e38] * 2
    )


# -- the compiled path: one compile for every shape, kept on disk


def test_the_compiled_step_compiles_once_for_every_row_bucket_and_cache_length(monkeypatch):
    """Rows and cache length are dynamic sizes of the compiled step: three row buckets and two cache lengths, one
    compile (counted by a backend that runs the traced graph as it is, so no code is generated)."""
    from torch._dynamo.testing import CompileCounter

    counter, compile_ = CompileCounter(), torch.compile
    monkeypatch.setattr(
        torch,
        "compile",
        lambda function, mode=None, fullgraph=False: compile_(function, backend=counter, fullgraph=fullgraph),
    )
    torch._dynamo.reset()
    team = tiny_team(2)
    router = AdapterRouter(team, NAMES[:2])
    decoder = CapturedDecoder(team, router, path="compiled")
    for rows, width in ((6, 7), (12, 7), (20, 7), (6, 250)):
        adapters = ["a", "b"] * (rows // 2)
        eager, captured = generate_both(team, router, decoder, adapters, *left_padded(rows, width, seed=rows + width))
        assert torch.equal(eager, captured), (rows, width)
    assert set(decoder.warmups) == {(8, 256), (16, 256), (32, 256), (8, 512)}
    assert counter.frame_count == 1


COMPILED_DECODE = """
import torch
from torch._dynamo.utils import counters
from transformers import LlamaConfig, LlamaForCausalLM
from trl_marl.generation.captured_decode import CapturedDecoder

torch.manual_seed(0)
config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
model = LlamaForCausalLM(config).eval()
CapturedDecoder(model, path="compiled").generate(
    torch.ones(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.long), max_new_tokens=3, pad_token_id=0
)
print("HITS", counters["inductor"]["fxgraph_cache_hit"], "MISSES", counters["inductor"]["fxgraph_cache_miss"])
"""


@pytest.mark.slow
def test_the_compiled_step_is_kept_in_the_users_cache_directory_and_a_second_run_loads_it(tmp_path):
    import os
    import subprocess
    import sys

    env = {key: value for key, value in os.environ.items() if key != "TORCHINDUCTOR_CACHE_DIR"}
    env["XDG_CACHE_HOME"] = str(tmp_path)
    runs = [
        subprocess.run([sys.executable, "-c", COMPILED_DECODE], env=env, capture_output=True, text=True, check=True)
        for _ in range(2)
    ]
    (_, first_hits, _, first_misses), (_, second_hits, _, second_misses) = (run.stdout.split()[-4:] for run in runs)
    assert (int(first_hits), int(second_misses)) == (0, 0), (runs[0].stdout, runs[1].stdout)
    assert int(first_misses) >= 1 and int(second_hits) == int(first_misses)  # the second run compiled nothing
    assert any((tmp_path / "trl_marl" / "torch_compile").rglob("*")), "nothing was kept on disk"


def test_the_path_is_chosen_by_device_or_named_in_python_and_as_command_line_words(tmp_path):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert [choose_path(value, cuda) for value in (None, True, "cuda-graphs", "compiled", False)] == [
        "cuda-graphs",
        "cuda-graphs",
        "cuda-graphs",
        "compiled",
        None,
    ]
    assert [choose_path(value, cpu) for value in (None, True, "compiled", False)] == [
        None,
        "compiled",
        "compiled",
        None,
    ]
    with pytest.raises(ValueError, match="'cuda-graphs'.*records CUDA graphs.*cpu.*'compiled'"):
        choose_path("cuda-graphs", cpu)
    words = (("false", False), ("no", False), ("0", False), ("true", True), ("On", True), ("None", None))
    for given, read in (*words, ("compiled", "compiled"), ("Compiled", "compiled"), ("CUDA-graphs", "cuda-graphs")):
        config = MAGRPOConfig(
            output_dir=str(tmp_path), agents=["writer", "critic"], use_cpu=True, captured_decode=given
        )
        assert (config.captured_decode, type(config.captured_decode)) == (read, type(read)), given
    with pytest.raises(ValueError, match="`captured_decode` must be .*'cuda-graphs' or 'compiled', got 'graphs'"):
        MAGRPOConfig(output_dir=str(tmp_path), agents=["writer", "critic"], use_cpu=True, captured_decode="graphs")
