"""CUDA graphs for decode-only steps and for speculative decoding's verify steps.

One graph per captured batch size, all sharing the runner's persistent input buffers (``StepBuffers``) and one
memory pool.
A step of R decode requests replays the smallest captured size bs >= R; rows R..bs-1 are padding: slot -1 (no
KV write) and seq_len 0 (the attention kernel skips them), and their logits are dropped.

Verify steps (n-gram proposals: the target's forward over 1 + k tokens per request; Q = num_speculative_tokens +
1) are keyed by (bs, Q): a step of R <= bs requests whose query lengths are all <= Q (requests without proposals,
or with fewer, included) replays the (bs, Q) graph over T_pad = bs x Q tokens: tokens T..T_pad-1 belong to no
request (slot -1), requests R..bs-1 have no queries and seq_len 0 (``StepBuffers.pad_verify``); the attention
kernel's grid depends only on (bs, Q), every length is read on the device. The graph's output is the hidden states
[T_pad, H]; the step's logits rows (1 + k per request) are computed from its first T rows outside the graph.
Sizes: the decode sizes whose bs x Q fits max_num_batched_tokens and VERIFY_GRAPH_MAX_TOKENS, up to the first one
>= disable_by_batch_size (no step has proposals above it); other verify steps run eagerly. With a draft model the
target's decode and verify steps replay these graphs too, and so does the draft's mirror of them (its own graphs on
the target's buffers; its proposal forwards have decode graphs on buffers of their own: worker/draft_model.py
``make_graphs``). With EAGLE / EAGLE-3 (``eagle_forward``, on CUDA while worker/eagle.py USE_EAGLE_GRAPHS, the default) the
target's decode and verify graphs also output the head's input for every token of the padded step (EAGLE-1: the
final hidden state; EAGLE-3: the head's ``fc`` over the aux layers' states), read as ``head_input`` after the run.

Mixed steps (prompt chunks, alone or with decode / verify rows: admissions) are keyed by (bs, T_pad): a step of
R <= bs requests and T <= T_pad tokens, any query lengths, replays the (bs, T_pad) graph, padded like a verify step
(``StepBuffers.pad_verify``) and captured with max_query_len = T_pad (the prefill tile configuration, which does
not depend on the length, so the attention is the eager step's; the grid's programs past a request's queries
exit). The output is the hidden states [T_pad, H]; logits come from the first T rows outside the graph. Why: an
eager step is host-bound for small models. Measured on an H200 (2026-12-03, SmolLM2-135M fp16, W11 at
max_num_seqs 4, benchmarks/payoff_trace.py): an admission step (one 1,300-token prompt with 3 decode rows) took
15-25 ms of host launches eagerly, ~15 decode steps' time, and speculation, which desynchronises the requests,
needed 33 admission steps where lockstep decoding needed 8: 0.52 s of its 1.63 s. Sizes (``mixed_graph_sizes``):
bs in MIXED_GRAPH_BATCH_SIZES, T_pad in MIXED_GRAPH_TOKENS up to max_num_batched_tokens and while the padded
step's linear FLOPs stay under MIXED_GRAPH_FLOP_BUDGET (a large model's prefill is GPU-bound: there padding
would cost more than the launches it saves). With enforce_eager the same padded shapes run eagerly. Off (steps
unpadded, eager) with HAYABUSA_MIXED_GRAPHS=0 and for draft / EAGLE / encoder-decoder / image / batch-invariant
runners.
"""

from __future__ import annotations

import logging
import time

import torch

from hayabusa.attention.metadata import ForwardContext
from hayabusa.envs import env_flag
from hayabusa.errors import HayabusaValidationError
from hayabusa.worker.step_buffers import StepBuffers

logger = logging.getLogger(__name__)

# Verify graphs hold at most this many tokens (bs x (k + 1)): their activations live in the graphs' pool, outside
# the profiled peak; larger verify steps run eagerly.
VERIFY_GRAPH_MAX_TOKENS = 1024

# Mixed-step graphs (module docstring): batch sizes, token buckets, and the most linear FLOPs (2 x params x T_pad)
# a padded step may have: 1e12 is about 3 ms of an H200 at half its bf16 peak, under the 15-25 ms an eager step's
# launches take (a choice from that measurement; on slower GPUs fewer buckets would pay). A 135M model gets every
# bucket, a 0.5B one up to 1,024 tokens, a 7B one 64 tokens.
MIXED_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16)
MIXED_GRAPH_TOKENS = (64, 128, 256, 512, 1024, 2048)
MIXED_GRAPH_FLOP_BUDGET = 1e12
USE_MIXED_GRAPHS = env_flag("HAYABUSA_MIXED_GRAPHS", True)


def capture_sizes(max_batch: int, sizes: list[int] | None = None) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every 16 up to max_batch (vLLM's schedule), plus max_batch."""
    if sizes:
        return sorted({s for s in sizes if 1 <= s <= max_batch} | {max_batch})
    out = [s for s in (1, 2, 4, 8) if s <= max_batch] + list(range(16, max_batch + 1, 16))
    return sorted(set(out) | {max_batch})


def linear_params_per_token(model_config) -> int:
    """About the decoder's linear weights one token multiplies (the FLOPs per token / 2): layers x (4 h^2 + 3 h x
    intermediate) from the model's config (an upper bound with GQA; the LM head, computed outside the graphs on
    the sampling rows only, is left out). h = hidden_size; intermediate_size (else n_inner, else 4 h)."""
    text = model_config.hf_config.get_text_config() if hasattr(model_config.hf_config, "get_text_config") \
        else model_config.hf_config
    h = model_config.hidden_size
    inter = getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None) or 4 * h
    return model_config.num_layers * (4 * h * h + 3 * h * inter)


def mixed_graph_sizes(max_num_reqs: int, max_num_tokens: int, params_per_token: int) -> list[tuple[int, int]]:
    """The (bs, T_pad) sizes of mixed-step graphs: bs in MIXED_GRAPH_BATCH_SIZES up to max_num_reqs (and
    max_num_reqs itself when it is at most the largest), T_pad in MIXED_GRAPH_TOKENS up to max_num_tokens with
    2 x params_per_token x T_pad <= MIXED_GRAPH_FLOP_BUDGET. Empty when none fits."""
    top = MIXED_GRAPH_BATCH_SIZES[-1]
    sizes = {b for b in MIXED_GRAPH_BATCH_SIZES if b <= max_num_reqs}
    if max_num_reqs <= top:
        sizes.add(max_num_reqs)
    tokens = [t for t in MIXED_GRAPH_TOKENS
              if t <= max_num_tokens and 2 * params_per_token * t <= MIXED_GRAPH_FLOP_BUDGET]
    return [(b, t) for b in sorted(sizes) for t in tokens]


class CUDAGraphRunner:
    """Captures and replays a model's forward (+ logits) for decode batches, and its verify steps.

    The graphs' static inputs are ``buffers``: the caller copies a step's inputs into them
    (``ModelRunner.copy_inputs``) before calling ``run`` / ``run_verify``; this class only pads the rows past the
    step's and replays.

    Args:
        model: the model (forward(input_ids, positions, ctx) -> hidden [T, H]; compute_logits).
        kv_caches: its per-layer (k, v) paged caches.
        backend: the attention backend.
        buffers: the StepBuffers the graphs read (at least ``max_num_reqs`` rows; with ``verify``,
            ``max_num_tokens`` tokens).
        cfg: the engine config (capture sizes, max_model_len, speculative_config's k and disable_by_batch_size).
        max_num_reqs: R at most (capture sizes are <= it).
        max_num_tokens: T at most (verify graphs hold bs x (k + 1) <= it tokens).
        device: the device.
        encdec: encoder-decoder cross-attention metadata buffers (EncoderDecoderRunner), or None.
        verify: also (bs, k + 1) verify graphs (needs ``cfg.speculative_config``).
        with_logits: decode graphs output logits [bs, V]; False: hidden states [bs, H] (a draft model's mirror
            of a decode step, whose output is not read).
        use_graphs: capture and replay graphs; False (enforce_eager, CPU tests) runs the same padded shapes
            eagerly.
        eagle_forward: EAGLE: the drafter's ``target_forward`` (model, input_ids [T], positions [T], ctx) ->
            (hidden [T, H], head input [T, H_head]); the graphs run it instead of the model and keep the head input
            as a second static output (``head_input`` after each ``run`` / ``run_verify``). None: no head input.

    Raises:
        HayabusaValidationError: ``verify`` without a speculative_config (parameter ``verify``).
    """

    def __init__(self, model, kv_caches, backend, buffers: StepBuffers, cfg, *, max_num_reqs: int,
                 max_num_tokens: int, device: torch.device, encdec=None, verify: bool = False,
                 with_logits: bool = True, use_graphs: bool = True, eagle_forward=None,
                 mixed_sizes: list[tuple[int, int]] | None = None) -> None:
        spec = cfg.speculative_config
        if verify and spec is None:
            raise HayabusaValidationError("verify graphs need a speculative_config.", parameter="verify",
                                          value=verify)
        self.buffers = buffers
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.encdec = encdec
        self.device = device
        self.max_model_len = cfg.scheduler_config.max_model_len
        self.with_logits = with_logits
        self.use_graphs = use_graphs
        self.eagle_forward = eagle_forward
        # EAGLE: the head input [R or T, H_head] of the last run (a view of the graph's static output: read it
        # before the next replay); None without eagle_forward
        self.head_input: torch.Tensor | None = None
        self.head_inputs: dict[int, torch.Tensor] = {}          # decode graphs' second output, by bs
        self.verify_head_inputs: dict[int, torch.Tensor] = {}   # verify graphs' second output, by bs
        self.sizes = capture_sizes(min(cfg.max_cuda_graph_batch, max_num_reqs), cfg.cuda_graph_sizes)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # empty when use_graphs is False (enforce_eager)
        self.logits: dict[int, torch.Tensor] = {}          # (hidden states when not with_logits)
        self.pool = None
        self.capture_seconds = 0.0
        # verify steps: Q tokens per request, sizes bs with bs * Q <= max_num_tokens
        self.verify_width = spec.num_speculative_tokens + 1 if verify else 0
        self.verify_sizes: list[int] = []
        if self.verify_width:
            max_tokens = min(max_num_tokens, VERIFY_GRAPH_MAX_TOKENS)
            fit = [s for s in self.sizes if s * self.verify_width <= max_tokens]
            cap = spec.disable_by_batch_size
            if cap:
                fit = [s for s in fit if s < cap] + [s for s in fit if s >= cap][:1]
            self.verify_sizes = fit
        self.verify_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.verify_hidden: dict[int, torch.Tensor] = {}
        # mixed steps (prompt chunks): (bs, T_pad) sizes (mixed_graph_sizes); with enforce_eager the same padded
        # shapes run eagerly (as decode's do), so graphs on and off give the same numbers
        self.mixed_sizes = sorted(mixed_sizes or [])
        self.mixed_batch_sizes = sorted({b for b, _ in self.mixed_sizes})
        self.mixed_tokens = sorted({t for _, t in self.mixed_sizes})
        self.mixed_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.mixed_hidden: dict[tuple[int, int], torch.Tensor] = {}
        self.num_mixed_runs = 0       # mixed steps run on the padded shapes
        self.num_mixed_replays = 0    # of those, replayed from a graph
        self.num_runs = 0             # decode steps run on the padded shapes
        self.num_replays = 0          # of those, replayed from a graph
        self.num_verify_runs = 0      # verify steps run on the padded (bs, Q) shapes
        self.num_verify_replays = 0   # of those, replayed from a graph

    @classmethod
    def for_runner(cls, runner, use_graphs: bool = True) -> "CUDAGraphRunner":
        """A ModelRunner's target graphs: its ``buffers``, ``model``, ``kv_caches``, ``backend``, ``cfg``,
        ``max_num_reqs``, ``max_num_tokens``, ``encdec`` and ``device``; verify graphs with speculation. With EAGLE
        the graphs also output the head's input (``eagle_forward``) when they will serve its steps: always on the
        padded eager shapes (``use_graphs`` False), on CUDA graphs only with worker/eagle.py's USE_EAGLE_GRAPHS;
        otherwise EAGLE steps run eagerly and the runner gets plain decode graphs (no verify graphs)."""
        eagle_forward = None
        verify = runner.cfg.speculative_config is not None
        mixed = None
        if USE_MIXED_GRAPHS and runner.draft is None and runner.encdec is None \
                and runner.mm is None and not getattr(runner.cfg.model_config, "batch_invariant", False):
            mixed = mixed_graph_sizes(runner.max_num_reqs, runner.max_num_tokens,
                                      linear_params_per_token(runner.cfg.model_config))
        if getattr(runner.draft, "is_eagle", False):
            from hayabusa.worker import eagle

            if not use_graphs or eagle.USE_EAGLE_GRAPHS:
                eagle_forward = runner.draft.target_forward
            else:
                verify = False
        return cls(runner.model, runner.kv_caches, runner.backend, runner.buffers, runner.cfg,
                   max_num_reqs=runner.max_num_reqs, max_num_tokens=runner.max_num_tokens, device=runner.device,
                   encdec=runner.encdec, verify=verify, use_graphs=use_graphs, eagle_forward=eagle_forward,
                   mixed_sizes=mixed)

    def can_run(self, num_reqs: int) -> bool:
        return num_reqs <= self.sizes[-1]

    def padded_size(self, num_reqs: int) -> int:
        """The smallest captured batch size >= num_reqs."""
        for s in self.sizes:
            if s >= num_reqs:
                return s
        raise ValueError(num_reqs)

    def _model(self, n: int, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model over the buffers' first n tokens: (hidden [n, H], EAGLE's head input [n, H_head] or None)."""
        buf = self.buffers
        if self.eagle_forward is None:
            return self.model(buf.input_ids[:n], buf.positions[:n], ctx), None
        return self.eagle_forward(self.model, buf.input_ids[:n], buf.positions[:n], ctx)

    def _forward(self, bs: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        buf = self.buffers
        ctx = ForwardContext(buf.attn_metadata(bs, bs, 1, self.max_model_len), self.kv_caches, self.backend,
                             None if self.encdec is None else self.encdec.metadata(bs))
        hidden, head_input = self._model(bs, ctx)
        return (self.model.compute_logits(hidden) if self.with_logits else hidden), head_input

    def _forward_verify(self, bs: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        buf, Q = self.buffers, self.verify_width
        ctx = ForwardContext(buf.attn_metadata(bs, bs * Q, Q, self.max_model_len), self.kv_caches, self.backend)
        return self._model(bs * Q, ctx)      # [bs * Q, H], head input [bs * Q, H_head] or None

    def _forward_mixed(self, bs: int, T_pad: int) -> torch.Tensor:
        buf = self.buffers
        ctx = ForwardContext(buf.attn_metadata(bs, T_pad, T_pad, self.max_model_len), self.kv_caches, self.backend)
        return self.model(buf.input_ids[:T_pad], buf.positions[:T_pad], ctx)     # [T_pad, H]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first so smaller graphs reuse the pool; then the verify sizes."""
        t0 = time.perf_counter()
        for bs in sorted(self.sizes, reverse=True):
            self.buffers.pad_decode(0, bs)
            self._forward(bs)  # warm up: compiles Triton kernels, settles the allocator
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.logits[bs], self.head_inputs[bs] = self._forward(bs)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
        for bs in sorted(self.verify_sizes, reverse=True):
            self.buffers.pad_verify(0, 0, bs, bs * self.verify_width)
            self._forward_verify(bs)  # warm up
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.verify_hidden[bs], self.verify_head_inputs[bs] = self._forward_verify(bs)
            self.verify_graphs[bs] = graph
        if self.mixed_sizes and self.use_graphs:
            largest = max(self.mixed_sizes, key=lambda s: (s[1], s[0]))
            try:   # the largest step's activations, outside the pool: no room, no mixed graphs (steps stay eager)
                self.buffers.pad_verify(0, 0, *largest)
                self._forward_mixed(*largest)
            except torch.cuda.OutOfMemoryError:
                logger.warning("no GPU memory for the mixed-step CUDA graphs (%s tokens at most): prompt steps run "
                               "eagerly", self.mixed_tokens[-1])
                self.mixed_sizes, self.mixed_batch_sizes, self.mixed_tokens = [], [], []
                torch.cuda.empty_cache()
        for bs, T_pad in sorted(self.mixed_sizes if self.use_graphs else [], key=lambda s: (-s[1], -s[0])):
            self.buffers.pad_verify(0, 0, bs, T_pad)
            self._forward_mixed(bs, T_pad)  # warm up
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.mixed_hidden[(bs, T_pad)] = self._forward_mixed(bs, T_pad)
            self.mixed_graphs[(bs, T_pad)] = graph
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - t0
        logger.info("captured %d CUDA graphs (sizes %s; verify sizes %s x %d tokens; mixed batch sizes %s x tokens "
                    "%s) in %.1f s", len(self.sizes) + len(self.verify_sizes) + len(self.mixed_sizes), self.sizes,
                    self.verify_sizes, self.verify_width, self.mixed_batch_sizes, self.mixed_tokens,
                    self.capture_seconds)

    def mixed_size(self, num_reqs: int, num_tokens: int) -> tuple[int, int] | None:
        """The (bs, T_pad) graph a mixed step of ``num_reqs`` requests / ``num_tokens`` tokens replays: the
        smallest captured batch size and token bucket that hold it; None when none does (it runs eagerly)."""
        bs = next((b for b in self.mixed_batch_sizes if b >= num_reqs), None)
        t = next((t for t in self.mixed_tokens if t >= num_tokens), None)
        return None if bs is None or t is None else (bs, t)

    def run_mixed(self, inp) -> torch.Tensor:
        """Replay (or, with enforce_eager, run eagerly on the same padded shapes) the (bs, T_pad) graph of
        ``mixed_size`` for a step whose inputs are already in the buffers (it must fit one); returns hidden [T, H]
        (a view of the graph's static output: read it before the next replay)."""
        R, T = inp.num_reqs, len(inp.input_ids)
        size = self.mixed_size(R, T)
        bs, T_pad = size
        self.buffers.pad_verify(T, R, bs, T_pad)
        self.num_mixed_runs += 1
        if not self.use_graphs:
            return self._forward_mixed(bs, T_pad)[:T]
        self.num_mixed_replays += 1
        self.mixed_graphs[size].replay()
        return self.mixed_hidden[size][:T]

    def can_run_verify(self, num_reqs: int, max_query_len: int) -> bool:
        """A verify step of ``num_reqs`` requests, none with more than Q tokens, fits a (bs, Q) size."""
        return bool(self.verify_sizes) and max_query_len <= self.verify_width and num_reqs <= self.verify_sizes[-1]

    def run_verify(self, inp) -> torch.Tensor:
        """Replay (or, with enforce_eager, run eagerly on the same padded shapes) the target's forward of a verify
        step whose inputs are already in the buffers; returns hidden [T, H] (a view of the graph's static
        output: read it before the next replay). With ``eagle_forward`` ``head_input`` is then the step's head
        input [T, H_head] (a view too)."""
        R, T = inp.num_reqs, len(inp.input_ids)
        bs = next(s for s in self.verify_sizes if s >= R)
        self.buffers.pad_verify(T, R, bs, bs * self.verify_width)
        self.num_verify_runs += 1
        if not self.use_graphs:
            hidden, head_input = self._forward_verify(bs)
        else:
            self.num_verify_replays += 1
            self.verify_graphs[bs].replay()
            hidden, head_input = self.verify_hidden[bs], self.verify_head_inputs.get(bs)
        self.head_input = None if head_input is None else head_input[:T]
        return hidden[:T]

    def run(self, inp) -> torch.Tensor:
        """Replay for a decode-only step whose inputs are already in the buffers; returns logits [R, V] (hidden
        [R, H] when not ``with_logits``; a view of the graph's static output). With ``eagle_forward``
        ``head_input`` is then the step's head input [R, H_head] (a view too)."""
        R = inp.num_reqs
        bs = self.padded_size(R)
        self.buffers.pad_decode(R, bs)
        self.num_runs += 1
        if not self.use_graphs:  # enforce_eager: the same padded shapes, run eagerly
            out, head_input = self._forward(bs)
        else:
            self.num_replays += 1
            self.graphs[bs].replay()
            out, head_input = self.logits[bs], self.head_inputs.get(bs)
        self.head_input = None if head_input is None else head_input[:R]
        return out[:R]


__all__ = ["CUDAGraphRunner", "capture_sizes", "linear_params_per_token", "mixed_graph_sizes"]
