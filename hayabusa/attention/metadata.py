"""Per-step attention metadata (what every attention layer reads)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [R + 1] int32, cumulative query lengths (device)
    seq_lens: torch.Tensor         # [R] int32, context length after this step (cached + new tokens)
    block_table: torch.Tensor      # [R, max_blocks_per_req] int32 (row stride may exceed its width)
    slot_mapping: torch.Tensor     # [T] int64, block_id * block_size + offset, -1 = padding (skipped)
    num_reqs: int                  # R (host)
    max_query_len: int             # host, sizes the kernel grid
    max_seq_len: int               # host


@dataclass
class ForwardContext:
    """Everything a model's attention layers need for one forward pass.

    kv_caches: per layer ``(k_cache, v_cache)``, each ``[num_blocks, block_size, H_kv, D]``; None while
    profiling memory (attention then returns uninitialised output of the right shape).

    cross_attn_metadata: encoder-decoder models: the decoder tokens' cross-attention over their request's encoder
    K/V (one one-token "sequence" per query token; see ``worker/encoder_decoder.py``); None otherwise.
    """

    attn_metadata: AttentionMetadata | None
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None
    backend: "object"
    cross_attn_metadata: AttentionMetadata | None = None
