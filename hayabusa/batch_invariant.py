"""Batch-invariant mode (``LLM(..., batch_invariant=True)``, ``--batch-invariant``, ``HAYABUSA_BATCH_INVARIANT=1``):
a request's token ids and logprobs do not depend on the other requests of its steps, on max_num_seqs /
max_num_batched_tokens, on how its prompt was chunked, on prefix-cache hits or on CUDA graphs.

What the mode swaps (the kernels are in ``kernels/batch_invariant.py``; why each is invariant is said there):
linear layers and the lm_head -> ``linear_bi`` (``BatchInvariantLinearMethod``, ``model.logits_linear``);
attention -> ``get_attention_backend(device, batch_invariant=True)``; the sampler's log-softmax / softmax ->
``log_softmax_bi``. This module decides whether the mode is on and refuses, by name, what it does not cover.
"""

from __future__ import annotations

import os
from typing import Any

from hayabusa.envs import env_flag
from hayabusa.errors import HayabusaValidationError

ENV_VAR = "HAYABUSA_BATCH_INVARIANT"
# vLLM's variable for its batch-invariant mode (vllm/envs.py): a script or job environment written for vLLM that
# sets it gets the mode here too; HAYABUSA_BATCH_INVARIANT, when set, decides instead
VLLM_ENV_VAR = "VLLM_BATCH_INVARIANT"


def _deciding_env_var() -> str | None:
    """The environment variable that decides when the argument is None: HAYABUSA_BATCH_INVARIANT when set (empty
    included: off), else VLLM_BATCH_INVARIANT when set, else None."""
    return next((name for name in (ENV_VAR, VLLM_ENV_VAR) if name in os.environ), None)


def batch_invariant_requested(value: bool | None) -> bool:
    """The engine argument when given (True / False: an explicit False wins over the environment's value; a value
    that is not a switch is still refused when an engine is configured, by envs.check_switches), else
    ``HAYABUSA_BATCH_INVARIANT`` (1 / true / yes / on; unset, empty, 0 / false / no / off: off), else vLLM's
    ``VLLM_BATCH_INVARIANT`` read as vLLM reads it (an integer, nonzero = on; unset or empty: off) or in our
    spellings.

    Raises:
        HayabusaValidationError: any other value of the deciding variable, naming it."""
    if value is not None:
        return bool(value)
    name = _deciding_env_var()
    if name == VLLM_ENV_VAR:
        raw = os.environ[name].strip()
        if raw.lstrip("+-").isdigit():      # vllm/envs.py: bool(int(os.getenv("VLLM_BATCH_INVARIANT", "0")))
            return int(raw) != 0
    return env_flag(name, False) if name else False


def _refuse(parameter: str, value: Any, why: str, env_var: str | None) -> HayabusaValidationError:
    source = f" (from the environment variable {env_var}; pass batch_invariant=False or --no-batch-invariant to " \
        "turn the mode off)" if env_var else ""
    return HayabusaValidationError(f"{parameter}={value!r} is not supported with batch_invariant=True{source}: "
                                   f"{why}", parameter=parameter, value=value)


def check_batch_invariant(model_config: Any, tensor_parallel_size: int, speculative_config: Any,
                          from_env: bool = False) -> None:
    """Refuse, by name, what the mode does not cover (called when the mode is on).

    Encoder-decoder (T5) and vision (Qwen2-VL / Qwen2.5-VL) models are covered: their linears take the mode's
    GEMM like every other, the runner runs each request's encoder and each image's vision tower on its own (the
    tower's and encoder's shapes then depend on that request alone), and the attention backend adds T5's
    position bias in the mode's fixed key order. ``from_env``: the environment variable turned the mode on (the
    argument was None): the refusal says so.

    Raises:
        HayabusaValidationError: quantization (its kernels pick tiles / split-K by M), an encoder-decoder model in
            float16 (transformers' overflow clamp, decided per step), tensor_parallel_size > 1 (NCCL's all-reduce
            order depends on the message size), speculative decoding; a malformed HAYABUSA_BI_GEMM_CONFIGS or
            HAYABUSA_BI_GEMM_BUCKETS (kernels/bi_gemm.check_env_files).
    """
    from hayabusa.kernels.bi_gemm import check_env_files

    check_env_files()   # the GEMM's tuning variables, on any device
    env_var = _deciding_env_var() if from_env else None   # what a refusal names as having turned the mode on
    if model_config.quant_config is not None:
        raise _refuse("quantization", model_config.quantization, "the quantized linears' kernels choose their "
                      "tiling and split-K by the number of rows; drop quantization= (for a quantized checkpoint: "
                      "load an unquantized one), or turn the mode off.", env_var)
    if model_config.is_encoder_decoder and str(model_config.dtype) == "torch.float16":
        raise _refuse("dtype", "float16", "T5 in float16 clamps its residual stream as transformers does, and "
                      "whether a step clamps depends on every row of the step (an inf anywhere lowers every row's "
                      "limit); use dtype='bfloat16' or 'float32'.", env_var)
    if tensor_parallel_size > 1:
        raise _refuse("tensor_parallel_size", tensor_parallel_size, "the all-reduce's summation order depends on "
                      "the message size (the number of tokens in the step).", env_var)
    if speculative_config is not None:
        raise _refuse("speculative_config", speculative_config, "speculative decoding is not covered by the mode "
                      "yet.", env_var)
