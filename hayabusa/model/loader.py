"""Checkpoint loading: HF folder or Hub id -> model with every parameter loaded.

Only safetensors by default: pickle ``.bin`` checkpoints can execute code when loaded, so they need
``load_format="pt"``. Every checkpoint tensor must map to a parameter and every parameter must be loaded;
anything else is an error that names the keys.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Iterator

import torch
from torch import nn

from hayabusa.errors import HayabusaValidationError
from hayabusa.model.layers.attention import load_kv_scale


def resolve_model_dir(model: str, revision: str | None = None, download_dir: str | None = None,
                      allow_pt: bool = False) -> str:
    """A local folder holding config.json and the weights. Hub ids are fetched with huggingface_hub
    (respects HF_HUB_OFFLINE and the HF cache).

    Raises:
        HayabusaValidationError: the folder does not exist / has no config.json, or the Hub cannot provide it.
    """
    if os.path.isdir(model):
        if not os.path.exists(os.path.join(model, "config.json")):
            raise HayabusaValidationError(f"model folder {model!r} has no config.json.", parameter="model",
                                          value=model)
        return os.path.abspath(model)
    if os.path.exists(model) or model.startswith((".", "/")) or model.count("/") > 1:
        raise HayabusaValidationError(f"model {model!r} is neither a folder nor a Hugging Face Hub id.",
                                      parameter="model", value=model)
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
    if allow_pt:
        patterns.append("*.bin")
    try:
        return snapshot_download(model, revision=revision, cache_dir=download_dir, allow_patterns=patterns)
    except Exception as e:  # network, auth, not found: all end the same way for the user
        raise HayabusaValidationError(
            f"could not get model {model!r} from the Hugging Face Hub ({type(e).__name__}: {e}). Pass a local "
            "folder, or check the id, your network and HF_TOKEN.", parameter="model", value=model) from None


def checkpoint_files(model_dir: str, allow_pt: bool) -> tuple[str, list[str]]:
    """("safetensors" | "pt", files). Raises HayabusaValidationError when there is nothing loadable."""
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(model_dir, n) for n in names]
    if files:
        return "safetensors", files
    pt = sorted(glob.glob(os.path.join(model_dir, "*.bin")))
    if pt and not allow_pt:
        raise HayabusaValidationError(
            f"{model_dir} has only pickle .bin weights, which can run code when loaded. Convert them to "
            "safetensors, or pass load_format='pt' if you trust the checkpoint.", parameter="load_format",
            value="auto")
    if pt:
        return "pt", pt
    raise HayabusaValidationError(f"no *.safetensors weights in {model_dir}.", parameter="model", value=model_dir)


def iterate_weights(model_dir: str, allow_pt: bool, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every checkpoint tensor, read straight to ``device`` for safetensors."""
    kind, files = checkpoint_files(model_dir, allow_pt)
    if kind == "safetensors":
        from safetensors import safe_open

        for path in files:
            with safe_open(path, framework="pt", device=str(device)) as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
    else:
        for path in files:
            state = torch.load(path, map_location="cpu", weights_only=True)
            yield from state.items()


def load_weights(model: nn.Module, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Copy checkpoint tensors into ``model``'s parameters.

    Floating-point tensors are cast to the parameter's dtype (a bf16 checkpoint into an fp32 model, bf16 scales
    into fp32 scale parameters); fp8 tensors load only into fp8 parameters of the same format, and integer
    (packed) tensors only into integer parameters, never cast to a float. Parameters marked ``optional`` (see
    ``hayabusa/quantization/base.py``) may be absent from the checkpoint altogether.

    Raises:
        HayabusaValidationError: a checkpoint key has no parameter, a parameter got no tensor, or a tensor's
            dtype cannot go into its parameter.
    """
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    unused: list[str] = []
    mapping = getattr(model, "stacked_params_mapping", [])
    rename = getattr(model, "rename_checkpoint_key", None)  # e.g. GPT-2 files without the "transformer." prefix
    for name, tensor in weights:
        if rename is not None:
            name = rename(name)
        if model.ignored_checkpoint_key(name):
            continue
        if load_kv_scale(model, name, tensor):  # an Attention layer's k_scale / v_scale (optional buffers)
            continue
        target, shard = name, None
        for ours, theirs, shard_id in mapping:
            if theirs in name:
                target, shard = name.replace(theirs, ours), shard_id
                break
        param = params.get(target)
        if param is None:
            if not _is_zero_bias_of_biasless_linear(model, target, tensor):
                unused.append(name)
            continue
        loader = getattr(param, "weight_loader", None)
        data = _cast_for(param, tensor, name)
        if loader is not None:
            loader(param, data, shard)
        else:
            if param.shape != data.shape:
                raise HayabusaValidationError(f"checkpoint tensor {name} has shape {tuple(data.shape)}, the model "
                                              f"expects {tuple(param.shape)}.", parameter="model", value=name)
            param.data.copy_(data)
        loaded.add(f"{target}#{shard}")
    expected = set()
    for pname, p in params.items():
        owner = _owner_of(model, pname)
        names = getattr(owner, "shard_names", None) if owner is not None else None
        keys = {f"{pname}#{s}" for s in names} if names else {f"{pname}#None"}
        if getattr(p, "optional", False) and not keys & loaded:
            continue
        expected |= keys
    missing = sorted(expected - loaded)
    if unused or missing:
        raise HayabusaValidationError(
            "checkpoint does not match the model: " + "; ".join(
                part for part in (
                    f"unused checkpoint tensors {unused[:8]}{'...' if len(unused) > 8 else ''}" if unused else "",
                    f"parameters not in the checkpoint {missing[:8]}{'...' if len(missing) > 8 else ''}" if missing
                    else "") if part) + ".", parameter="model", value=(unused or missing)[0])


_FP8_DTYPES = {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
               if hasattr(torch, n)}


def _cast_for(param: torch.Tensor, tensor: torch.Tensor, name: str) -> torch.Tensor:
    """``tensor`` in ``param``'s dtype where that is a plain float-to-float or int-to-int cast; else an error."""
    if tensor.dtype == param.dtype:
        return tensor
    src_fp8, dst_fp8 = tensor.dtype in _FP8_DTYPES, param.dtype in _FP8_DTYPES
    src_float, dst_float = tensor.dtype.is_floating_point, param.dtype.is_floating_point
    if (src_float and dst_float and not src_fp8 and not dst_fp8) or (not src_float and not dst_float):
        return tensor.to(dtype=param.dtype)
    why = ("an fp8 tensor needs its scales: is the checkpoint quantized but its quantization_config missing, "
           "or does this layer's format differ?" if src_fp8 else "the checkpoint and the model disagree on "
           "how this layer is quantized (check quantization= and the checkpoint's quantization_config).")
    raise HayabusaValidationError(f"checkpoint tensor {name} is {str(tensor.dtype).replace('torch.', '')}; the "
                                  f"model parameter is {str(param.dtype).replace('torch.', '')}: {why}",
                                  parameter="model", value=name)


def _is_zero_bias_of_biasless_linear(model: nn.Module, target: str, tensor: torch.Tensor) -> bool:
    """An all-zero ``bias`` for one of our Linear layers that has no bias (AutoGPTQ writes these for every
    quantized layer): adding zero changes nothing, so it is skipped instead of refused, as vLLM skips it."""
    if not target.endswith(".bias") or not tensor.is_floating_point():
        return False
    from hayabusa.model.layers.linear import Linear

    owner = _owner_of(model, target)
    return isinstance(owner, Linear) and owner.bias is None and not bool(tensor.any())


def _owner_of(model: nn.Module, param_name: str) -> nn.Module | None:
    module_name = param_name.rsplit(".", 1)[0]
    try:
        return model.get_submodule(module_name)
    except AttributeError:
        return None


def build_model(model_config, device: torch.device) -> nn.Module:
    """Instantiate the architecture's class on ``device``, give each Linear its quantization method, load the
    weights and let each method process them (see ``hayabusa/quantization/base.py``)."""
    from hayabusa.model.registry import get_model_class
    from hayabusa.quantization import set_quantization_config

    cls = get_model_class(model_config.architecture)
    quant_config = getattr(model_config, "quant_config", None)
    with torch.device(device), set_quantization_config(quant_config):
        # a multimodal model is built from the whole config (vision_config too), the others from the text config
        hf_config = model_config.multimodal_config if getattr(cls, "is_multimodal", False) else model_config.hf_config
        model = cls(hf_config, model_config.dtype, device, model_config.max_model_len)
    if quant_config is not None:
        create_linear_weights(model, quant_config)
    allow_pt = model_config.load_format == "pt"
    weights = iterate_weights(model_config.model, allow_pt, device)
    if quant_config is not None:
        weights = ((quant_config.checkpoint_key(name), t) for name, t in weights)
    load_weights(model, weights)
    process_weights_after_loading(model)
    if quant_config is not None and device.type == "cuda":
        torch.cuda.empty_cache()   # the high-precision copies that online schemes freed
    if getattr(model_config, "batch_invariant", False):
        use_batch_invariant_linears(model)
    else:
        maybe_use_small_m_linears(model, model_config, device)
    return model.eval()


# the device types HAYABUSA_SMALL_M_LINEAR applies on (the kernel runs in the CPU engine only under the interpreter)
SMALL_M_DEVICE_TYPES: tuple[str, ...] = ("cuda",)


def maybe_use_small_m_linears(model: nn.Module, model_config, device: torch.device) -> bool:
    """``use_small_m_linears`` where the small-M kernels apply: ``small_m_enabled(device)``
    (``HAYABUSA_SMALL_M_LINEAR`` when set, else a CUDA device of compute capability 9.0+), ``device`` (where the
    model runs) CUDA, a bf16 / fp16 model, not batch-invariant mode. build_model calls it, and build_sharded_model once
    the shard is on its device (tensor / pipeline parallel workers build on the host). Returns whether it did.

    Raises:
        HayabusaValidationError: the switch's value is not one (``envs.env_flag``), on any device and dtype.
    """
    from hayabusa.kernels.small_m_linear import small_m_enabled

    # the switch is read first, so a value that is not one is refused wherever the model loads (CPU, fp32 too)
    if not small_m_enabled(device) or getattr(model_config, "batch_invariant", False) \
            or device.type not in SMALL_M_DEVICE_TYPES or model_config.dtype not in (torch.bfloat16, torch.float16):
        return False
    use_small_m_linears(model)
    return True


def _swap_unquantized_linears(model: nn.Module, method: type, logits_linear, refuse: str | None = None) -> None:
    """Every unquantized Linear (exactly ``UnquantizedLinearMethod``) gets ``method()`` and the lm_head
    (``model.logits_linear``, which every architecture has) ``logits_linear``: a mode that multiplies the same
    weights another way. With ``refuse`` (the mode's name), any other Linear is a ValueError naming it; without, it
    keeps its own kernel."""
    from hayabusa.model.layers.linear import Linear
    from hayabusa.quantization.base import UnquantizedLinearMethod

    for module in model.modules():
        if isinstance(module, Linear):
            if type(module.quant_method) is UnquantizedLinearMethod:
                module.quant_method = method()
            elif refuse is not None:
                raise ValueError(f"{refuse}: a {type(module.quant_method).__name__} linear is not covered")
    model.logits_linear = logits_linear


def use_small_m_linears(model: nn.Module) -> None:
    """The small-M kernels (where ``maybe_use_small_m_linears`` finds they apply; on by default on Hopper): every
    unquantized Linear and the lm_head (``model.logits_linear``) multiply 1-16 rows with
    ``kernels/small_m_linear.small_m_linear`` (the weight streamed once by 16-row tl.dot tiles) and more rows with
    F.linear as before. Quantized linears keep their own kernels."""
    from hayabusa.kernels.small_m_linear import linear_small_m
    from hayabusa.quantization.base import SmallMLinearMethod

    _swap_unquantized_linears(model, SmallMLinearMethod, linear_small_m)


def use_batch_invariant_linears(model: nn.Module) -> None:
    """Batch-invariant mode: every unquantized Linear and the lm_head (``model.logits_linear``) multiply through
    ``kernels/batch_invariant.linear_bi`` (tiles and K chunks fixed per weight shape). Quantized linears never get
    here (``check_batch_invariant`` refuses them by name)."""
    from hayabusa.kernels.batch_invariant import linear_bi
    from hayabusa.kernels.bi_gemm import reserve_tile_counters
    from hayabusa.quantization.base import BatchInvariantLinearMethod

    _swap_unquantized_linears(model, BatchInvariantLinearMethod, linear_bi, refuse="batch_invariant")
    param = next(model.parameters(), None)
    if param is not None and param.is_cuda:
        reserve_tile_counters(param.device)     # the GEMM's workspace, before any CUDA-graph capture


def create_linear_weights(model: nn.Module, quant_config) -> None:
    """Ask ``quant_config`` for each deferred Linear's method, by module name; lm_head is never quantized (as in
    vLLM: the logits keep the model dtype). ``layer.checkpoint_prefixes`` gives the config each shard's
    checkpoint module name (our merged ``qkv_proj`` is q_proj / k_proj / v_proj there) for its ignore lists."""
    from hayabusa.model.layers.linear import Linear
    from hayabusa.quantization import UnquantizedLinearMethod

    mapping = getattr(model, "stacked_params_mapping", [])
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or module.quant_method is not None:
            continue
        module.checkpoint_prefixes = _checkpoint_prefixes(name, module, mapping)
        method = None
        if name != "lm_head" and not name.endswith(".lm_head"):
            method = quant_config.get_linear_method(name, module)
        module.create_weights(method or UnquantizedLinearMethod())


def _checkpoint_prefixes(name: str, layer: nn.Module, mapping: list[tuple[str, str, str]]) -> list[str]:
    """Checkpoint module name of each shard of the Linear ``name`` (in ``shard_names`` order)."""
    dotted = name + "."
    by_shard = {shard: dotted.replace(ours, theirs)[:-1] for ours, theirs, shard in mapping if ours in dotted}
    shards = getattr(layer, "shard_names", [])
    if shards and all(s in by_shard for s in shards):
        return [by_shard[s] for s in shards]
    return [name]


def process_weights_after_loading(model: nn.Module) -> None:
    """Each Linear's quantization method turns its loaded parameters into what it runs with."""
    from hayabusa.model.layers.linear import Linear

    for module in model.modules():
        if isinstance(module, Linear) and module.quant_method is not None:
            module.quant_method.process_weights_after_loading(module)
