"""greedy_verify: a verify step's emitted tokens when every request with proposals is greedy (kernel + launcher +
reference).

Greedy verification emits, per request, the longest prefix of its proposals equal to the target's argmax at their
positions, then the target's argmax at the first mismatch (or at the bonus position when all were accepted). Since
an accepted proposal equals the argmax there, the emitted run is simply the argmax ids at the request's positions
0 .. n_accepted, -1 after. One program per request reads its row of a host-built ``plan`` (moved to the device in
one copy); the argmax over all the step's logits rows is taken before, by the caller (one op).

``plan`` [R, 2W + 2] int64, W = K + 1 (K = the step's max proposals per request), per request:
  columns 0 .. W-1:   the index in ``argmax_ids`` of its position j (logits row start + min(j, num_drafts))
  columns W .. 2W-1:  its proposals, -1 at and after column num_drafts (-1 never equals an argmax)
  column 2W:          num_drafts (0 .. K)
  column 2W + 1:      its row in ``drafts`` (proposals on the device: a draft model's or EAGLE head's), -1 = none
"""

from __future__ import annotations

import torch

from hayabusa.errors import HayabusaValidationError
from hayabusa.kernels._triton import next_power_of_2, tl, triton


@triton.jit
def _greedy_verify_kernel(
    argmax_ptr,            # [N] int64, the target's argmax at every logits row of the step
    plan_ptr,              # [R, 2W + 2] int64 (module docstring)
    drafts_ptr,            # [R_d, >= K] int64 device proposals (read when DRAFTS_ON_DEVICE)
    bonus_ptr,             # [R] int64, tokens that replace the argmax at column num_drafts (read when HAS_BONUS)
    out_ptr,               # [R, W] int64
    stride_plan, stride_drafts,
    W: tl.constexpr, BLOCK_W: tl.constexpr, DRAFTS_ON_DEVICE: tl.constexpr, HAS_BONUS: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_W)
    m = j < W
    row = plan_ptr + r * stride_plan
    g = tl.load(argmax_ptr + tl.load(row + j, mask=m, other=0), mask=m, other=0)
    nd = tl.load(row + 2 * W)
    if DRAFTS_ON_DEVICE:
        src = tl.load(row + 2 * W + 1)
        d = tl.load(drafts_ptr + src * stride_drafts + j, mask=(j < nd) & (src >= 0), other=-1)
    else:
        d = tl.load(row + W + j, mask=m, other=-1)
    if HAS_BONUS:
        g = tl.where(j == nd, tl.load(bonus_ptr + r), g)
    # column num_drafts always misses (d = -1 there): the first miss is the accepted count, <= num_drafts
    n_acc = tl.min(tl.where((g != d) & m, j, BLOCK_W), axis=0)
    tl.store(out_ptr + r * W + j, tl.where(j <= n_acc, g, -1), mask=m)


def _check(argmax_ids: torch.Tensor, plan: torch.Tensor, drafts: torch.Tensor | None,
           bonus: torch.Tensor | None) -> int:
    """greedy_verify's argument checks; returns W. Raises HayabusaValidationError naming the argument."""
    if argmax_ids.dim() != 1 or argmax_ids.dtype != torch.int64:
        raise HayabusaValidationError(f"argmax_ids must be [N] int64, got {tuple(argmax_ids.shape)} "
                                      f"{argmax_ids.dtype}", parameter="argmax_ids")
    if plan.dim() != 2 or plan.dtype != torch.int64 or plan.shape[1] < 4 or plan.shape[1] % 2:
        raise HayabusaValidationError(f"plan must be [R, 2 * (K + 1) + 2] int64, got {tuple(plan.shape)} "
                                      f"{plan.dtype}", parameter="plan")
    if not plan.is_contiguous():
        raise HayabusaValidationError("plan must be contiguous", parameter="plan")
    R = plan.shape[0]
    if drafts is not None and (drafts.dim() != 2 or drafts.dtype != torch.int64
                               or (drafts.shape[1] > 1 and drafts.stride(1) != 1)):
        raise HayabusaValidationError(f"drafts must be [R_d, K] int64 with unit column stride, got "
                                      f"{tuple(drafts.shape)} {drafts.dtype}", parameter="drafts")
    if bonus is not None and (bonus.shape != (R,) or bonus.dtype != torch.int64):
        raise HayabusaValidationError(f"bonus must be [R={R}] int64, got {tuple(bonus.shape)} {bonus.dtype}",
                                      parameter="bonus")
    for name, t in (("argmax_ids", argmax_ids), ("drafts", drafts), ("bonus", bonus)):
        if t is not None and t.device != plan.device:
            raise HayabusaValidationError(f"{name} is on {t.device}, plan on {plan.device}: one device needed",
                                          parameter=name)
    return (plan.shape[1] - 2) // 2


def greedy_verify(argmax_ids: torch.Tensor, plan: torch.Tensor, drafts: torch.Tensor | None = None,
                  bonus: torch.Tensor | None = None) -> torch.Tensor:
    """Each request's emitted tokens under greedy verification, in one Triton kernel (no host sync).

    Args:
        argmax_ids: [N] int64, the target's argmax at each of the step's logits rows.
        plan: [R, 2W + 2] int64 (W = K + 1), built on the host (module docstring; ``spec_verify.greedy_plan``).
        drafts: [R_d, >= K] int64, proposals on the device (unit column stride), rows picked by plan column
            2W + 1; None: the proposals are the plan's columns W .. 2W-1.
        bonus: [R] int64, tokens to emit instead of the argmax at column num_drafts (the usual sampler's token at
            each request's last position); None: the argmax there.

    Returns:
        [R, W] int64: the accepted proposals, then the argmax (or bonus) at the first mismatch, then -1 padding.

    Raises:
        HayabusaValidationError (a ValueError) naming the argument of a wrong shape, dtype or device.
    """
    W = _check(argmax_ids, plan, drafts, bonus)
    R = plan.shape[0]
    out = torch.empty((R, W), dtype=torch.int64, device=plan.device)
    if R == 0:
        return out
    _greedy_verify_kernel[(R,)](
        argmax_ids, plan, drafts if drafts is not None else plan, bonus if bonus is not None else argmax_ids, out,
        plan.stride(0), drafts.stride(0) if drafts is not None else 0,
        W=W, BLOCK_W=next_power_of_2(W), DRAFTS_ON_DEVICE=drafts is not None, HAS_BONUS=bonus is not None)
    return out


def greedy_verify_ref(argmax_ids: torch.Tensor, plan: torch.Tensor, drafts: torch.Tensor | None = None,
                      bonus: torch.Tensor | None = None) -> torch.Tensor:
    """greedy_verify in plain torch (the CPU path and the kernel's reference); same arguments, result and errors.
    With host proposals and no bonus it is 7 small ops: argmax gather, compare, cumsum, compare, masked fill."""
    W = _check(argmax_ids, plan, drafts, bonus)
    g = argmax_ids[plan[:, :W]]                                              # [R, W] argmax at positions 0..nd
    d = plan[:, W:2 * W]
    if drafts is not None:   # device proposals into columns < num_drafts, -1 elsewhere
        nd, src = plan[:, 2 * W:2 * W + 1], plan[:, 2 * W + 1]
        K = min(drafts.shape[1], W - 1)
        ext = torch.cat([torch.nn.functional.pad(drafts[:, :K], (0, W - K), value=-1),
                         drafts.new_full((1, W), -1)])                       # row -1: no proposals
        d = torch.where(torch.arange(W, device=d.device) < nd, ext[src], -1)
    if bonus is not None:
        g = g.scatter(1, plan[:, 2 * W:2 * W + 1], bonus[:, None])
    miss = g != d                                                            # always True at column num_drafts
    # emitted: no miss before j (misses up to j <= the miss at j)
    return g.masked_fill(miss.cumsum(1) > miss, -1)
