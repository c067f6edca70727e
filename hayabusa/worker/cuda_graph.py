"""CUDA graphs for decode-only steps.

One graph per captured batch size, all sharing the runner's persistent input buffers (``StepBuffers``) and one
memory pool.
A step of R decode requests replays the smallest captured size bs >= R; rows R..bs-1 are padding: slot -1 (no
KV write) and seq_len 0 (the attention kernel skips them), and their logits are dropped.
"""

from __future__ import annotations

import logging
import time

import torch

from hayabusa.attention.metadata import ForwardContext
from hayabusa.worker.step_buffers import StepBuffers

logger = logging.getLogger(__name__)


def capture_sizes(max_batch: int, sizes: list[int] | None = None) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every 16 up to max_batch (vLLM's schedule), plus max_batch."""
    if sizes:
        return sorted({s for s in sizes if 1 <= s <= max_batch} | {max_batch})
    out = [s for s in (1, 2, 4, 8) if s <= max_batch] + list(range(16, max_batch + 1, 16))
    return sorted(set(out) | {max_batch})


class CUDAGraphRunner:
    """Captures and replays the model forward + logits for decode batches.

    The graphs' static inputs are the runner's ``StepBuffers``: the runner copies a step's inputs into them
    (``ModelRunner.copy_inputs``) before calling ``run``; this class only pads the rows past the step's and
    replays.

    Args:
        runner: the ModelRunner; its public ``buffers``, ``model``, ``kv_caches``, ``backend``, ``cfg``,
            ``max_num_reqs`` and ``device`` are read once, here.
        use_graphs: capture and replay graphs; False (enforce_eager) runs the same padded shapes eagerly.
    """

    def __init__(self, runner, use_graphs: bool = True) -> None:
        self.buffers: StepBuffers = runner.buffers
        self.model = runner.model
        self.kv_caches = runner.kv_caches
        self.backend = runner.backend
        self.encdec = runner.encdec   # encoder-decoder: cross-attention metadata buffers (None otherwise)
        self.device = runner.device
        self.max_model_len = runner.cfg.scheduler_config.max_model_len
        self.use_graphs = use_graphs
        self.sizes = capture_sizes(min(runner.cfg.max_cuda_graph_batch, runner.max_num_reqs),
                                   runner.cfg.cuda_graph_sizes)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # empty when use_graphs is False (enforce_eager)
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None
        self.capture_seconds = 0.0

    def can_run(self, num_reqs: int) -> bool:
        return num_reqs <= self.sizes[-1]

    def padded_size(self, num_reqs: int) -> int:
        """The smallest captured batch size >= num_reqs."""
        for s in self.sizes:
            if s >= num_reqs:
                return s
        raise ValueError(num_reqs)

    def _forward(self, bs: int) -> torch.Tensor:
        buf = self.buffers
        ctx = ForwardContext(buf.attn_metadata(bs, bs, 1, self.max_model_len), self.kv_caches, self.backend,
                             None if self.encdec is None else self.encdec.metadata(bs))
        hidden = self.model(buf.input_ids[:bs], buf.positions[:bs], ctx)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first so smaller graphs reuse the pool."""
        t0 = time.perf_counter()
        for bs in sorted(self.sizes, reverse=True):
            self.buffers.pad_decode(0, bs)
            self._forward(bs)  # warm up: compiles Triton kernels, settles the allocator
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.logits[bs] = self._forward(bs)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - t0
        logger.info("captured %d CUDA graphs (sizes %s) in %.1f s", len(self.sizes), self.sizes,
                    self.capture_seconds)

    def run(self, inp) -> torch.Tensor:
        """Replay for a decode-only step whose inputs are already in the buffers; returns logits [R, V] (a view
        of the graph's static output)."""
        R = inp.num_reqs
        bs = self.padded_size(R)
        self.buffers.pad_decode(R, bs)
        if not self.use_graphs:  # enforce_eager: the same padded shapes, run eagerly
            return self._forward(bs)[:R]
        self.graphs[bs].replay()
        return self.logits[bs][:R]


__all__ = ["CUDAGraphRunner", "capture_sizes"]
