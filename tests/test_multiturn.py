"""Multi-turn MAGRPO through the trainer: what each agent saw, every tree sample reaching the loss exactly once,
per-turn metrics, and transitions that fail without touching the training state on disk."""

import hashlib
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from tiny_run import TINY_RUN
from transformers import AutoTokenizer
from trl.trainer.utils import split_tensor_dict

from trl_marl import MAGRPOConfig, MAGRPOTrainer, NextTurn, TransitionError
from trl_marl.agents import agent_prompt
from trl_marl.rollouts.rows import pad_rows, padding_loss_scale
from trl_marl.rollouts.scheduling import parallel

AGENTS = [{"name": "planner", "system_prompt": "Plan briefly."}, {"name": "checker"}]
PROMPTS = ["Name a colour.", "Name a fruit.", "Count to three.", "Say hello."]


def shorter_is_better(prompts, completions, turn, **kwargs):
    return [1.0 / (1 + len(c["planner"]) + len(c["checker"])) + 0.1 * t for c, t in zip(completions, turn)]


def make_trainer(model_dir, tmp_path, transition=None, **overrides):
    values = dict(
        output_dir=str(tmp_path / "out"),
        agents=AGENTS,
        num_turns=2,
        discount=0.9,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=5,
        max_steps=2,
        **TINY_RUN,
        seed=5,
    )
    values.update(overrides)
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS]})
    return MAGRPOTrainer(
        model_dir, shorter_is_better, args=MAGRPOConfig(**values), train_dataset=dataset, transition=transition
    )


class RowCounter:
    """Records the rows each generation produced and the rows each loss call received."""

    def __init__(self, trainer):
        self.generated, self.trained = [], []
        generate, compute_loss = trainer._generate_and_score_completions, trainer._compute_loss

        def counting_generate(inputs):
            output = generate(inputs)
            self.generated.append(output)
            return output

        def counting_loss(model, inputs):
            self.trained.append(inputs)
            return compute_loss(model, inputs)

        trainer._generate_and_score_completions = counting_generate
        trainer._compute_loss = counting_loss


def lora_params(model, adapter):
    return {n: p.detach().clone() for n, p in model.named_parameters() if f".{adapter}." in n}


def stop_some_branches(prompt, joint_action, history, turn, **kwargs):
    """Ends the episodes whose planner answer has an even number of characters: trees of varying size."""
    if len(joint_action["planner"]) % 2 == 0:
        return NextTurn(done=True)
    return [f"{prompt[-1]['content']} Again."] * 2


@pytest.mark.parametrize("joint_mode", ["aligned", pytest.param("cross", marks=pytest.mark.slow)])
def test_every_tree_sample_reaches_the_loss_exactly_once(tiny_model_dir, tmp_path, joint_mode):
    # 2 micro-batches per generation and 2 accumulation steps: rows split unevenly must all be trained.
    trainer = make_trainer(
        tiny_model_dir,
        tmp_path,
        transition=stop_some_branches,
        joint_mode=joint_mode,
        steps_per_generation=2,
        gradient_accumulation_steps=2,
        max_steps=3,
    )
    counter = RowCounter(trainer)
    trainer.train()
    assert len(counter.generated) == 3 and len(counter.trained) == 6

    def real_rows(batches):
        """(advantage, agent, turn, loss tokens) of every row that is not padding, sorted."""
        return sorted(
            (a.item(), g.item(), t.item(), m.sum().item())
            for batch in batches
            for a, g, t, m, padding in zip(
                batch["advantages"],
                batch["agent_index"],
                batch["turn_index"],
                batch["completion_mask"],
                batch["is_padding"],
            )
            if not padding
        )

    logged = [entry["num_samples"] for entry in trainer.state.log_history if "num_samples" in entry]
    tree_rows = []
    for index, output in enumerate(counter.generated):
        chunks = counter.trained[2 * index : 2 * index + 2]
        # TRL's equal split: padding rounds the rows up to a multiple of steps_per_generation, nothing is dropped
        assert len(chunks[0]["advantages"]) == len(chunks[1]["advantages"])
        assert sum(len(chunk["advantages"]) for chunk in chunks) == len(output["advantages"])
        assert real_rows(chunks) == real_rows([output])  # every tree row once, padding aside
        tree_rows.append(len(real_rows([output])))
        assert (output["completion_mask"][output["is_padding"]] == 0).all()
        assert chunks[0]["num_items_in_batch"] == output["completion_mask"].sum()
    assert logged == [float(count) for count in tree_rows]
    # `done` made the trees differ in size; full trees would give N·G·(1 + K) rows for each of the 2 prompts.
    full = 2 * 2 * 2 * (1 + (2 if joint_mode == "aligned" else 4))
    assert any(count < full for count in tree_rows), tree_rows


def test_two_turn_training_changes_every_adapter_and_logs_per_turn_metrics(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path)
    before = {agent["name"]: lora_params(trainer.model, agent["name"]) for agent in AGENTS}
    trainer.train()
    for agent, params in before.items():
        after = lora_params(trainer.model, agent)
        assert any(not torch.equal(params[n], after[n]) for n in params), f"adapter {agent} did not change"
    logs = trainer.state.log_history[0]
    for key in (
        "turns/0/reward",
        "turns/1/reward",
        "turns/0/return",
        "turns/1/return",
        "turns/1/num_nodes",
        "turns/0/agents/planner/completion_length",
        "turns/1/agents/checker/completion_length",
    ):
        assert key in logs, key
    # the reward adds 0.1 per turn, so the second turn's mean reward is the first's plus about 0.1
    assert logs["turns/1/reward"] > logs["turns/0/reward"]
    assert logs["turns/1/num_nodes"] == 2.0  # one prompt per generation batch: G = 2 joint actions expanded


def test_each_sample_was_prompted_with_what_its_agent_saw_at_that_node(tiny_model_dir, tmp_path):
    shown = []

    def recording_transition(prompt, joint_action, history, turn, **kwargs):
        prompts = [
            f"{agent['name']} reads {joint_action[other['name']]!r}" for agent, other in zip(AGENTS, AGENTS[::-1])
        ]
        shown.append((prompts, dict(joint_action)))
        return prompts

    trainer = make_trainer(tiny_model_dir, tmp_path, transition=recording_transition, max_steps=1)
    counter = RowCounter(trainer)
    trainer.train()
    output = counter.generated[0]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)

    def rendered(agent, prompt):
        conversation = agent_prompt(AGENTS[agent].get("system_prompt", ""), prompt, use_chat_template=True)
        return tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]

    seen = {0: [], 1: []}
    for ids, mask, agent, turn in zip(
        output["prompt_ids"], output["prompt_mask"], output["agent_index"], output["turn_index"]
    ):
        seen[turn.item()].append((agent.item(), ids[mask.bool()].tolist()))
    task = tokenizer.decode(seen[0][0][1])
    prompt = [{"role": "user", "content": next(p for p in PROMPTS if p in task)}]  # the sampler picks the prompt
    assert sorted(seen[0]) == sorted((a, rendered(a, prompt)) for a in (0, 1) for _ in range(2))
    # Turn 1: G rows per child node and agent, each with exactly the prompt the transition gave that agent.
    # The parallel scheduler shows the transition's prompt followed by what the team said at turn 1.
    names = [agent["name"] for agent in AGENTS]
    expected = sorted(
        (a, rendered(a, parallel.observe(a, prompts[a], [said], {}, names)))
        for prompts, said in shown
        for a in (0, 1)
        for _ in range(2)
    )
    assert sorted(seen[1]) == expected
    assert len(shown) == 2


def file_hashes(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in folder.rglob("*")
        if p.is_file()
    }


@pytest.mark.parametrize(
    ("transition", "message"),
    [
        (lambda **kwargs: ["just one prompt"], "returned 1 prompts after turn 0; expected 2 prompts"),
        (lambda **kwargs: 1 / 0, "raised ZeroDivisionError after turn 0"),
    ],
    ids=["wrong-count", "raises"],
)
def test_a_failing_transition_stops_training_with_its_name_and_leaves_checkpoints_intact(
    tiny_model_dir, tmp_path, transition, message
):
    trainer = make_trainer(tiny_model_dir, tmp_path, max_steps=1, save_strategy="steps", save_steps=1)
    trainer.train()
    output_dir = tmp_path / "out"
    before = file_hashes(output_dir)
    assert any(name.startswith("checkpoint-1/") for name in before)

    resumed = make_trainer(
        tiny_model_dir, tmp_path, transition=transition, max_steps=3, save_strategy="steps", save_steps=1
    )
    with pytest.raises(TransitionError, match="Transition '<lambda>'") as error:
        resumed.train(resume_from_checkpoint=str(output_dir / "checkpoint-1"))
    assert message in str(error.value)
    assert file_hashes(output_dir) == before


def test_evaluation_runs_trees_and_reports_per_turn_metrics(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path, per_device_eval_batch_size=2, num_generations_eval=2)
    trainer.eval_dataset = trainer.train_dataset.select(range(2))
    metrics = trainer.evaluate()
    assert metrics["eval_num_samples"] == 2 * 2 * (1 + 2)  # one prompt per batch: 4 root rows, 8 in 2 children
    assert "eval_turns/1/reward" in metrics and "eval_turns/0/return" in metrics


# The default run keeps the tiny-model tree tests (every sample reaches the loss once) and the multi-turn recipe on the
# default model (test_quickstart.py); this one repeats both on the default model, so it runs with the slow set.
@pytest.mark.slow
def test_two_turn_training_on_the_default_model_trains_every_row_of_every_tree(default_model_dir, tmp_path):
    trainer = make_trainer(
        default_model_dir, tmp_path, transition=stop_some_branches, max_completion_length=8, learning_rate=1e-3
    )
    before = {agent["name"]: lora_params(trainer.model, agent["name"]) for agent in AGENTS}
    counter = RowCounter(trainer)
    trainer.train()
    for agent, params in before.items():
        after = lora_params(trainer.model, agent)
        assert any(not torch.equal(params[n], after[n]) for n in params), f"adapter {agent} did not change"
    assert len(counter.trained) == len(counter.generated) == 2
    for output, trained in zip(counter.generated, counter.trained):
        tree_rows = int((~output["is_padding"]).sum())
        assert int((~trained["is_padding"]).sum()) == tree_rows
        assert set(output["turn_index"][~output["is_padding"]].tolist()) <= {0, 1}
    logged = [entry["num_samples"] for entry in trainer.state.log_history if "num_samples" in entry]
    assert logged == [float((~output["is_padding"]).sum()) for output in counter.generated]


def test_padding_loss_scale_by_hand():
    # 2 processes, 12 rows each after padding, 3 micro-batches of 4 rows, 20 real rows in all; this micro-batch holds
    # 1 real row. Per-row types: every real row weighs as in a 20-row generation (P·S·b / R = 2·3·4 / 20)
    settings = dict(rows=4, real_rows=1, total_real_rows=20, num_chunks=3, num_processes=2)
    for loss_type in ("grpo", "sapo", "dr_grpo", "luspo"):
        assert padding_loss_scale(loss_type, **settings) == pytest.approx(24 / 20)
    # bnpo: the micro-batch weighs as its real rows (P·S·r / R = 2·3·1 / 20), not as a full one
    assert padding_loss_scale("bnpo", **settings) == pytest.approx(6 / 20)
    for loss_type in ("dapo", "cispo", "vespo"):  # normalised by the real tokens of the generation: exact already
        assert padding_loss_scale(loss_type, **settings) == 1.0
    no_padding = dict(rows=4, real_rows=4, total_real_rows=24, num_chunks=3, num_processes=2)
    assert all(padding_loss_scale(t, **no_padding) == 1.0 for t in ("grpo", "bnpo", "dr_grpo", "dapo"))
    assert padding_loss_scale("grpo", 4, 0, 0, 3, 2) == 1.0  # nothing trains


@pytest.mark.parametrize("loss_type", ["grpo", "sapo", "dr_grpo", "luspo", "dapo", "bnpo"])
def test_padding_rows_change_neither_the_loss_nor_the_gradient(tiny_model_dir, tmp_path, loss_type):
    trainer = make_trainer(tiny_model_dir, tmp_path, num_turns=1, loss_type=loss_type)
    trainer.model.train()
    batch = [example for example in trainer.train_dataset.select(range(1)) for _ in range(2)]
    real = trainer._generate_and_score_completions(batch)
    real_rows = len(real["advantages"])
    assert not real["is_padding"].any() and real["num_real_rows"].item() == real_rows
    padded = pad_rows(real, real_rows + 3)
    trainer.current_gradient_accumulation_steps = 1

    def loss_and_gradients(inputs):
        trainer.model.zero_grad()
        loss = trainer._compute_loss(trainer.model, inputs)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}

    (loss, grads), (padded_loss, padded_grads) = loss_and_gradients(real), loss_and_gradients(padded)
    torch.testing.assert_close(padded_loss, loss, rtol=1e-5, atol=1e-7)
    assert grads and grads.keys() == padded_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(padded_grads[name], grad, rtol=1e-4, atol=1e-7)


def test_a_padded_tree_batch_carries_the_scale_of_its_real_rows(tiny_model_dir, tmp_path):
    def stop_first_prompt(prompt, joint_action, history, turn, **kwargs):
        return NextTurn(done=True) if "colour" in prompt[-1]["content"] else [prompt[-1]["content"]] * 2

    # 3 prompts per generation, 3 micro-batches: the colour prompt's tree is its root (2 slots x 2 agents = 4 rows),
    # the others grow a turn (4 + 2 children x 4 = 12 rows each): 28 rows, padded to 30
    trainer = make_trainer(
        tiny_model_dir, tmp_path, transition=stop_first_prompt, steps_per_generation=3, loss_type="grpo"
    )
    trainer.model.train()
    prompts = ["Name a colour.", "Name a fruit.", "Count to three."]
    batch = [{"prompt": [{"role": "user", "content": p}]} for p in prompts for _ in range(2)]
    output = trainer._generate_and_score_completions(batch)
    assert int((~output["is_padding"]).sum()) == 28 and len(output["advantages"]) == 30
    assert output["num_real_rows"].item() == 28


def test_a_per_row_loss_with_an_entropy_bonus_is_refused_for_trees(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match=r"loss_type='grpo'.*num_turns=2.*entropy bonus.*loss_type='dapo'"):
        make_trainer(tiny_model_dir, tmp_path, loss_type="grpo", entropy_coef=0.01)


@pytest.mark.parametrize("loss_type", ["grpo", "sapo", "dr_grpo", "luspo", "bnpo", "dapo", "cispo", "vespo"])
def test_padding_rows_spread_unevenly_over_micro_batches_leave_the_step_gradient_exact(
    tiny_model_dir, tmp_path, loss_type
):
    """A generation of 4 real rows padded to 6 and split into 2 micro-batches of one optimizer step, {r0 r1 r2} and
    {r3 pad pad}: the step's gradient is that of the 4 real rows as one unpadded micro-batch (for bnpo, a
    per-micro-batch token mean: its two micro-batches unpadded, weighted by their real rows, 3/4 and 1/4)."""
    trainer = make_trainer(tiny_model_dir, tmp_path, num_turns=1, loss_type=loss_type)
    trainer.model.train()
    batch = [example for example in trainer.train_dataset.select(range(1)) for _ in range(2)]
    real = trainer._generate_and_score_completions(batch)
    assert len(real["advantages"]) == 4 and real["advantages"].abs().sum() > 0

    def rows(indices):
        return {k: v[indices] if isinstance(v, torch.Tensor) and v.ndim > 0 else v for k, v in real.items()}

    def step_gradient(micro_batches, steps_per_generation, weights):
        trainer.args.steps_per_generation = trainer.current_gradient_accumulation_steps = steps_per_generation
        trainer.model.zero_grad()
        for inputs, weight in zip(micro_batches, weights):
            (weight * trainer._compute_loss(trainer.model, inputs)).backward()
        return {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}

    padded = split_tensor_dict(pad_rows(real, 6), 2)
    assert padded[1]["is_padding"].tolist() == [False, True, True]
    gradient = step_gradient(padded, 2, [1.0, 1.0])
    if loss_type == "bnpo":
        pieces = [rows([0, 1, 2]), rows([3])]
        for piece in pieces:
            piece["num_real_rows"] = torch.tensor(len(piece["advantages"]))
        expected = step_gradient(pieces, 1, [3 / 4, 1 / 4])
    else:
        expected = step_gradient([real], 1, [1.0])
    assert expected and gradient.keys() == expected.keys()
    assert any(g.abs().sum() > 0 for g in expected.values())
    for name, grad in expected.items():
        torch.testing.assert_close(gradient[name], grad, rtol=1e-4, atol=1e-7)
