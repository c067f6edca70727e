"""benchmarks/vl_host_profile.py's vision-tower instruments (``--profile-vision``, ``--sync-vision``) on the CPU
with a tiny tower: ops per call are counted, a host sync (.item(), nonzero) inside the call is found and named."""

from __future__ import annotations

import runpy
from pathlib import Path

import torch

from tests.models.test_qwen2_vl_varlen import GRIDS, _pixels, tiny_tower

REPO = Path(__file__).resolve().parents[2]


def _script():
    return runpy.run_path(str(REPO / "benchmarks" / "vl_host_profile.py"), run_name="vl_host_profile")


def test_profile_vision_counts_ops_and_host_waits():
    s = _script()
    tower = tiny_tower(True)
    pixels = _pixels(GRIDS)

    def clean(pv, grid):
        with torch.no_grad():
            return tower(pv, grid)

    def syncing(pv, grid):
        out = clean(pv, grid)
        n = int(out.abs().sum().item() > 0)                # .item(): the host waits on CUDA
        return out[torch.nonzero(out[:, 0] > -1e9)[:, 0]] * n

    vp = s["VisionProfile"](cuda=False)
    f, g = vp.wrap(clean), vp.wrap(syncing)
    a, b = f(pixels, GRIDS), g(pixels, GRIDS)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    res = vp.result()
    assert res["calls"] == 2 and res["images_per_call"] == [len(GRIDS)] * 2
    clean_ops, sync_ops = res["launches_per_call"]
    assert clean_ops > 2 * 10 and sync_ops > clean_ops          # two blocks of >= 10 ops; the extra ops counted
    assert res["host_waits_per_call"] == [0, 2]
    assert res["host_waits_by"] == {"aten::_local_scalar_dense": 1, "aten::nonzero": 1}
    assert res["kernel_device_ms"] == [] and res["host_ops"][0]["self_ms"] > 0


def test_sync_vision_times_the_call():
    s = _script()
    timers = s["Timers"]()
    calls = []
    wrapped = s["sync_wrap"](lambda *a: calls.append(a) or "out", timers, cuda=False)
    assert wrapped(1, [2]) == "out" and calls == [(1, [2])]
    assert timers.seconds["vision_host"] > 0 and timers.seconds["vision_device_tail"] >= 0
    assert dict(timers.syncs) == {}
