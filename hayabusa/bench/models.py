"""Random-weight checkpoints of real model shapes (BENCHMARKS.md "Models"), for speed runs without network.

``make_model("qwen2.5-7b-shape", DIR)`` writes ``config.json`` + bf16 safetensors (+ ``generation_config.json``)
and a small ``bench_shape.json`` that names the shape for the benchmark records. No tokenizer is written: every
workload uses token ids (run the engine with ``skip_tokenizer_init=True``).

The model is built on the ``meta`` device (no memory, no init), materialised with ``to_empty`` on the GPU when
there is one (else the CPU), and filled with ``torch.manual_seed(0)`` draws: normal(0, 0.02) for matrices and
embeddings, ones for norm weights, zeros for biases. A 7B checkpoint takes seconds on a GPU; on a CPU the draws
cost ~1-2 s per billion parameters per core.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch

# name -> (architecture, hidden, intermediate, layers, heads, kv heads, vocab, tied)
SHAPES: dict[str, tuple[str, int, int, int, int, int, int, bool]] = {
    "qwen2.5-0.5b-shape": ("Qwen2ForCausalLM", 896, 4864, 24, 14, 2, 151936, True),
    "qwen2.5-7b-shape": ("Qwen2ForCausalLM", 3584, 18944, 28, 28, 4, 152064, False),
    "llama-3-8b-shape": ("LlamaForCausalLM", 4096, 14336, 32, 32, 8, 128256, False),
    # tiny shapes for tests and CPU smoke runs: vocab >= 10000 because workload token ids are in [100, 10000)
    "tiny-llama": ("LlamaForCausalLM", 64, 128, 2, 4, 2, 10240, False),
    "tiny-qwen2": ("Qwen2ForCausalLM", 64, 128, 2, 4, 2, 10240, True),
    # small but with real head_dim (64) and GQA group (4): the batch-invariance CUDA test's model
    "small-qwen2": ("Qwen2ForCausalLM", 512, 1408, 4, 8, 2, 32000, True),
}
INIT_STD = 0.02
SHAPE_FILE = "bench_shape.json"


def _arch_shapes() -> dict[str, Any]:
    """Real shapes of the other supported architectures (from the models' public config.json files)."""
    from transformers import Gemma2Config, GPT2Config, MistralConfig, OPTConfig, Qwen3Config, T5Config

    def t5(**kw):   # google-t5/t5-small, t5-base (ReLU, tied and scaled head), google/flan-t5-large (gated-GELU)
        return T5Config(vocab_size=32128, d_kv=64, eos_token_id=1, pad_token_id=0, decoder_start_token_id=0, **kw)

    return {
        # rinna/japanese-gpt-1b: GPT-2 layout, 24 x 2048, vocab 44928, 1024 positions
        "rinna-gpt-1b-shape": lambda: GPT2Config(n_embd=2048, n_layer=24, n_head=16, vocab_size=44928,
                                                 n_positions=1024, activation_function="gelu_fast",
                                                 bos_token_id=1, eos_token_id=2),
        # facebook/opt-125m (vLLM's quickstart model): pre-LN, ReLU, 12 x 768, vocab 50272, 2048 positions, tied
        "opt-125m-shape": lambda: OPTConfig(hidden_size=768, num_hidden_layers=12, ffn_dim=3072,
                                            num_attention_heads=12, vocab_size=50272, max_position_embeddings=2048,
                                            pad_token_id=1, bos_token_id=2, eos_token_id=2),
        # Qwen/Qwen3-0.6B
        "qwen3-0.6b-shape": lambda: Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                                num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                                vocab_size=151936, tie_word_embeddings=True, rms_norm_eps=1e-6,
                                                max_position_embeddings=32768, rope_theta=1e6,
                                                bos_token_id=151643, eos_token_id=151645),
        # google/gemma-2-2b
        "gemma-2-2b-shape": lambda: Gemma2Config(hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                                                 num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                                                 vocab_size=256000, sliding_window=4096, max_position_embeddings=8192,
                                                 attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                                                 query_pre_attn_scalar=256, bos_token_id=2, eos_token_id=1),
        "t5-small-shape": lambda: t5(d_model=512, d_ff=2048, num_layers=6, num_heads=8),
        "t5-base-shape": lambda: t5(d_model=768, d_ff=3072, num_layers=12, num_heads=12),
        "flan-t5-large-shape": lambda: t5(d_model=1024, d_ff=2816, num_layers=24, num_heads=16,
                                          feed_forward_proj="gated-gelu", tie_word_embeddings=False),
        # mistralai/Mistral-7B-v0.1
        "mistral-7b-shape": lambda: MistralConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                                  num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                                                  sliding_window=4096, max_position_embeddings=32768,
                                                  bos_token_id=1, eos_token_id=2),
    }


ARCH_SHAPE_NAMES = ("rinna-gpt-1b-shape", "opt-125m-shape", "qwen3-0.6b-shape", "gemma-2-2b-shape", "mistral-7b-shape",
                    "t5-small-shape", "t5-base-shape", "flan-t5-large-shape")


def shape_config(name: str) -> Any:
    """The transformers config of shape `name` (bf16, max_position_embeddings 32768).

    Raises:
        ValueError: an unknown shape (the message lists the known ones).
    """
    from transformers import LlamaConfig, Qwen2Config

    if name in ARCH_SHAPE_NAMES:
        cfg = _arch_shapes()[name]()
        cfg.architectures = [{"gpt2": "GPT2LMHeadModel", "opt": "OPTForCausalLM", "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
                              "mistral": "MistralForCausalLM", "t5": "T5ForConditionalGeneration"}[cfg.model_type]]
        cfg.dtype = "bfloat16"
        return cfg
    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; known shapes: "
                         f"{', '.join(list(SHAPES) + list(ARCH_SHAPE_NAMES))}.")
    arch, hidden, inter, layers, heads, kv_heads, vocab, tied = SHAPES[name]
    common = dict(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                  tie_word_embeddings=tied, max_position_embeddings=32768, initializer_range=INIT_STD,
                  hidden_act="silu", attention_dropout=0.0, dtype="bfloat16")
    if arch == "Qwen2ForCausalLM":
        # Qwen2.5's special ids when the vocab is the real one; 0 otherwise (tiny shapes)
        eos = 151643 if vocab > 151643 else 1
        cfg = Qwen2Config(**common, rms_norm_eps=1e-6, rope_theta=1e6, use_sliding_window=False,
                          bos_token_id=eos, eos_token_id=eos)
    else:
        bos, eos = (128000, 128001) if vocab > 128001 else (1, 2)
        cfg = LlamaConfig(**common, rms_norm_eps=1e-5, rope_theta=5e5, bos_token_id=bos, eos_token_id=eos,
                          attention_bias=False, mlp_bias=False)
    cfg.architectures = [arch]
    _set_rope_theta(cfg, 1e6 if arch == "Qwen2ForCausalLM" else 5e5)
    return cfg


def _set_rope_theta(cfg: Any, theta: float) -> None:
    """transformers 5 keeps rope_theta in ``rope_parameters``; older versions in ``rope_theta``. Set both."""
    params = getattr(cfg, "rope_parameters", None)
    if isinstance(params, dict):
        params["rope_theta"] = theta
    cfg.rope_theta = theta


def shape_stats(name_or_config: Any) -> dict[str, int]:
    """Parameter counts of a shape, computed from the config (no weights).

    Returns:
        {"params": unique parameters, "embedding_params": vocab x hidden, "non_embedding_params": params minus
        the input embedding and (untied) lm_head, "vocab_size", "hidden_size", "num_layers", "num_heads",
        "num_kv_heads", "head_dim", "tied": 0/1}.
    """
    cfg = shape_config(name_or_config) if isinstance(name_or_config, str) else name_or_config
    if getattr(cfg, "model_type", "") not in ("llama", "qwen2"):
        return _counted_stats(cfg)
    h, i, n_layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or h // heads
    bias = h_bias = 0
    if getattr(cfg, "model_type", "") == "qwen2" or getattr(cfg, "attention_bias", False):
        bias = heads * d + 2 * kv * d                       # q, k, v biases
        h_bias = h if getattr(cfg, "attention_bias", False) else 0   # o_proj bias (Llama attention_bias)
    attn = h * heads * d + 2 * h * kv * d + heads * d * h + bias + h_bias
    layer = attn + 3 * h * i + 2 * h                        # attention + gate/up/down + two norms
    emb = cfg.vocab_size * h
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    non_emb = n_layers * layer + h                          # + final norm
    return {"params": non_emb + emb * (1 if tied else 2), "embedding_params": emb, "non_embedding_params": non_emb,
            "vocab_size": cfg.vocab_size, "hidden_size": h, "num_layers": n_layers, "num_heads": heads,
            "num_kv_heads": kv, "head_dim": d, "tied": int(tied)}


def linear_shapes(name: str) -> dict[str, tuple[int, int, bool]]:
    """The weight shapes of a Llama / Qwen2 shape's linears as the engine holds them (q/k/v and gate/up merged):
    {"qkv" | "o" | "gate_up" | "down" | "lm_head": (N, K, has_bias)}, N output features, K input features.
    E.g. qwen2.5-0.5b-shape: qkv (1152, 896, True), o (896, 896), gate_up (9728, 896), down (896, 4864),
    lm_head (151936, 896)."""
    st = shape_stats(name)
    cfg = shape_config(name)
    h, d = st["hidden_size"], st["head_dim"]
    q, kv = st["num_heads"] * d, st["num_kv_heads"] * d
    qkv_bias = cfg.model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False))
    return {"qkv": (q + 2 * kv, h, qkv_bias), "o": (h, q, False), "gate_up": (2 * cfg.intermediate_size, h, False),
            "down": (h, cfg.intermediate_size, False), "lm_head": (st["vocab_size"], h, False)}


def _counted_stats(cfg: Any) -> dict[str, int]:
    """shape_stats by counting the parameters of the HF model built on the meta device (any architecture)."""
    with torch.device("meta"):
        model = _auto_model_class(cfg).from_config(cfg)
    params = sum(p.numel() for p in model.parameters())
    emb = model.get_input_embeddings().weight.numel()
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    heads = cfg.num_attention_heads
    non_emb = params - emb * (1 if tied else 2)
    return {"params": params, "embedding_params": emb, "non_embedding_params": non_emb,
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_layers": cfg.num_hidden_layers,
            "num_heads": heads, "num_kv_heads": getattr(cfg, "num_key_value_heads", None) or heads,
            "head_dim": getattr(cfg, "head_dim", None) or getattr(cfg, "d_kv", None) or cfg.hidden_size // heads,
            "tied": int(tied)}


def _auto_model_class(cfg: Any):
    """AutoModelForSeq2SeqLM for encoder-decoder configs (T5), else AutoModelForCausalLM."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    return AutoModelForSeq2SeqLM if getattr(cfg, "is_encoder_decoder", False) else AutoModelForCausalLM


def fill_random(model: torch.nn.Module, seed: int) -> None:
    """normal(0, INIT_STD) matrices, ones for norms, zeros for biases; one seeded generator, fixed order."""
    gen_device = next(model.parameters()).device
    gen = torch.Generator(device=gen_device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # shared (tied) parameters appear once
            if name.endswith(".bias"):
                p.zero_()
            elif p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, INIT_STD, generator=gen)


def make_model(name: str, out_dir: str, device: str | None = None, seed: int = 0) -> dict[str, Any]:
    """Write a random-weight bf16 checkpoint of shape `name` into `out_dir` (created if needed).

    Args:
        name: a key of SHAPES.
        out_dir: target folder.
        device: where the weights are drawn ("cuda" when available, else "cpu").
        seed: torch seed of the draws.

    Returns:
        {"shape", "dir", "params", "bytes", "seconds", "device"}.
    """
    t0 = time.perf_counter()
    cfg = shape_config(name)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = _auto_model_class(cfg).from_config(cfg, dtype=torch.bfloat16)
    model = model.to_empty(device=device)
    model.tie_weights()
    fill_random(model, seed)
    # rotary inv_freq and other buffers are not saved but must be sane if anyone uses this in-process object
    model = model.to("cpu")
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, max_shard_size="100GB")
    n_params = sum(p.numel() for p in model.parameters())
    info = {"shape": name, "dir": out_dir, "params": n_params, "bytes": 2 * n_params,
            "seconds": round(time.perf_counter() - t0, 2), "device": device, "seed": seed}
    with open(os.path.join(out_dir, SHAPE_FILE), "w") as f:
        json.dump({**shape_stats(cfg), "shape": name, "seed": seed}, f, indent=1)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return info


def model_name(model_dir: str) -> str:
    """The shape name written by make_model, else the folder's base name."""
    path = os.path.join(model_dir, SHAPE_FILE)
    if os.path.exists(path):
        try:
            with open(path) as f:
                return json.load(f)["shape"]
        except (OSError, ValueError, KeyError):
            pass
    return os.path.basename(os.path.normpath(model_dir))


def model_stats(model_dir: str) -> dict[str, int] | None:
    """shape_stats of the checkpoint's config.json, or None when it cannot be read."""
    try:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(model_dir)
        cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        return shape_stats(cfg)
    except Exception:  # noqa: BLE001 -- stats are optional decoration of the record
        return None
