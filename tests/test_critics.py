"""Critics as LoRA adapters on the team's base (`trl_marl.critics`): their names, the value head's reading of a padded
batch, and a critic trained on a fixed return reaching it while the base stays frozen."""

import pytest
import torch
from peft import get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_marl.agents import agent_lora_config
from trl_marl.critics import ValueHead, attach_critics, critic_adapter_names


def test_iac_has_a_critic_per_agent_maac_one_and_a_clashing_agent_name_is_refused_by_name():
    assert critic_adapter_names(["writer", "checker"], "iac") == ["critic_writer", "critic_checker"]
    assert critic_adapter_names(["writer", "checker"], "maac") == ["critic"]
    with pytest.raises(ValueError, match=r"\['critic'\].*rename the agent"):
        critic_adapter_names(["critic", "writer"], "maac")
    with pytest.raises(ValueError, match="Unknown critic kind 'mappo'"):
        critic_adapter_names(["writer"], "mappo")


def test_the_value_head_reads_each_rows_last_attended_token_whichever_side_it_is_padded():
    torch.manual_seed(0)
    head = ValueHead(4)
    assert torch.equal(head.linear.bias, torch.zeros(1)) and head.linear.weight.shape == (1, 4)
    hidden = torch.randn(3, 5, 4, dtype=torch.bfloat16)
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])  # left-padded, right-padded, none
    weight = head.linear.weight[0].detach()
    expected = torch.stack(
        [hidden[0, 4].float() @ weight, hidden[1, 2].float() @ weight, hidden[2, 4].float() @ weight]
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as under `bf16=True`: the value stays float32
        values = head(hidden, mask)
    assert values.dtype == torch.float32 and torch.allclose(values, expected, atol=1e-6)
    with pytest.raises(ValueError, match="all zeros"):
        head(hidden, torch.tensor([[0, 0, 1, 1, 1], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]]))


def test_attaching_critics_keeps_every_agents_adapter_trainable_and_adds_theirs(tiny_model_dir):
    from trl_marl.agents import attach_agent_adapters

    config = agent_lora_config(4, 8, 0.0, "all-linear")
    model = attach_agent_adapters(AutoModelForCausalLM.from_pretrained(tiny_model_dir), ["writer", "checker"], config)
    names = critic_adapter_names(["writer", "checker"], "iac")
    heads = attach_critics(model, names, config, model.config.hidden_size)
    assert sorted(heads) == sorted(names) and model.peft_config.keys() == {"writer", "checker", *names}
    for adapter in ("writer", "checker", *names):
        weights = [p for path, p in model.named_parameters() if f".{adapter}." in path]
        assert weights and all(p.requires_grad for p in weights), adapter
    assert not any(p.requires_grad for path, p in model.named_parameters() if "lora_" not in path)  # the base


def test_a_critic_trained_on_a_fixed_return_reaches_it_and_moves_only_its_adapter_and_head(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = agent_lora_config(4, 8, 0.0, "all-linear")
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), config, adapter_name="writer")
    heads = attach_critics(model, ["critic"], config, model.config.hidden_size)
    assert model.peft_config.keys() == {"writer", "critic"}
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    model.set_adapter("critic")
    trained = [p for name, p in model.named_parameters() if ".critic." in name]
    assert trained and all(p.requires_grad for p in trained)
    optimizer = torch.optim.Adam([*trained, *heads.parameters()], lr=2e-2)
    batch = tokenizer(["Two plus two?", "Name a colour, please."], return_tensors="pt", padding=True)
    returns = torch.tensor([0.7, -0.3])  # each text's fixed return
    torch.manual_seed(0)
    for _ in range(150):
        hidden = model(**batch, output_hidden_states=True).hidden_states[-1]
        loss = torch.nn.functional.mse_loss(heads["critic"](hidden, batch["attention_mask"]), returns)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        values = heads["critic"](model(**batch, output_hidden_states=True).hidden_states[-1], batch["attention_mask"])
    assert torch.allclose(values, returns, atol=0.02), values
    moved = {name for name, p in model.named_parameters() if not torch.equal(p, before[name])}
    assert moved and all(".critic." in name for name in moved)  # not the base, not the agent's adapter
