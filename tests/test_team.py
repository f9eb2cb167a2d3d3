"""The trained team as an artefact: `save_model` writes PEFT adapters and `team.json`; `load_team` rebuilds the team on
a full-precision or 4-bit base and replays the trained agents' greedy episodes."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

from trl_marl import MAGRPOConfig, MAGRPOTrainer, load_team
from trl_marl.agents import agent_prompt
from trl_marl.rollouts.rollout import default_transition
from trl_marl.rollouts.scheduling import parallel
from trl_marl.tasks.coding.code_tester import code_tester_feedback
from trl_marl.tasks.coding.coop_coding import coding_feedback
from trl_marl.tasks.math_tool import math_feedback
from trl_marl.tasks.toy import word_count_feedback
from trl_marl.team.importable import import_by_name
from trl_marl.team.saved_bases import saved_base_loading

AGENTS = [{"name": "planner", "system_prompt": "Plan briefly."}, {"name": "checker", "system_prompt": "Check."}]
NEW_PROMPT = [{"role": "user", "content": "Suggest a name for a cat."}]


def different_lengths(prompts, completions, **kwargs):
    return [float(len(c["planner"]) - len(c["checker"])) for c in completions]


def train_team(model_dir, tmp_path, **overrides):
    values = dict(
        output_dir=str(tmp_path / "out"),
        agents=AGENTS,
        num_turns=2,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=6,
        max_steps=2,
        learning_rate=5e-2,
        lora_r=4,
        lora_alpha=8,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        seed=11,
    )
    quantization_config = overrides.pop("quantization_config", None)
    values.update(overrides)
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in ["Say hi.", "Count."]]})
    trainer = MAGRPOTrainer(
        model_dir,
        different_lengths,
        args=MAGRPOConfig(**values),
        train_dataset=dataset,
        quantization_config=quantization_config,
    )
    # Fresh LoRA B is zero, so agents start equal to the base; make them differ so the replay tells them apart.
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in trainer.model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator).to(param.dtype) * 0.5)
    trainer.train()
    trainer.save_model()
    return trainer


@torch.no_grad()
def reference_episode(model, tokenizer, prompt, num_turns, max_new_tokens, adapters=None):
    """The trained model replayed one agent at a time (`set_adapter`, batch of one), with training's prompt
    building and the default transition, independently of `Team`."""
    model.eval()
    names, history = [agent["name"] for agent in AGENTS], []
    for _ in range(num_turns):
        answers = {}
        for index, agent in enumerate(AGENTS):
            model.set_adapter((adapters or {}).get(agent["name"], agent["name"]))
            observed = parallel.observe(index, prompt, history, {}, names)  # the default scheduler
            conversation = agent_prompt(agent["system_prompt"], observed, use_chat_template=True)
            inputs = tokenizer.apply_chat_template(
                conversation, add_generation_prompt=True, return_tensors="pt", return_dict=True
            )
            output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
            completion = output[0, inputs["input_ids"].shape[1] :].tolist()
            if tokenizer.eos_token_id in completion:
                completion = completion[: completion.index(tokenizer.eos_token_id) + 1]
            answers[agent["name"]] = tokenizer.decode(completion, skip_special_tokens=True)
        history.append(answers)
    return history


def test_save_model_writes_peft_adapters_and_a_team_file(tiny_model_dir, tmp_path):
    trainer = train_team(tiny_model_dir, tmp_path, num_turns=2, discount=0.8, termination_threshold=3.0)
    out = tmp_path / "out"
    for agent in AGENTS:
        assert (out / agent["name"] / "adapter_config.json").is_file()
        assert (out / agent["name"] / "adapter_model.safetensors").is_file()
    spec = json.loads((out / "team.json").read_text())
    assert spec["agents"] == [{**agent, "adapter": agent["name"]} for agent in AGENTS]
    assert spec["base_model"] == f"./{Path(tiny_model_dir).name}"  # a local base: its folder's name
    assert (spec["num_turns"], spec["discount"], spec["termination_threshold"]) == (2, 0.8, 3.0)
    assert spec["transition"] == "trl_marl.rollouts.rollout:default_transition"
    assert spec["scheduler"] == "parallel"
    assert spec["max_completion_length"] == 6

    # Each adapter also loads with plain PEFT and computes what the trained agent computes.
    inputs = torch.randint(100, 1000, (1, 7))
    trainer.router.route(None)
    for agent in AGENTS:
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        plain = PeftModel.from_pretrained(base, str(out / agent["name"])).eval()
        trainer.model.set_adapter(agent["name"])
        with torch.no_grad():
            expected = trainer.model.eval()(inputs).logits
            torch.testing.assert_close(plain(inputs).logits, expected)


def test_load_team_replays_the_trained_agents_greedy_episode(tiny_model_dir, tmp_path):
    trainer = train_team(tiny_model_dir, tmp_path)
    trainer.router.route(None)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    expected = reference_episode(trainer.model, tokenizer, NEW_PROMPT, num_turns=2, max_new_tokens=6)
    assert expected[0]["planner"] != expected[0]["checker"], "the agents should differ"

    team = load_team(tmp_path / "out")
    run = team.run(NEW_PROMPT)
    assert run.turns == expected
    assert len(run.observations) == 2
    # Turn 2 shows each agent the task and both answers of turn 1, as in training.
    second = run.observations[1]["planner"][-1]["content"]
    assert "[planner] " + expected[0]["planner"].strip() in second
    assert "[checker] " + expected[0]["checker"].strip() in second


def test_load_team_on_a_4bit_base_replays_the_4bit_trained_team(tiny_model_dir, tmp_path):
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is needed for 4-bit bases")
    quantization = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
    )
    trainer = train_team(tiny_model_dir, tmp_path, quantization_config=quantization)
    trainer.router.route(None)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    expected = reference_episode(trainer.model, tokenizer, NEW_PROMPT, num_turns=2, max_new_tokens=6)

    team = load_team(tmp_path / "out", load_in_4bit=True)
    import bitsandbytes

    assert any(isinstance(m, bitsandbytes.nn.Linear4bit) for m in team.model.modules())
    assert team.run(NEW_PROMPT).turns == expected


def test_a_team_trained_with_a_local_transition_needs_it_passed_to_load_team(tiny_model_dir, tmp_path):
    def private_view(prompt, joint_action, **kwargs):
        return [prompt, prompt]

    values = dict(
        output_dir=str(tmp_path / "out"), agents=["alpha", "beta"], num_turns=2, report_to="none", use_cpu=True
    )
    dataset = Dataset.from_dict({"prompt": ["Say hi."]})
    trainer = MAGRPOTrainer(
        tiny_model_dir, different_lengths, args=MAGRPOConfig(**values), train_dataset=dataset, transition=private_view
    )
    trainer.save_model()
    with pytest.raises(ValueError, match="cannot be imported .* pass `transition=` to load_team"):
        load_team(tmp_path / "out")
    assert load_team(tmp_path / "out", transition=private_view).run("Say hi.", max_new_tokens=2).turns


def test_a_local_base_is_recorded_by_its_folders_name_and_found_here_by_its_path(tiny_model_dir, tmp_path):
    save_untrained_team_with_transition(tiny_model_dir, tmp_path)
    out = tmp_path / "out"
    recorded = f"./{Path(tiny_model_dir).name}"
    for saved in (out / "team.json", out / "alpha" / "adapter_config.json", out / "beta" / "adapter_config.json"):
        assert tiny_model_dir not in saved.read_text()
    assert json.loads((out / "alpha" / "adapter_config.json").read_text())["base_model_name_or_path"] == recorded
    # The path of this machine's copy stays beside the team, in a file Trainer's uploads leave out ("_*").
    assert json.loads((out / "_local_bases.json").read_text()) == {recorded: tiny_model_dir}
    assert load_team(out).model.get_base_model().config._name_or_path == tiny_model_dir


def test_load_team_that_cannot_find_a_local_base_says_to_pass_base_model(tiny_model_dir, tmp_path, monkeypatch):
    save_untrained_team_with_transition(tiny_model_dir, tmp_path)
    elsewhere = tmp_path / "elsewhere"  # the team on another machine
    shutil.copytree(tmp_path / "out", elsewhere, ignore=shutil.ignore_patterns("_*"))
    recorded = f"./{Path(tiny_model_dir).name}"
    with pytest.raises(FileNotFoundError, match=rf"{recorded!r} \(the base of 'alpha', 'beta'\).*base_model="):
        load_team(elsewhere)
    loaded_from = load_team(elsewhere, base_model=tiny_model_dir).model.get_base_model().config._name_or_path
    assert loaded_from == tiny_model_dir
    monkeypatch.chdir(Path(tiny_model_dir).parent)  # or the base's folder in the working directory
    assert load_team(elsewhere).model.get_base_model().config._name_or_path == recorded


def test_a_saved_base_loads_as_the_caller_says_else_as_its_agents_recorded():
    recorded = {"name": "checker", "model": "./qwen", "load_in_4bit": True, "dtype": "bfloat16"}
    quantization, dtype = saved_base_loading(recorded, None, None, None)
    assert quantization.load_in_4bit and quantization.bnb_4bit_quant_type == "nf4" and dtype == "bfloat16"
    assert saved_base_loading(recorded, False, None, "float32") == (None, "float32")  # given: for every base
    given = BitsAndBytesConfig(load_in_8bit=True)
    assert saved_base_loading({"name": "writer"}, None, given, None) == (given, "auto")
    assert saved_base_loading({"name": "writer"}, None, None, None) == (None, "auto")  # nothing recorded


def test_load_team_on_a_folder_without_a_team_file_says_what_to_point_it_at(tmp_path):
    with pytest.raises(FileNotFoundError, match="No team.json in .*MAGRPOTrainer.save_model"):
        load_team(tmp_path)


def save_untrained_team_with_transition(tiny_model_dir, tmp_path, columns=None, **trainer_kwargs) -> dict:
    """Save an untrained two-turn team and return its team.json contents."""
    values = dict(
        output_dir=str(tmp_path / "out"), agents=["alpha", "beta"], num_turns=2, report_to="none", use_cpu=True
    )
    trainer = MAGRPOTrainer(
        tiny_model_dir,
        different_lengths,
        args=MAGRPOConfig(**values),
        train_dataset=Dataset.from_dict({"prompt": ["Hi."], **(columns or {})}),
        **trainer_kwargs,
    )
    trainer.save_model()
    return json.loads((tmp_path / "out" / "team.json").read_text())


def test_a_recorded_transition_that_no_longer_imports_is_an_error_saying_what_to_pass(tiny_model_dir, tmp_path):
    spec = save_untrained_team_with_transition(tiny_model_dir, tmp_path)
    spec["transition"] = str(tmp_path / "moved_script.py") + ":feedback"
    (tmp_path / "out" / "team.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="moved_script.py:feedback.*cannot be imported here.*pass `transition=`"):
        load_team(tmp_path / "out")


def test_a_team_file_written_before_the_tasks_package_loads_its_transition(tiny_model_dir, tmp_path):
    columns = {"word": ["tide"], "word_limit": [8]}
    spec = save_untrained_team_with_transition(tiny_model_dir, tmp_path, columns, transition=word_count_feedback)
    assert spec["transition"] == "trl_marl.tasks.toy:word_count_feedback"
    spec["transition"] = "trl_marl.plugins.tasks:word_count_feedback"  # as the multi-turn recipe wrote it before
    (tmp_path / "out" / "team.json").write_text(json.dumps(spec))
    assert load_team(tmp_path / "out").transition is word_count_feedback


@pytest.mark.parametrize(
    "old, new",
    [
        ("trl_marl.plugins.coding:coding_feedback", coding_feedback),
        ("trl_marl.plugins.code_tester:code_tester_feedback", code_tester_feedback),
        ("trl_marl.plugins.math_tool:math_feedback", math_feedback),
        ("trl_marl.rollout:default_transition", default_transition),
    ],
)
def test_every_transition_a_team_file_could_name_before_the_move_still_imports(old, new):
    assert import_by_name(old) is new


def test_a_team_sharing_one_adapter_saves_it_once_and_replays(tiny_model_dir, tmp_path):
    trainer = train_team(tiny_model_dir, tmp_path, adapter_mode="shared", max_steps=1)
    # one adapter, still routed (the KL reference goes to the base through the router); cleared after training
    assert trainer.router.adapter_names == ["team"] and trainer.router.row_adapters is None
    out = tmp_path / "out"
    assert (out / "team" / "adapter_model.safetensors").is_file()
    assert not (out / "planner").exists()
    spec = json.loads((out / "team.json").read_text())
    assert [agent["adapter"] for agent in spec["agents"]] == ["team", "team"]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    # one adapter; the roles tell the agents apart
    expected = reference_episode(
        trainer.model, tokenizer, NEW_PROMPT, 2, 6, adapters={"planner": "team", "checker": "team"}
    )
    assert load_team(out).run(NEW_PROMPT).turns == expected


def save_lora_team(model_dir, folder, names, target_modules=("q_proj", "embed_tokens")):
    """An untrained one-base team of agents `names`, LoRA on `target_modules` (the embeddings too), with every LoRA B
    randomised (fresh it is zero), saved to `folder`."""
    from peft import LoraConfig
    from tiny_run import TINY_RUN

    args = MAGRPOConfig.for_task(
        "explain", output_dir=str(folder), agents=[{"name": name} for name in names], num_generations=2, **TINY_RUN
    )
    config = LoraConfig(r=4, lora_alpha=8, target_modules=list(target_modules), task_type="CAUSAL_LM")
    trainer = MAGRPOTrainer(model_dir, args=args, task="explain", peft_config=config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in trainer.model.named_parameters():
            if "lora_B" in name or "lora_embedding_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    trainer.save_model()
    return trainer


def test_agents_named_user_and_model_save_and_load_with_every_lora_weight(tiny_model_dir, tmp_path):
    # Every parameter name holds ".model.": an agent of that name once made the other agent's weights "missing".
    trainer = save_lora_team(tiny_model_dir, tmp_path / "team", ["user", "model"])
    loaded = dict(load_team(tmp_path / "team", captured_decode=False).model.named_parameters())
    trained = {name: param for name, param in trainer.model.named_parameters() if "lora_" in name}
    assert any(name.endswith("lora_embedding_B.model") for name in trained)
    assert any(name.endswith("lora_A.user.weight") for name in trained)
    for name, param in trained.items():
        assert torch.equal(loaded[name], param), name


def test_a_saved_adapter_without_its_embedding_lora_is_refused_naming_the_weight(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    save_lora_team(tiny_model_dir, tmp_path / "team", ["concise", "detailed"])
    weights = tmp_path / "team" / "concise" / "adapter_model.safetensors"
    save_file({key: value for key, value in load_file(weights).items() if "embed" not in key}, weights)
    with pytest.raises(ValueError, match=r"adapter 'concise'.*embed_tokens\.lora_embedding_[AB]\.concise"):
        load_team(tmp_path / "team", captured_decode=False)


def test_loading_a_team_on_a_local_base_warns_of_no_renamed_base_model(tiny_model_dir, tmp_path, recwarn):
    save_untrained_team_with_transition(tiny_model_dir, tmp_path)
    load_team(tmp_path / "out", captured_decode=False)
    assert not [str(w.message) for w in recwarn if "base_model_name_or_path" in str(w.message)]


def test_a_kept_base_path_that_is_gone_loads_the_working_directorys_folder_with_a_warning(
    tiny_model_dir, tmp_path, monkeypatch, caplog
):
    save_untrained_team_with_transition(tiny_model_dir, tmp_path)
    recorded, gone = f"./{Path(tiny_model_dir).name}", str(tmp_path / "moved-away")
    (tmp_path / "out" / "_local_bases.json").write_text(json.dumps({recorded: gone}))
    here = tmp_path / "elsewhere"
    shutil.copytree(tiny_model_dir, here / Path(tiny_model_dir).name)  # another model of that folder's name
    monkeypatch.chdir(here)
    with caplog.at_level("WARNING", logger="trl_marl"):
        team = load_team(tmp_path / "out", captured_decode=False)
    assert team.model.get_base_model().config._name_or_path == recorded
    (warning,) = [record.getMessage() for record in caplog.records if "does not exist any more" in record.getMessage()]
    assert recorded in warning and gone in warning and str(here / Path(tiny_model_dir).name) in warning
    assert "base_model=" in warning


def test_a_local_base_found_nowhere_says_which_kept_path_and_folder_it_tried(tiny_model_dir, tmp_path, monkeypatch):
    save_untrained_team_with_transition(tiny_model_dir, tmp_path)
    recorded, gone = f"./{Path(tiny_model_dir).name}", str(tmp_path / "moved-away")
    (tmp_path / "out" / "_local_bases.json").write_text(json.dumps({recorded: gone}))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as error:
        load_team(tmp_path / "out")
    message = str(error.value)
    assert f"the kept path {gone!r} (_local_bases.json) does not exist" in message
    assert f"the working directory's {recorded!r} ({tmp_path / Path(tiny_model_dir).name}) does not exist" in message
    assert "base_model=" in message and "evaluate_task" in message
    assert "Repo id" not in message and ".." not in message
