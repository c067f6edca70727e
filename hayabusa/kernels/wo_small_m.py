"""wo_small_m_linear: the weight-only int4 / int8 linears (W4A16 / W8A16, quant_linear's layouts) for a few rows
(batched decode), on small_m_linear's 16-row tl.dot tile loop (kernel + launcher + launch table).

    int4: y [M, N] = x [M, K] @ W (+ bias),   W[k, n] = (q[k, n] - zeros[k // G, n]) * scales[k // G, n]
          qweight [K // 8, N] int32 (GPTQ packing: k = 8i + j in bits 4j..4j+3 of row i), scales / zeros [K // G, N]
    int8: y [M, N] = x [M, K] @ W^T (+ bias), W[n, k] = qweight[n, k] * scales[n];  qweight [N, K] int8, scales [N]

Why (issue #24): at M = 5-64 the weight-only linears lost to bf16 cuBLAS on the H200 (7b gate_up int4 at M = 16:
~100 us against 70 us, BENCHMARKS.md "swapped-operand"), while kernels/small_m_linear.py streams bf16 weights at
89-97 % of copy bandwidth at M = 1-16 with one 16-row tl.dot tile per program (fp8_gemv.dot_tile_setup) and the
fused split-K reduction (fp8_gemv.SplitKPlan / splitk_finish). Int4 weights are a quarter of bf16's bytes, so that
loop streaming them with cheap in-register dequantization could beat bf16 by up to ~3x at M <= 16.

int4, kind "slab": the packed tile [BLOCK_K // 8, BLOCK_N] int32 is NOT rebuilt in k order (the nibble
interleave costs Triton layout conversions). A dot product sums over k in any order, so the tile is split into its 8
nibble slabs: slab s holds k = k0 + 8i + s, i < BLOCK_K // 8. Each becomes exact integers in x's dtype by
quant_linear's magic number (a nibble q OR 0x4300 is the bf16 128 + q, OR 0x6400 the fp16 1024 + q; minus (128 +
zero), resp. (1024 + zero), in that dtype: exact; one shift, one LOP3, one subtract per weight) and meets the x
columns k0 + s + 8i (a stride-8 load of x, which is tiny and stays in L1/L2) in one tl.dot [BLOCK_M, BLOCK_K // 8] @
[BLOCK_K // 8, BLOCK_N]; the 8 dots are summed in fp32 and the tile's group scale multiplies that partial once
(BLOCK_K divides G: one group per tile, as _wo_gemm_kernel). BLOCK_K = 128 makes each dot's K 16, the MMA minimum,
so "slab" needs G % 128 == 0 (GPTQ's usual 128). Kind "join" builds the [BLOCK_K, BLOCK_N] tile in k order with
quant_linear.int4_tile_t (tl.interleave = join + reshape) and does one dot: for groups of 16-64, and for the bench
to compare. int8, kind "slab" (a candidate): qweight read as int32 words (qweight.view(int32) [N, K // 4], K % 4 ==
0), the word tile [BLOCK_K // 4, BLOCK_N] split into its 4 byte slabs (slab b: k = k0 + 4i + b) against x's stride-4
columns, 4 dots of K = BLOCK_K // 4; kind "dot": the [BLOCK_K, BLOCK_N] byte tile as stored, one dot (what the H200
sweep chose for every int8 entry). Either way a byte becomes the exact integer q by the fp16 magic number ((q &
0xFF) ^ 0x6480 is the half 1152 + q: one LOP3 and one subtract; for bf16 x one exact fp16 -> bf16 conversion), and
the channel scale multiplies the fp32 sum at the end. Compiled for sm_90 (ptxas -v, Triton 3.6, bf16, 16 x 64 x 128
tiles, 4 warps): int4 slab 72 registers, join 158; int8 byte tile 255 with spills (4-byte pointers per weight byte),
which the word slabs avoid. x is bf16 / fp16; BLOCK_M 16 (16- to 128-row tiles for the bench and HAYABUSA_WO_MID_M).

int4 kinds "lop3" and "lop3j" (built in the twenty-sixth session without a GPU, measured on an H200 in the
twenty-seventh: "lop3" is the table's 16-row launch for square and deep layers, "lop3j" its 32-256-row one): the
slabs made by inline PTX, two packed words at a time (_lop3_asm: PRMT + LOP3 + packed FMA, as FasterTransformer /
Marlin convert int4). "lop3" is "slab" with those slabs (the same values). "lop3j" multiplies each slab by its group
scales in the same PTX (round((q - zero) * scale) in x's dtype, the weights dequantize + cuBLAS multiplies), joins
the 8 slabs into the k-ordered tile and runs one K = BLOCK_K dot into the loop's accumulator: on sm_90 the tile's 8
wgmma instructions issue back to back with one wait, where the slab kinds wait after each of their dots and rescale
a partial (benchmarks/kernels/sass_wo_small_m.py prints the loop's SASS without a GPU; BENCHMARKS.md "twenty-sixth
session").

Numerics: the dot operands are exact integers and x's values, so the products are exact and summed in fp32; only
the order of the sums differs from quant_ref's references (and the scale is applied per tile / split): fp32
rounding before one cast. "lop3j" rounds each weight to x's dtype first, as dequantize + cuBLAS does. In the
interpreter (CPU tests) the dot takes fp32 operands (DOT_FP32, as small_m_linear) and the kernel writes fp32, rounded
once by torch (the interpreter's bf16 cast truncates).

Switch: quant_linear._kernel_linear (this module registers with it at import) sends x with WO_SMALL_M_MIN_M <= M <=
WO_SMALL_M_MAX rows (up to WO_MID_M_MAX with HAYABUSA_WO_MID_M=1, at the keys of WO_MID_M_WINS; fp16 / bf16, CUDA
or the interpreter) here where quant_linear.wo_small_m_enabled: on by default on CUDA devices of compute capability
9.0+ (where the table was measured); ``HAYABUSA_WO_SMALL_M=0`` / ``=1`` (read at import) turns it off / on for any
CUDA device (off: the GEMV to 4 rows and the 16-row GEMM above, as before).
Measured on an H200 (``benchmarks/kernels/bench_quant_linear.py --small-m``, BENCHMARKS.md "twenty-second session"),
us summed over a 7B layer's qkv + o + gate_up + down: int4 at 4 rows 110 against the 4-row GEMV's 231, at 16 rows
171 against 301 (bf16 cuBLAS 126); int8 at 4 rows 92 against 325, at 16 rows 93 against 132 (bf16 126). At one row
the GEMV stays (int4 81 against 105 here). Past 16 rows neither kernel of this file beat bf16 cuBLAS on most layers.
No autotune: the launch comes from WO_SMALL_M_TABLE by (scheme, shape class, M bucket), the same every call (CUDA-
graph safe).
"""

from __future__ import annotations

import torch

from hayabusa.envs import env_flag
from hayabusa.kernels._triton import cdiv, tl, triton
from hayabusa.kernels.fp8_gemv import (
    FP8_AUTO_SPLIT_WAVES, SplitKPlan, dot_tile_setup, load_w_tile, load_x_tile, splitk_finish,
)
from hayabusa.kernels.pdl import pdl_wait
from hayabusa.kernels.quant_linear import (
    LaunchConfig, bf16_rne, check_on_device_contiguous, device_limits, gemm_shape_class, int4_tile_t, pow2_divisor,
    register_small_m_kernel, split_k_for,
)
from hayabusa.kernels.quant_ref import check_group_size
from hayabusa.kernels.small_m_linear import dot_acc, split_dot_launch_kwargs

# quant_linear routes at most this many rows here (one 16-row tile; up to WO_MID_M_MAX with USE_WO_MID_M); the
# launcher itself takes any M (tiles of BLOCK_M rows; the table has entries for 32-256 rows)
WO_SMALL_M_MAX = 16
# and at least this many (one row: quant_linear's GEMV, faster there; see the module docstring)
WO_SMALL_M_MIN_M = 2
WO_M_BUCKETS = (16, 32, 64, 128, 256)
WO_KINDS = {"int4": ("slab", "join", "lop3", "lop3j"), "int8": ("slab", "dot")}
# kind -> the kernel's (SLAB, LOP3, SCALE_W) constexprs as the launcher passes them on CUDA (wo_small_m_linear: int8's
# "slab" falls to the byte tile where qweight has no int32 words; LOP3 is off in the interpreter);
# benchmarks/kernels/sass_wo_small_m.py compiles launches from it
KIND_FLAGS = {"slab": (True, False, False), "join": (False, False, False), "dot": (False, False, False),
              "lop3": (True, True, False), "lop3j": (False, True, True)}
# the kinds that dot nibble / byte slabs one by one; the smallest BLOCK_K of their launches: each dot has K = BLOCK_K
# // (weights per int32) >= 16 ("lop3j" joins its slabs into one K = BLOCK_K tile: any BLOCK_K >= 16, as "join")
_SLAB_KINDS = tuple(k for k, (slab, _, _) in KIND_FLAGS.items() if slab)
_SLAB_MIN_BK = {"int4": 128, "int8": 64}
# HAYABUSA_WO_MID_M=1 (read at import; tests set USE_WO_MID_M): x of WO_SMALL_M_MAX + 1 .. WO_MID_M_MAX rows come
# here too, for the (scheme, shape class, M bucket) keys of WO_MID_M_WINS only (by default, and at every other key,
# they take quant_linear's path: its 16-row GEMM below DEQUANT_GEMM_MIN_M(_INT4) rows, dequantize + cuBLAS from
# there). Off until the engine runs with it are measured on a GPU (issue #24).
USE_WO_MID_M = env_flag("HAYABUSA_WO_MID_M", False)
WO_MID_M_MAX = WO_M_BUCKETS[-1]
# The mid-M keys where WO_SMALL_M_TABLE's launch beat quant_linear's path without the switch ("today": its tl.dot
# GEMM below DEQUANT_GEMM_MIN_M_INT4 = 64 rows for int4 and DEQUANT_GEMM_MIN_M = 256 for int8, dequantize + cuBLAS
# from there) in time summed over the class's Qwen2.5-7B layers. Measured on an H200 (2026-12-05, commit 4758af8,
# `bench_quant_linear.py --small-m --schemes int4,int8 --m 64,256,16,128,32`, CUDA-graph medians, int4 G = 128;
# BENCHMARKS.md "twenty-seventh session"), us this table's launch / today (bf16 cuBLAS):
# - int4 32 rows: qkv 18.7 / 34.9 (8.0), o 18.9 / 25.3 (8.5), gate_up 97.3 / 168 (73.8), down 51.5 / 126 (40.0);
# - int4 64: gate_up 98.4 / 171 (72.4), down 60.3 / 91.8 (43.0); lost on qkv 21.2 / 20.7, o 21.6 / 16.5;
# - int4 128: gate_up 147 / 170 (72.7); lost on down 101 / 94.7, qkv 37.2 / 21.9, o 36.4 / 17.3;
# - int4 256: lost everywhere (gate_up 252 / 191, down 174 / 107; bf16 103 / 58);
# - int8 32: gate_up 57.9 / 73.8 (73.8); lost on qkv 16.0 / 15.8, o 16.0 / 12.8, down 58.4 / 51.5; lost at 64-256.
# From 32 rows on the int4 launches lose to bf16 cuBLAS everywhere (0.24-0.78x its speed), int8's everywhere but
# gate_up at 32 rows: dequantizing in the K loop keeps the tensor cores waiting (the "lop3j" loop is 521
# instructions a warp per 128-deep tile at 64 rows, BENCHMARKS.md "twenty-sixth session"); the bench prints this
# set with the table (print_small_m_table).
WO_MID_M_WINS: frozenset[tuple[str, str, int]] = frozenset({
    ("int4", "deep", 32), ("int4", "square", 32), ("int4", "wide", 32),
    ("int4", "deep", 64), ("int4", "wide", 64),
    ("int4", "wide", 128),
    ("int8", "wide", 32),
})
_DTYPES = (torch.bfloat16, torch.float16)

# (scheme, shape class, M bucket) -> (kind, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages); SPLIT_K 0:
# as many K splits as give FP8_AUTO_SPLIT_WAVES programs per SM (split_k_for). Per class and bucket the candidate
# with the least time summed over the class's Qwen2.5-7B layers (qkv / o: square, gate_up: wide, down: deep), CUDA-
# graph replay medians, int4 G = 128: `bench_quant_linear.py --small-m` on an H200, 2026-12-05, commit 4758af8
# (--schemes int4,int8 --m 64,256,16,128,32; BENCHMARKS.md "twenty-seventh session"). At 16 rows int4 "lop3" (the
# "slab" launch with its slabs made by inline PTX, the same values) won on qkv and down (on o "slab" did, 12.9
# against 15.4 us; the square class's sum chose "lop3", 30.9 against 31.4), and gate_up took a 256-wide "slab" tile
# without a K split (SPLIT_K 1; the twenty-second session, commit 21d4d34, had "slab" 16 x 128 x 128, SPLIT_K 0, for
# every int4 class).
# E.g. at 16 rows, us this launch / bf16 cuBLAS: int4 qkv 15.5 / 7.7, down 39.2 / 39.9,
# gate_up 88.9 / 73.2; int8 gate_up 45.6 / 73.2, down 29.6 / 39.9. 32-256 rows: only the bench, direct calls and
# USE_WO_MID_M at WO_MID_M_WINS's keys reach them (see there for their times).
WO_SMALL_M_TABLE: dict[tuple[str, str, int], tuple[str, int, int, int, int, int, int]] = {
    ('int4', 'deep', 16): ('lop3', 16, 128, 128, 0, 8, 3),
    ('int4', 'deep', 32): ('lop3j', 64, 128, 128, 0, 4, 3),
    ('int4', 'deep', 64): ('lop3j', 64, 128, 128, 0, 8, 3),
    ('int4', 'deep', 128): ('lop3j', 128, 64, 128, 0, 4, 4),
    ('int4', 'deep', 256): ('lop3j', 128, 128, 128, 0, 8, 3),
    ('int4', 'square', 16): ('lop3', 16, 128, 128, 0, 8, 3),
    ('int4', 'square', 32): ('lop3j', 64, 64, 128, 0, 4, 4),
    ('int4', 'square', 64): ('lop3j', 64, 64, 128, 0, 4, 4),
    ('int4', 'square', 128): ('lop3j', 128, 64, 128, 0, 4, 4),
    ('int4', 'square', 256): ('lop3j', 128, 64, 128, 0, 4, 4),
    ('int4', 'wide', 16): ('slab', 16, 256, 128, 1, 8, 3),
    ('int4', 'wide', 32): ('lop3j', 64, 128, 128, 0, 8, 3),
    ('int4', 'wide', 64): ('lop3j', 64, 128, 128, 0, 8, 3),
    ('int4', 'wide', 128): ('lop3j', 128, 64, 128, 0, 4, 4),
    ('int4', 'wide', 256): ('lop3j', 128, 128, 128, 0, 8, 3),
    ('int8', 'deep', 16): ('dot', 16, 32, 128, 0, 4, 4),
    ('int8', 'deep', 32): ('dot', 32, 32, 128, 0, 4, 4),
    ('int8', 'deep', 64): ('dot', 64, 32, 128, 0, 4, 4),
    ('int8', 'deep', 128): ('dot', 128, 32, 128, 0, 4, 4),
    ('int8', 'deep', 256): ('dot', 128, 64, 128, 1, 4, 3),
    ('int8', 'square', 16): ('dot', 16, 32, 128, 0, 4, 4),
    ('int8', 'square', 32): ('dot', 32, 64, 128, 1, 4, 3),
    ('int8', 'square', 64): ('dot', 64, 64, 128, 1, 4, 3),
    ('int8', 'square', 128): ('dot', 128, 64, 128, 1, 4, 3),
    ('int8', 'square', 256): ('dot', 128, 64, 128, 1, 4, 3),
    ('int8', 'wide', 16): ('dot', 16, 32, 128, 0, 4, 4),
    ('int8', 'wide', 32): ('dot', 32, 64, 128, 1, 4, 3),
    ('int8', 'wide', 64): ('dot', 64, 64, 128, 1, 4, 3),
    ('int8', 'wide', 128): ('dot', 128, 64, 128, 1, 4, 3),
    ('int8', 'wide', 256): ('dot', 128, 64, 128, 1, 4, 3),
}


@triton.jit
def _int4_slab(q, s: tl.constexpr, off, MAGIC: tl.constexpr, BY_HAND: tl.constexpr, DTYPE: tl.constexpr):
    """Nibble slab s of the packed tile q (int32; [BK // 8, BN], or its transpose) as the exact integers q - zero:
    in DTYPE, or (BY_HAND, the interpreter with bf16: its bf16 arithmetic works on raw bits) in fp32. off fp32 =
    2**e + zero, already shaped to broadcast against q ([None, :] or [:, None])."""
    u = (q >> (4 * s)) & 0xF | MAGIC
    if BY_HAND:
        w = (u << 16).to(tl.float32, bitcast=True) - off
    else:
        w = u.to(tl.int16).to(DTYPE, bitcast=True) - off.to(DTYPE)
    return w


def _lop3_asm(magic: str, one: str, ty: str, scaled: bool) -> str:
    """The inline PTX that makes the 8 nibble slabs of two packed int4 words (kinds "lop3" and "lop3j"). Operands are
    pairs of tile elements (pack=2): $8 / $9 the two int32 words, $10 the pair's negated offsets -(2**e + zero) and
    (``scaled``) $11 the pair's group scales, as a bf16x2 / f16x2 (``ty``; ``one`` its 1.0 pair); $0..$7 slab s of
    both words as a ``ty``. PRMT puts nibbles 0-3 of word 0 in the low half and of word 1 in the high half (0x5410;
    nibbles 4-7: 0x7632); then per slab a shift (none for slabs 0 and 4), one LOP3 ((t & 0x000F000F) | magic: two
    numbers 2**e + q at once, LUT 0xEA = (a & b) | c), one packed FMA t * 1 - (2**e + zero) (exact: integers below
    2**11) and with ``scaled`` one packed FMA t * scale + (-0) (round((q - zero) * scale): the weight dequantize +
    cuBLAS multiplies). 2 PRMT + 6 shifts + 8 LOP3 + 8 (+ 8) FMA for 16 weights, where the Triton-built slab spends a
    shift, a mask, an OR, a 16-bit move and half a packed subtract per weight. FMA rather than sub / mul: the bf16x2
    forms of those need sm_90, fma.rn.bf16x2 sm_80 (HAYABUSA_WO_SMALL_M=1 runs the kernel on any CUDA GPU). (As
    FasterTransformer / Marlin convert int4 to fp16 with LOP3.)"""
    lines = ["{ .reg .b32 lo, hi, t, one, nz;", f"mov.b32 one, {one};", "mov.b32 nz, 0x80008000;",
             "prmt.b32 lo, $8, $9, 0x5410;", "prmt.b32 hi, $8, $9, 0x7632;"]
    for s in range(8):
        src = "lo" if s < 4 else "hi"
        shift = 4 * (s % 4)
        lines.append(f"shr.u32 t, {src}, {shift};" if shift else f"mov.b32 t, {src};")
        lines.append(f"lop3.b32 t, t, 0x000F000F, {magic}, 0xEA;")
        if scaled:
            lines += [f"fma.rn.{ty} t, t, one, $10;", f"fma.rn.{ty} ${s}, t, $11, nz;"]
        else:
            lines.append(f"fma.rn.{ty} ${s}, t, one, $10;")
    return " ".join(lines + ["}"])


LOP3_ASM_BF16 = tl.constexpr(_lop3_asm("0x43004300", "0x3F803F80", "bf16x2", False))
LOP3_ASM_FP16 = tl.constexpr(_lop3_asm("0x64006400", "0x3C003C00", "f16x2", False))
LOP3S_ASM_BF16 = tl.constexpr(_lop3_asm("0x43004300", "0x3F803F80", "bf16x2", True))
LOP3S_ASM_FP16 = tl.constexpr(_lop3_asm("0x64006400", "0x3C003C00", "f16x2", True))
_LOP3_CONSTRAINTS = tl.constexpr("=r," * 8 + "r,r,r")
_LOP3S_CONSTRAINTS = tl.constexpr("=r," * 8 + "r,r,r,r")


@triton.jit
def _int4_slabs_lop3(q, neg_off, sc, FP16: tl.constexpr, SCALED: tl.constexpr):
    """All 8 nibble slabs of q [.., ..] int32 (slab s: k = 8i + s) by _lop3_asm's PTX, in bf16 / fp16 (FP16): the
    exact integers q - zero, or (SCALED) round((q - zero) * sc). neg_off (q's shape, that dtype) = -(2**e + zero)
    (2**e = 128 / 1024); sc (q's shape, that dtype): the group scales, read only when SCALED."""
    # one return after the ifs: Triton type-checks every return, even in a branch it does not take
    if SCALED:
        if FP16:
            ws = tl.inline_asm_elementwise(LOP3S_ASM_FP16, _LOP3S_CONSTRAINTS, [q, neg_off, sc],
                                           dtype=(tl.float16, ) * 8, is_pure=True, pack=2)
        else:
            ws = tl.inline_asm_elementwise(LOP3S_ASM_BF16, _LOP3S_CONSTRAINTS, [q, neg_off, sc],
                                           dtype=(tl.bfloat16, ) * 8, is_pure=True, pack=2)
    else:
        if FP16:
            ws = tl.inline_asm_elementwise(LOP3_ASM_FP16, _LOP3_CONSTRAINTS, [q, neg_off], dtype=(tl.float16, ) * 8,
                                           is_pure=True, pack=2)
        else:
            ws = tl.inline_asm_elementwise(LOP3_ASM_BF16, _LOP3_CONSTRAINTS, [q, neg_off],
                                           dtype=(tl.bfloat16, ) * 8, is_pure=True, pack=2)
    return ws


@triton.jit
def _int4_slab_scaled(q, s: tl.constexpr, off, sc, MAGIC: tl.constexpr, BY_HAND: tl.constexpr,
                      DTYPE: tl.constexpr):
    """_int4_slab's slab s times the group scales sc (fp32, shaped as off), rounded once to DTYPE (BY_HAND: to bf16
    by bf16_rne, the interpreter's cast truncates)."""
    w = _int4_slab(q, s, off, MAGIC, BY_HAND, DTYPE).to(tl.float32) * sc
    return bf16_rne(w) if BY_HAND else w.to(DTYPE)


@triton.jit
def _int4_tile_dot(acc, x_ptr, x_rows, qw_ptr, scales_ptr, zeros_ptr, k0, m_mask, offs_n, n_mask, N,
                   GROUP_SIZE: tl.constexpr, SLAB: tl.constexpr, MAGIC: tl.constexpr, BY_HAND: tl.constexpr,
                   DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   LOP3: tl.constexpr = False, SCALE_W: tl.constexpr = False):
    """acc + x[:, k0:k0 + BK] @ W[k0:k0 + BK, n] for the K tile of one group g = k0 // G.

    SLAB (kinds "slab", "lop3"): 8 dots of nibble slabs against x's stride-8 columns; otherwise ("join") one dot of
    the k-ordered tile. Both take the exact integers q - zero and scale the tile's partial sum once: acc + (x @ (q -
    zero)) * scale[g, n]. SCALE_W (kind "lop3j"): the 8 slabs times the group scales, rounded to x's dtype (W =
    round((q - zero) * scale), the weights dequantize + cuBLAS multiplies), joined into the k-ordered tile W^T [BN,
    BK] (k = 8i + s: tl.join thrice, then a reshape) and dotted with x's contiguous tile into acc itself: one K = BK
    dot per tile and no per-group rescale, so on sm_90 the tile's wgmma instructions issue back to back into the
    loop's accumulator (Triton 3.6: one wait per tile, where the slab kinds wait after each of their 8 dots). LOP3:
    the slabs by _lop3_asm's inline PTX (CUDA only: the interpreter cannot run PTX, so there the launcher passes LOP3
    False and the same slabs come from _int4_slab / _int4_slab_scaled)."""
    dtype = x_ptr.dtype.element_ty
    g = k0 // GROUP_SIZE
    sc = tl.load(scales_ptr + g * N + offs_n, mask=n_mask, other=0.0)                        # [BN], x's dtype
    offs_i = tl.arange(0, BLOCK_K // 8)
    if SCALE_W or SLAB:   # ("join": int4_tile_t reads the zeros itself)
        z = tl.load(zeros_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        off = z + (128.0 if MAGIC == 0x4300 else 1024.0)                                    # [BN] 2**e + zero
    if SCALE_W:
        q = tl.load(qw_ptr + (k0 // 8 + offs_i)[None, :] * N + offs_n[:, None], mask=n_mask[:, None], other=0)
        shape: tl.constexpr = [BLOCK_N, BLOCK_K // 8]                                      # q^T [BN, BK // 8]
        if LOP3:
            w0, w1, w2, w3, w4, w5, w6, w7 = _int4_slabs_lop3(
                q, tl.broadcast_to((-off).to(dtype)[:, None], shape), tl.broadcast_to(sc[:, None], shape),
                MAGIC == 0x6400, True)
        else:
            o2 = off[:, None]
            s2 = sc.to(tl.float32)[:, None]
            w0 = _int4_slab_scaled(q, 0, o2, s2, MAGIC, BY_HAND, dtype)
            w1 = _int4_slab_scaled(q, 1, o2, s2, MAGIC, BY_HAND, dtype)
            w2 = _int4_slab_scaled(q, 2, o2, s2, MAGIC, BY_HAND, dtype)
            w3 = _int4_slab_scaled(q, 3, o2, s2, MAGIC, BY_HAND, dtype)
            w4 = _int4_slab_scaled(q, 4, o2, s2, MAGIC, BY_HAND, dtype)
            w5 = _int4_slab_scaled(q, 5, o2, s2, MAGIC, BY_HAND, dtype)
            w6 = _int4_slab_scaled(q, 6, o2, s2, MAGIC, BY_HAND, dtype)
            w7 = _int4_slab_scaled(q, 7, o2, s2, MAGIC, BY_HAND, dtype)
        # tl.join appends its new dim last, so the innermost join's pair differs in slab bit 2: [BN, BK // 8, 2, 2, 2]
        # indexed (i, c0, c1, c2) holds slab s = 4 c0 + 2 c1 + c2 -> k = 8i + s after the row-major reshape
        w = tl.join(tl.join(tl.join(w0, w4), tl.join(w2, w6)), tl.join(tl.join(w1, w5), tl.join(w3, w7)))
        w = tl.reshape(w, [BLOCK_N, BLOCK_K])
        x = tl.load(x_rows + (k0 + tl.arange(0, BLOCK_K))[None, :], mask=m_mask[:, None], other=0.0)
        acc = dot_acc(x, tl.trans(w), acc, DOT_FP32)
    elif SLAB:
        q = tl.load(qw_ptr + (k0 // 8 + offs_i)[:, None] * N + offs_n[None, :], mask=n_mask[None, :], other=0)
        part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if LOP3:
            ws = _int4_slabs_lop3(q, tl.broadcast_to((-off).to(dtype)[None, :], [BLOCK_K // 8, BLOCK_N]), sc,
                                  MAGIC == 0x6400, False)
            for s in tl.static_range(8):
                xs = tl.load(x_rows + (k0 + s + 8 * offs_i)[None, :], mask=m_mask[:, None], other=0.0)
                part = dot_acc(xs, ws[s], part, DOT_FP32)
        else:
            for s in tl.static_range(8):
                w = _int4_slab(q, s, off[None, :], MAGIC, BY_HAND, dtype)               # [BK // 8, BN]
                xs = tl.load(x_rows + (k0 + s + 8 * offs_i)[None, :], mask=m_mask[:, None], other=0.0)
                part = dot_acc(xs, w, part, DOT_FP32)
        acc = acc + part * sc.to(tl.float32)[None, :]
    else:
        w = tl.trans(int4_tile_t(qw_ptr, zeros_ptr, k0, offs_n, n_mask, N, GROUP_SIZE, BLOCK_K, MAGIC, BY_HAND))
        x = tl.load(x_rows + (k0 + tl.arange(0, BLOCK_K))[None, :], mask=m_mask[:, None], other=0.0)
        part = dot_acc(x, w, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), DOT_FP32)
        acc = acc + part * sc.to(tl.float32)[None, :]
    return acc


@triton.jit
def _int8_tile(w_cols, offs_k, k_end, n_mask, EVEN_K: tl.constexpr, BY_HAND: tl.constexpr, DTYPE: tl.constexpr):
    """The int8 weight tile [BK, BN] (qweight [N, K]: w_cols [1, BN] points at its rows) as the exact integers q in
    DTYPE: (q & 0xFF) ^ 0x6480 is the half 1024 + q + 128 (one LOP3 on the sign-extended byte, as
    quant_linear._int8_tile_t's fp16 path), minus 1152 in fp16; for bf16 x one fp16 -> bf16 conversion, exact
    (|q| <= 128 needs 8 significant bits). BY_HAND (the interpreter): left in fp32."""
    q = load_w_tile(w_cols, offs_k, k_end, n_mask, EVEN_K)                                 # [BK, BN] int8
    w = ((q.to(tl.int16) & 0xFF) ^ 0x6480).to(tl.float16, bitcast=True) - 1152.0
    if BY_HAND:
        return w.to(tl.float32)
    return w.to(DTYPE)


@triton.jit
def _int8_slab_dot(acc, x_rows, w_cols, k0, k_end, m_mask, n_mask, EVEN_K: tl.constexpr, BY_HAND: tl.constexpr,
                   DOT_FP32: tl.constexpr, DTYPE: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc + x[:, k0:k0 + BK] @ q[k0:k0 + BK, n] from qweight read as int32 words (w_cols [1, BN] points at the
    rows of qweight.view(int32) [N, K // 4]): the word tile [BK // 4, BN] is split into its 4 byte slabs (slab b:
    k = k0 + 4i + b), each made exact integers by the fp16 magic number (as _int8_tile) and dotted with x's stride-4
    columns. A quarter of the byte tile's pointers and registers (ptxas, sm_90: the byte tile spilled)."""
    offs_i = tl.arange(0, BLOCK_K // 4)
    kw = k0 // 4 + offs_i
    if EVEN_K:
        q = tl.load(w_cols + kw[:, None], mask=n_mask[None, :], other=0)                   # [BK // 4, BN]
    else:  # K % 4 == 0: a word lies wholly before k_end or after it
        q = tl.load(w_cols + kw[:, None], mask=n_mask[None, :] & (4 * kw < k_end)[:, None], other=0)
    for b in tl.static_range(4):
        w = (((q >> (8 * b)) & 0xFF) ^ 0x6480).to(tl.int16).to(tl.float16, bitcast=True) - 1152.0
        if BY_HAND:
            w = w.to(tl.float32)
        else:
            w = w.to(DTYPE)
        offs_k = k0 + b + 4 * offs_i
        if EVEN_K:
            xs = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None], other=0.0)
        else:
            xs = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & (offs_k < k_end)[None, :], other=0.0)
        acc = dot_acc(xs, w, acc, DOT_FP32)
    return acc


@triton.jit
def _wo_small_m_kernel(x_ptr, qw_ptr, scales_ptr, zeros_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr,
                       M, N, K, k_per_split, splits, stride_xm, stride_wn, stride_om,
                       INT4: tl.constexpr, SLAB: tl.constexpr, GROUP_SIZE: tl.constexpr, MAGIC: tl.constexpr,
                       BY_HAND: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                       FUSED_REDUCE: tl.constexpr, EVEN_K: tl.constexpr, DOT_FP32: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       PDL: tl.constexpr = False, LOP3: tl.constexpr = False, SCALE_W: tl.constexpr = False):
    """Grid (row tiles, N tiles, K splits), as small_m_linear's _small_m_dot_kernel; int4 tiles lie in one group
    (BLOCK_K divides G and so K: no K mask), int8 tiles may be ragged at K's end (EVEN_K False)."""
    pid_m, pid_n, pid_k, rows, m_mask, offs_n, n_mask, k_start, k_end, w_cols, x_rows = dot_tile_setup(
        x_ptr, qw_ptr, M, N, K, k_per_split, stride_xm, stride_wn, BLOCK_M, BLOCK_N)
    pdl_wait(PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if INT4:
            acc = _int4_tile_dot(acc, x_ptr, x_rows, qw_ptr, scales_ptr, zeros_ptr, k0, m_mask, offs_n, n_mask, N,
                                 GROUP_SIZE, SLAB, MAGIC, BY_HAND, DOT_FP32, BLOCK_M, BLOCK_N, BLOCK_K, LOP3,
                                 SCALE_W)
        elif SLAB:
            acc = _int8_slab_dot(acc, x_rows, w_cols, k0, k_end, m_mask, n_mask, EVEN_K, BY_HAND, DOT_FP32,
                                 x_ptr.dtype.element_ty, BLOCK_K)
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            w = _int8_tile(w_cols, offs_k, k_end, n_mask, EVEN_K, BY_HAND, x_ptr.dtype.element_ty)  # [BK, BN]
            acc = dot_acc(load_x_tile(x_rows, offs_k, k_end, m_mask, EVEN_K), w, acc, DOT_FP32)
    if not INT4:
        acc *= tl.load(scales_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    splitk_finish(acc, rows, m_mask, offs_n, n_mask, bias_ptr, out_ptr, part_ptr, lock_ptr,
                  pid_m * tl.num_programs(1) + pid_n, pid_k, splits, M, N, stride_om, HAS_BIAS, SPLIT, FUSED_REDUCE)


def wo_m_bucket(M: int) -> int:
    """WO_SMALL_M_TABLE's row bucket of M rows: the smallest of WO_M_BUCKETS >= M (the largest past them)."""
    return next((b for b in WO_M_BUCKETS if M <= b), WO_M_BUCKETS[-1])


def check_wo_entry(scheme: str, entry: tuple) -> None:
    """Check one WO_SMALL_M_TABLE entry (kind, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages) for
    scheme "int4" | "int8": kind in WO_KINDS[scheme], power-of-two tiles >= 16 and warps, SPLIT_K >= 0 (0: from the
    SM count), num_stages >= 1; "slab" needs BLOCK_K >= 128 (each of its 8 dots has K = BLOCK_K // 8 >= 16).
    Raises ValueError naming the entry."""
    if scheme not in WO_KINDS:
        raise ValueError(f"scheme must be 'int4' or 'int8', got {scheme!r}")
    ok = isinstance(entry, tuple) and len(entry) == 7 and entry[0] in WO_KINDS[scheme] \
        and all(isinstance(v, int) and not isinstance(v, bool) for v in entry[1:])
    if ok:
        kind, bm, bn, bk, split, warps, stages = entry
        ok = min(bm, bn, bk) >= 16 and split >= 0 and stages >= 1 and warps >= 1 \
            and not any(v & (v - 1) for v in (bm, bn, bk, warps)) \
            and (kind not in _SLAB_KINDS or bk >= _SLAB_MIN_BK[scheme])
    if not ok:
        raise ValueError(f"{scheme} entry must be ({' | '.join(WO_KINDS[scheme])}, BLOCK_M, BLOCK_N, BLOCK_K, "
                         f"SPLIT_K >= 0, num_warps, num_stages >= 1) with power-of-two tiles >= 16 (slab kinds: "
                         f"BLOCK_K >= {_SLAB_MIN_BK[scheme]}), got {entry!r}")


def wo_small_m_launch(entry: tuple, M: int, N: int, K: int, group_size: int | None,
                      device: torch.device) -> LaunchConfig | None:
    """The launch of one table entry for [M, K] x [K, N] (int4 when group_size is given): int4's BLOCK_K capped at
    the largest power-of-two divisor of G (one group per tile); an int4 slab-kind entry whose capped BLOCK_K is under
    128 becomes "join", an int8 "slab" entry for K % 4 != 0 (no int32 words) "dot"; SPLIT_K 0 resolved on the SM
    count. None where int4's G has no power-of-two divisor >= 16 (the
    dot needs K >= 16): the caller keeps quant_linear's path. Raises ValueError on a malformed entry."""
    check_wo_entry("int8" if group_size is None else "int4", entry)
    kind, bm, bn, bk, split, warps, stages = entry
    if group_size is not None:
        bk = min(bk, pow2_divisor(group_size, 128))
        if bk < 16:
            return None
        if kind in _SLAB_KINDS and bk < 128:
            kind = "join"
    elif kind == "slab" and K % 4:
        kind = "dot"
    if split == 0:
        split = split_k_for(cdiv(M, bm) * cdiv(N, bn), cdiv(K, bk),
                            FP8_AUTO_SPLIT_WAVES * device_limits(device)[0])
    return LaunchConfig(kind, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=warps,
                        num_stages=stages)


def pick_wo_small_m_config(M: int, N: int, K: int, group_size: int | None,
                           device: torch.device) -> LaunchConfig | None:
    """WO_SMALL_M_TABLE's launch for (scheme, gemm_shape_class(N, K), wo_m_bucket(M)), or None where the scheme's G
    cannot be tiled (wo_small_m_launch). Host ints and the SM count only: CUDA-graph safe."""
    scheme = "int8" if group_size is None else "int4"
    entry = WO_SMALL_M_TABLE[(scheme, gemm_shape_class(N, K), wo_m_bucket(M))]
    return wo_small_m_launch(entry, M, N, K, group_size, device)


def _check(x, qweight, scales, zeros, group_size, bias) -> int:
    """Validate the operands; returns N."""
    if not isinstance(x, torch.Tensor) or x.dtype not in _DTYPES or x.dim() != 2 or x.shape[1] == 0 \
            or (x.stride(1) != 1 and x.shape[0] > 0):
        got = (tuple(x.shape), x.dtype, x.stride()) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be [M, K > 0] bfloat16 or float16 with a unit last stride, got {got}")
    K = x.shape[1]
    if not isinstance(qweight, torch.Tensor):
        raise ValueError(f"qweight must be a tensor, got {type(qweight).__name__}")
    if group_size is None:
        if qweight.dtype != torch.int8 or qweight.dim() != 2 or qweight.shape[1] != K:
            raise ValueError(f"qweight must be [N, K={K}] int8, got {tuple(qweight.shape)} {qweight.dtype}")
        N = qweight.shape[0]
        if not isinstance(scales, torch.Tensor) or scales.shape != (N,) or scales.dtype != x.dtype:
            got = (tuple(scales.shape), scales.dtype) if isinstance(scales, torch.Tensor) else scales
            raise ValueError(f"scales must be [N={N}] {x.dtype} (x's dtype), got {got}")
        named = dict(qweight=qweight, scales=scales, bias=bias)
    else:
        if qweight.dtype != torch.int32 or qweight.dim() != 2 or K % 8 or qweight.shape[0] != K // 8:
            raise ValueError(f"qweight must be [K // 8, N] int32 with K = {K} (a multiple of 8), got "
                             f"{tuple(qweight.shape)} {qweight.dtype}")
        check_group_size(K, group_size)
        N = qweight.shape[1]
        for name, t in (("scales", scales), ("zeros", zeros)):
            if not isinstance(t, torch.Tensor) or t.shape != (K // group_size, N) or t.dtype != x.dtype:
                got = (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t
                raise ValueError(f"{name} must be [K // group_size, N] = [{K // group_size}, {N}] {x.dtype}, got "
                                 f"{got}")
        named = dict(qweight=qweight, scales=scales, zeros=zeros, bias=bias)
    if N == 0:
        raise ValueError(f"qweight has N = 0 output features: {tuple(qweight.shape)}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != (N,) or bias.dtype != x.dtype):
        got = (tuple(bias.shape), bias.dtype) if isinstance(bias, torch.Tensor) else bias
        raise ValueError(f"bias must be [N={N}] {x.dtype} or None, got {got}")
    check_on_device_contiguous(x, named)
    return N


def wo_small_m_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None = None,
                      group_size: int | None = None, bias: torch.Tensor | None = None,
                      cfg: LaunchConfig | None = None) -> torch.Tensor:
    """The weight-only int4 (group_size given) or int8 (group_size None) linear for a few rows (module docstring).

    Args:
        x: [M, K] bfloat16 or float16, unit last stride (any row stride); M may be 0.
        qweight: int4: [K // 8, N] int32 (GPTQ packing), int8: [N, K] int8; contiguous.
        scales: int4: [K // G, N], int8: [N]; x's dtype, contiguous.
        zeros: int4: [K // G, N] in x's dtype (integers 0..15), contiguous; int8: ignored (None).
        group_size: G (int4: a multiple of 8 dividing K), or None for int8.
        bias: [N] in x's dtype, or None (added in fp32 before the one cast).
        cfg: a launch (bench, tests): kind "slab" | "join" | "lop3" | "lop3j" (int4) or "slab" | "dot" (int8),
            tiles >= 16, int4's BLOCK_K dividing G (the slab kinds "slab" / "lop3": BLOCK_K >= 128 for int4, >= 64
            for int8); default pick_wo_small_m_config's. "lop3" and "lop3j" make the slabs by inline PTX on CUDA (the
            interpreter, which cannot run PTX, makes the same values in Triton); "lop3j" dots the scaled weights
            round((q - zero) * scale) (dequantize + cuBLAS's rounding) as one k-ordered tile into one accumulator,
            the others the integers q - zero with the scale applied per K tile (_int4_tile_dot).
    Returns:
        [M, N] in x's dtype: int4_weight_only_linear_ref / int8_weight_only_linear_ref's value up to the fp32
        summation order (one rounding); "lop3j" also rounds each weight to x's dtype first (as dequantize + cuBLAS).
    Raises:
        ValueError: a bad shape, dtype, stride, contiguity or device (the message names the argument), a group size
            with no tile (G with no power-of-two divisor >= 16), or a cfg that does not fit the scheme.
    No host sync; the grid depends on (M, N, K, G) only: CUDA-graph safe. On CPU it needs TRITON_INTERPRET=1.
    """
    N = _check(x, qweight, scales, zeros, group_size, bias)
    M, K = x.shape
    int4 = group_size is not None
    on_cpu = x.device.type == "cpu"
    out = torch.empty((M, N), dtype=torch.float32 if on_cpu else x.dtype, device=x.device)
    if M == 0:
        return out.to(x.dtype)
    if cfg is None:
        cfg = pick_wo_small_m_config(M, N, K, group_size, x.device)
        if cfg is None:
            raise ValueError(f"group_size {group_size} has no power-of-two divisor >= 16: no tl.dot tile fits")
    scheme = "int4" if int4 else "int8"
    if cfg.kind not in WO_KINDS[scheme] or min(cfg.BLOCK_M, cfg.BLOCK_N, cfg.BLOCK_K) < 16 \
            or (cfg.kind in _SLAB_KINDS and cfg.BLOCK_K < _SLAB_MIN_BK[scheme]) or (int4 and group_size % cfg.BLOCK_K):
        raise ValueError(f"cfg must be a {' | '.join(WO_KINDS[scheme])} launch with tiles >= 16 (slab kinds: BLOCK_K "
                         f">= {_SLAB_MIN_BK[scheme]}){' and BLOCK_K dividing group_size' if int4 else ''}, got {cfg}")
    # int8 "slab" reads qweight as int32 words: where it has none (K % 4, a misaligned view) the byte tile, same sums
    slab, lop3, scale_w = KIND_FLAGS[cfg.kind]
    slab = slab and (int4 or (K % 4 == 0 and qweight.data_ptr() % 4 == 0))
    if not int4 and slab:
        qweight = qweight.view(torch.int32)
    plan = SplitKPlan.of(M, N, K, cfg, out)
    fp16 = x.dtype == torch.float16
    _wo_small_m_kernel[plan.grid](
        x, qweight, scales, zeros if int4 else scales, bias if bias is not None else out, out, plan.part,
        plan.locks if plan.locks is not None else out,
        M, N, K, plan.k_per_split, plan.splits, x.stride(0), 1 if int4 else K // 4 if slab else K, out.stride(0),
        INT4=int4, SLAB=slab, GROUP_SIZE=group_size or 1,
        MAGIC=0x6400 if fp16 else 0x4300, BY_HAND=on_cpu and not fp16,
        LOP3=lop3 and not on_cpu, SCALE_W=scale_w,
        **split_dot_launch_kwargs(plan, cfg, K, bias is not None, x.device))
    plan.finish(bias, out)
    return out.to(x.dtype) if on_cpu else out


def wo_small_m_applies(x: torch.Tensor, N: int, group_size: int | None) -> bool:
    """Whether quant_linear's dispatch may send x ([M, K]; N output features) here (checked operands assumed): bf16 /
    fp16 x with WO_SMALL_M_MIN_M..WO_SMALL_M_MAX rows, or with USE_WO_MID_M up to WO_MID_M_MAX rows where
    (scheme, gemm_shape_class(N, K), wo_m_bucket(M)) is in WO_MID_M_WINS; int4's G tileable (a power-of-two divisor
    >= 16)."""
    M, K = x.shape
    if x.dtype not in _DTYPES or not WO_SMALL_M_MIN_M <= M <= WO_MID_M_MAX \
            or (group_size is not None and pow2_divisor(group_size, 128) < 16):
        return False
    return M <= WO_SMALL_M_MAX or (USE_WO_MID_M and ("int8" if group_size is None else "int4", gemm_shape_class(N, K),
                                                     wo_m_bucket(M)) in WO_MID_M_WINS)


# quant_linear's dispatch reaches this kernel through the registration (the names looked up per call: tests patch them)
register_small_m_kernel(lambda x, N, group_size: wo_small_m_applies(x, N, group_size),
                        lambda *args: wo_small_m_linear(*args))

__all__ = ["KIND_FLAGS", "WO_KINDS", "WO_M_BUCKETS", "WO_MID_M_MAX", "WO_MID_M_WINS", "WO_SMALL_M_MAX",
           "WO_SMALL_M_MIN_M", "WO_SMALL_M_TABLE",
           "check_wo_entry", "pick_wo_small_m_config", "wo_m_bucket", "wo_small_m_applies",
           "wo_small_m_launch", "wo_small_m_linear"]
