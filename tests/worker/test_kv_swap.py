"""KVSwapper: a step's block copies between the device KV caches (a target's and a draft model's on the same block
ids) and the CPU tier, exact contents."""

from __future__ import annotations

import pytest
import torch

from hayabusa.worker.kv_swap import KVSwapper, block_runs


def test_block_runs_merge_consecutive_pairs_only():
    assert block_runs([(0, 4), (1, 5), (2, 6), (7, 1), (8, 3), (9, 4)]) == [(0, 4, 3), (7, 1, 1), (8, 3, 2)]
    assert block_runs([]) == []


def _cache(L: int, N: int, H: int, D: int, device: str, start: int = 0):
    """A device KV cache [L, 2, N, 4, H, D] of distinct values: (the original, the buffer the swapper copies)."""
    base = torch.arange(start, start + L * 2 * N * 4 * H * D, dtype=torch.float32, device=device)
    base = base.view(L, 2, N, 4, H, D)
    return base, base.clone()


def _run_swaps(device: str, gather: bool = False) -> None:
    # the target's cache (2 layers, 2 KV heads) and a draft model's (1 layer, 1 KV head, D 4) on the same block ids
    N = 6
    base, gpu = _cache(2, N, 2, 8, device)
    dbase, dgpu = _cache(1, N, 1, 4, device, start=10**6)
    swapper = KVSwapper([gpu, dgpu], num_blocks=5, gather=gather)
    # block-major: [N_cpu, L, 2, block_size, H_kv, D]
    assert [tuple(c.shape) for c in swapper.cpu_caches] == [(5, 2, 2, 4, 2, 8), (5, 1, 2, 4, 1, 4)]
    # step 1: device blocks 1, 2 and 5 out to CPU blocks 3, 4 and 0
    swapper.execute([(1, 3), (2, 4), (5, 0)], [])
    # step 2: block 1 is refilled from CPU 0 (what was block 5) after block 1 went out to CPU 2 in the same step
    swapper.execute([(1, 2)], [(0, 1), (3, 0), (4, 3)])
    # step 3: write-through copies (freed prefix blocks) of device blocks 4 and 0 into CPU blocks 1 and 0
    swapper.execute([], [], [(4, 1), (0, 0)], step_id=3)
    if device == "cuda":
        torch.cuda.synchronize()
    for cpu, b, g in zip(swapper.cpu_caches, (base, dbase), (gpu, dgpu)):
        for layer in range(b.shape[0]):
            for kv in range(2):
                assert torch.equal(cpu[3, layer, kv], b[layer, kv, 1].cpu())
                assert torch.equal(cpu[4, layer, kv], b[layer, kv, 2].cpu())
                assert torch.equal(cpu[2, layer, kv], b[layer, kv, 1].cpu())
                assert torch.equal(g[layer, kv, 1], b[layer, kv, 5])      # swap-outs ran first
                assert torch.equal(g[layer, kv, 0], b[layer, kv, 1])
                assert torch.equal(g[layer, kv, 3], b[layer, kv, 2])
                assert torch.equal(g[layer, kv, 4], b[layer, kv, 4])      # untouched
                assert torch.equal(cpu[1, layer, kv], b[layer, kv, 4].cpu())   # written through
                assert torch.equal(cpu[0, layer, kv], b[layer, kv, 1].cpu())   # device block 0 held block 1
    # runs: step 1: (1,3)+(2,4) merged, (5,0); step 2: (1,2); (0,1), (3,0), (4,3); step 3: (4,1), (0,0); one copy
    # per run and cache
    assert swapper.num_runs == 8 and swapper.num_copies == 16


@pytest.mark.parametrize("gather", [False, True])
def test_swaps_on_cpu(gather):
    _run_swaps("cpu", gather)


@pytest.mark.cuda
@pytest.mark.parametrize("gather", [False, True])
def test_swaps_on_cuda_side_stream(gather):
    _run_swaps("cuda", gather)
    assert torch.empty(1).pin_memory().is_pinned()


# ---------------------------------------------------------------------------------------------------------------
# One copy per run and cache, whatever the layer count; byte-exact round trips of arbitrary block ids.

def _random_buffer(L: int, N: int, H: int, D: int, dtype: torch.dtype, device: str, gen: torch.Generator):
    """[L, 2, N, 4, H, D] of random bytes in `dtype` (fp8 / bf16 bit patterns included: compared as bytes)."""
    elem = torch.empty((), dtype=dtype).element_size()
    raw = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[elem]
    lo, hi = (0, 256) if elem == 1 else (-(2 ** (8 * elem - 1)), 2 ** (8 * elem - 1))
    bits = torch.randint(lo, hi, (L, 2, N, 4, H, D), dtype=raw, generator=gen)
    return bits.view(dtype).to(device)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A copy of t's bytes on the CPU, [..., last dim x element size] uint8."""
    return t.cpu().clone().contiguous().view(torch.uint8)


class _CountCalls(torch.overrides.TorchFunctionMode):
    """Counts torch calls by name (``Tensor.copy_``, ``index_select``, ...) while active."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        self.calls[name] = self.calls.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("gather", [False, True])
@pytest.mark.parametrize("num_layers", [1, 6])
def test_a_step_of_k_runs_is_k_copies_per_cache_whatever_the_layer_count(gather, num_layers):
    gen = torch.Generator().manual_seed(0)
    target = _random_buffer(num_layers, 16, 2, 8, torch.float32, "cpu", gen)
    draft = _random_buffer(1, 16, 1, 4, torch.float32, "cpu", gen)
    swapper = KVSwapper([target, draft], num_blocks=12, gather=gather)
    swap_out = [(3, 0), (4, 1), (5, 2), (9, 7), (1, 4), (2, 5)]   # 3 runs: (3,0,3), (9,7,1), (1,4,2)
    swap_in = [(7, 3), (0, 10), (1, 11)]                          # 2 runs: (7,3,1), (0,10,2)
    with _CountCalls() as count:
        swapper.execute(swap_out, swap_in)
    assert count.calls.get("copy_", 0) == (3 + 2) * 2             # one per run and cache (2 caches)
    assert swapper.num_copies == 10 and swapper.num_runs == 5
    gathers, scatters = count.calls.get("index_select", 0), count.calls.get("index_copy_", 0)
    assert (gathers, scatters) == ((2, 2) if gather else (0, 0))  # one of each per cache when a side has >1 run
    # a step of one run each way copies it directly (nothing to gather)
    with _CountCalls() as count:
        swapper.execute([(10, 8), (11, 9)], [(8, 0)])
    assert count.calls.get("copy_", 0) == 2 * 2 and "index_select" not in count.calls


def _round_trip(device: str, dtype: torch.dtype, gather: bool, steps: int = 6) -> KVSwapper:
    """Random steps of swap-outs and swap-ins of non-consecutive, interleaved block ids on a target + draft pair of
    caches, checked byte for byte against a per-block reference after every step."""
    gen = torch.Generator().manual_seed(1)
    N, N_cpu = 24, 20
    bufs = [_random_buffer(3, N, 2, 8, dtype, device, gen), _random_buffer(2, N, 1, 16, dtype, device, gen)]
    ref_gpu = [_bytes(b) for b in bufs]                               # [L, 2, N, 4, H, D * elem] uint8
    ref_cpu: list[dict[int, torch.Tensor]] = [{} for _ in bufs]       # CPU block -> [L, 2, 4, H, D * elem]
    swapper = KVSwapper(bufs, num_blocks=N_cpu, gather=gather)
    for step in range(steps):
        swap_out = []
        if step % 2:   # a run of two consecutive ids too, beside the scattered ones
            b = int(torch.randint(0, N // 2, (1,), generator=gen)) * 2
            swap_out = [(b, N_cpu - 2), (b + 1, N_cpu - 1)]
        srcs = [s for s in torch.randperm(N, generator=gen).tolist() if s not in {s for s, _ in swap_out}]
        cpu_free = torch.randperm(N_cpu - 2, generator=gen).tolist()
        k_out = 1 + step % 5
        swap_out = [(srcs[i], cpu_free[i]) for i in range(k_out)] + swap_out
        written = {d for _, d in swap_out}
        readable = [c for c in ref_cpu[0] if c not in written]
        dsts = torch.randperm(N, generator=gen).tolist()
        swap_in = [(c, dsts[i]) for i, c in enumerate(readable[: 1 + step % 4])]
        for r_gpu, r_cpu in zip(ref_gpu, ref_cpu):
            for s, d in swap_out:
                r_cpu[d] = r_gpu[:, :, s].clone()
            for s, d in swap_in:                                      # after the swap-outs
                r_gpu[:, :, d] = r_cpu[s]
        swapper.execute(swap_out, swap_in)
        if device == "cuda":
            torch.cuda.synchronize()
        for buf, cpu, r_gpu, r_cpu in zip(bufs, swapper.cpu_caches, ref_gpu, ref_cpu):
            assert torch.equal(_bytes(buf), r_gpu), f"step {step}: device blocks"
            cpu_bytes = _bytes(cpu)                                   # [N_cpu, L, 2, 4, H, D * elem]
            for c, want in r_cpu.items():
                assert torch.equal(cpu_bytes[c], want), f"step {step}: CPU block {c}"
    return swapper


FP8 = getattr(torch, "float8_e4m3fn", None)


@pytest.mark.parametrize("gather", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16] + ([FP8] if FP8 is not None else []),
                         ids=str)
def test_round_trip_restores_every_byte_of_every_layer(dtype, gather):
    swapper = _round_trip("cpu", dtype, gather)
    assert swapper.num_copies == 2 * swapper.num_runs > 0


@pytest.mark.cuda
@pytest.mark.parametrize("gather", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16] + ([FP8] if FP8 is not None else []), ids=str)
def test_round_trip_on_cuda(dtype, gather):
    swapper = _round_trip("cuda", dtype, gather)
    assert all(c.is_pinned() for c in swapper.cpu_caches)


@pytest.mark.cuda
@pytest.mark.parametrize("gather", [False, True])
def test_execute_does_not_wait_for_the_queued_work_on_cuda(gather):
    """The host returns from execute while a long kernel queued before it still runs; the copies run after it
    (the side stream waits for the compute stream) and the compute stream's next work runs after the copies."""
    import time

    gen = torch.Generator().manual_seed(2)
    buf = _random_buffer(24, 64, 2, 64, torch.bfloat16, "cuda", gen)   # the 0.5b shape's layers and heads
    swapper = KVSwapper([buf], num_blocks=64, gather=gather)
    # warm-up (kernels loaded, pinned index blocks in the host allocator): 3 runs out, then 3 runs in
    swapper.execute([(1, 10), (2, 11), (7, 20), (9, 30)], [])
    swapper.execute([], [(10, 40), (20, 41), (30, 45)])
    torch.cuda.synchronize()
    want = _bytes(buf)
    torch.cuda._sleep(2_000_000_000)             # ~1 s of GPU clock cycles queued on the compute stream
    buf[:, :, 0].fill_(1.0)                      # queued after it: the swap-out of block 0 must see it
    t0 = time.perf_counter()
    swapper.execute([(0, 50), (5, 52)], [(10, 60), (30, 62)])
    host_s = time.perf_counter() - t0
    buf[:, :, 5].fill_(2.0)                      # the forward writes a block a swap-out read: after the copy
    after = buf[:, :, 60].clone()                # and reads a block a swap-in wrote: after the copy
    done = torch.cuda.Event()
    done.record()
    assert not done.query(), "the queued kernel had ended when execute returned: the host waited for it"
    assert host_s < 0.2, host_s
    torch.cuda.synchronize()
    cpu = swapper.cpu_caches[0]
    assert torch.equal(cpu[50], torch.ones_like(cpu[50]))
    assert torch.equal(_bytes(cpu[52]), want[:, :, 5])
    assert torch.equal(_bytes(after), want[:, :, 1])            # CPU block 10 holds device block 1 (warm-up)
    assert torch.equal(_bytes(buf[:, :, 62]), want[:, :, 9])    # CPU block 30 holds device block 9
    assert swapper.num_copies == 3 + 3 + 2 + 2   # one per run: the runs of the four lists


@pytest.mark.cuda
@pytest.mark.parametrize("gather", [False, True])
def test_write_through_does_not_gate_the_forward_but_a_fence_does_on_cuda(gather):
    """The side stream is kept busy (~1 s queued on it): a step's write-through copies wait behind that, the
    compute stream's next work does not wait for them; a later step whose fence names that step does, so its
    forward's write into a block being copied lands after the copy read it."""
    import time

    gen = torch.Generator().manual_seed(3)
    buf = _random_buffer(24, 64, 2, 64, torch.bfloat16, "cuda", gen)   # the 0.5b shape's layers and heads
    swapper = KVSwapper([buf], num_blocks=64, gather=gather)
    swapper.execute([], [], [(1, 10), (7, 20)], step_id=1)              # warm-up (kernels, pinned index blocks)
    torch.cuda.synchronize()
    want = _bytes(buf)
    with torch.cuda.stream(swapper.stream):
        torch.cuda._sleep(2_000_000_000)         # ~1 s of GPU clock cycles queued on the side stream
    swapper.execute([], [], [(3, 5), (8, 9)], step_id=2)               # two runs: gathered when gather=True
    buf[:, :, 10].fill_(3.0)                     # this step's forward: a block no copy reads
    t0 = time.perf_counter()
    torch.cuda.current_stream().synchronize()    # the forward's stream: done without waiting for the copies
    forward_s = time.perf_counter() - t0
    side_done = swapper.write_through_events._events[-1][1]
    assert not side_done.query(), "the side stream's sleep ended before the check: it proves nothing"
    assert forward_s < 0.5, forward_s
    swapper.execute([], [], [], step_id=3, fence=2)   # step 3 writes blocks 3 and 8: it waits for step 2's copies
    assert len(swapper.write_through_events) == 0
    buf[:, :, 3].fill_(7.0)
    buf[:, :, 8].fill_(7.0)
    fenced = torch.cuda.Event()
    fenced.record()
    assert not fenced.query(), "the fenced forward did not wait for the copies"
    torch.cuda.synchronize()
    cpu = swapper.cpu_caches[0]
    assert torch.equal(_bytes(cpu[5]), want[:, :, 3]) and torch.equal(_bytes(cpu[9]), want[:, :, 8])
    assert torch.equal(_bytes(cpu[10]), want[:, :, 1]) and torch.equal(_bytes(cpu[20]), want[:, :, 7])
    assert bool((buf[:, :, 3] == 7.0).all()) and swapper.num_copies == 4
