"""Qwen2.5-VL's window layout (model/qwen2_vl.py ``window_order``, numpy, no per-window loop) against the loop
over windows it replaced, on W8-sized pages, edge windows, several frames and several images. CPU, no model."""

from __future__ import annotations

import numpy as np
import pytest

from hayabusa.model.qwen2_vl import window_order


def window_order_loop(grid_thw, merge, window_units):
    """The reference: visit every window (row-major), its units row-major, one numpy slice per window."""
    order, cu, base = [], [0], 0
    for t, h, w in grid_thw:
        gh, gw = h // merge, w // merge
        units = np.arange(t * gh * gw).reshape(t, gh, gw)
        for f in range(t):
            for r0 in range(0, gh, window_units):
                for c0 in range(0, gw, window_units):
                    win = units[f, r0:r0 + window_units, c0:c0 + window_units].reshape(-1)
                    order.append(win + base)
                    cu.append(cu[-1] + len(win) * merge * merge)
        base += t * gh * gw
    return np.concatenate(order).astype(np.int64), cu


@pytest.mark.parametrize("grids", [
    [(1, 54, 74)],                                   # a 1036 x 756 page: 27 x 37 units, edge windows both ways
    [(1, 8, 8)],                                     # exactly one window
    [(1, 2, 18), (2, 12, 6), (1, 30, 2)],            # thin images, two frames
    [(1, 44, 68), (1, 34, 56), (1, 28, 48), (1, 28, 40)],
])
def test_window_order_equals_loop(grids):
    order, cu = window_order(grids, 2, 4)
    ref_order, ref_cu = window_order_loop(grids, 2, 4)
    assert order.dtype == np.int64 and np.array_equal(order, ref_order)
    assert cu == ref_cu and all(isinstance(x, int) for x in cu)
    assert sorted(order.tolist()) == list(range(sum(t * h * w // 4 for t, h, w in grids)))
