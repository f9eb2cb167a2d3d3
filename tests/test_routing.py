"""AdapterRouter: each row of one forward goes through its own adapter, on the batched path and on PEFT's path."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from trl_marl.generation.routing import BASE, AdapterRouter, check_sharding_routable

ROWS = ["left", "right", "right", "left"]


def two_adapter_model(model_dir, right_rank, right_dropout=0.0):
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    lora = dict(target_modules=["q_proj", "v_proj", "down_proj"], task_type="CAUSAL_LM")
    model = get_peft_model(base, LoraConfig(r=2, **lora), adapter_name="left")
    model.add_adapter("right", LoraConfig(r=right_rank, lora_alpha=16, lora_dropout=right_dropout, **lora))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator))
    model.set_requires_grad(["left", "right"], requires_grad=True)
    return model.eval()  # dropout off, so that outputs can be compared (gradients still flow)


def per_adapter_reference(model, input_ids):
    """Row by row, with PEFT's own single active adapter: what routing must reproduce."""
    logits = []
    for row, adapter in enumerate(ROWS):
        model.set_adapter(adapter)
        logits.append(model(input_ids=input_ids[row : row + 1]).logits)
    model.set_requires_grad(["left", "right"], requires_grad=True)
    return torch.cat(logits)


@pytest.mark.parametrize(
    ("right_rank", "right_dropout", "zero3", "batched"),
    [(2, 0.0, False, True), (4, 0.0, False, True), (2, 0.1, False, False), (2, 0.0, True, False)],
    ids=["batched", "batched-different-ranks", "peft-mixed-batch-different-dropouts", "peft-mixed-batch-zero3"],
)
def test_routed_forward_and_gradients_equal_per_adapter_forwards(
    tiny_model_dir, monkeypatch, right_rank, right_dropout, zero3, batched
):
    """Under DeepSpeed ZeRO-3 a parameter is gathered only while its own module runs: the batched path reads the
    adapters' weights without running their modules, so every layer takes PEFT's path, which runs them."""
    monkeypatch.setattr("trl_marl.generation.routing.is_deepspeed_zero3_enabled", lambda: zero3)
    model = two_adapter_model(tiny_model_dir, right_rank, right_dropout)
    router = AdapterRouter(model, ["left", "right"])
    plain_layers = [m for m in model.modules() if hasattr(m, "lora_A") and router._is_plain_lora(m)]
    assert bool(plain_layers) == batched
    input_ids = torch.randint(100, 1000, (4, 6))

    expected = per_adapter_reference(model, input_ids)
    expected.square().mean().backward()
    expected_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()

    router.route(ROWS)
    routed = model(input_ids=input_ids).logits
    routed.square().mean().backward()
    torch.testing.assert_close(routed, expected, rtol=1e-5, atol=1e-5)
    assert set(expected_grads) == {n for n, p in model.named_parameters() if p.grad is not None}
    for name, grad in expected_grads.items():
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, grad, rtol=1e-4, atol=1e-6)


def test_disabled_adapters_and_cleared_routing_leave_peft_in_charge(tiny_model_dir):
    model = two_adapter_model(tiny_model_dir, right_rank=2)
    router = AdapterRouter(model, ["left", "right"])
    input_ids = torch.randint(100, 1000, (4, 6))
    with torch.no_grad():
        with model.disable_adapter():
            base = model(input_ids=input_ids).logits
        router.route(ROWS)
        with model.disable_adapter():  # TRL's reference model: the base, whatever the routing
            torch.testing.assert_close(model(input_ids=input_ids).logits, base)
        router.route(None)
        model.set_adapter("right")
        right = model(input_ids=input_ids).logits
    assert not torch.allclose(right, base)
    with pytest.raises(ValueError, match=r"\['middle'\]"):
        router.route(["middle"] * 4)


def test_rows_routed_to_the_base_get_the_base_output_and_leave_requires_grad_alone(tiny_model_dir):
    model = two_adapter_model(tiny_model_dir, right_rank=4)
    router = AdapterRouter(model, ["left", "right"])
    input_ids = torch.randint(100, 1000, (4, 6))
    with torch.no_grad(), model.disable_adapter():
        base = model(input_ids=input_ids).logits
    model.set_requires_grad(["left", "right"], requires_grad=True)  # disable_adapter's exit froze "right"
    expected_right = per_adapter_reference(model, input_ids)[1:3]

    router.route([BASE, "right", "right", BASE])
    mixed = model(input_ids=input_ids).logits
    router.route([BASE] * 4)
    with torch.no_grad():
        only_base = model(input_ids=input_ids).logits
    torch.testing.assert_close(mixed[[0, 3]], base[[0, 3]], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mixed[1:3], expected_right, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(only_base, base, rtol=1e-5, atol=1e-5)
    assert all(p.requires_grad for n, p in model.named_parameters() if "lora_" in n)


def test_rows_of_one_adapter_skip_the_other_adapters_work_and_match_peft(tiny_model_dir):
    model = two_adapter_model(tiny_model_dir, right_rank=4)
    router = AdapterRouter(model, ["left", "right"])
    concatenations = []
    concatenated = router._concatenated
    router._concatenated = lambda layer: concatenations.append(layer) or concatenated(layer)
    input_ids = torch.randint(100, 1000, (3, 6))
    model.set_adapter("right")
    with torch.no_grad():
        expected = model(input_ids=input_ids).logits
    model.set_requires_grad(["left", "right"], requires_grad=True)

    router.route(["right"] * 3)
    routed = model(input_ids=input_ids).logits
    assert concatenations == [], "one adapter's rows must not compute the other adapters' projections"
    torch.testing.assert_close(routed, expected, rtol=0, atol=0)  # PEFT's own single-adapter arithmetic
    routed.square().mean().backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if ".right." in n)
    assert all(p.grad is None for n, p in model.named_parameters() if ".left." in n)

    router.route(["right", "left", "right"])
    model(input_ids=input_ids)
    assert concatenations, "a mixed batch takes the concatenated path"


def test_routing_tensors_are_built_on_the_adapters_device(tiny_model_dir):
    # The meta device stands in for an accelerator: a tensor built on the host would say "cpu".
    model = two_adapter_model(tiny_model_dir, right_rank=4).to("meta")
    router = AdapterRouter(model, ["left", "right"])
    router.route(ROWS)
    assert router._row_index.device.type == "meta"
    layer = next(m for m in model.modules() if hasattr(m, "lora_A") and router._is_plain_lora(m))
    assert router._mask(layer, torch.device("meta"), torch.float32).device.type == "meta"
    output = model(input_ids=torch.zeros(4, 3, dtype=torch.long, device="meta")).logits
    assert output.device.type == "meta" and output.shape[:2] == (4, 3)


@pytest.mark.parametrize("sharding", ["FSDP", "DeepSpeed ZeRO-3"])
def test_several_adapters_are_refused_under_sharded_parameters_and_one_is_not(sharding):
    """Every process gathers a sharded module together; processes whose rows go to different agents would run
    different adapters' modules (pairing one's weights with another's, or waiting forever)."""
    with pytest.raises(ValueError, match=rf"A team of 2 adapters cannot train under {sharding}.*'shared'"):
        check_sharding_routable(2, sharding)
    check_sharding_routable(1, sharding)
    check_sharding_routable(3, None)
