"""Megatron-style tensor parallelism over a loaded model: each rank keeps its slice of every layer.

Column-parallel (output rows split, no communication): merged QKV (query heads split; KV heads split, or one KV
head per rank replicated when there are fewer KV heads than ranks), gate/up, GPT-2's c_attn / c_fc. Row-parallel
(input columns split, one all-reduce of the output): o_proj, down_proj, GPT-2's c_proj; their bias is kept on rank 0
only, so the sum adds it once. Vocab-parallel: the token embedding (each rank looks up its rows, zeros elsewhere,
all-reduce) and the lm_head (each rank's logits, all-gathered so every rank holds the same [R, V] and samples the
same tokens). The model files know nothing of ranks; ``shard_model`` rewrites their layers after loading.

Which rows each rank keeps (H query heads, H_kv KV heads, D head dim, tp ranks, rank r)::

    qkv rows:  | q: heads [r H/tp, (r+1) H/tp) | k: KV heads kv(r) | v: KV heads kv(r) |
    kv(r) = [r H_kv/tp, (r+1) H_kv/tp) when tp <= H_kv, else the one head r H_kv // tp (replicated)
"""

from __future__ import annotations

import torch
from torch import nn

from hayabusa.distributed.config import kv_heads_per_rank
from hayabusa.distributed.parallel_state import tp_all_gather, tp_all_reduce
from hayabusa.model.layers.attention import Attention
from hayabusa.model.layers.linear import Linear


def _keep_rows(layer: Linear, ranges: list[tuple[int, int]]) -> None:
    """Column-parallel: keep output rows ``ranges`` ([start, end) each) of weight [N, K] and bias [N]."""
    w = layer.weight.data
    layer.weight = nn.Parameter(torch.cat([w[s:e] for s, e in ranges]).contiguous(), requires_grad=False)
    if layer.bias is not None:
        b = layer.bias.data
        layer.bias = nn.Parameter(torch.cat([b[s:e] for s, e in ranges]).contiguous(), requires_grad=False)
    sizes = [e - s for s, e in ranges]
    if len(layer.output_sizes) == len(ranges):
        layer.output_sizes = sizes
    else:
        layer.output_sizes = [sum(sizes)]
    layer.out_features = sum(sizes)


def _row_parallel(layer: Linear, start: int, end: int, rank: int) -> None:
    """Row-parallel: keep input columns [start, end) of weight [N, K]; the output is all-reduced after the
    matmul (one all-reduce per layer); the bias stays on rank 0 only."""
    layer.weight = nn.Parameter(layer.weight.data[:, start:end].contiguous(), requires_grad=False)
    layer.in_features = end - start
    if layer.bias is not None and rank != 0:
        layer.bias.data.zero_()
    layer.register_forward_hook(lambda mod, inp, out: tp_all_reduce(out))


def _head_ranges(num_heads: int, num_kv_heads: int, head_dim: int, rank: int, tp: int
                 ) -> tuple[tuple[int, int], tuple[int, int]]:
    """(query rows, KV rows) of ``rank`` inside the q block and inside each of the k / v blocks."""
    hq = num_heads // tp
    q = (rank * hq * head_dim, (rank + 1) * hq * head_dim)
    hkv = kv_heads_per_rank(num_kv_heads, tp)
    first_kv = rank * hkv if num_kv_heads >= tp else rank * num_kv_heads // tp
    kv = (first_kv * head_dim, (first_kv + hkv) * head_dim)
    return q, kv


def _shard_attention(mod: nn.Module, qkv: Linear, out_proj: Linear, rank: int, tp: int) -> None:
    """Split a merged q | k | v projection by heads and its output projection by input columns; set the
    per-rank head counts on ``mod`` and its Attention."""
    H, H_kv, D = mod.attn.num_heads, mod.attn.num_kv_heads, mod.attn.head_dim
    (qs, qe), (ks, ke) = _head_ranges(H, H_kv, D, rank, tp)
    q_size, kv_size = H * D, H_kv * D
    _keep_rows(qkv, [(qs, qe), (q_size + ks, q_size + ke), (q_size + kv_size + ks, q_size + kv_size + ke)])
    _row_parallel(out_proj, qs, qe, rank)
    h, h_kv = H // tp, kv_heads_per_rank(H_kv, tp)
    mod.attn.num_heads, mod.attn.num_kv_heads = h, h_kv
    mod.num_heads = h
    if hasattr(mod, "num_kv_heads"):
        mod.num_kv_heads = h_kv
    if hasattr(mod, "q_size"):
        mod.q_size, mod.kv_size = h * D, h_kv * D


def _shard_mlp(up: Linear, down: Linear, rank: int, tp: int, gated: bool) -> None:
    """gate | up (or GPT-2's c_fc) split by rows, down_proj (c_proj) by input columns."""
    inter = down.in_features
    n = inter // tp
    s, e = rank * n, (rank + 1) * n
    _keep_rows(up, [(s, e), (inter + s, inter + e)] if gated else [(s, e)])
    _row_parallel(down, s, e, rank)


class VocabParallelEmbedding(nn.Module):
    """Token embedding split by vocabulary rows: rank r holds rows [start, start + n) (zero-padded to n for the last
    rank); ids outside look up nothing (zeros) and the all-reduce fills them in.

    ``weight`` [n, hidden] doubles as the tied lm_head's slice (its logits are columns [start, start + n))."""

    def __init__(self, full: torch.Tensor, rank: int, tp: int) -> None:
        super().__init__()
        V = full.shape[0]
        n = -(-V // tp)
        self.start, self.num_embeddings = rank * n, V
        rows = full[self.start:min(self.start + n, V)]
        w = torch.zeros(n, full.shape[1], dtype=full.dtype, device=full.device)
        w[:rows.shape[0]] = rows
        self.weight = nn.Parameter(w, requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start                                   # [T]
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)   # [T, hidden]
        x.masked_fill_(outside.unsqueeze(-1), 0)
        return tp_all_reduce(x)


def _vocab_rows(layer: Linear, rank: int, tp: int) -> None:
    """An untied lm_head: keep its vocab rows (zero-padded like VocabParallelEmbedding)."""
    V = layer.weight.shape[0]
    n = -(-V // tp)
    w = torch.zeros(n, layer.weight.shape[1], dtype=layer.weight.dtype, device=layer.weight.device)
    rows = layer.weight.data[rank * n:min((rank + 1) * n, V)]
    w[:rows.shape[0]] = rows
    layer.weight = nn.Parameter(w, requires_grad=False)
    layer.output_sizes, layer.out_features = [n], n


def shard_model(model: nn.Module, rank: int, tp: int) -> nn.Module:
    """Keep rank ``rank``'s slice of every layer of a loaded (unquantized) model; returns the model.

    Supported: the Llama family (Llama, Mistral, Qwen2, Qwen3, Gemma 2: ``qkv_proj`` / ``o_proj``, ``gate_up_proj``
    / ``down_proj``) and GPT-2 (``c_attn`` / ``c_proj``, ``c_fc`` / ``c_proj``); the config checks
    (hayabusa/distributed/config.py) refuse the others by name before this runs.
    """
    if tp == 1:
        return model
    for mod in list(model.modules()):
        if isinstance(getattr(mod, "attn", None), Attention):
            if hasattr(mod, "qkv_proj"):
                _shard_attention(mod, mod.qkv_proj, mod.o_proj, rank, tp)
            elif hasattr(mod, "c_attn"):
                _shard_attention(mod, mod.c_attn, mod.c_proj, rank, tp)
        elif hasattr(mod, "gate_up_proj") and hasattr(mod, "down_proj"):
            _shard_mlp(mod.gate_up_proj, mod.down_proj, rank, tp, gated=True)
        elif hasattr(mod, "c_fc") and hasattr(mod, "c_proj"):
            _shard_mlp(mod.c_fc, mod.c_proj, rank, tp, gated=False)
    vocab = model.config.vocab_size   # the embedding's and the lm_head's rows
    for parent in list(model.modules()):   # a pipeline stage after the first may hold no token embedding
        for name in ("embed_tokens", "wte"):
            emb = getattr(parent, name, None)
            if isinstance(emb, nn.Embedding):
                assert emb.num_embeddings == vocab, (emb.num_embeddings, vocab)
                setattr(parent, name, VocabParallelEmbedding(emb.weight.data, rank, tp))
    if isinstance(getattr(model, "lm_head", None), Linear):   # not before the last pipeline stage
        _vocab_rows(model.lm_head, rank, tp)
    local_logits = model.compute_logits

    def compute_logits(hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, hidden] -> logits [R, V]: this rank's vocab slice, all-gathered, padding cut off."""
        return tp_all_gather(local_logits(hidden))[..., :vocab]

    model.compute_logits = compute_logits
    return model


def build_sharded_model(model_config, device: torch.device, rank: int, tp: int,
                        stage: tuple[int, int, bool, bool] | None = None) -> nn.Module:
    """Load the checkpoint on the host, keep pipeline ``stage``'s layers (``(start, end, first, last)``,
    model/layers/pipeline.py; None: all) and rank ``rank``'s slice of them, move only that to ``device`` (a GPU
    never holds more than its shard; the host holds one full copy per rank while loading)."""
    from hayabusa.model.layers.pipeline import stage_model
    from hayabusa.model.loader import build_model, maybe_use_small_m_linears

    model = build_model(model_config, torch.device("cpu"))
    if stage is not None:
        model = stage_model(model, *stage)
    model = shard_model(model, rank, tp).to(device)
    maybe_use_small_m_linears(model, model_config, device)   # HAYABUSA_SMALL_M_LINEAR: decided by where it runs
    return model
