"""The PEFT internals the adapter router reads: present in the installed release, pinned in pyproject, and a clear
error naming what moved when a release moves one."""

import re
from pathlib import Path

import peft
import pytest
import torch
from packaging.specifiers import SpecifierSet
from peft import LoraConfig, get_peft_model

from trl_marl.generation.routing import PEFT_TESTED, AdapterRouter, check_peft_internals, missing_peft_internals

REPO = Path(__file__).resolve().parents[1]


class TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(4, 8)
        self.down = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def two_adapter_model():
    model = get_peft_model(TwoLayers(), LoraConfig(r=2, target_modules=["up", "down"]), adapter_name="writer")
    model.add_adapter("editor", LoraConfig(r=2, target_modules=["up", "down"]))
    return model


def test_the_installed_peft_has_every_internal_the_router_reads_and_is_in_the_tested_range():
    assert missing_peft_internals(two_adapter_model()) == []
    assert peft.__version__ in SpecifierSet(PEFT_TESTED)


def test_pyproject_pins_peft_to_the_tested_range():
    (pin,) = re.findall(r'^\s*"peft([^"]*)"', (REPO / "pyproject.toml").read_text(), flags=re.MULTILINE)
    assert SpecifierSet(pin) == SpecifierSet(PEFT_TESTED)
    assert any(spec.operator == "<" for spec in SpecifierSet(PEFT_TESTED))  # an upper bound


def test_a_moved_internal_is_an_error_naming_it_the_release_and_the_tested_range():
    model = two_adapter_model()
    for layer in (model.base_model.model.up, model.base_model.model.down):
        del layer.scaling  # as if a PEFT release renamed it
    message = rf"peft {re.escape(peft.__version__)} does not have: LoraLayer\.scaling\. .*peft{re.escape(PEFT_TESTED)}"
    with pytest.raises(RuntimeError, match=message):
        check_peft_internals(model)
    with pytest.raises(RuntimeError, match=message):  # before any hook is installed
        AdapterRouter(model, ["writer", "editor"])


def test_a_forward_without_adapter_names_is_named():
    model = two_adapter_model()
    layer = model.base_model.model.up

    def forward(self, x):  # a LoRA layer whose forward no longer takes PEFT's mixed-batch argument
        return self.base_layer(x)

    layer_class = type(layer)
    original = layer_class.forward
    try:
        layer_class.forward = forward
        assert missing_peft_internals(model) == [f"{layer_class.__name__}.forward(..., adapter_names=...)"]
    finally:
        layer_class.forward = original
