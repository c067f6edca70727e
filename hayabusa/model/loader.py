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
    """Copy checkpoint tensors into ``model``'s parameters (casting dtype).

    Raises:
        HayabusaValidationError: a checkpoint key has no parameter, or a parameter got no tensor.
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
        target, shard = name, None
        for ours, theirs, shard_id in mapping:
            if theirs in name:
                target, shard = name.replace(theirs, ours), shard_id
                break
        param = params.get(target)
        if param is None:
            unused.append(name)
            continue
        loader = getattr(param, "weight_loader", None)
        data = tensor.to(dtype=param.dtype)
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
        expected |= {f"{pname}#{s}" for s in names} if names else {f"{pname}#None"}
    missing = sorted(expected - loaded)
    if unused or missing:
        raise HayabusaValidationError(
            "checkpoint does not match the model: "
            + (f"unused checkpoint tensors {unused[:8]}{'...' if len(unused) > 8 else ''}; " if unused else "")
            + (f"parameters not in the checkpoint {missing[:8]}{'...' if len(missing) > 8 else ''}" if missing
               else ""), parameter="model", value=(unused or missing)[0])


def _owner_of(model: nn.Module, param_name: str) -> nn.Module | None:
    module_name = param_name.rsplit(".", 1)[0]
    try:
        return model.get_submodule(module_name)
    except AttributeError:
        return None


def build_model(model_config, device: torch.device) -> nn.Module:
    """Instantiate the architecture's class on ``device`` and load its weights."""
    from hayabusa.model.registry import get_model_class

    cls = get_model_class(model_config.architecture)
    with torch.device(device):
        model = cls(model_config.hf_config, model_config.dtype, device, model_config.max_model_len)
    allow_pt = model_config.load_format == "pt"
    load_weights(model, iterate_weights(model_config.model, allow_pt, device))
    return model.eval()
