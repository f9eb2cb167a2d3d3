"""Routing held in tensors (`trl_marl.generation.tensor_routing`), as the captured decode step reads it: layers that
read one input share their LoRA matmuls, a call on one adapter reads that adapter alone with no mask, and both give
the logits and tokens of the ordinary routing, with the kernels counted."""

from collections import Counter

import pytest
import torch
from peft import LoraConfig, get_peft_model
from test_captured_decode import NAMES, emulate_recording, generate_both, left_padded, tiny_base, tiny_team
from torch.utils._python_dispatch import TorchDispatchMode

from trl_marl.generation.captured_decode import CapturedDecoder
from trl_marl.generation.routing import AdapterRouter
from trl_marl.generation.tensor_routing import TensorRouting

# The tiny team's decoder layers (2) each have seven LoRA linears: q, k, v, o, gate, up, down; plus an untargeted head.
LAYERS, LINEARS = 2, 7


class CountOps(TorchDispatchMode):
    """Counts the aten operations run inside the block."""

    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


def routed_logits(team, router, adapters, input_ids):
    """The ordinary (hook) routing's logits."""
    router.route(adapters)
    try:
        with torch.no_grad():
            return team(input_ids).logits
    finally:
        router.route(None)


def counted_forward(team, input_ids):
    with torch.no_grad(), CountOps() as ops:
        logits = team(input_ids).logits
    return logits, ops.counts


def test_layers_reading_one_input_share_their_matmuls_and_one_adapter_needs_no_mask():
    team = tiny_team(2)
    router = AdapterRouter(team, NAMES[:2])
    input_ids = torch.randint(3, 100, (4, 5), generator=torch.Generator().manual_seed(0))
    mixed = ["a", "b", "a", "b"]
    one_token = input_ids[:, :1]  # a decode step's shape: a prefill's tokens keep one delta per layer (below)
    with router.tensor_routing(mixed):
        unfused, before = counted_forward(team, one_token)
        assert router.fuse_shared_inputs() and not router.fuse_shared_inputs()  # once
        fused, after = counted_forward(team, one_token)
        prefill, prefill_ops = counted_forward(team, input_ids)
    groups = [[layer for layer in group.layers] for group in router._tensor_routing.groups]
    names = {layer: name.rsplit(".", 1)[-1] for name, layer in team.named_modules() if name.endswith("proj")}
    assert [[names[layer] for layer in group] for group in groups] == [
        ["q_proj", "k_proj", "v_proj"],
        ["o_proj"],
        ["gate_proj", "up_proj"],
        ["down_proj"],
    ] * LAYERS
    with router.tensor_routing(["b"] * 4):
        assert router.tensor_routing_mode == "single"
        single, alone = counted_forward(team, one_token)
    assert router.tensor_routing_mode == "unrouted"

    reference = routed_logits(team, router, mixed, one_token)
    assert torch.equal(unfused, reference)
    torch.testing.assert_close(fused, reference, rtol=0, atol=1e-5)
    torch.testing.assert_close(prefill, routed_logits(team, router, mixed, input_ids), rtol=0, atol=1e-5)
    torch.testing.assert_close(single, routed_logits(team, router, ["b"] * 4, one_token), rtol=0, atol=1e-5)
    # matmuls: per layer 7 base + 7 A + 7 B unfused; 7 base + 4 groups x (A, B) fused; plus the head
    assert before["aten.mm.default"] == prefill_ops["aten.mm.default"] == LAYERS * 3 * LINEARS + 1 == 43
    assert after["aten.mm.default"] == alone["aten.mm.default"] == LAYERS * (LINEARS + 4 * 2) + 1 == 31
    # the mask: one multiply per layer unfused, one per group fused, none on one adapter
    assert before["aten.mul.Tensor"] - after["aten.mul.Tensor"] == LAYERS * (LINEARS - 4)
    assert after["aten.mul.Tensor"] - alone["aten.mul.Tensor"] == LAYERS * 4


def test_a_grouped_layer_handed_another_input_computes_its_own_delta():
    team = tiny_team(2)
    router = AdapterRouter(team, NAMES[:2])
    attention = team.base_model.model.model.layers[0].self_attn
    x, other = torch.randn(2, 3, 32), torch.randn(2, 3, 32)
    with torch.no_grad():
        router.route(["a", "b"])
        expected = attention.k_proj(other)
        router.route(None)
        with router.tensor_routing(["a", "b"]):
            team(torch.ones(2, 3, dtype=torch.long))
            router.fuse_shared_inputs()
            attention.q_proj(x)  # the group's deltas for x, kept for k and v
            torch.testing.assert_close(attention.k_proj(other), expected, rtol=0, atol=1e-6)


def test_layers_with_lora_dropout_are_never_grouped():
    team = tiny_team(1)
    team.add_adapter("dropping", LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.5))
    router = AdapterRouter(team, ["dropping"])
    with torch.no_grad(), router.tensor_routing(["dropping"] * 2):
        team(torch.ones(2, 3, dtype=torch.long))
        assert router.fuse_shared_inputs()
    assert {len(group.layers) for group in router._tensor_routing.groups} == {1}


def test_one_adapter_calls_replay_one_recording_whichever_agent_and_never_a_mixed_calls(monkeypatch):
    recorded = emulate_recording(monkeypatch)
    team = tiny_team(2)
    router = AdapterRouter(team, NAMES[:2])
    decoder = CapturedDecoder(team, router, path="cuda-graphs")
    addresses = []
    for call, adapters in enumerate((["a"] * 6, ["b"] * 6, ["a", "b"] * 3, ["b"] * 6, ["a", "b"] * 3)):
        eager, captured = generate_both(team, router, decoder, adapters, *left_padded(6, 7, seed=call))
        assert torch.equal(eager, captured), adapters
        group = router._tensor_routing.groups[0]
        if router._tensor_routing.mode == "single":  # the last call's
            addresses.append((group.lora_a.data_ptr(), group.lora_b.data_ptr()))
    # one recording per mode: agent b's calls replay agent a's graph, on the same buffers (its weights copied in)
    assert len(recorded) == 2 and set(decoder._recorded) == {(8, 256, "single"), (8, 256, "mixed")}
    assert len(set(addresses)) == 1 and len(addresses) == 3


def test_the_first_forward_keeps_no_layers_input_alive_to_group_them():
    """Grouping compares each layer's input with its group's: only that one input is held, so the first prefill
    frees each layer's input as an ordinary forward does."""
    import gc
    import weakref

    team = tiny_team(2)
    router = AdapterRouter(team, NAMES[:2])
    first_attention_input = []
    attention = team.base_model.model.model.layers[0].self_attn
    hook = attention.q_proj.register_forward_pre_hook(
        lambda module, args: first_attention_input.append(weakref.ref(args[0]))
    )
    with torch.no_grad(), router.tensor_routing(["a", "b"]):
        team(torch.ones(2, 9, dtype=torch.long))
        gc.collect()
        assert first_attention_input[0]() is None  # freed before the grouping ran
        assert router.fuse_shared_inputs()
    hook.remove()
    assert [len(group.layers) for group in router._tensor_routing.groups] == [3, 1, 2, 1] * LAYERS


def test_agents_of_different_ranks_share_one_agents_buffers_and_recording(monkeypatch):
    recorded = emulate_recording(monkeypatch)
    team = tiny_team(1)
    team.add_adapter("wide", LoraConfig(r=8, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))
    router = AdapterRouter(team, ["a", "wide"])
    decoder = CapturedDecoder(team, router, path="cuda-graphs")
    versions = []
    for call, adapter in enumerate(("a", "wide", "a", "wide")):
        eager, captured = generate_both(team, router, decoder, [adapter] * 6, *left_padded(6, 7, seed=call))
        assert torch.equal(eager, captured), adapter
        versions.append(router._tensor_routing.versions["single"])
    assert len(set(versions)) == 1 and len(recorded) == 1  # rank 4 padded with zeros to 8: no new buffers


def test_a_call_without_routing_never_replays_a_routed_recording(monkeypatch):
    recorded = emulate_recording(monkeypatch)
    team = tiny_team(2)
    router = AdapterRouter(team, NAMES[:2])
    decoder = CapturedDecoder(team, router, path="cuda-graphs")
    input_ids, attention_mask = left_padded(6, 7, seed=0)
    generate_both(team, router, decoder, ["a"] * 6, input_ids, attention_mask)
    team.set_adapter("b")
    for adapters in (None, None):  # PEFT's active adapter, no routing: its own recording, replayed the second time
        eager, captured = generate_both(team, None, decoder, adapters, input_ids, attention_mask)
        assert torch.equal(eager, captured)
    assert set(decoder._recorded) == {(8, 256, "single"), (8, 256, "unrouted:b")} and len(recorded) == 2


@pytest.mark.parametrize(
    "lora",
    [
        dict(target_modules=["q_proj", "v_proj"]),  # PEFT's default for Llama
        dict(target_modules=["q_proj", "k_proj", "v_proj"]),
        dict(target_modules="all-linear", rank_pattern={"q_proj": 8}),
    ],
    ids=["q_v", "q_k_v", "rank_pattern"],
)
def test_a_mixed_call_larger_than_the_first_decodes_after_the_layers_were_grouped(lora):
    """Grouping replaces the layers' rank layouts: the masks of the layouts before it are dropped, not refilled at
    the first call's row count (a later call of more rows crashed on them)."""
    config = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **lora)
    team = get_peft_model(tiny_base(), config, adapter_name="a")
    team.add_adapter("b", config)
    router = AdapterRouter(team, ["a", "b"])
    decoder = CapturedDecoder(team, router, path="static")
    for call, rows in enumerate((6, 12, 20, 6)):
        eager, captured = generate_both(team, router, decoder, ["a", "b"] * (rows // 2), *left_padded(rows, 7, call))
        assert torch.equal(eager, captured), rows
    used = {group.columns for group in router._tensor_routing.groups}
    assert {columns for columns, _, _ in router._tensor_routing.masks} == used


def test_when_the_routing_buffers_cannot_be_refreshed_the_fallback_answers_through_each_rows_adapter(monkeypatch):
    """The default decoder falls back to eager `generate` when the captured step fails; a failure while the routing
    is being moved into tensors must leave the rows routed, so the fallback gives the routed answer."""
    team = tiny_team(2)
    router = AdapterRouter(team, NAMES[:2])
    decoder = CapturedDecoder(team, router, path="static", fall_back=True)
    rows = left_padded(6, 7, seed=3)
    adapters = ["a", "b"] * 3

    def failing_refresh(self, row_index, rows=None):
        raise RuntimeError("refresh failed")

    monkeypatch.setattr(TensorRouting, "refresh", failing_refresh)
    eager, fell_back = generate_both(team, router, decoder, adapters, *rows)
    assert decoder.failure == "RuntimeError: refresh failed"
    assert torch.equal(fell_back, eager)
    unrouted = generate_both(team, None, decoder, None, *rows)[0]
    assert not torch.equal(unrouted, eager)  # the check can fail: PEFT's active adapter alone answers otherwise
