"""greedy_verify (kernel on CUDA, or the Triton interpreter on CPU) and its torch reference against the general
verification path (rejection_sample, greedy rows), on random steps with proposals on the host or the device and
with or without the sampler's bonus tokens; bad arguments named."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hayabusa.errors import HayabusaValidationError
from hayabusa.kernels.greedy_verify import greedy_verify, greedy_verify_ref
from hayabusa.sample.rejection_sampler import rejection_sample
from hayabusa.worker.spec_verify import SpecStepInputs, greedy_plan
from tests.kernels.conftest import DEVICE


def _step(R: int, K: int, V: int, seed: int):
    """A random verify step: (spec, logits [N, V]); proposals agree with the argmax for a random prefix, then
    differ, so every accepted count 0..k occurs."""
    rng = np.random.default_rng(seed)
    nd = rng.integers(0, K + 1, R)
    nd[0] = K
    width = nd + 1
    starts = np.cumsum(width) - width
    logits = torch.from_numpy(rng.standard_normal((int(width.sum()), V)).astype(np.float32))
    am = logits.argmax(-1).numpy()
    drafts = np.zeros((R, max(K, 1)), dtype=np.int64)
    for i in range(R):
        right = rng.integers(0, nd[i] + 1)
        for j in range(nd[i]):
            t = am[starts[i] + j]
            drafts[i, j] = t if j < right else (t + 1 + rng.integers(0, V - 1)) % V
    last = starts + nd
    col = np.arange(drafts.shape[1])
    index = np.where(col[None, :] < nd[:, None], starts[:, None] + col[None, :], last[:, None])
    return SpecStepInputs(nd, drafts, last, index), logits


def _general(spec: SpecStepInputs, logits: torch.Tensor, bonus: torch.Tensor) -> torch.Tensor:
    """What verify's general path emits for all-greedy rows."""
    R, K = spec.draft_ids.shape
    out = torch.full((R, K + 1), -1, dtype=torch.int64)
    out[:, 0] = bonus
    sel = np.flatnonzero(spec.num_drafts > 0)
    if len(sel):
        am = logits[torch.from_numpy(spec.draft_index[sel])].argmax(-1)
        out[torch.from_numpy(sel)] = rejection_sample(
            torch.from_numpy(spec.draft_ids[sel]), torch.from_numpy(spec.num_drafts[sel]), am, None, bonus[sel],
            torch.ones(len(sel), dtype=torch.bool), {})
    return out


@pytest.mark.parametrize("R,K,V", [(1, 1, 7), (1, 4, 50), (5, 3, 11), (16, 4, 101), (33, 7, 64), (4, 0, 9)])
@pytest.mark.parametrize("drafts_on_device", [False, True])
@pytest.mark.parametrize("with_bonus", [False, True])
def test_greedy_verify_equals_the_general_path(device, R, K, V, drafts_on_device, with_bonus):
    for seed in range(3):
        spec, logits = _step(R, K, V, seed)
        am = logits.argmax(-1)
        last = torch.from_numpy(spec.last_index)
        # a bonus different from the argmax shows that it is the one used at the bonus position
        bonus = (am[last] + 1) % V if with_bonus else am[last]
        expected = _general(spec, logits, bonus)
        # every accepted count occurs across the cases; the result is not all -1 past column 0
        assert (expected[:, 0] >= 0).all()
        plan = torch.from_numpy(greedy_plan(spec))
        drafts = None
        if drafts_on_device:   # the draft model's layout: rows with proposals only, junk past num_drafts
            sel = spec.num_drafts > 0
            drafts = torch.from_numpy(np.where(np.arange(spec.draft_ids.shape[1]) < spec.num_drafts[:, None],
                                               spec.draft_ids, 12345)[sel])
        args = (am, plan, drafts, bonus if with_bonus else None)
        assert torch.equal(greedy_verify_ref(*args), expected)
        dev_args = [None if a is None else a.to(device) for a in args]
        assert torch.equal(greedy_verify(*dev_args).cpu(), expected)


def test_greedy_verify_known_values(device):
    # two requests: drafts [5, 6, 7] with argmax [5, 6, 9, 3] -> 5 6 9; no drafts, argmax 4 -> 4
    am = torch.tensor([5, 6, 9, 3, 4])
    spec = SpecStepInputs(np.array([3, 0]), np.array([[5, 6, 7], [0, 0, 0]]), np.array([3, 4]),
                          np.array([[0, 1, 2], [4, 4, 4]]))
    plan = torch.from_numpy(greedy_plan(spec))
    want = torch.tensor([[5, 6, 9, -1], [4, -1, -1, -1]])
    assert torch.equal(greedy_verify_ref(am, plan), want)
    assert torch.equal(greedy_verify(am.to(device), plan.to(device)).cpu(), want)
    # all accepted: the bonus (or argmax) at position 3
    am2 = torch.tensor([5, 6, 7, 3, 4])
    assert greedy_verify_ref(am2, plan)[0].tolist() == [5, 6, 7, 3]
    assert greedy_verify_ref(am2, plan, bonus=torch.tensor([8, 2]))[0].tolist() == [5, 6, 7, 8]


@pytest.mark.parametrize("fn", [greedy_verify, greedy_verify_ref])
def test_bad_arguments_are_named(fn):
    am, plan = torch.zeros(4, dtype=torch.int64), torch.zeros(2, 6, dtype=torch.int64)
    cases = [((am.float(), plan), "argmax_ids"), ((am, plan[:, :5]), "plan"), ((am, plan.int()), "plan"),
             ((am, plan, torch.zeros(2, 2)), "drafts"), ((am, plan, None, torch.zeros(3, dtype=torch.int64)), "bonus")]
    if torch.cuda.is_available():
        cases.append(((am.cuda(), plan), "argmax_ids"))
    for args, name in cases:
        with pytest.raises(HayabusaValidationError) as e:
            fn(*args)
        assert e.value.parameter == name
