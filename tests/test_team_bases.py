"""Teams on several base models (`team/bases.py`): the embedded SmolLM2-135M beside a tiny Qwen2 with a BPE tokenizer
of its own (`other_base_dir`). Both algorithms train every adapter and leave both bases unchanged; each base loads
once; a greedy episode equals each agent run alone on its own base; save -> `load_team` replays the trainer's team;
the card and `team.json` name both bases; a resumed run equals the uninterrupted one; mistakes are refused before
anything loads."""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, PeftModel
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file, save_file
from test_atgrpo_trainer import Notebook
from test_atgrpo_trainer import config as notebook_config
from test_cli import dataset_config, no_model_load, one_line_error  # noqa: F401 (a fixture)
from test_resume import StopAt, make_trainer
from tiny_run import TINY_RUN
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig, GenerationConfig, PreTrainedModel

from trl_marl import ATGRPOConfig, ATGRPOTrainer, MAGRPOConfig, MAGRPOTrainer, Team, load_team
from trl_marl.cli import main
from trl_marl.cli.evaluation import evaluate_task
from trl_marl.rollouts.scheduling import parallel
from trl_marl.tasks import resolve_task
from trl_marl.team.base_generation import base_generation_config
from trl_marl.team.bases import base_tokenizer, plan_bases
from trl_marl.team.default_model import DEFAULT_MODEL_ID

PROMPTS = ["Say hi.", "Count to three."]
NEW_PROMPT = [{"role": "user", "content": "Suggest a name for a cat."}]


def agents_on_two_bases(other_base_dir):
    return [
        {"name": "writer", "system_prompt": "Write."},
        {"name": "checker", "system_prompt": "Check.", "model": other_base_dir},
    ]


def length_gap(prompts, completions, **kwargs):
    return [float(len(c["writer"]) - len(c["checker"])) for c in completions]


def randomize_lora_b(model):
    """Fresh LoRA B is zero: give every adapter weights of its own, so each agent differs from its base."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator).to(param.dtype) * 0.5)


def snapshot(model):
    return {name: param.detach().clone() for name, param in model.named_parameters()}


def check_trained_every_adapter_and_no_base(trainer, before):
    after = dict(trainer.model.named_parameters())
    assert before.keys() == after.keys()
    for agent in trainer.agent_names:
        names = [name for name in after if "lora_" in name and f".{agent}." in name]
        assert names, agent
        assert all(not torch.equal(before[name], after[name]) for name in names), f"adapter {agent} did not train"
    # The second base's adapters are the trainer's own parameters: registered under the first base, in the optimizer.
    second = trainer.agent_names[trainer.bases[1].agents[0]]
    assert any(name.startswith("team_bases.") and f".{second}." in name for name in after)
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert all(id(after[name]) in optimized for name in after if "lora_" in name)
    unchanged = [name for name in after if "lora_" not in name]
    assert len(unchanged) > 100
    assert all(torch.equal(before[name], after[name]) for name in unchanged)


@pytest.fixture(scope="module")
def magrpo_team(default_model_dir, other_base_dir, tmp_path_factory):
    """A 2-agent MAGRPO team, the writer on SmolLM2 and the checker on the tiny Qwen2, trained 2 steps and saved."""
    out = tmp_path_factory.mktemp("two-bases") / "out"
    args = MAGRPOConfig(
        output_dir=str(out),
        agents=agents_on_two_bases(other_base_dir),
        num_turns=2,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=5,
        max_steps=2,
        **{**TINY_RUN, "learning_rate": 1e-2},
        bf16=False,
        seed=11,
    )
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS]})
    trainer = MAGRPOTrainer(default_model_dir, length_gap, args=args, train_dataset=dataset)
    randomize_lora_b(trainer.model)
    before = snapshot(trainer.model)
    trainer.train()
    trainer.save_model()
    return trainer, before, out


def test_a_magrpo_team_on_two_bases_trains_every_adapter_and_leaves_both_bases_unchanged(magrpo_team):
    trainer, before, _ = magrpo_team
    assert [base.agents for base in trainer.bases] == [[0], [1]]
    assert type(trainer.bases[1].model.get_base_model()).__name__ == "Qwen2ForCausalLM"
    assert trainer.bases[1].tokenizer.get_vocab() != trainer.processing_class.get_vocab()
    check_trained_every_adapter_and_no_base(trainer, before)


@pytest.mark.slow
def test_an_atgrpo_team_on_two_bases_trains_every_adapter_and_leaves_both_bases_unchanged(
    default_model_dir, other_base_dir, tmp_path
):
    # Notebook's agents, the editor (with its local reward) on the second base.
    agents = [Notebook.agents[0], {**Notebook.agents[1], "model": other_base_dir}]
    args = notebook_config(ATGRPOConfig, tmp_path, agents=agents)
    args.max_steps = 1
    trainer = ATGRPOTrainer(default_model_dir, args=args, task=Notebook())
    assert trainer.agent_base == [0, 1]
    randomize_lora_b(trainer.model)
    before = snapshot(trainer.model)
    trainer.train()
    check_trained_every_adapter_and_no_base(trainer, before)
    assert "agents/editor/local_reward" in trainer.state.log_history[0]


def test_a_mixed_team_loads_each_base_once(tiny_model_dir, other_base_dir, tmp_path, monkeypatch):
    loaded = []
    original = PreTrainedModel.from_pretrained.__func__

    def counting(cls, name, *args, **kwargs):
        loaded.append(str(name))
        return original(cls, name, *args, **kwargs)

    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(counting))
    agents = [
        {"name": "writer"},
        {"name": "tester", "model": other_base_dir},
        {"name": "editor", "model": tiny_model_dir},  # the trainer's own model, named: the same base
    ]
    args = MAGRPOConfig(output_dir=str(tmp_path), agents=agents, num_generations=2, **TINY_RUN)
    trainer = MAGRPOTrainer(tiny_model_dir, length_gap, args=args, train_dataset=Dataset.from_dict({"prompt": ["x"]}))
    assert sorted(loaded) == sorted([tiny_model_dir, other_base_dir])
    assert [base.agents for base in trainer.bases] == [[0, 2], [1]]
    assert sorted(trainer.model.peft_config) == ["editor", "writer"]
    assert list(trainer.bases[1].model.peft_config) == ["tester"]
    assert trainer.router.adapter_names == ["writer", "editor"]


def alone_on_its_base(folder, base_dir, tokenizer_dir, agent, shown, max_new_tokens):
    """What one agent answers to what it was shown (its role included), run alone: its base, its adapter (plain
    PEFT) and its tokenizer."""
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), str(folder / agent)).eval()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    inputs = tokenizer.apply_chat_template(shown, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    completion = output[0, inputs["input_ids"].shape[1] :].tolist()
    if tokenizer.eos_token_id in completion:
        completion = completion[: completion.index(tokenizer.eos_token_id) + 1]
    return tokenizer.decode(completion, skip_special_tokens=True)


def test_a_two_base_teams_greedy_episode_equals_each_agent_run_alone_on_its_base(
    magrpo_team, default_model_dir, other_base_dir
):
    _, _, out = magrpo_team
    run = load_team(out).run(NEW_PROMPT)
    assert len(run.turns) == 2
    bases = {"writer": (default_model_dir, out), "checker": (other_base_dir, out / "checker")}
    for turn, answers in enumerate(run.turns):
        for agent, answer in answers.items():
            base_dir, tokenizer_dir = bases[agent]
            shown = run.observations[turn][agent]
            assert shown[0] == {"role": "system", "content": {"writer": "Write.", "checker": "Check."}[agent]}
            assert answer == alone_on_its_base(out, base_dir, tokenizer_dir, agent, shown, max_new_tokens=5)
    # Turn 2 shows each agent both answers of turn 1, whichever base said them.
    second = run.observations[1]["checker"][-1]["content"]
    assert "[writer] " + run.turns[0]["writer"].strip() in second


def test_save_then_load_team_replays_the_trainers_greedy_episode(magrpo_team):
    trainer, _, out = magrpo_team
    loaded = load_team(out)
    assert [base.agents for base in loaded.bases] == [[0], [1]]
    assert type(loaded.bases[1].model.get_base_model()).__name__ == "Qwen2ForCausalLM"
    trainer.model.eval()
    first, other = trainer.bases
    in_memory = Team(
        first.model,
        trainer.processing_class,
        trainer._team_spec(),
        trainer.transition,
        parallel,
        other_bases=[(other.model, other.tokenizer, other.agents)],
    )
    assert loaded.run(NEW_PROMPT).turns == in_memory.run(NEW_PROMPT).turns


def test_the_team_file_adapters_and_card_name_both_bases(magrpo_team, other_base_dir):
    trainer, _, out = magrpo_team
    spec = json.loads((out / "team.json").read_text())
    assert spec["base_model"] == DEFAULT_MODEL_ID
    folder = Path(other_base_dir).name
    assert [agent.get("model") for agent in spec["agents"]] == [None, f"./{folder}"]  # its folder's name, not its path
    configs = {agent: json.loads((out / agent / "adapter_config.json").read_text()) for agent in ("writer", "checker")}
    assert configs["writer"]["base_model_name_or_path"] == DEFAULT_MODEL_ID
    assert configs["checker"]["base_model_name_or_path"] == f"./{folder}"
    # Each adapter file holds its own base's weights only, and the other base's tokenizer sits beside its adapter.
    from safetensors import safe_open

    for agent, base in (("writer", trainer.bases[0]), ("checker", trainer.bases[1])):
        with safe_open(str(out / agent / "adapter_model.safetensors"), "pt") as saved:
            keys = list(saved.keys())
        own = [n for n, _ in base.model.named_parameters() if f".{agent}." in n and not n.startswith("team_bases.")]
        assert len(keys) == len(own) and not any("team_bases" in key for key in keys)
    assert AutoTokenizer.from_pretrained(out / "checker").get_vocab() == trainer.bases[1].tokenizer.get_vocab()
    card = (out / "README.md").read_text()
    assert "sits on 2 base models" in card
    assert f"[{DEFAULT_MODEL_ID}](https://huggingface.co/{DEFAULT_MODEL_ID})" in card
    assert f"a local checkpoint (`{folder}`)" in card
    assert "| base model |" in card and f"| `checker` | Check. | `checker/` | {folder} |" in card
    assert 'tokenizer_2 = AutoTokenizer.from_pretrained(f"{folder}/checker")' in card
    assert "The agents' base models:" in card


def test_resuming_a_two_base_team_equals_the_uninterrupted_run(tiny_model_dir, other_base_dir, tmp_path):
    agents = [
        {"name": "concise", "system_prompt": "Be brief."},
        {"name": "detailed", "system_prompt": "Explain.", "model": other_base_dir},
    ]
    uninterrupted = make_trainer(tiny_model_dir, tmp_path / "a", agents=agents, max_steps=4)
    uninterrupted.train()
    first = make_trainer(
        tiny_model_dir, tmp_path / "b", agents=agents, max_steps=4, save_strategy="steps", save_steps=3
    )
    first.add_callback(StopAt(3))
    first.train()
    resumed = make_trainer(tiny_model_dir, tmp_path / "b", agents=agents, max_steps=4)
    resumed.train(resume_from_checkpoint=True)
    expected = {n: p for n, p in uninterrupted.model.named_parameters() if "lora_" in n}
    final = {n: p for n, p in resumed.model.named_parameters() if "lora_" in n}
    assert expected.keys() == final.keys() and any(n.startswith("team_bases.") for n in final)
    for name in expected:
        torch.testing.assert_close(final[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)
    # The reloaded adapters are the ones the optimizer holds, and every one still trains.
    optimized = {id(p) for group in resumed.optimizer.param_groups for p in group["params"]}
    assert all(id(p) in optimized and p.requires_grad for p in final.values())


def test_agents_on_one_model_asking_for_different_loadings_are_refused_before_anything_loads(other_base_dir):
    agents = [
        {"name": "writer"},
        {"name": "checker", "model": other_base_dir, "load_in_4bit": True},
        {"name": "tester", "model": other_base_dir},
    ]
    args = MAGRPOConfig(output_dir="unused", agents=agents, num_generations=2, use_cpu=True)
    with pytest.raises(ValueError, match=r"agent 'checker': load_in_4bit=True.*agent 'tester': load_in_4bit=False"):
        plan_bases(args, "SmolLM2")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("use_vllm", True, r"`use_vllm=True` with agents on 2 base models"),
        ("adapter_mode", "shared", r"`adapter_mode='shared'` with agents on 2 base models"),
    ],
)
def test_what_cannot_serve_several_bases_is_refused_naming_the_field(other_base_dir, field, value, message):
    args = MAGRPOConfig(
        output_dir="unused",
        agents=agents_on_two_bases(other_base_dir),
        num_generations=2,
        use_cpu=True,
        **{field: value},
    )
    with pytest.raises(ValueError, match=message):
        plan_bases(args, "SmolLM2")


def test_an_agents_own_loading_without_its_own_model_is_an_error_naming_the_entry():
    with pytest.raises(ValueError, match=r"`agents\[1\]` sets \['load_in_4bit'\] without 'model'"):
        MAGRPOConfig(output_dir="unused", agents=["a1", {"name": "b1", "load_in_4bit": True}], num_generations=2)
    with pytest.raises(ValueError, match=r"`agents\[0\]\['dtype'\]` must be one of"):
        MAGRPOConfig(output_dir="unused", agents=[{"name": "a1", "model": "m", "dtype": "int3"}], num_generations=2)


@pytest.mark.usefixtures("no_model_load")
def test_trl_marl_train_refuses_an_agents_missing_model_in_one_line_before_anything_loads(
    tmp_path, capsys, other_base_dir
):
    missing = str(tmp_path / "no-such-model")
    agents = [{"name": "writer"}, {"name": "checker", "model": missing}]
    message = one_line_error(capsys, ["train", dataset_config(tmp_path, "unused", agents=agents)])
    assert message.startswith(f"`agents`: the model of 'checker', {missing!r}, cannot be found")
    agents = [
        {"name": "writer"},
        {"name": "checker", "model": other_base_dir, "load_in_4bit": True},
        {"name": "tester", "model": other_base_dir},
    ]
    message = one_line_error(capsys, ["train", dataset_config(tmp_path, "unused", agents=agents)])
    assert "agent 'checker': load_in_4bit=True" in message and "agent 'tester': load_in_4bit=False" in message


@pytest.fixture(scope="module")
def tiny_two_base_team(tiny_model_dir, other_base_dir, tmp_path_factory):
    """The `explain` task's team on two tiny bases (a Llama and a Qwen2 of other vocabularies), trained 2 steps with a
    KL term and saved: fast enough for the checks below."""
    out = tmp_path_factory.mktemp("tiny-two-bases") / "out"
    concise, detailed = resolve_task("explain").agents
    args = MAGRPOConfig.for_task(
        "explain",
        output_dir=str(out),
        agents=[concise, {**detailed, "model": other_base_dir}],
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=4,
        max_steps=2,
        beta=0.04,
        **TINY_RUN,
        seed=5,
    )
    trainer = MAGRPOTrainer(tiny_model_dir, args=args, task="explain")
    randomize_lora_b(trainer.model)
    trainer.train()
    trainer.save_model()
    return trainer, out


def test_the_kl_term_of_a_two_base_team_is_each_agents_distance_to_its_own_base(tiny_two_base_team):
    trainer, _ = tiny_two_base_team
    kl = [log["kl"] for log in trainer.state.log_history if "kl" in log]
    assert len(kl) == 2 and all(math.isfinite(value) for value in kl) and kl[-1] > 0


def test_a_mixed_batchs_log_probs_equal_each_row_alone_on_its_own_base(tiny_two_base_team):
    trainer, _ = tiny_two_base_team
    trainer.model.eval()
    first, other = trainer.bases
    conversation = [{"role": "user", "content": "Why is the sky blue?"}]
    rows = []  # (agent, prompt ids, completion ids), tokenized by each agent's own base
    for agent, base, completion in ((0, first, " Because light"), (1, other, " Light scatters"), (0, first, " Air")):
        prompt = base.tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        rows.append((agent, prompt[: 5 + 4 * agent], base.tokenizer(completion)["input_ids"][:3]))
    batch = trainer._pad_samples([r[1] for r in rows], [r[2] for r in rows], agents=[r[0] for r in rows])
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    trainer._rows_agent_index = torch.tensor([r[0] for r in rows])
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, input_ids, attention_mask, batch["completion_ids"].size(1)
        )
    trainer._clear_routing()
    for row, (agent, prompt, completion) in enumerate(rows):
        base = trainer.bases[trainer.agent_base[agent]]
        base.model.set_adapter(trainer.agent_names[agent])
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            logits = base.model(input_ids=ids).logits[0, len(prompt) - 1 : -1] / trainer.temperature
        alone = torch.log_softmax(logits.float(), dim=-1).gather(1, torch.tensor(completion)[:, None])[:, 0]
        torch.testing.assert_close(logps[row, : len(completion)], alone, rtol=1e-4, atol=1e-4)


def test_evaluate_task_scores_a_saved_two_base_team_with_its_trained_adapters(tiny_two_base_team, monkeypatch):
    trainer, out = tiny_two_base_team
    built = []
    evaluate = MAGRPOTrainer.evaluate
    monkeypatch.setattr(MAGRPOTrainer, "evaluate", lambda self, *a, **k: built.append(self) or evaluate(self, *a, **k))
    metrics = evaluate_task("explain", team=str(out), limit=2, use_cpu=True, max_completion_length=4)
    assert math.isfinite(metrics["reward"])
    (evaluator,) = built
    assert [base.agents for base in evaluator.bases] == [[0], [1]]
    trained = {n: p for n, p in trainer.model.named_parameters() if "lora_" in n}
    loaded = {n: p for n, p in evaluator.model.named_parameters() if "lora_" in n}
    assert trained.keys() == loaded.keys() and any(n.startswith("team_bases.") for n in loaded)
    for name in trained:
        torch.testing.assert_close(loaded[name], trained[name], msg=name)


def saved_two_base_team(tiny_model_dir, other_base_dir, folder, agents=None, config=None, **trainer_kwargs):
    """The `explain` task's team on the two tiny bases (the detailed agent on the Qwen2 unless `agents` says
    otherwise), untrained but for its randomised LoRA B, saved to `folder`; `config`: more config fields."""
    concise, detailed = resolve_task("explain").agents
    agents = agents or [concise, {**detailed, "model": other_base_dir}]
    settings = {**TINY_RUN, **(config or {})}
    args = MAGRPOConfig.for_task("explain", output_dir=str(folder), agents=agents, num_generations=2, **settings)
    trainer = MAGRPOTrainer(tiny_model_dir, args=args, task="explain", **trainer_kwargs)
    randomize_lora_b(trainer.model)
    trainer.save_model()
    return trainer


def evaluator_of(team, monkeypatch, **options):
    """The trainer `evaluate_task` builds to score the saved `team` (its evaluation itself left out)."""
    built = []
    monkeypatch.setattr(MAGRPOTrainer, "evaluate", lambda trainer, *a, **k: built.append(trainer) or {})
    evaluate_task("explain", team=str(team), limit=1, use_cpu=True, **options)
    (evaluator,) = built
    return evaluator


def lora_scalings(model, adapter: str) -> dict[str, float]:
    """Each LoRA layer's scaling of `adapter` on one base (not the bases registered under it)."""
    return {
        name: layer.scaling[adapter]
        for name, layer in model.named_modules()
        if isinstance(layer, LoraLayer) and adapter in layer.scaling and not name.startswith("team_bases.")
    }


@torch.no_grad()
def adapter_logits(base, adapter: str) -> torch.Tensor:
    """A fixed input's logits on a trainer's base (`TeamBase`), every row through `adapter`."""
    base.model.eval()
    base.router.route([adapter])
    try:
        return base.model(input_ids=torch.arange(5, 12)[None]).logits
    finally:
        base.router.route(None)


@pytest.mark.parametrize(
    "lora",
    [
        dict(use_rslora=True, alpha_pattern={"v_proj": 16}),  # was scored as plain LoRA: other scalings, no error
        dict(rank_pattern={"q_proj": 2}, lora_bias=True),  # failed to load
    ],
    ids=["rslora-alpha_pattern", "rank_pattern-lora_bias"],
)
def test_evaluate_task_rebuilds_each_adapter_of_a_two_base_team_from_its_own_saved_config(
    tiny_model_dir, other_base_dir, tmp_path, monkeypatch, lora
):
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM", **lora)
    trainer = saved_two_base_team(tiny_model_dir, other_base_dir, tmp_path / "team", peft_config=config)
    evaluator = evaluator_of(tmp_path / "team", monkeypatch)
    for trained, loaded in zip(trainer.bases, evaluator.bases, strict=True):
        assert loaded.agents == trained.agents
        for adapter in (trainer.agent_adapters[agent] for agent in trained.agents):
            assert lora_scalings(loaded.model, adapter) == lora_scalings(trained.model, adapter)
            torch.testing.assert_close(adapter_logits(loaded, adapter), adapter_logits(trained, adapter))
    if lora.get("use_rslora"):  # alpha / sqrt(r) = 8 / 2 on q_proj, 16 / 2 on v_proj (plain LoRA's alpha / r: 2, 4)
        scalings = lora_scalings(evaluator.bases[1].model, "detailed")
        assert {s for name, s in scalings.items() if "q_proj" in name} == {4.0}
        assert {s for name, s in scalings.items() if "v_proj" in name} == {8.0}


def base_dtypes(bases) -> list[torch.dtype]:
    return [base.model.get_base_model().dtype for base in bases]


def test_an_agents_recorded_dtype_loads_its_base_alike_in_load_team_and_evaluate_task(
    tiny_model_dir, other_base_dir, tmp_path, monkeypatch
):
    concise, detailed = resolve_task("explain").agents
    agents = [concise, {**detailed, "model": other_base_dir, "dtype": "bfloat16"}]
    saved_two_base_team(tiny_model_dir, other_base_dir, tmp_path / "team", agents=agents)
    assert json.loads((tmp_path / "team" / "team.json").read_text())["agents"][1]["dtype"] == "bfloat16"
    as_trained = [torch.float32, torch.bfloat16]
    assert base_dtypes(load_team(tmp_path / "team").bases) == as_trained
    assert base_dtypes(evaluator_of(tmp_path / "team", monkeypatch).bases) == as_trained
    # A dtype the caller gives applies to every base.
    assert base_dtypes(load_team(tmp_path / "team", dtype="float32").bases) == [torch.float32, torch.float32]


def test_a_base_that_follows_the_trainers_loading_records_it_and_loads_as_trained(
    tiny_model_dir, other_base_dir, tmp_path, monkeypatch
):
    # The detailed agent sets no loading: its base follows the trainer's, which loads a model in float32 (TRL's
    # default) whatever its checkpoint's dtype, here bfloat16. team.json recorded nothing for it, and load_team and
    # evaluate_task loaded that base in the checkpoint's bfloat16.
    bf16_base = tmp_path / "qwen2-bf16"
    shutil.copytree(other_base_dir, bf16_base)
    AutoModelForCausalLM.from_pretrained(other_base_dir, dtype=torch.bfloat16).save_pretrained(bf16_base)
    concise, detailed = resolve_task("explain").agents
    agents = [concise, {**detailed, "model": str(bf16_base)}]
    team = tmp_path / "team"
    trainer = saved_two_base_team(tiny_model_dir, other_base_dir, team, agents=agents)
    as_trained = [torch.float32, torch.float32]
    assert base_dtypes(trainer.bases) == as_trained
    concise, detailed = json.loads((team / "team.json").read_text())["agents"]
    assert (detailed["load_in_4bit"], detailed["dtype"]) == (False, "float32")
    assert "dtype" not in concise and "load_in_4bit" not in concise  # the first base records none
    assert base_dtypes(load_team(team).bases) == as_trained
    assert base_dtypes(evaluator_of(team, monkeypatch).bases) == as_trained
    # The caller's loading applies to every base, the first's too: load_team, evaluate_task and trl-marl evaluate.
    bf16 = [torch.bfloat16, torch.bfloat16]
    assert base_dtypes(load_team(team, dtype="bfloat16").bases) == bf16
    assert base_dtypes(evaluator_of(team, monkeypatch, dtype="bfloat16").bases) == bf16
    built = []
    monkeypatch.setattr(MAGRPOTrainer, "evaluate", lambda trainer, *a, **k: built.append(trainer) or {})
    assert main(["evaluate", "explain", "--team", str(team), "--limit", "1", "--dtype", "bfloat16"]) == 0
    assert base_dtypes(built[0].bases) == bf16
    with pytest.raises(ValueError, match=r"`load_in_4bit` / `dtype` say how a saved team's bases load"):
        evaluate_task("explain", baseline="parallel", dtype="bfloat16")


def test_a_base_that_follows_a_4bit_trainer_records_it_and_loads_in_4bit(tiny_model_dir, other_base_dir, tmp_path):
    four_bit = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    team = tmp_path / "team"
    trainer = saved_two_base_team(tiny_model_dir, other_base_dir, team, quantization_config=four_bit)
    assert four_bit_bases(trainer) == [True, True]
    detailed = json.loads((team / "team.json").read_text())["agents"][1]
    assert detailed["load_in_4bit"] is True  # recorded nothing: load_team loaded that base unquantized
    assert four_bit_bases(load_team(team)) == [False, True]  # the first base records none
    assert four_bit_bases(load_team(team, load_in_4bit=True)) == [True, True]


def four_bit_bases(team) -> list[bool]:
    return [bool(getattr(base.model, "is_loaded_in_4bit", False)) for base in team.bases]


def test_adapter_weights_missing_from_a_checkpoint_are_refused_naming_the_first(tiny_two_base_team, tmp_path):
    trainer, out = tiny_two_base_team
    partial = tmp_path / "partial"
    shutil.copytree(out, partial)
    weights = partial / "detailed" / "adapter_model.safetensors"
    save_file({key: value for key, value in load_file(weights).items() if "v_proj" not in key}, weights)
    missing = r"adapter 'detailed'.*missing.*model\.layers\.0\.self_attn\.v_proj\.lora_A\.detailed\.weight"
    with pytest.raises(ValueError, match=missing):
        trainer._load_from_checkpoint(str(partial))  # a resume, or the best model
    with pytest.raises(ValueError, match=missing):
        load_team(partial)  # and evaluate_task, which loads a saved team as load_team does


def test_a_module_trained_whole_loads_with_its_adapter_and_is_refused_when_missing(
    tiny_model_dir, other_base_dir, tmp_path
):
    # `modules_to_save` crashed evaluate_task on a two-base team; a missing copy failed in PEFT with a bare KeyError.
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=["norm"], task_type="CAUSAL_LM")
    team = tmp_path / "team"
    trainer = saved_two_base_team(tiny_model_dir, other_base_dir, team, peft_config=config)
    with torch.no_grad():  # the norms' copies trained to values of their own (fresh, they equal the base's norms)
        for name, param in trainer.bases[1].model.named_parameters():
            if "modules_to_save.detailed" in name:
                param.fill_(0.5)
    trainer.save_model()
    loaded = {
        name: param for name, param in load_team(team).bases[1].model.named_parameters() if "modules_to_save" in name
    }
    assert loaded and all(torch.equal(param, torch.full_like(param, 0.5)) for param in loaded.values())
    weights = team / "detailed" / "adapter_model.safetensors"
    saved = load_file(weights)
    kept = {key: value for key, value in saved.items() if not key.endswith(".model.norm.weight")}
    assert len(kept) == len(saved) - 1  # the final norm's copy, and only it
    save_file(kept, weights)
    missing = r"adapter 'detailed' are missing, the first base_model\.model\.model\.norm\.weight"
    with pytest.raises(ValueError, match=missing):
        load_team(team)


def test_load_team_elsewhere_names_each_base_it_cannot_find_and_takes_them_by_their_recorded_names(
    tiny_two_base_team, tiny_model_dir, other_base_dir, tmp_path
):
    _, out = tiny_two_base_team
    elsewhere = tmp_path / "elsewhere"  # the team as pushed: no path of the machine that trained it
    shutil.copytree(out, elsewhere, ignore=shutil.ignore_patterns("_*"))
    first, second = f"./{Path(tiny_model_dir).name}", f"./{Path(other_base_dir).name}"
    with pytest.raises(FileNotFoundError) as error:
        load_team(elsewhere)
    message = str(error.value)
    assert f"{first!r} (the base of 'concise')" in message and f"{second!r} (the base of 'detailed')" in message
    assert f"load_team({str(elsewhere)!r}, base_model=" in message and f"base_models={{{second!r}: " in message
    team = load_team(elsewhere, base_model=tiny_model_dir, base_models={second: other_base_dir})
    assert [base.model.get_base_model().config._name_or_path for base in team.bases] == [
        tiny_model_dir,
        other_base_dir,
    ]


def test_evaluate_task_elsewhere_takes_each_base_where_the_caller_says(
    tiny_two_base_team, tiny_model_dir, other_base_dir, tmp_path, monkeypatch
):
    _, out = tiny_two_base_team
    elsewhere = tmp_path / "elsewhere"  # the team as pushed: no path of the machine that trained it
    shutil.copytree(out, elsewhere, ignore=shutil.ignore_patterns("_*"))
    second = f"./{Path(other_base_dir).name}"
    built = []
    monkeypatch.setattr(MAGRPOTrainer, "evaluate", lambda trainer, *a, **k: built.append(trainer) or {})
    with pytest.raises(FileNotFoundError, match=r"base_models=\{.*the same base_models= to evaluate_task"):
        evaluate_task("explain", team=str(elsewhere), limit=1, use_cpu=True, base_model=tiny_model_dir)
    places = dict(base_model=tiny_model_dir, base_models={second: other_base_dir})
    evaluate_task("explain", team=str(elsewhere), limit=1, use_cpu=True, **places)
    (evaluator,) = built
    loaded_from = [base.model.get_base_model().config._name_or_path for base in evaluator.bases]
    assert loaded_from == [tiny_model_dir, other_base_dir]


def test_two_local_bases_in_folders_of_one_name_are_refused_before_anything_loads(
    tiny_model_dir, other_base_dir, tmp_path
):
    for parent in ("a", "b"):
        shutil.copytree(other_base_dir, tmp_path / parent / "qwen")
    agents = [
        {"name": "writer"},
        {"name": "checker", "model": str(tmp_path / "a" / "qwen")},
        {"name": "tester", "model": str(tmp_path / "b" / "qwen")},
    ]
    args = MAGRPOConfig(output_dir="unused", agents=agents, num_generations=2, use_cpu=True)
    with pytest.raises(ValueError, match=r"would both be recorded as '\./qwen'"):
        plan_bases(args, tiny_model_dir)


def test_another_bases_generation_config_carries_the_first_bases_token_ids_by_their_text(
    tiny_model_dir, other_base_dir
):
    first, other = AutoTokenizer.from_pretrained(tiny_model_dir), base_tokenizer(other_base_dir)
    model = AutoModelForCausalLM.from_pretrained(other_base_dir)
    # " the", " a", "," and " is" are 260, 253, 28 and 314 to SmolLM2's tokenizer, 272, 265, 16 and 296 to the tiny
    # Qwen2's (hand-checked).
    config = GenerationConfig(
        suppress_tokens=[260, 28],
        begin_suppress_tokens=[253],
        bad_words_ids=[[260, 314]],
        force_words_ids=[[314]],
        sequence_bias={(253, 28): -2.0},
        forced_bos_token_id=253,
        forced_eos_token_id=[314],
    )
    mapped = base_generation_config(config, model, other, first)
    assert (mapped.suppress_tokens, mapped.begin_suppress_tokens) == ([272, 16], [265])
    assert (mapped.bad_words_ids, mapped.force_words_ids) == ([[272, 296]], [[296]])
    assert mapped.sequence_bias == {(265, 16): -2.0}
    assert (mapped.forced_bos_token_id, mapped.forced_eos_token_id) == (265, [296])
    assert (mapped.pad_token_id, mapped.eos_token_id) == (other.pad_token_id, [other.eos_token_id])
    assert config.suppress_tokens == [260, 28]  # the first base's own config is left as it was


def test_a_token_id_another_base_cannot_carry_is_refused_naming_the_field(tiny_model_dir, other_base_dir):
    first, other = AutoTokenizer.from_pretrained(tiny_model_dir), base_tokenizer(other_base_dir)
    model = AutoModelForCausalLM.from_pretrained(other_base_dir)
    config = GenerationConfig(suppress_tokens=[260, 2644])  # " cat": 2644, two tokens to the Qwen2; one is suppressed
    with pytest.raises(
        ValueError, match=r"`suppress_tokens` holds token id 2644 \(' cat'\).*\[277, 297\], not as one"
    ):
        base_generation_config(config, model, other, first)


def test_a_sequence_of_token_ids_is_carried_whole_by_its_text(tiny_model_dir, other_base_dir):
    smol, qwen = AutoTokenizer.from_pretrained(tiny_model_dir), base_tokenizer(other_base_dir)
    smol_model, qwen_model = (AutoModelForCausalLM.from_pretrained(d) for d in (tiny_model_dir, other_base_dir))
    # " cat" is 2644 to SmolLM2, [277, 297] to the tiny Qwen2; " the" 260 and 272 (hand-checked).
    to_qwen = base_generation_config(
        GenerationConfig(bad_words_ids=[[2644]], force_words_ids=[[[2644], [260]]], sequence_bias={(2644,): -1.0}),
        qwen_model,
        qwen,
        smol,
    )
    assert (to_qwen.bad_words_ids, to_qwen.force_words_ids) == ([[277, 297]], [[[277, 297], [272]]])
    assert to_qwen.sequence_bias == {(277, 297): -1.0}
    to_smol = base_generation_config(
        GenerationConfig(bad_words_ids=[[277, 297]], sequence_bias=[[[272, 277, 297], 2.0]]), smol_model, smol, qwen
    )
    assert (to_smol.bad_words_ids, to_smol.sequence_bias) == ([[2644]], [[[260, 2644], 2.0]])


@pytest.fixture(scope="module")
def sentencepiece_tokenizer():
    """A Llama tokenizer of SentencePiece's kind (Llama-2, Mistral, TinyLlama: "▁" for a space, the Metaspace
    pre-tokenizer and decoder), its BPE trained on the standard library's help texts: decoding a single token, it drops
    that token's leading space ("▁the" alone decodes to "the")."""
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaTokenizer

    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=["<unk>", "<s>", "</s>"])
    trained.train_from_iterator(list(topics.values()), trainer)
    bpe = json.loads(trained.to_str())["model"]
    merges = [tuple(merge.split(" ")) if isinstance(merge, str) else tuple(merge) for merge in bpe["merges"]]
    tokenizer = LlamaTokenizer(vocab=bpe["vocab"], merges=merges)
    assert tokenizer.decode([tokenizer.convert_tokens_to_ids("\u2581the")]) == "the"  # the space it drops
    return tokenizer


def test_a_sentencepiece_tokens_leading_space_is_carried_both_ways(tiny_model_dir, sentencepiece_tokenizer):
    llama, smol = sentencepiece_tokenizer, AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)  # only its generation config's EOS is read
    the, of_the = llama.convert_tokens_to_ids("\u2581the"), llama.encode("of the", add_special_tokens=False)
    assert llama.convert_ids_to_tokens(of_the) == ["\u2581of", "\u2581the"]
    config = GenerationConfig(suppress_tokens=[the], bad_words_ids=[of_the])
    to_smol = base_generation_config(config, model, smol, llama)
    of_the_smol = smol.encode(" of the", add_special_tokens=False)
    assert (to_smol.suppress_tokens, to_smol.bad_words_ids) == ([260], [of_the_smol])  # " the", not "the"
    to_llama = base_generation_config(
        GenerationConfig(suppress_tokens=[260], bad_words_ids=[[260]]), model, llama, smol
    )
    assert (to_llama.suppress_tokens, to_llama.bad_words_ids) == ([the], [[the]])


def test_the_planner_sums_the_bases_and_lists_them(tiny_model_dir, other_base_dir):
    from transformers import AutoConfig

    from trl_marl.memory import estimate_memory, estimate_team_memory

    agents = [{"name": "writer"}, {"name": "checker", "model": other_base_dir}, {"name": "editor"}]
    config = MAGRPOConfig(output_dir="unused", agents=agents, num_generations=2, use_cpu=True)
    team = estimate_team_memory(config, model_name_or_path=tiny_model_dir, device="cuda")
    first = estimate_memory(config, AutoConfig.from_pretrained(tiny_model_dir), device="cuda", agents=[0, 2])
    second = estimate_memory(config, AutoConfig.from_pretrained(other_base_dir), device="cuda", agents=[1])
    assert team.base_weights == first.base_weights + second.base_weights
    assert team.adapters == first.adapters + second.adapters and first.details["adapters"] == 2
    assert team.saved_activations == first.saved_activations + second.saved_activations
    assert team.backward_working_set == max(first.backward_working_set, second.backward_working_set)
    assert team.kv_cache == first.kv_cache + second.kv_cache  # the captured decode step keeps every base's caches
    table = team.table()
    assert f"base 1: {tiny_model_dir} (the team's dtype; writer, editor)" in table
    assert f"base 2: {other_base_dir} (the team's dtype; checker)" in table
