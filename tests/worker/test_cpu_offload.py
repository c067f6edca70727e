"""WeightOffloader (cpu_offload_gb) in the fake-device mode on CPU: which layers, the ring's slots, the prefetch
order, the bytes each layer computes from, and outputs unchanged."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from hayabusa.errors import HayabusaValidationError
from hayabusa.worker.cpu_offload import WeightOffloader, choose_offload_layers, decoder_layers, spread_layers


def test_spread_layers_and_choice():
    assert spread_layers(1, 4) == [2]
    assert spread_layers(2, 4) == [1, 3]
    assert spread_layers(14, 28) == list(range(1, 28, 2))      # half: every odd layer
    assert spread_layers(5, 5) == [0, 1, 2, 3, 4]
    assert spread_layers(3, 10) == [1, 5, 8]
    # the fewest spread layers whose bytes reach the budget
    assert choose_offload_layers([10] * 6, 0) == []
    assert choose_offload_layers([10] * 6, 1) == [3]
    assert choose_offload_layers([10] * 6, 20) == [1, 4]
    assert choose_offload_layers([10] * 6, 21) == [1, 3, 5]
    assert choose_offload_layers([10, 10, 10, 50], 50) == [1, 3]   # bytes of the chosen layers, not a count
    assert choose_offload_layers([10] * 6, 10**9) == [0, 1, 2, 3, 4, 5]   # more than the model: every layer


class Block(nn.Module):
    """A layer with a contiguous float weight, a transposed (non-contiguous) one, an int8 one and a bias."""

    def __init__(self, i: int, d: int = 8) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(i)
        self.w = nn.Parameter(torch.randn(d, d, generator=g) / d ** 0.5, requires_grad=False)
        self.wt = nn.Parameter((torch.randn(d, d, generator=g) / d ** 0.5).t(), requires_grad=False)
        self.q = nn.Parameter(torch.randint(-8, 8, (d, d), generator=g, dtype=torch.int8), requires_grad=False)
        self.b = nn.Parameter(torch.randn(d, generator=g), requires_grad=False)

    def forward(self, x):
        return torch.tanh(x @ self.w + x @ self.wt + x @ self.q.float() / 8 + self.b)


class Stack(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.embed = nn.Parameter(torch.randn(8), requires_grad=False)
        self.layers = nn.ModuleList(Block(i) for i in range(n))

    def forward(self, x):
        x = x + self.embed
        for layer in self.layers:
            x = layer(x)
        return x


# a Block packed: each tensor padded to 256 bytes (8x8 fp32 = 256, 8x8 fp32 = 256, 8x8 int8 = 64, 8 fp32 = 32)
LAYER_BYTES = 4 * 256


@pytest.mark.parametrize("num_slots", [1, 2, 3])
def test_outputs_unchanged_and_weights_live_in_the_ring(num_slots):
    torch.manual_seed(0)
    model = Stack(5)
    x = torch.randn(3, 8)
    want = model(x)
    off = WeightOffloader(model, 3 * LAYER_BYTES, torch.device("cpu"), fake=True, num_slots=num_slots,
                          trace=True)
    assert off.layer_indices == [0, 2, 4]
    assert off.offloaded_bytes == 3 * 1024 and off.ring_bytes == num_slots * 1024
    for o, i in enumerate(off.layer_indices):   # every parameter of an offloaded layer is a view into its slot
        slot = off.slots[o % num_slots]
        lo, hi = slot.data_ptr(), slot.data_ptr() + slot.numel()
        for p in model.layers[i].parameters():
            assert lo <= p.data_ptr() < hi
    in_ring = [(s.data_ptr(), s.data_ptr() + s.numel()) for s in off.slots]
    for i in (1, 3):                                                   # resident layers stay where they were
        assert not any(lo <= p.data_ptr() < hi for p in model.layers[i].parameters() for lo, hi in in_ring)
    assert model.layers[0].wt.stride() == (1, 8)                       # strides kept
    for _ in range(2):                                                 # forwards reuse the ring
        assert torch.equal(model(x), want)


def test_prefetch_order_and_slot_reuse():
    model = Stack(5)
    x = torch.randn(2, 8)
    want = model(x)
    off = WeightOffloader(model, 10**9, torch.device("cpu"), fake=True, trace=True)
    assert off.layer_indices == [0, 1, 2, 3, 4] and off.num_slots == 2
    seen = []

    def check(m, args, i):   # runs after the offloader's pre hook: the layer's own bytes are in its slot
        pl = next(p for p in off.packed if p.index == i)
        seen.append((i, pl.slot, torch.equal(off.slots[pl.slot][: pl.nbytes], pl.host)))

    for i, layer in enumerate(model.layers):
        layer.register_forward_pre_hook(lambda m, a, i=i: check(m, a, i))
    assert torch.equal(model(x), want)
    # layer i+1 is copied before layer i computes; a slot is refilled only after the layer that used it
    assert off.trace == [("copy", 0, 0), ("copy", 1, 1),
                         ("compute", 0, 0), ("copy", 2, 0),
                         ("compute", 1, 1), ("copy", 3, 1),
                         ("compute", 2, 0), ("copy", 4, 0),
                         ("compute", 3, 1),
                         ("compute", 4, 0)]
    assert seen == [(0, 0, True), (1, 1, True), (2, 0, True), (3, 1, True), (4, 0, True)]
    off.trace.clear()
    assert torch.equal(model(x), want)
    assert [t for t in off.trace if t[0] == "copy"] == [("copy", i, i % 2) for i in range(5)]


def test_budget_larger_than_the_model_offloads_all_and_says_so(caplog):
    model = Stack(3)
    with caplog.at_level(logging.INFO, logger="hayabusa.worker.cpu_offload"):
        off = WeightOffloader(model, 1 << 30, torch.device("cpu"), fake=True)
    assert off.layer_indices == [0, 1, 2]
    assert any("3 of 3 decoder layers" in r.getMessage() and "all of them are offloaded" in r.getMessage()
               and r.levelno == logging.WARNING for r in caplog.records)


def test_shared_parameters_stay_resident():
    model = Stack(2)
    model.layers[1].b = model.layers[0].b       # one tensor in two layers: neither may move it
    before = model.layers[0].b.data_ptr()
    off = WeightOffloader(model, 10**9, torch.device("cpu"), fake=True)
    assert model.layers[0].b.data_ptr() == before
    assert off.offloaded_bytes == 2 * 3 * 256


def test_a_model_without_a_decoder_stack_is_refused():
    with pytest.raises(HayabusaValidationError) as e:
        decoder_layers(nn.Sequential(nn.Linear(2, 2)))
    assert e.value.parameter == "cpu_offload_gb"
