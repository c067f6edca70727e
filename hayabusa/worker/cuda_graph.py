"""CUDA graphs for decode-only steps.

One graph per captured batch size, all sharing the runner's persistent input buffers and one memory pool.
A step of R decode requests replays the smallest captured size bs >= R; rows R..bs-1 are padding: slot -1 (no
KV write) and seq_len 0 (the attention kernel skips them), and their logits are dropped.
"""

from __future__ import annotations

import logging
import time

import torch

from hayabusa.attention.metadata import ForwardContext

logger = logging.getLogger(__name__)


def capture_sizes(max_batch: int, sizes: list[int] | None = None) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every 16 up to max_batch (vLLM's schedule), plus max_batch."""
    if sizes:
        return sorted({s for s in sizes if 1 <= s <= max_batch} | {max_batch})
    out = [s for s in (1, 2, 4, 8) if s <= max_batch] + list(range(16, max_batch + 1, 16))
    return sorted(set(out) | {max_batch})


class CUDAGraphRunner:
    """Captures and replays the model forward + logits for decode batches.

    Args:
        runner: the ModelRunner (its persistent buffers are the graphs' static inputs).
    """

    def __init__(self, runner, use_graphs: bool = True) -> None:
        self.runner = runner
        self.use_graphs = use_graphs
        self.sizes = capture_sizes(min(runner.cfg.max_cuda_graph_batch, runner.max_num_reqs),
                                   runner.cfg.cuda_graph_sizes)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # empty when use_graphs is False (enforce_eager)
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None
        self.capture_seconds = 0.0
        self._arange = torch.arange(self.sizes[-1] + 1, dtype=torch.int32, device=runner.device)

    def can_run(self, num_reqs: int) -> bool:
        return num_reqs <= self.sizes[-1]

    def _padded(self, num_reqs: int) -> int:
        for s in self.sizes:
            if s >= num_reqs:
                return s
        raise ValueError(num_reqs)

    def _fill_padding(self, R: int, bs: int) -> None:
        r = self.runner
        r.input_ids[R:bs].zero_()
        r.positions[R:bs].zero_()
        r.slot_mapping[R:bs].fill_(-1)
        r.seq_lens[R:bs].zero_()
        r.query_start_loc[: bs + 1].copy_(self._arange[: bs + 1])  # decode: one query token per row

    def _forward(self, bs: int) -> torch.Tensor:
        r = self.runner
        meta = r.attn_metadata(bs, bs, 1, r.cfg.scheduler_config.max_model_len)
        ctx = ForwardContext(meta, r.kv_caches, r.backend)
        hidden = r.model(r.input_ids[:bs], r.positions[:bs], ctx)
        return r.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first so smaller graphs reuse the pool."""
        t0 = time.perf_counter()
        r = self.runner
        for bs in sorted(self.sizes, reverse=True):
            self._fill_padding(0, bs)
            self._forward(bs)  # warm up: compiles Triton kernels, settles the allocator
            torch.cuda.synchronize(r.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.logits[bs] = self._forward(bs)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize(r.device)
        self.capture_seconds = time.perf_counter() - t0
        logger.info("captured %d CUDA graphs (sizes %s) in %.1f s", len(self.sizes), self.sizes,
                    self.capture_seconds)

    def run(self, inp) -> torch.Tensor:
        """Replay for a decode-only step; returns logits [R, V] (a view of the graph's static output)."""
        r = self.runner
        R = len(inp.reqs)
        bs = self._padded(R)
        r._copy_inputs(inp)
        self._fill_padding(R, bs)
        if not self.use_graphs:  # enforce_eager: the same padded shapes, run eagerly
            return self._forward(bs)[:R]
        self.graphs[bs].replay()
        return self.logits[bs][:R]


__all__ = ["CUDAGraphRunner", "capture_sizes"]
