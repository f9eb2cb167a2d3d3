"""Tools in the built-in rollouts (`tools=`, `environment_factory=`, docs/training.md "Tools"): TRL's tool loop for a
team, each agent with its own tools, one environment per episode shared by its agents, and every fork of an episode
(a MAGRPO tree's joint actions, AT-GRPO's candidates) on its own copy."""

import json

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from trl_marl import ATGRPOConfig, ATGRPOTrainer, MAGRPOConfig, MAGRPOTrainer
from trl_marl.generation.tool_templates import CHATML_TOOLS, prepare_response_parsing, tool_chat_template

PROMPTS = ["Add 2 and 3.", "Add 4 and 4.", "Add 1 and 6.", "Add 5 and 2."]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def tool_tokenizer(model_dir):
    """The default model's tokenizer made to render tools (ChatML with Hermes calls) and parse them back."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = tool_chat_template(tokenizer, CHATML_TOOLS)
    prepare_response_parsing(tokenizer, CHATML_TOOLS)
    return tokenizer


def scripted(tokenizer):
    """Completions as a function of the prompt and the row's place in the call, for both trainers alike: a prompt
    without a tool result calls `add` on every other row and answers on the others; an answer's length varies."""
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    call = tokenizer(CALL, add_special_tokens=False)["input_ids"] + [eos]

    def generate(prompt_ids, *args, **kwargs):
        completions = []
        for row, ids in enumerate(prompt_ids):
            after_tool = "<tool_response>" in tokenizer.decode(ids)
            if not after_tool and (sum(ids) + row) % 2 == 0:
                completions.append(list(call))
            else:
                words = " ok" * (1 + (len(ids) + row) % 4)
                completions.append(tokenizer(f"The sum is{words}.", add_special_tokens=False)["input_ids"] + [eos])
        return completions, None

    return generate


def calls_add_once(tokenizer):
    """A parse that reads every first answer as a call to `add` and every answer after a tool result as text."""

    def parse(completion_ids, prompt_ids, tools):
        if "<tool_response>" in tokenizer.decode(prompt_ids):
            return {"role": "assistant", "content": tokenizer.decode(completion_ids)}
        call = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
        return {"role": "assistant", "content": "", "tool_calls": [call]}

    return parse


def final_answer_reward(prompts, completions, **kwargs):  # TRL's: the last message of each completion
    return [len(completion[-1]["content"]) / 10.0 for completion in completions]


def team_answer_reward(prompts, completions, **kwargs):
    return [len(completion["solo"]) / 10.0 for completion in completions]


def run(trainer_cls, config_cls, model_dir, reward, output_dir, **extra):
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS]})
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    args = config_cls(
        output_dir=str(output_dir), per_device_train_batch_size=4, num_generations=4, gradient_accumulation_steps=2,
        max_completion_length=64, max_steps=2, learning_rate=5e-2, loss_type="dapo", seed=11, logging_steps=1,
        report_to="none", save_strategy="no", use_cpu=True, bf16=False, **extra,
    )  # fmt: skip
    tokenizer = tool_tokenizer(model_dir)
    trainer = trainer_cls(
        model_dir, reward, args=args, train_dataset=dataset, peft_config=lora, processing_class=tokenizer, tools=[add]
    )
    trainer._generate_single_turn = scripted(tokenizer)
    masks = []
    compute_loss = trainer._compute_loss

    def keeping_masks(model, inputs):
        masks.append(inputs["tool_mask"][inputs["completion_mask"].bool()].tolist())
        return compute_loss(model, inputs)

    trainer._compute_loss = keeping_masks
    initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}
    trainer.train()
    final = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return initial, final, logs, masks


def test_one_agent_with_tools_trains_exactly_as_grpo_trainer_with_the_same_tools(tiny_model_dir, tmp_path):
    trl = run(GRPOTrainer, GRPOConfig, tiny_model_dir, final_answer_reward, tmp_path / "trl")
    marl = run(MAGRPOTrainer, MAGRPOConfig, tiny_model_dir, team_answer_reward, tmp_path / "marl", agents=["solo"])
    (trl_initial, trl_final, trl_logs, trl_masks), (_, marl_final, marl_logs, marl_masks) = trl, marl
    assert sorted(sum(trl_masks, [])) != sorted(sum(trl_masks, [1]))  # some tokens were masked: tool results
    assert sorted(sum(marl_masks, [])) == sorted(sum(trl_masks, []))  # the same masked tokens, row order aside
    lengths = ("completions/mean_length", "completions/min_length", "completions/max_length", "num_tokens")
    for key in ("loss", "reward", "tools/call_frequency", "tools/failure_frequency", *lengths):
        assert [entry[key] for entry in marl_logs] == pytest.approx([entry[key] for entry in trl_logs], abs=1e-6), key
    # TRL counts the model's tokens only (`sum(tool_mask)`), tool results left out
    assert [entry["agents/solo/completion_length"] for entry in marl_logs] == [
        entry["completions/mean_length"] for entry in trl_logs
    ]
    assert trl_logs[0]["tools/call_frequency"] > 0
    as_trl = {name.replace(".solo.", ".default."): value for name, value in marl_final.items()}
    moved = max((trl_final[n] - trl_initial[n]).abs().max().item() for n in trl_final)
    assert moved > 1e-3
    for name in trl_final:
        torch.testing.assert_close(as_trl[name], trl_final[name], rtol=0, atol=1e-6)


class Notebook:
    """An environment whose tool changes its state: `write` appends a word to the episode's notes."""

    def reset(self, **row):
        self.notes = []
        return None

    def write(self, word: str) -> str:
        """Write a word in the notes.

        Args:
            word: The word.
        """
        self.notes.append(word)
        return f"noted {word}"

    def get_reward(self) -> float:
        return float(len(self.notes))


def scripted_writer(tokenizer, tool="write"):
    """Every row without a tool result calls `write` (or `tool`) with a word of its own (`w0`, `w1`, ... in call
    order); after a result, it answers."""
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    counter = iter(range(10_000))

    def generate(prompt_ids, *args, **kwargs):
        completions = []
        for ids in prompt_ids:
            if "<tool_response>" in tokenizer.decode(ids[-30:]):
                completions.append(tokenizer("Done.", add_special_tokens=False)["input_ids"] + [eos])
            else:
                call = f'<tool_call>\n{{"name": "{tool}", "arguments": {{"word": "w{next(counter)}"}}}}\n</tool_call>'
                completions.append(tokenizer(call, add_special_tokens=False)["input_ids"] + [eos])
        return completions, None

    return generate


def notebook_trainer(trainer_cls, config_cls, model_dir, tmp_path, reward=None, **extra):
    args = config_cls(
        output_dir=str(tmp_path), agents=["first", "second"], per_device_train_batch_size=2, num_generations=2,
        max_completion_length=64, max_steps=1, learning_rate=1e-3, report_to="none", save_strategy="no",
        use_cpu=True, bf16=False, **extra,
    )  # fmt: skip
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "Take notes."}]] * 2})
    tokenizer = tool_tokenizer(model_dir)
    trainer = trainer_cls(
        model_dir, reward, args=args, train_dataset=dataset, processing_class=tokenizer, environment_factory=Notebook
    )
    trainer._generate_single_turn = scripted_writer(tokenizer)
    kept, rollout = [], trainer._rollout
    trainer._rollout = lambda *a, **k: kept.append(rollout(*a, **k)) or kept[-1]
    return trainer, kept


def words(environment) -> list[int]:
    return [int(word[1:]) for word in environment.notes]


def test_a_magrpo_trees_branches_each_act_on_their_own_copy_of_the_episodes_environment(tiny_model_dir, tmp_path):
    trainer, kept = notebook_trainer(MAGRPOTrainer, MAGRPOConfig, tiny_model_dir, tmp_path, num_turns=2)
    trainer.train()
    joint_actions = kept[0].joint_actions
    by_index = dict(enumerate(joint_actions))
    roots = [ja for ja in joint_actions if ja.turn == 0]
    children = [ja for ja in joint_actions if ja.turn == 1]
    assert len(roots) == 2 and len(children) == 4
    for root in roots:  # both agents of an episode wrote in its one environment
        assert len(words(root.environment)) == 2
    assert not set(words(roots[0].environment)) & set(words(roots[1].environment))
    for node in {ja.node for ja in children}:
        siblings = [ja for ja in children if ja.node == node]
        parent = by_index[siblings[0].branch.parent]
        own = []
        for sibling in siblings:  # the parent's notes, then its own two words only
            assert words(sibling.environment)[:2] == words(parent.environment)
            own.append(set(words(sibling.environment)[2:]))
            assert len(own[-1]) == 2
        assert not own[0] & own[1]  # siblings never see each other's writes
    assert len(words(parent.environment)) == 2  # forking copied the environment: the parent's stayed as it was


def test_at_grpo_candidates_act_on_their_own_copies_and_the_episode_continues_from_the_chosen_one(
    tiny_model_dir, tmp_path
):
    trainer, kept = notebook_trainer(
        ATGRPOTrainer,
        ATGRPOConfig,
        tiny_model_dir,
        tmp_path,
        reward=lambda completions, **kw: [0.0] * len(completions),
    )
    trainer.train()
    candidates = kept[0].joint_actions
    first = [ja for ja in candidates if ja.node[2] == 0]
    second = [ja for ja in candidates if ja.node[2] == 1]
    assert len(first) == len(second) == 2  # two copies (candidates) of one problem, per agent
    assert [len(words(ja.environment)) for ja in first] == [1, 1]
    assert words(first[0].environment) != words(first[1].environment)  # each candidate wrote in its own copy
    chosen = words(second[0].environment)[:1]  # the second agent acts from the first's chosen candidate's notes
    assert chosen in [words(ja.environment) for ja in first]  # (the agents share a phase: they act in turn)
    for ja in second:  # both its candidates from that one, each on its own copy
        assert words(ja.environment)[:1] == chosen and len(words(ja.environment)) == 2
    assert words(second[0].environment)[1] != words(second[1].environment)[1]


def test_an_environments_get_reward_is_a_team_reward_source(tiny_model_dir, tmp_path):
    trainer, kept = notebook_trainer(MAGRPOTrainer, MAGRPOConfig, tiny_model_dir, tmp_path)
    assert trainer.reward_func_names[-1] == "Notebook"
    trainer.train()
    for joint_action in kept[0].joint_actions:  # one word per agent: get_reward is 2
        assert joint_action.rewards_per_func[-1] == 2.0
    assert trainer.state.log_history[0]["rewards/Notebook/mean"] == 2.0


def test_an_agents_own_tools_are_rendered_only_into_its_prompts_and_run_only_for_it(tiny_model_dir, tmp_path):
    args = MAGRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2, max_completion_length=64,
        max_steps=1, report_to="none", save_strategy="no", use_cpu=True, bf16=False,
        agents=[{"name": "caller", "tools": ["test_tools:add"]}, {"name": "plain"}],
    )  # fmt: skip
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "Add 2 and 3."}]] * 2})
    tokenizer = tool_tokenizer(tiny_model_dir)
    trainer = MAGRPOTrainer(
        tiny_model_dir, team_answer_reward_any, args=args, train_dataset=dataset, processing_class=tokenizer
    )
    trainer._generate_single_turn = scripted(tokenizer)
    kept, rollout = [], trainer._rollout
    trainer._rollout = lambda *a, **k: kept.append(rollout(*a, **k)) or kept[-1]
    trainer.train()
    for sample in kept[0].samples:
        prompt = tokenizer.decode(sample.prompt_ids)
        assert ("# Tools" in prompt) == (sample.agent == 0)
        assert (sample.tool_mask is not None) == (sample.agent == 0)
    called = [s for s in kept[0].samples if s.agent == 0 and 0 in s.tool_mask]
    assert called and all("<tool_response>\n5\n</tool_response>" in tokenizer.decode(s.completion_ids) for s in called)


def test_an_agent_without_tools_in_a_team_with_an_environment_is_prompted_without_tools(tiny_model_dir, tmp_path):
    """AT-GRPO generates each agent of a phase on its own when there is an environment: a call of only the agent with
    `tools: []` renders none of the environment's tools (TRL's own prompt rendering would) and runs none."""
    args = ATGRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2, max_completion_length=64,
        max_steps=1, report_to="none", save_strategy="no", use_cpu=True, bf16=False,
        agents=[{"name": "writer"}, {"name": "reader", "tools": []}],
    )  # fmt: skip
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "Take notes."}]] * 2})
    tokenizer = tool_tokenizer(tiny_model_dir)
    trainer = ATGRPOTrainer(
        tiny_model_dir, lambda completions, **kw: [0.0] * len(completions), args=args, train_dataset=dataset,
        processing_class=tokenizer, environment_factory=Notebook,
    )  # fmt: skip
    trainer._generate_single_turn = scripted_writer(tokenizer)
    kept, rollout = [], trainer._rollout
    trainer._rollout = lambda *a, **k: kept.append(rollout(*a, **k)) or kept[-1]
    trainer.train()
    for sample in kept[0].samples:
        prompt = tokenizer.decode(sample.prompt_ids)
        assert ("# Tools" in prompt) == ('"name": "write"' in prompt) == (sample.agent == 0)
    reader = [s for s in kept[0].samples if s.agent == 1]
    assert reader and all(s.tool_mask is None for s in reader)  # its calls (the script writes them) never ran
    assert all(len(ja.environment.notes) == 1 for ja in kept[0].joint_actions if ja.node[2] == 1)


def team_answer_reward_any(prompts, completions, **kwargs):
    return [float(len(completion["caller"])) for completion in completions]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(environment_factory={"a": Notebook, "b": Notebook}), "dict of several environments"),
        (dict(environment_factory=Notebook, joint_mode="cross"), "joint_mode='cross'"),
        (dict(agents=[{"name": "solo", "tools": ["no_such_module:tool"]}]), "cannot be imported"),
        (dict(agents=[{"name": "solo", "tools": ["spell"]}], environment_factory=Notebook), "neither methods"),
    ],
)
def test_what_tools_cannot_do_in_a_team_is_refused_by_name(tiny_model_dir, tmp_path, settings, message):
    config = {"agents": ["solo"], "joint_mode": "aligned", **settings}
    factory = config.pop("environment_factory", None)
    args = MAGRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False, **config)
    dataset = Dataset.from_dict({"prompt": ["Hi."]})
    with pytest.raises(ValueError, match=message):
        MAGRPOTrainer(
            tiny_model_dir, team_answer_reward, args=args, train_dataset=dataset, environment_factory=factory
        )


def test_the_math_tool_calls_environment_runs_programs_sandboxed_and_its_reward_reads_each_episodes_own():
    import copy
    from fractions import Fraction

    from sandbox_helpers import require_bubblewrap

    from trl_marl.tasks.math_tool_calls import PythonRunner, math_tool_calls_reward

    require_bubblewrap()
    right, wrong = PythonRunner(), PythonRunner()
    right.reset(prompt="What is 3 + 4?")
    assert right.run_python("print(3 + 4)") == "the program printed '7'" and right.printed == Fraction(7)
    forked = copy.deepcopy(right)
    forked.run_python("print(8)")
    assert right.printed == Fraction(7) and right.runs == 1  # a fork's runs stay its own
    wrong.reset(prompt="What is 3 + 4?")
    wrong.run_python("raise SystemExit(1)")
    completions = [{"tool": "", "reasoner": "Answer: 7"}, {"tool": "", "reasoner": "Answer: 6"}]
    rewards = math_tool_calls_reward(["q", "q"], completions, answer=["7", "7"], environments=[right, wrong])
    assert rewards == [1.0, 0.0]
    as_text = [{"tool": "```python\nprint(7)\n```", "reasoner": "Answer: 7"}]  # no environment: the program in text
    assert math_tool_calls_reward(["q"], as_text, answer=["7"]) == [1.0]


def test_the_math_tool_calls_demonstrations_are_calls_the_loop_parses_of_programs_that_print_the_answer():
    """The warm start's demonstrations (`recipes/atgrpo_math_tools.py`): the training problems in order, each a
    `run_python` call that the tool loop's parsing reads back from the rendered conversation, whose program, run in the
    episode's environment, prints the problem's answer; the text arm's program prints it too."""
    import json
    from fractions import Fraction

    from sandbox_helpers import require_bubblewrap

    from trl_marl import default_model_path
    from trl_marl.generation.tool_templates import parse_tool_calls
    from trl_marl.tasks.math_tool import TOOL_PROMPT, run_tool
    from trl_marl.tasks.math_tool_calls import TOOL_CALLS_PROMPT, MathToolCalls, PythonRunner

    require_bubblewrap()
    task = MathToolCalls()
    problems = task.dataset("train").select(range(3))
    calls, texts = task.demonstrations(3), task.demonstrations(3, tools=False)
    assert [row[1:] for row in calls["prompt"]] == problems["prompt"] == [row[1:] for row in texts["prompt"]]
    assert {row[0]["content"] for row in calls["prompt"]} == {TOOL_CALLS_PROMPT}
    assert {row[0]["content"] for row in texts["prompt"]} == {TOOL_PROMPT}
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    template = tool_chat_template(tokenizer)
    prepare_response_parsing(tokenizer, CHATML_TOOLS)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for demonstration, text, answer in zip(calls, texts, problems["answer"]):
        tools = json.loads(demonstration["tools"])
        render = dict(tools=tools, chat_template=template, tokenize=True, return_dict=False)
        prompt_ids = tokenizer.apply_chat_template(demonstration["prompt"], add_generation_prompt=True, **render)
        ids = tokenizer.apply_chat_template(demonstration["prompt"] + demonstration["completion"][:1], **render)
        assert ids[: len(prompt_ids)] == prompt_ids  # the completion continues the prompt the loop generates from
        completion = ids[len(prompt_ids) :]
        [call] = parse_tool_calls(tokenizer, completion[: completion.index(end) + 1], prompt_ids, tools)["tool_calls"]
        assert call["function"]["name"] == "run_python"
        environment = PythonRunner()
        environment.reset()
        result = environment.run_python(**call["function"]["arguments"])
        assert environment.printed == Fraction(answer) and demonstration["completion"][1]["content"] == result
        assert demonstration["completion"][2]["content"] == f"Answer: {answer}"
        assert run_tool(text["completion"][0]["content"])[0] == Fraction(answer)


def test_the_recipes_warm_start_trains_only_its_agents_adapter_and_the_team_trains_every_adapter_after(
    tiny_model_dir, tmp_path
):
    """`recipes/atgrpo_math_tools.py`'s warm start: TRL's `SFTTrainer` on the team's own model moves the one agent's
    adapter and no other; afterwards the team's RL step trains both adapters (the trainer checks before every loss)."""
    import importlib.util
    from pathlib import Path
    from types import SimpleNamespace

    path = Path(__file__).parent.parent / "recipes" / "atgrpo_math_tools.py"
    spec = importlib.util.spec_from_file_location("atgrpo_math_tools", path)
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS]})
    args = ATGRPOConfig(
        output_dir=str(tmp_path), agents=["caller", "answerer"], per_device_train_batch_size=4, num_generations=4,
        max_completion_length=8, max_steps=1, learning_rate=5e-2, seed=3, report_to="none", save_strategy="no",
        use_cpu=True, bf16=False,
    )  # fmt: skip
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = ATGRPOTrainer(
        tiny_model_dir, team_answer_length, args=args, train_dataset=dataset, peft_config=lora,
        processing_class=tool_tokenizer(tiny_model_dir), tools=[add],
    )  # fmt: skip
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
    demonstrations = Dataset.from_dict(
        {
            "prompt": dataset["prompt"],
            "completion": [[{"role": "assistant", "content": "", "tool_calls": [call]}]] * len(PROMPTS),
        }
    )

    def adapter(agent):
        return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if f".{agent}." in n}

    before = {agent: adapter(agent) for agent in ("caller", "answerer")}
    settings = SimpleNamespace(warm_start_epochs=2.0, warm_start_learning_rate=1e-2)
    recipe.warm_start(trainer, "caller", demonstrations, settings, args)
    warm = {agent: adapter(agent) for agent in ("caller", "answerer")}
    assert max((warm["caller"][n] - before["caller"][n]).abs().max().item() for n in warm["caller"]) > 1e-3
    assert all(torch.equal(warm["answerer"][n], before["answerer"][n]) for n in warm["answerer"])
    trainer.train()
    for agent in ("caller", "answerer"):
        after = adapter(agent)
        assert max((after[n] - warm[agent][n]).abs().max().item() for n in after) > 0, agent


def team_answer_length(prompts, completions, **kwargs):
    return [len(completion["caller"]) / 10.0 + len(completion["answerer"]) / 7.0 for completion in completions]


@pytest.mark.slow
def test_stopping_and_resuming_a_run_with_tools_equals_the_uninterrupted_run(tiny_model_dir, tmp_path):
    """Resuming mid-generation-buffer (steps_per_generation=2, stopped at step 3) restores the buffered tool masks,
    and the later rollouts draw the same tool calls (decided by the sampler's generator) as the uninterrupted run."""
    from test_resume import StopAt, adapters, logged_after

    def make(output_dir, **extra):
        settings = dict(
            output_dir=str(output_dir), agents=["first", "second"], per_device_train_batch_size=4, num_generations=2,
            steps_per_generation=2, max_completion_length=64, max_steps=4, learning_rate=5e-2, logging_steps=1,
            report_to="none", save_strategy="no", use_cpu=True, bf16=False, seed=5,
        )  # fmt: skip
        args = MAGRPOConfig(**{**settings, **extra})
        dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS]})
        tokenizer = tool_tokenizer(tiny_model_dir)
        trainer = MAGRPOTrainer(
            tiny_model_dir, team_reward, args=args, train_dataset=dataset, processing_class=tokenizer, tools=[add]
        )
        trainer._generate_single_turn = sampled(tokenizer)
        return trainer

    uninterrupted = make(tmp_path / "a")
    uninterrupted.train()
    first = make(tmp_path / "b", save_strategy="steps", save_steps=3)
    first.add_callback(StopAt(3))
    first.train()
    resumed = make(tmp_path / "b")
    resumed.train(resume_from_checkpoint=True)

    assert resumed.state.global_step == 4
    rollouts = [entry for entry in uninterrupted.state.log_history if "tools/call_frequency" in entry]
    assert len(rollouts) == 2 and min(entry["tools/call_frequency"] for entry in rollouts) > 0  # both called tools
    expected, final = adapters(uninterrupted), adapters(resumed)
    for name in expected:
        torch.testing.assert_close(final[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)
    assert logged_after(resumed, 3) == pytest.approx(logged_after(uninterrupted, 3), rel=1e-5, abs=1e-7)


def sampled(tokenizer):
    """A row without a tool result calls `add` (arguments drawn from torch's generator, as a sampler draws) on about
    half of the draws, else answers; after a result it answers."""
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def generate(prompt_ids, *args, **kwargs):
        completions = []
        for ids in prompt_ids:
            a, b = torch.randint(0, 10, (2,)).tolist()
            if "<tool_response>" not in tokenizer.decode(ids[-30:]) and a % 2 == 0:
                text = f'<tool_call>\n{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>'
            else:
                text = "The sum is" + " ok" * (1 + b % 4) + "."
            completions.append(tokenizer(text, add_special_tokens=False)["input_ids"] + [eos])
        return completions, None

    return generate


def team_reward(prompts, completions, **kwargs):
    return [len(completion["first"]) / (1 + len(completion["second"])) for completion in completions]


def lookup_capital(country: str) -> str:
    """Look up the capital city of a country.

    Args:
        country: The country's name.
    """
    return {"France": "Paris"}.get(country, "unknown")


def lookup_population(city: str, year: int) -> int:
    """Look up how many people live in a city.

    Args:
        city: The city's name.
        year: The census year.
    """
    return 2_100_000 if city == "Paris" else 0


lookup_capital.__name__ = lookup_population.__name__ = (
    "lookup"  # two tools of the same name, as "a:lookup", "b:lookup"
)


class Atlas(Notebook):
    """An environment whose method is named like another agent's own tool."""

    def lookup(self, river: str) -> str:
        """Look up the sea a river flows into.

        Args:
            river: The river's name.
        """
        return "the Channel"


@pytest.mark.parametrize(
    ("agents", "environment_factory", "described"),
    [
        (
            [{"name": "first", "tools": [lookup_capital]}, {"name": "second", "tools": [lookup_population]}],
            None,
            ["capital city of a country", "how many people live in a city"],
        ),
        (
            [{"name": "first", "tools": [lookup_capital]}, {"name": "second", "tools": ["lookup"]}],
            Atlas,
            ["capital city of a country", "the sea a river flows into"],
        ),
    ],
)
def test_agents_tools_of_the_same_name_are_each_described_from_their_own(
    tiny_model_dir, tmp_path, agents, environment_factory, described
):
    args = MAGRPOConfig(
        output_dir=str(tmp_path), agents=agents, per_device_train_batch_size=2, num_generations=2,
        max_completion_length=16, max_steps=1, report_to="none", save_strategy="no", use_cpu=True, bf16=False,
    )  # fmt: skip
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "Where?"}]] * 2})
    tokenizer = tool_tokenizer(tiny_model_dir)
    trainer = MAGRPOTrainer(
        tiny_model_dir, lambda completions, **kw: [0.0] * len(completions), args=args, train_dataset=dataset,
        processing_class=tokenizer, environment_factory=environment_factory,
    )  # fmt: skip
    trainer._generate_single_turn = scripted(tokenizer)
    kept, rollout = [], trainer._rollout
    trainer._rollout = lambda *a, **k: kept.append(rollout(*a, **k)) or kept[-1]
    trainer.train()
    for sample in kept[0].samples:
        prompt = tokenizer.decode(sample.prompt_ids)
        assert described[sample.agent] in prompt and described[1 - sample.agent] not in prompt, sample.agent


def test_a_tool_round_past_the_prompt_room_goes_on_as_in_grpo_trainer(tiny_model_dir, tmp_path):
    """A real prompt must leave `max_completion_length` positions free; a round of the tool loop only keeps within the
    completion budget and the model's positions (TRL's rule): with 512 positions, a 236-token prompt and
    `max_completion_length=256`, the call's result takes the sequence past 256 tokens and the row goes on."""
    args = MAGRPOConfig(
        output_dir=str(tmp_path), agents=["solo"], per_device_train_batch_size=2, num_generations=2,
        max_completion_length=256, max_steps=1, report_to="none", save_strategy="no", use_cpu=True, bf16=False,
    )  # fmt: skip
    prompt = [{"role": "user", "content": "Add 2 and 3." + " Please" * 19}]
    tokenizer = tool_tokenizer(tiny_model_dir)
    assert (
        len(tokenizer.apply_chat_template(prompt, tools=[add], add_generation_prompt=True, return_dict=False)) == 236
    )
    dataset = Dataset.from_dict({"prompt": [prompt] * 2})
    trainer = MAGRPOTrainer(
        tiny_model_dir, team_answer_reward, args=args, train_dataset=dataset, processing_class=tokenizer, tools=[add]
    )
    trainer._generate_single_turn = scripted(tokenizer)
    kept, rollout = [], trainer._rollout
    trainer._rollout = lambda *a, **k: kept.append(rollout(*a, **k)) or kept[-1]
    trainer.train()
    went_on = [s for s in kept[0].samples if 0 in s.tool_mask]
    assert went_on, "no row called the tool"
    for sample in went_on:
        assert len(sample.prompt_ids) == 236 and len(sample.prompt_ids) + sample.tool_mask.index(0) > 512 - 256
        assert sample.tool_mask[-1] == 1 and "The sum is" in tokenizer.decode(sample.completion_ids)


# ------------------------------------------------------------------ a saved team plays with the tools it trained with


def scripted_team(team, script):
    """The loaded `team`'s base generating as `script` (a `_generate_single_turn`) says; the prompts it was given, as
    text, are kept in the list returned."""
    tokenizer, prompts = team.tokenizer, []

    def generate(input_ids, attention_mask, pad_token_id, **kwargs):
        rows = [[t for t, m in zip(ids, mask) if m] for ids, mask in zip(input_ids.tolist(), attention_mask.tolist())]
        prompts.extend(tokenizer.decode(ids) for ids in rows)
        completions, _ = script(rows)
        width = max(len(ids) for ids in completions)
        tail = [ids + [pad_token_id] * (width - len(ids)) for ids in completions]
        return torch.cat([input_ids, torch.tensor(tail, dtype=input_ids.dtype)], dim=1)

    team.bases[0].model.generate = generate
    return prompts


def save_notebook_team(model_dir, folder, agents, **trainer_kwargs):
    """An untrained team of `agents` saved to `folder` by a trainer given `trainer_kwargs` (tools, environment); its
    team.json."""
    args = MAGRPOConfig(
        output_dir=str(folder), agents=agents, per_device_train_batch_size=2, num_generations=2,
        max_completion_length=64, report_to="none", save_strategy="no", use_cpu=True, bf16=False,
    )  # fmt: skip
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "Take notes."}]] * 2})
    trainer = MAGRPOTrainer(model_dir, team_answer_reward_any, args=args, train_dataset=dataset, **trainer_kwargs)
    trainer.save_model(str(folder))
    return json.loads((folder / "team.json").read_text())


def test_a_played_team_calls_the_tools_it_trained_with_in_its_episodes_environment(tiny_model_dir, tmp_path):
    from trl_marl import load_team

    agents = [{"name": "caller"}, {"name": "reader", "tools": []}]
    spec = save_notebook_team(tiny_model_dir, tmp_path / "team", agents, environment_factory=Notebook)
    assert spec["environment_factory"] == "test_tools:Notebook" and spec["tools"] == []
    assert [agent.get("tools") for agent in spec["agents"]] == [None, []]
    team = load_team(tmp_path / "team", captured_decode=False)
    prompts = scripted_team(team, scripted_writer(team.tokenizer))
    episode = team.run([{"role": "user", "content": "Take notes."}])
    # the caller was offered `write`, called it in the episode's notebook, and answered after its result; the reader,
    # trained without tools, was offered none and its call (the script writes one) never ran
    assert episode.final["caller"] == "Done."
    assert episode.environment.notes == ["w0"]
    assert ['"name": "write"' in prompt for prompt in prompts] == [True, False, True]


def test_a_team_whose_tool_cannot_be_imported_says_which_tool_and_to_pass_it_again(tiny_model_dir, tmp_path):
    from trl_marl import load_team

    looked_up = []

    def look_up(word: str) -> str:
        """Look a word up.

        Args:
            word: The word.
        """
        looked_up.append(word)
        return word

    spec = save_notebook_team(tiny_model_dir, tmp_path / "team", ["solver", "checker"], tools=[look_up])
    assert spec["tools"] == [{"name": "look_up", "importable": False}]
    team = load_team(tmp_path / "team", captured_decode=False)  # loads: only playing needs the tools
    with pytest.raises(ValueError, match=r"every agent \(the trainer's `tools=`\) with the tool 'look_up', which has "
                       r"no importable name.*load_team\(\.\.\., tools=\[look_up\]\)"):  # fmt: skip
        team.run([{"role": "user", "content": "Take notes."}])
    team = load_team(tmp_path / "team", captured_decode=False, tools=[look_up])
    prompts = scripted_team(team, scripted_writer(team.tokenizer, tool="look_up"))
    team.run([{"role": "user", "content": "Take notes."}])
    assert ['"name": "look_up"' in prompt for prompt in prompts] == [True] * 4  # two agents, each after its result
    assert looked_up == ["w0", "w1"]


def test_a_team_whose_environment_cannot_be_imported_says_to_pass_it_again(tiny_model_dir, tmp_path):
    from trl_marl import load_team
    from trl_marl.cli.evaluation import evaluate_task

    class LocalNotebook(Notebook):
        pass

    spec = save_notebook_team(tiny_model_dir, tmp_path / "team", ["solo"], environment_factory=LocalNotebook)
    assert spec["environment_factory"] == {"name": "LocalNotebook", "importable": False}
    playing = (
        lambda team: load_team(team).run([{"role": "user", "content": "Take notes."}]),
        lambda team: evaluate_task("reach_target", team=team),
    )
    for play in playing:
        with pytest.raises(
            ValueError, match=r"environment factory 'LocalNotebook'.*environment_factory=LocalNotebook"
        ):
            play(tmp_path / "team")
    assert load_team(tmp_path / "team", environment_factory=LocalNotebook).environment_factory is LocalNotebook


def test_a_team_file_from_before_tools_were_recorded_keeps_its_agents_tools_and_takes_its_tasks_environment(
    tiny_model_dir, tmp_path, caplog
):
    from trl_marl.tasks.math_tool_calls import MathToolCalls, PythonRunner
    from trl_marl.team.saved_tools import saved_tools

    args = MAGRPOConfig.for_task(
        "math_tool_calls", output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2,
        report_to="none", save_strategy="no", use_cpu=True, bf16=False,
    )  # fmt: skip
    MAGRPOTrainer(tiny_model_dir, args=args, task="math_tool_calls").save_model(str(tmp_path / "team"))
    spec = json.loads((tmp_path / "team" / "team.json").read_text())
    old = {key: value for key, value in spec.items() if key not in ("tools", "environment_factory")}
    trained = saved_tools(old, "team", MathToolCalls())
    assert trained.environment_factory is PythonRunner and "does not record its environment" in caplog.text
    assert (trained.tools, trained.agent_tools) == ([], [["run_python"], []])
    assert saved_tools(spec, "team", MathToolCalls()).environment_factory is PythonRunner
    assert saved_tools({**spec, "environment_factory": "none"}, "team", MathToolCalls()).environment_factory is None


class CountedNotebook(Notebook):
    """A notebook that counts the instances made of it."""

    made = 0

    def __init__(self):
        CountedNotebook.made += 1


@pytest.mark.parametrize("recorded", [None, "gone_package.tools:look_up"], ids=["unimportable", "gone module"])
def test_a_team_whose_tool_cannot_be_rebuilt_here_is_served_without_it_and_refuses_to_play_naming_it(
    tiny_model_dir, tmp_path, recorded
):
    """Serving never needs the training tools (clients send their own): a tool that cannot be rebuilt here (no
    importable name, or a module not installed) does not stop a team from being served, nor is its environment made;
    playing the team still needs it and names it."""
    pytest.importorskip("fastapi", reason="serving needs the `serve` extra (FastAPI, uvicorn)")
    pytest.importorskip("uvicorn", reason="serving needs the `serve` extra (FastAPI, uvicorn)")
    httpx = pytest.importorskip("httpx", reason="the served team is read with httpx")
    from trl_marl import load_team, serve_team

    def look_up(word: str) -> str:
        """Look a word up.

        Args:
            word: The word.
        """
        return word

    folder = tmp_path / "team"
    spec = save_notebook_team(
        tiny_model_dir, folder, ["solver", "checker"], tools=[look_up], environment_factory=CountedNotebook
    )
    if recorded is not None:
        (folder / "team.json").write_text(json.dumps({**spec, "tools": [recorded]}))
    made = CountedNotebook.made
    with serve_team(folder) as server:
        models = httpx.get(f"{server.base_url}/models").json()
        chat = {"model": "checker", "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 2}
        answer = httpx.post(f"{server.base_url}/chat/completions", json=chat, timeout=60).json()
    assert [model["id"] for model in models["data"]] == ["solver", "checker"]
    assert answer["usage"]["completion_tokens"] == 2
    assert CountedNotebook.made == made  # the served team never made its environment
    named = r"every agent \(the trainer's `tools=`\) with the tool '(gone_package\.tools:)?look_up'"
    with pytest.raises(ValueError, match=named + r".*load_team\(\.\.\., tools=\[look_up\]\)"):
        load_team(folder, captured_decode=False).run([{"role": "user", "content": "Take notes."}])


class Glossary:
    """Tools as static methods of a class."""

    @staticmethod
    def look_up(word: str) -> str:
        """Look a word up in the glossary.

        Args:
            word: The word.
        """
        return f"glossary says {word}"


TRAINING_SCRIPT = '''
def look_up(word: str) -> str:
    """Look a word up in the script.

    Args:
        word: The word.
    """
    return f"script says {word}"


if __name__ == "__main__":
    raise SystemExit("the script's training ran when its tool was rebuilt")
'''


@pytest.mark.parametrize("defined_in", ["a script", "a class"])
def test_a_tool_recorded_by_its_scripts_path_or_a_dotted_name_is_rebuilt_and_called(
    tiny_model_dir, tmp_path, defined_in
):
    """A function of a script run as `python train.py` is recorded as `/path/train.py:look_up` (`importable_name`), a
    static method as `module:Class.method`: a played team rebuilds both and calls them."""
    from trl_marl import load_team

    folder = tmp_path / "team"
    spec = save_notebook_team(tiny_model_dir, folder, ["solo"], tools=[Glossary.look_up])
    assert spec["tools"] == ["test_tools:Glossary.look_up"]
    said = "glossary says w0"
    script = tmp_path / "train.py"
    if defined_in == "a script":
        script.write_text(TRAINING_SCRIPT)
        (folder / "team.json").write_text(json.dumps({**spec, "tools": [f"{script}:look_up"]}))
        said = "script says w0"
    team = load_team(folder, captured_decode=False)
    prompts = scripted_team(team, scripted_writer(team.tokenizer, tool="look_up"))
    assert team.run([{"role": "user", "content": "Take notes."}]).final["solo"] == "Done."
    assert [said in prompt for prompt in prompts] == [False, True]  # the tool's result, after its call
    if defined_in == "a script":  # a script that is gone says so (installing nothing brings it back)
        script.unlink()
        with pytest.raises(
            ValueError, match=rf"'{script}:look_up'.*no script at {script}.*tools=\[look_up\]"
        ) as error:
            load_team(folder, captured_decode=False).run([{"role": "user", "content": "Take notes."}])
        assert "install" not in str(error.value).lower()


def test_a_team_played_on_vllm_keeps_its_tool_rounds_within_vllm_max_model_length(
    tiny_model_dir, tmp_path, monkeypatch
):
    """With `use_vllm=True`, a round whose tool results would take the sequence to `vllm_max_model_length` ends the
    row with its call, as in training (`position_limit`), not only at the model's positions. vLLM stood in for."""
    from trl_marl import load_team

    folder = tmp_path / "team"
    save_notebook_team(tiny_model_dir, folder, ["solo"], environment_factory=Notebook)
    tokenizer, calls = AutoTokenizer.from_pretrained(folder), []

    class ScriptedEngine:  # `SavedTeamEngine`'s interface, generating as `scripted_writer` says
        def __init__(self, base_model, adapter_folders, lora_rank, dtype, **settings):
            self.max_model_len, self.script = settings["max_model_len"], scripted_writer(tokenizer)

        def generate(self, prompt_ids, adapters, max_new_tokens, do_sample, stop_token_ids, generation_config=None):
            calls.append([len(ids) for ids in prompt_ids])
            return self.script(prompt_ids)[0]

        def close(self):
            pass

    monkeypatch.setattr("trl_marl.generation.vllm_serving.SavedTeamEngine", ScriptedEngine)
    prompt = [{"role": "user", "content": "Take notes."}]
    episode = load_team(folder, use_vllm=True).run(prompt)
    assert episode.final["solo"] == "Done." and len(calls) == 2  # the model's 512 positions leave room for a round
    round_length = calls[1][0]  # the prompt, the call and its result
    calls.clear()
    team = load_team(folder, use_vllm=True, vllm_max_model_length=round_length)
    episode = team.run(prompt)
    assert team.engine.max_model_len == round_length
    assert len(calls) == 1 and episode.final["solo"] != "Done."  # the result dropped: the row ended with its call
    assert episode.environment.notes == ["w0"]


def look_up(word: str) -> str:
    """Look a word up in the importable dictionary.

    Args:
        word: The word.
    """
    return f"importable says {word}"


def test_a_tool_given_again_stands_in_only_for_the_recorded_tools_that_cannot_be_rebuilt(tiny_model_dir, tmp_path):
    """`tools=[look_up]` stands in for the first agent's local `look_up` (no importable name), never for the second
    agent's `test_tools:look_up`, which imports here; given for that one alone, it is refused."""
    from trl_marl import load_team

    def local_look_up(word: str) -> str:
        """Look a word up in the local dictionary.

        Args:
            word: The word.
        """
        return f"local says {word}"

    local_look_up.__name__ = "look_up"
    folder = tmp_path / "team"
    agents = [{"name": "first", "tools": [look_up]}, {"name": "second", "tools": [look_up]}]
    spec = save_notebook_team(tiny_model_dir, folder, agents)
    assert [agent["tools"] for agent in spec["agents"]] == [["test_tools:look_up"]] * 2
    # the first agent's tool as team.json records a local function (a trainer's arguments holding one cannot be saved)
    spec["agents"][0]["tools"] = [{"name": "look_up", "importable": False}]
    (folder / "team.json").write_text(json.dumps(spec))
    team = load_team(folder, captured_decode=False, tools=[local_look_up])
    prompts = scripted_team(team, scripted_writer(team.tokenizer, tool="look_up"))
    team.run([{"role": "user", "content": "Take notes."}])
    assert ["local says w0" in prompt for prompt in prompts] == [False, False, True, False]
    assert ["importable says w1" in prompt for prompt in prompts] == [False, False, False, True]
    (folder / "team.json").write_text(json.dumps({**spec, "agents": [spec["agents"][1]]}))
    with pytest.raises(
        ValueError, match=r"`tools` gives \['look_up'\].*\['test_tools:look_up'\] import here and are kept"
    ):
        load_team(folder, captured_decode=False, tools=[local_look_up]).run([{"role": "user", "content": "Hi."}])


def test_a_math_tool_calls_episode_on_a_machine_without_a_sandbox_stops_naming_what_is_missing(monkeypatch, tmp_path):
    """Not one tool error per call, which the team would train on: the episode's environment refuses to start."""
    from trl_marl.sandbox import SandboxUnavailable
    from trl_marl.sandbox.capability import probe
    from trl_marl.tasks import sandbox_runs
    from trl_marl.tasks.math_tool_calls import PythonRunner

    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on it
    monkeypatch.setattr(sandbox_runs, "_sandbox", None)
    probe.cache_clear()
    try:
        with pytest.raises(SandboxUnavailable, match="bubblewrap is not installed"):
            PythonRunner().reset(question="What is 1 plus 1?", answer="2")
    finally:
        probe.cache_clear()
