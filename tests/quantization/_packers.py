"""The tests' own AWQ / GPTQ / bitsandbytes writers: round-to-nearest quantization of a float HF checkpoint, packed
the way AutoAWQ, AutoGPTQ / GPTQModel and bitsandbytes store it, written from the formats' descriptions with numpy
bit operations (nothing here imports hayabusa.quantization, so a loader bug cannot cancel out).

Also a command line, for the fidelity rows of BENCHMARKS.md:
    python -m tests.quantization._packers awq|gptq SRC OUT [--group-size 32] [--skip gate_proj,up_proj,down_proj]
        [--desc-act] [--asym] [--bits 4]

Formats (see hayabusa/quantization/awq.py, gptq.py, bitsandbytes.py for the loader side):
  AWQ   qweight [K, N/8] int32: word c's nibble i (bits 4i..) holds column 8c + ORDER[i], ORDER = 0 2 4 6 1 3 5 7;
        qzeros [K/G, N/8] the same; scales [K/G, N] fp16; W[k, n] = (q - z) * s.
  GPTQ  qweight [K/f, N] int32, f = 32/bits: row f*i + j in field j (low first); qzeros [K/G, N/f] packed along N
        the same way, holding zero - 1 in v1 ("gptq"), zero in v2 ("gptq_v2"); scales [K/G, N] fp16;
        g_idx [K] int32 (row -> group); W[k, n] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n].
  bnb   8-bit: weight int8 [N, K], SCB fp32 [N] (row absmax), weight_format uint8 0; W = weight * SCB / 127.
        4-bit: weight uint8 [N*K/2, 1] (two codes per byte, first in the high nibble, W flattened row-major),
        weight.absmax fp32 [N*K/64], weight.quant_map fp32 [16], weight.quant_state.bitsandbytes__nf4 (JSON bytes).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# NF4 code values (QLoRA, arXiv:2305.14314, Appendix E; the table bitsandbytes stores as quant_map)
NF4 = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
       -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
       0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0)


# ---------------------------------------------------------------------------------------------- RTN quantizer
def rtn(w: torch.Tensor, g_idx: torch.Tensor, num_groups: int, bits: int, sym: bool):
    """Round-to-nearest per (group, output channel) of w [N, K] fp32, groups given by g_idx [K].

    Returns (q [K, N] int64 in 0..2^bits-1, scales [num_groups, N] fp16, zeros [num_groups, N] int64).
    asym: scale = (max(w, 0) - min(w, 0)) / maxq, zero = round(-min / scale); sym (GPTQ's): scale = 2 amax / maxq,
    zero = (maxq + 1) / 2.
    """
    maxq = 2 ** bits - 1
    N, K = w.shape
    q = torch.empty(K, N, dtype=torch.int64)
    scales = torch.empty(num_groups, N, dtype=torch.float16)
    zeros = torch.empty(num_groups, N, dtype=torch.int64)
    for g in range(num_groups):
        rows = (g_idx == g).nonzero().flatten()
        wg = w[:, rows]                                                   # [N, rows]
        if sym:
            s = (2 * wg.abs().amax(1) / maxq).clamp_min(1e-6).half()
            z = torch.full((N,), (maxq + 1) // 2, dtype=torch.int64)
        else:
            lo, hi = wg.amin(1).clamp_max(0), wg.amax(1).clamp_min(0)
            s = ((hi - lo) / maxq).clamp_min(1e-6).half()
            z = torch.round(-lo / s.float()).clamp(0, maxq).long()
        q[rows] = (torch.round(wg / s.float()[:, None]).long() + z[:, None]).clamp(0, maxq).t()
        scales[g], zeros[g] = s, z
    return q, scales, zeros


def dequant(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    """W [N, K] fp32 = ((q[k, n] - zeros[g_idx[k], n]) * scales[g_idx[k], n]) transposed."""
    return ((q - zeros[g_idx]).float() * scales.float()[g_idx]).t().contiguous()


# ---------------------------------------------------------------------------------------------- bit packing
def pack_along_cols(v: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """v [R, C] unsigned fields -> int32 [R, C * bits / 32]: word c's field i holds column c * f + order[i]."""
    f = 32 // bits
    order = order or tuple(range(f))
    a = v.numpy().astype(np.uint64) & ((1 << bits) - 1)
    R, C = a.shape
    out = np.zeros((R, C // f), dtype=np.uint64)
    for i in range(f):
        out |= a.reshape(R, C // f, f)[:, :, order[i]] << np.uint64(bits * i)
    return torch.from_numpy(out.astype(np.uint32).view(np.int32))


def pack_along_rows(v: torch.Tensor, bits: int) -> torch.Tensor:
    """v [K, N] -> int32 [K * bits / 32, N]: word i of column n holds rows f * i + j in field j (low first)."""
    return pack_along_cols(v.t().contiguous(), bits).t().contiguous()


# ---------------------------------------------------------------------------------------------- checkpoints
def _linear_keys(state: dict[str, torch.Tensor], skip: tuple[str, ...]) -> list[str]:
    return [k for k in state if k.endswith(tuple(f".{n}.weight" for n in LINEARS))
            and not any(f".{s}." in k for s in skip)]


def _act_order_g_idx(module: str, K: int, G: int, desc_act: bool) -> torch.Tensor:
    """i // G, or with desc_act the group of each row when rows are quantized in a random order P (GPTQ's
    g_idx[P[i]] = i // G). q/k/v (and gate/up) share an input, hence one order: seeded by the input's name."""
    if not desc_act:
        return torch.arange(K) // G
    shared = module.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace("up_proj", "gate_proj")
    gen = torch.Generator().manual_seed(sum(map(ord, shared)) * 7919 + K)
    perm = torch.randperm(K, generator=gen)
    g_idx = torch.empty(K, dtype=torch.long)
    g_idx[perm] = torch.arange(K) // G
    return g_idx


def write_quantized(src: str, out: Path, fmt: str, group_size: int = 128, bits: int = 4, sym: bool = False,
                    desc_act: bool = False, gptq_version: int = 1, skip: tuple[str, ...] = (),
                    dequantized_out: Path | None = None) -> dict[str, torch.Tensor]:
    """Quantize the float HF checkpoint ``src`` with RTN and write it to ``out`` as ``fmt`` ("awq" | "gptq").

    Layers whose name contains ``.{s}.`` for s in skip stay float (listed in modules_to_not_convert). With
    ``dequantized_out`` also writes the float checkpoint of the dequantized weights (the exact model the quantized
    one encodes). Returns {module name: dequantized W [N, K] fp32}.
    """
    from safetensors.torch import load_file

    state = load_file(str(Path(src) / "model.safetensors"))
    tensors, deq_state, deq = dict(state), dict(state), {}
    for key in _linear_keys(state, skip):
        module, w = key[: -len(".weight")], state[key].float()
        N, K = w.shape
        G = K if group_size == -1 else group_size
        g_idx = _act_order_g_idx(module, K, G, desc_act and fmt == "gptq")
        q, s, z = rtn(w, g_idx, K // G, bits, sym and fmt == "gptq")
        del tensors[key]
        if fmt == "awq":
            tensors[f"{module}.qweight"] = pack_along_cols(q, 4, AWQ_ORDER)
            tensors[f"{module}.qzeros"] = pack_along_cols(z, 4, AWQ_ORDER)
        else:
            stored = (z - 1) & (2 ** bits - 1) if gptq_version == 1 else z
            tensors[f"{module}.qweight"] = pack_along_rows(q, bits)
            tensors[f"{module}.qzeros"] = pack_along_cols(stored, bits)
            tensors[f"{module}.g_idx"] = g_idx.to(torch.int32)
            if gptq_version == 1:   # what a v1 reader sees: the stored field + 1 (16 where the zero was 0)
                z = stored + 1
        tensors[f"{module}.scales"] = s
        deq[module] = deq_state[key] = dequant(q, s, z, g_idx)
    _save(src, out, tensors, _config(fmt, group_size, bits, sym, desc_act, gptq_version, skip))
    if dequantized_out is not None:
        _save(src, dequantized_out, deq_state, None)
    return deq


def _config(fmt, group_size, bits, sym, desc_act, version, skip) -> dict:
    skip_names = list(skip)
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": skip_names or None}
    return {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": sym,
            "checkpoint_format": "gptq" if version == 1 else "gptq_v2", "modules_to_not_convert": skip_names or None}


def _save(src: str, out: Path, tensors: dict[str, torch.Tensor], qc: dict | None) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for f in Path(src).iterdir():
        if f.is_file() and f.name != "model.safetensors" and not f.name.endswith(".gguf"):
            shutil.copy(f, out / f.name)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    if qc is not None:
        cfg = json.loads((out / "config.json").read_text())
        cfg["quantization_config"] = qc
        (out / "config.json").write_text(json.dumps(cfg, indent=2))


# ---------------------------------------------------------------------------------------------- bitsandbytes
def write_bnb_8bit(src: str, out: Path, dequantized_out: Path | None = None) -> dict[str, torch.Tensor]:
    """LLM.int8() row-wise: SCB = row absmax, weight = round(w * 127 / SCB). Returns {module: W = weight * SCB/127}."""
    from safetensors.torch import load_file

    state = load_file(str(Path(src) / "model.safetensors"))
    tensors, deq_state, deq = dict(state), dict(state), {}
    for key in _linear_keys(state, ()):
        module, w = key[: -len(".weight")], state[key].float()
        scb = w.abs().amax(1).clamp_min(1e-6)
        q = torch.round(w * 127.0 / scb[:, None]).clamp(-127, 127).to(torch.int8)
        tensors[key], tensors[f"{module}.SCB"] = q, scb
        tensors[f"{module}.weight_format"] = torch.tensor(0, dtype=torch.uint8)
        deq[module] = deq_state[key] = q.float() * (scb / 127.0)[:, None]
    qc = {"quant_method": "bitsandbytes", "load_in_8bit": True, "load_in_4bit": False,
          "llm_int8_threshold": 6.0, "llm_int8_skip_modules": None}
    _save(src, out, tensors, qc)
    if dequantized_out is not None:
        _save(src, dequantized_out, deq_state, None)
    return deq


def nf4_quantize(w: torch.Tensor, blocksize: int = 64) -> dict[str, torch.Tensor]:
    """NF4 without double quantization, as bitsandbytes stores it: each block of ``blocksize`` values of w [N, K]
    flattened row-major is scaled by its absmax and each value takes the nearest NF4 code."""
    N, K = w.shape
    flat = w.float().reshape(-1, blocksize)
    absmax = flat.abs().amax(1).clamp_min(1e-6)
    table = torch.tensor(NF4)
    codes = ((flat / absmax[:, None]).unsqueeze(-1) - table).abs().argmin(-1).flatten()     # [N * K]
    packed = (codes[0::2] << 4 | codes[1::2]).to(torch.uint8).unsqueeze(1)
    meta = {"quant_type": "nf4", "blocksize": blocksize, "dtype": "float32", "shape": [N, K]}
    return {"weight": packed, "absmax": absmax, "quant_map": table,
            "quant_state.bitsandbytes__nf4": torch.tensor(list(json.dumps(meta).encode()), dtype=torch.uint8)}


def bnb4_dequant(pieces: dict[str, torch.Tensor], shape: tuple[int, int]) -> torch.Tensor:
    """W [N, K] fp32 from a 4-bit checkpoint's tensors (codes, quant_map, absmax; nested absmax when present:
    absmax = nested_quant_map[code] * nested_absmax[i // 256] + offset)."""
    b = pieces["weight"].flatten().long()
    codes = torch.stack([b >> 4, b & 15], dim=1).flatten()
    meta = json.loads(bytes(pieces["quant_state"].tolist()).decode())
    absmax = pieces["absmax"]
    if "nested_absmax" in pieces:
        nb = meta["nested_blocksize"]
        idx = torch.arange(absmax.numel())
        absmax = pieces["nested_quant_map"][absmax.long()] * pieces["nested_absmax"][idx // nb] + meta["nested_offset"]
    vals = pieces["quant_map"][codes] * absmax.float()[torch.arange(codes.numel()) // meta["blocksize"]]
    return vals.reshape(shape)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tests.quantization._packers")
    p.add_argument("fmt", choices=["awq", "gptq"])
    p.add_argument("src")
    p.add_argument("out")
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--asym", action="store_true", help="GPTQ: asymmetric zeros (AWQ is always asymmetric)")
    p.add_argument("--desc-act", action="store_true")
    p.add_argument("--gptq-v2", action="store_true")
    p.add_argument("--skip", default="", help="comma-separated module names left float (modules_to_not_convert)")
    a = p.parse_args(argv)
    skip = tuple(s for s in a.skip.split(",") if s)
    write_quantized(a.src, Path(a.out), a.fmt, a.group_size, a.bits, sym=not a.asym, desc_act=a.desc_act,
                    gptq_version=2 if a.gptq_v2 else 1, skip=skip)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
