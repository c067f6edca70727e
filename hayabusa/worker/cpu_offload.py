"""``cpu_offload_gb``: whole decoder layers' weights live in (pinned) CPU memory and stream to the GPU each forward.

Which layers: the fewest whole decoder layers whose weights reach ``cpu_offload_gb`` GiB (vLLM's meaning: that many
GiB of weights per GPU in CPU memory; more than the model has offloads every layer, logged), spread evenly over the
stack (``spread_layers``): layer ``floor((2j + 1) L / 2n)`` for j < n. Evenly spread rather than the last n: a
slot is free once the offloaded layer that used it is done, and the copy into it must land before the next user
runs; between two offloaded layers the resident layers compute, so the copy has their compute to hide behind.
With the last n layers contiguous each copy would have one layer's compute at most.

How: each offloaded layer's parameters (after loading and quantization: the stored, packed tensors, so a
quantized model moves fewer bytes) are packed into one CPU byte buffer, each tensor at a 256-byte aligned offset
with its own shape and strides. The GPU holds a ring of ``NUM_SLOTS`` (2) byte buffers of the largest layer's
size; offloaded layer number o (in stack order) always runs from slot ``o % S``, so its parameters are rebound
once, for good, to views into that slot (fixed addresses: CUDA graphs capture the copies and replay them). Per
forward, on a side stream:

    model start:          copy layers 0 .. S-1 into slots 0 .. S-1 (after the work queued before the forward)
    before layer o:       the compute stream waits for copy o (and for nothing else)
    after layer o:        record "o done"; copy layer o + S into slot o % S after "o done"

so layer o + 1 is copied while layer o computes. The model code knows nothing of this: forward pre / post hooks
on the layers and a pre hook on the model, installed by the runner (``ModelRunner`` after ``build_model``).

On a CPU device the option changes nothing (the weights are in CPU memory already), except in the test-only
fake-device mode (``HAYABUSA_FAKE_DEVICE_OFFLOAD=1``, or ``fake=True``): the same packing, ring, rebinding and
prefetch order, the copies between two CPU tensors, done at once, events no-ops. ``trace`` then records which
layer is copied into which slot and when each layer computes from which slot.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch
from torch import nn

logger = logging.getLogger(__name__)

NUM_SLOTS = 2          # GPU ring buffers: one layer computing, the next one arriving
ALIGN = 256            # bytes; every tensor in a packed layer starts at a multiple of this
FAKE_ENV = "HAYABUSA_FAKE_DEVICE_OFFLOAD"
GiB = 1 << 30


def fake_device_offload() -> bool:
    """The test-only fake-device mode is on (``HAYABUSA_FAKE_DEVICE_OFFLOAD=1``)."""
    return os.environ.get(FAKE_ENV, "") not in ("", "0")


def spread_layers(n: int, num_layers: int) -> list[int]:
    """n layer indices of 0 .. num_layers-1 spread evenly: ``floor((2j + 1) * L / (2n))``, j < n (distinct,
    increasing; n = L gives every layer; n = L / 2 every odd one)."""
    assert 0 <= n <= num_layers
    return [(2 * j + 1) * num_layers // (2 * n) for j in range(n)]


def choose_offload_layers(layer_bytes: list[int], budget_bytes: int) -> list[int]:
    """The fewest evenly spread layers whose bytes reach ``budget_bytes`` (every layer when the model has less).

    Args:
        layer_bytes: [L] bytes of each decoder layer's offloadable weights.
        budget_bytes: cpu_offload_gb in bytes.
    Returns:
        Increasing layer indices ([] for a budget <= 0).
    """
    L = len(layer_bytes)
    if budget_bytes <= 0 or L == 0:
        return []
    for n in range(1, L + 1):
        idx = spread_layers(n, L)
        if sum(layer_bytes[i] for i in idx) >= budget_bytes:
            return idx
    return list(range(L))


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _span_bytes(t: torch.Tensor) -> int:
    """Bytes from a tensor's first element to its last one + 1 under its strides (its storage footprint)."""
    if t.numel() == 0:
        return 0
    return (1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))) * t.element_size()


@dataclass
class _Entry:
    param: nn.Parameter
    offset: int                  # bytes into the packed layer
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class _PackedLayer:
    index: int                   # the layer's index in the decoder stack
    slot: int                    # ring slot it always runs from
    entries: list[_Entry] = field(default_factory=list)
    nbytes: int = 0
    host: torch.Tensor | None = None   # [nbytes] uint8, pinned on CUDA


def _view(buf: torch.Tensor, e: _Entry) -> torch.Tensor:
    """``e``'s tensor inside the uint8 buffer ``buf`` (same shape, strides, dtype; ``buf``'s length is a
    multiple of ALIGN, so it views as any dtype)."""
    return buf.view(e.dtype).as_strided(e.shape, e.stride, e.offset // e.dtype.itemsize)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder stack of a decoder-only model: the ``nn.ModuleList`` named ``layers`` or ``h`` holding the most
    parameters (a vision tower's ``blocks`` are never it).

    Raises:
        HayabusaValidationError (parameter cpu_offload_gb): the model has no such stack (encoder-decoder models).
    """
    from hayabusa.errors import HayabusaValidationError

    best, best_n = None, 0
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.rsplit(".", 1)[-1] in ("layers", "h"):
            n = sum(p.numel() for p in module.parameters())
            if n > best_n:
                best, best_n = module, n
    if best is None or getattr(model, "is_encoder_decoder", False):
        raise HayabusaValidationError(
            f"cpu_offload_gb is not supported for {type(model).__name__} (only decoder-only models).",
            parameter="cpu_offload_gb", value=None)
    return best


def _layer_params(model: nn.Module, layers: nn.ModuleList) -> list[list[nn.Parameter]]:
    """Per layer, its parameters that no module outside that layer holds (tied or shared ones stay resident)."""
    owners: dict[int, set[int]] = {}
    in_layer = {id(m): i for i, layer in enumerate(layers) for m in layer.modules()}
    for module in model.modules():
        where = in_layer.get(id(module), -1)
        for p in module._parameters.values():   # noqa: SLF001
            if p is not None:
                owners.setdefault(id(p), set()).add(where)
    out = []
    for i, layer in enumerate(layers):
        seen: set[int] = set()
        params = []
        for p in layer.parameters():
            if id(p) not in seen and owners.get(id(p)) == {i} and p.numel() > 0:
                seen.add(id(p))
                params.append(p)
        out.append(params)
    return out


class WeightOffloader:
    """Keeps the chosen decoder layers' weights in CPU memory and streams them through a GPU ring each forward.

    Args:
        model: the loaded model (weights on ``device``; quantization processed).
        budget_bytes: cpu_offload_gb in bytes (> 0).
        device: the model's device ("cuda", or "cpu" with ``fake``).
        fake: the test-only fake-device mode (CPU copies, no streams or events).
        num_slots: ring size (>= 1; at most the number of offloaded layers).
        trace: record the copies and computes in ``self.trace`` (tests).

    Attributes:
        layer_indices: [n] offloaded layers (indices into the decoder stack), increasing.
        offloaded_bytes: bytes of weights moved to CPU memory (the packed layers, alignment included).
        ring_bytes: bytes of the GPU ring (num_slots x the largest packed layer).
        trace: ("copy", layer, slot) / ("compute", layer, slot) in issue order, when ``trace`` is on.
    """

    def __init__(self, model: nn.Module, budget_bytes: int, device: torch.device, fake: bool = False,
                 num_slots: int = NUM_SLOTS, trace: bool = False) -> None:
        self.device = torch.device(device)
        self.fake = fake
        self.cuda = self.device.type == "cuda" and not fake
        layers = decoder_layers(model)
        params = _layer_params(model, layers)
        layer_bytes = [sum(_align(_span_bytes(p)) for p in ps) for ps in params]
        self.layer_indices = choose_offload_layers(layer_bytes, budget_bytes)
        self.num_layers = len(layers)
        self.model_layer_bytes = sum(layer_bytes)
        self.trace: list[tuple[str, int, int]] | None = [] if trace else None
        n = len(self.layer_indices)
        self.num_slots = max(1, min(num_slots, n))
        self.packed = [self._pack(o, i, params[i]) for o, i in enumerate(self.layer_indices)]
        self.offloaded_bytes = sum(p.nbytes for p in self.packed)
        slot_bytes = max((p.nbytes for p in self.packed), default=0)
        self.slots = [torch.empty(slot_bytes, dtype=torch.uint8, device=self.device) for _ in range(self.num_slots)]
        self.ring_bytes = slot_bytes * self.num_slots
        with torch.no_grad():
            for pl in self.packed:   # the layer's parameters now live in its slot, for good
                for e in pl.entries:
                    e.param.data = _view(self.slots[pl.slot], e)
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._copy_done = [self._event() for _ in self.packed]
        self._compute_done = [self._event() for _ in self.packed]
        self._start = self._event()
        self._issued = 0        # copies issued in this forward
        self._active = False    # a forward is under way (its first copies are issued)
        self._hooks = [model.register_forward_pre_hook(lambda m, a: self.begin())]
        for o, i in enumerate(self.layer_indices):
            self._hooks.append(layers[i].register_forward_pre_hook(lambda m, a, o=o: self._before(o)))
            self._hooks.append(layers[i].register_forward_hook(lambda m, a, r, o=o: self._after(o)))
        if self.cuda:
            torch.cuda.empty_cache()   # give back the freed weights' memory (the KV profile reads what is reserved)
        self._log(budget_bytes)

    # ------------------------------------------------------------------ setup
    def _pack(self, o: int, index: int, params: list[nn.Parameter]) -> _PackedLayer:
        pl = _PackedLayer(index=index, slot=o % self.num_slots)
        for p in params:
            pl.entries.append(_Entry(p, pl.nbytes, tuple(p.shape), tuple(p.stride()), p.dtype))
            pl.nbytes += _align(_span_bytes(p))
        pl.host = torch.empty(pl.nbytes, dtype=torch.uint8, pin_memory=self.cuda)
        with torch.no_grad():
            for e in pl.entries:
                _view(pl.host, e).copy_(e.param.data)
        return pl

    def _event(self):
        return torch.cuda.Event() if self.cuda else None

    def _log(self, budget_bytes: int) -> None:
        n, L = len(self.layer_indices), self.num_layers
        more = budget_bytes > self.model_layer_bytes
        logger.log(logging.WARNING if more else logging.INFO,
                   "cpu_offload_gb=%g: %d of %d decoder layers (%s) offloaded, %.1f MiB of weights in %sCPU memory"
                   "%s; GPU ring %d x %.1f MiB%s", budget_bytes / GiB, n, L,
                   ", ".join(map(str, self.layer_indices)) if n <= 16 else f"{self.layer_indices[:16]}...",
                   self.offloaded_bytes / 2**20, "pinned " if self.cuda else "",
                   f" (more than the {self.model_layer_bytes / 2**20:.1f} MiB the decoder layers have: all of them "
                   "are offloaded)" if more else "", self.num_slots, self.ring_bytes / self.num_slots / 2**20,
                   " (fake-device mode: CPU copies)" if self.fake else "")

    @property
    def saved_bytes(self) -> int:
        """Device bytes the offload frees: offloaded weights minus the ring."""
        return self.offloaded_bytes - self.ring_bytes

    # ------------------------------------------------------------------ per forward
    def begin(self) -> None:
        """A forward starts: copy the first ``num_slots`` offloaded layers into the ring (on CUDA after the work
        queued so far, which includes the previous forward's last use of every slot)."""
        if not self.packed:
            return
        self._issued = 0
        self._active = True
        if self.cuda:
            self._start.record(torch.cuda.current_stream(self.device))
        for o in range(min(self.num_slots, len(self.packed))):
            self._copy(o, self._start)

    def _copy(self, o: int, after) -> None:
        """Copy offloaded layer o into its slot once ``after`` (an event on the compute stream) has happened."""
        pl = self.packed[o]
        assert o == self._issued, (o, self._issued)
        self._issued += 1
        if self.trace is not None:
            self.trace.append(("copy", pl.index, pl.slot))
        dst = self.slots[pl.slot][: pl.nbytes]
        if not self.cuda:
            dst.copy_(pl.host)
            return
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(after)
            dst.copy_(pl.host, non_blocking=True)
            self._copy_done[o].record(self.stream)

    def _before(self, o: int) -> None:
        if not self._active and o == 0:   # the layers were called without the model's forward
            self.begin()
        assert self._active and o < self._issued, (o, self._issued)
        pl = self.packed[o]
        if self.trace is not None:
            self.trace.append(("compute", pl.index, pl.slot))
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self._copy_done[o])

    def _after(self, o: int) -> None:
        nxt = o + self.num_slots
        if self.cuda:
            self._compute_done[o].record(torch.cuda.current_stream(self.device))
        if nxt < len(self.packed):
            self._copy(nxt, self._compute_done[o])
        if o == len(self.packed) - 1:
            self._active = False

    def remove(self) -> None:
        """Remove the hooks (the parameters stay views into the ring)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []


def maybe_offload(model: nn.Module, cfg, device: torch.device) -> WeightOffloader | None:
    """The runner's entry: a WeightOffloader when cpu_offload_gb > 0 on CUDA (or in the fake-device mode on CPU),
    else None (on CPU the option changes nothing; config.py logs that)."""
    budget = int(getattr(cfg.cache_config, "cpu_offload_bytes", 0) or 0)
    if budget <= 0:
        return None
    fake = device.type == "cpu" and fake_device_offload()
    if device.type != "cuda" and not fake:
        return None
    return WeightOffloader(model, budget, device, fake=fake, trace=fake)


__all__ = ["WeightOffloader", "choose_offload_layers", "spread_layers", "decoder_layers", "maybe_offload",
           "fake_device_offload", "NUM_SLOTS", "FAKE_ENV"]
