"""EAGLE and EAGLE-3 draft heads (speculative methods "eagle" / "eagle3") for Llama-shaped targets (Llama, Qwen2).

A head is one decoder layer that reads the target's hidden states; it knows no requests. Public checkpoint formats
(SafeAILab/EAGLE; the names vLLM's ``llama_eagle.py`` / ``llama_eagle3.py`` load):

EAGLE-1 (e.g. yuhuili/EAGLE-LLaMA3-Instruct-8B): config.json of a one-layer Llama (or Qwen2); tensors
  ``fc.weight`` [H, 2H] (+ ``fc.bias`` [H] where trained with one), ``layers.0.self_attn.{q,k,v,o}_proj.weight``
  (+ q/k/v biases for Qwen2 heads), ``layers.0.mlp.{gate,up,down}_proj.weight``,
  ``layers.0.post_attention_layernorm.weight``; the first layer has no input norm (an
  ``layers.0.input_layernorm.weight`` is ignored, as vLLM does), no final norm; ``embed_tokens.weight`` when present
  is a copy of the target's and is ignored: the head shares the target's embedding and lm_head.
    x = fc([embed(token_{p+1}); h_p]);  x = layer(x) (residual stream, no input norm);  out = x + residual
    logits = target.lm_head(out);  the next step's hidden is ``out``.
  h_p: the target's final hidden state (after its last norm) at position p.

EAGLE-3 (e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B): config.json with ``draft_vocab_size`` (default: vocab_size),
  optionally ``target_hidden_size`` and ``eagle_config.eagle_aux_hidden_state_layer_ids``; tensors
  ``midlayer.*`` (or ``layers.0.*``) of one decoder layer whose q/k/v projections read 2H, plus
  ``midlayer.hidden_norm.weight``, ``fc.weight`` [H, 3 H_target], ``norm.weight``, ``lm_head.weight``
  [draft_vocab, H], ``d2t`` [draft_vocab] int64 (target id = draft id + d2t[draft id]), ``t2d`` (ignored), and
  ``embed_tokens.weight`` when the head has its own (else the target's is shared).
    g_p = fc([a_p^low; a_p^mid; a_p^high])   (aux states: the residual stream entering target layers 2, L//2, L-3
                                              unless the config lists its own ids)
    x = attn(cat[input_norm(embed(token_{p+1})), hidden_norm(g)]) + g;  x = mlp(post_norm(x)) + x
    logits = lm_head(norm(x)) over the draft vocabulary, mapped to target ids by d2t; the next step's hidden is x.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from hayabusa.attention.metadata import ForwardContext
from hayabusa.model.layers.linear import Linear
from hayabusa.model.layers.norm import RMSNorm
from hayabusa.model.layers.rotary import RotaryEmbedding
from hayabusa.model.llama import MERGED_QKV_GATE_UP, LlamaAttention, LlamaMLP


class EagleDecoderLayer(nn.Module):
    """The head's one decoder layer. EAGLE-1: no input norm. EAGLE-3: q/k/v read [input_norm(embeds);
    hidden_norm(hidden)] (2H wide)."""

    def __init__(self, cfg: Any, rotary: RotaryEmbedding, eagle3: bool, qkv_bias: bool, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        H = cfg.hidden_size
        self.eagle3 = eagle3
        self.self_attn = LlamaAttention(cfg, 0, rotary, qkv_bias, False, dtype, device)
        if eagle3:   # the attention input is [embeds; hidden], 2H wide
            a = self.self_attn
            a.qkv_proj = Linear(2 * H, [a.q_size, a.kv_size, a.kv_size], qkv_bias, dtype, device,
                                shard_names=["q", "k", "v"])
            self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps, dtype, device)
            self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps, dtype, device)
        self.mlp = LlamaMLP(cfg, getattr(cfg, "mlp_bias", False), dtype, device)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps, dtype, device)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, embeds: torch.Tensor | None,
                ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        residual = x
        if self.eagle3:
            x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(x)], dim=-1)
        x = self.self_attn(positions, x, ctx)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class EagleHead(nn.Module):
    """An EAGLE / EAGLE-3 head on the shared layers; its one attention layer uses ``ctx.kv_caches[0]``.

    Args:
        cfg: the head's config.json (a transformers config: hidden_size, heads, intermediate_size, rms_norm_eps,
            rope settings; EAGLE-3: draft_vocab_size, target_hidden_size).
        eagle3: EAGLE-3 layout (else EAGLE-1).
        target: the target model (``model.embed_tokens``; EAGLE-1 uses its ``compute_logits``); not registered
            as a submodule: its weights stay the target's.
        qkv_bias / fc_bias / own_embed: what the checkpoint holds (q/k/v biases, ``fc.bias``, ``embed_tokens``).
        dtype, device, max_position: as for the target.
    """

    stacked_params_mapping = MERGED_QKV_GATE_UP

    def __init__(self, cfg: Any, eagle3: bool, target: nn.Module, qkv_bias: bool, fc_bias: bool, own_embed: bool,
                 dtype: torch.dtype, device: torch.device, max_position: int) -> None:
        super().__init__()
        H = cfg.hidden_size
        self.eagle3 = eagle3
        self.hidden_size = H
        head_dim = getattr(cfg, "head_dim", None) or H // cfg.num_attention_heads
        self.rotary_emb = RotaryEmbedding(cfg, head_dim, max(max_position, 1), dtype, device)
        self.layers = nn.ModuleList([EagleDecoderLayer(cfg, self.rotary_emb, eagle3, qkv_bias, dtype, device)])
        target_embed = target.model.embed_tokens
        self._target = [target]   # a list: not a submodule
        if eagle3:
            target_hidden = getattr(cfg, "target_hidden_size", None) or H
            self.fc = Linear(3 * target_hidden, [H], fc_bias, dtype, device)
            self.norm = RMSNorm(H, cfg.rms_norm_eps, dtype, device)
            self.draft_vocab_size = getattr(cfg, "draft_vocab_size", None) or cfg.vocab_size
            self.lm_head = Linear(H, [self.draft_vocab_size], False, dtype, device)
            self.d2t = nn.Parameter(torch.zeros(self.draft_vocab_size, dtype=torch.int64, device=device),
                                    requires_grad=False)
        else:
            self.fc = Linear(2 * H, [H], fc_bias, dtype, device)
        if own_embed:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, H, dtype=dtype, device=device)
            self.embed_tokens.weight.requires_grad_(False)
        else:
            self._embed = [target_embed]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        table = self.embed_tokens if hasattr(self, "embed_tokens") else self._embed[0]
        return table(input_ids)

    def combine(self, target_hidden: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
        """The target's states at each position -> the head's hidden input [T, H]. EAGLE-1: the final hidden
        state [T, H] as is; EAGLE-3: fc over the aux states (a list of [T, H_target], low to high)."""
        if not self.eagle3:
            return target_hidden
        return self.fc(torch.cat(list(target_hidden), dim=-1))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """One head step over T tokens.

        Args:
            input_ids: [T] int64, the token after each position (token_{p+1}).
            positions: [T] int64, the positions p (the target's).
            hidden: [T, H], ``combine``'s output (the target's states at p) or the head's own previous output.
            ctx: attention metadata and the head's KV cache (one layer).

        Returns:
            (for_logits [T, H], next_hidden [T, H]).
        """
        embeds = self.embed(input_ids)
        if self.eagle3:
            x, residual = self.layers[0](positions, hidden, embeds, ctx)
            return self.norm(x, residual)        # (norm(x + residual), x + residual)
        x = self.fc(torch.cat([embeds, hidden], dim=-1))
        x, residual = self.layers[0](positions, x, None, ctx)
        out = x + residual
        return out, out

    def propose_ids(self, for_logits: torch.Tensor) -> torch.Tensor:
        """[R, H] -> [R] int64 greedy proposals in target token ids."""
        if not self.eagle3:
            return self._target[0].compute_logits(for_logits).argmax(dim=-1)
        draft = self.lm_head(for_logits).argmax(dim=-1)
        return draft + self.d2t[draft]

    # ------------------------------------------------------------------ checkpoint names
    @staticmethod
    def rename_checkpoint_key(name: str) -> str:
        if name.startswith("model."):
            name = name[len("model."):]
        return name.replace("midlayer.", "layers.0.", 1) if name.startswith("midlayer.") else name

    def ignored_checkpoint_key(self, name: str) -> bool:
        if "rotary_emb.inv_freq" in name or name == "t2d":
            return True
        if name == "embed_tokens.weight" and not hasattr(self, "embed_tokens"):
            return True   # EAGLE-1 heads ship a copy of the target's embedding; the target's is used
        return not self.eagle3 and name == "layers.0.input_layernorm.weight"


def eagle_head_tensor_flags(names: set[str]) -> dict[str, bool]:
    """What a head checkpoint holds, from its tensor names (after ``rename_checkpoint_key``)."""
    return {"qkv_bias": "layers.0.self_attn.q_proj.bias" in names, "fc_bias": "fc.bias" in names,
            "own_embed": "embed_tokens.weight" in names}


def build_eagle_head(head_config, target: nn.Module, device: torch.device,
                     weights: Callable[[], Any]) -> EagleHead:
    """Build and load a head: ``head_config`` an EagleHeadConfig (hayabusa/spec_decode/eagle_config.py; its
    ``tensor_names()`` say which optional tensors the checkpoint has), ``weights()`` an iterator of (checkpoint
    name, tensor).

    Raises:
        HayabusaValidationError: the checkpoint is not a head for this target (a tensor with no place in the head,
            a missing one, a shape that does not fit), naming ``speculative_config`` and the head's folder.
    """
    from hayabusa.errors import HayabusaValidationError
    from hayabusa.model.loader import load_weights, maybe_use_small_m_linears

    names = {EagleHead.rename_checkpoint_key(n) for n in head_config.tensor_names()}
    flags = eagle_head_tensor_flags(names)
    eagle3 = head_config.method == "eagle3"
    flags["own_embed"] = flags["own_embed"] and eagle3
    with torch.device(device):
        head = EagleHead(head_config.hf_config, eagle3, target, dtype=head_config.dtype, device=device,
                         max_position=head_config.max_model_len, **flags)
    try:
        load_weights(head, weights())
    except (ValueError, RuntimeError) as e:   # HayabusaValidationError is a ValueError too
        where = getattr(head_config, "model", None) or "the head"
        raise HayabusaValidationError(
            f"speculative_config: {where} is not a {head_config.method} head for this target ({e}); give the "
            "folder of an EAGLE / EAGLE-3 head trained for this model in speculative_config['model'].",
            parameter="speculative_config", value=where) from None
    # HAYABUSA_SMALL_M_LINEAR reaches the head's own layers as the target's (never in batch-invariant mode: it
    # refuses speculative decoding); the head's lm_head (EAGLE-3) is one of its Linears
    maybe_use_small_m_linears(head, head_config, device)
    return head.eval()


__all__ = ["EagleHead", "build_eagle_head", "eagle_head_tensor_flags"]
