"""Sampler tests: each knob against its definition on small logits that can be checked by hand.

Runs on CPU; on a machine with CUDA every test also runs on the GPU.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hayabusa.sample import Sampler, SamplingMetadata, build_sampling_metadata
from hayabusa.sample.sampler import apply_penalties, gather_logprobs
from hayabusa.sampling_params import SamplingParams

DEVICES = ["cpu"] + ([pytest.param("cuda", marks=pytest.mark.cuda)] if torch.cuda.is_available() else [])
HYPO = settings(max_examples=30, deadline=None)
HYPO_FEW = settings(max_examples=15, deadline=None)

# V = 5, probabilities chosen so every truncation set is obvious. Sorted: 1 (.40), 3 (.30), 4 (.15), 0 (.10), 2 (.05).
PROBS = [0.10, 0.40, 0.05, 0.30, 0.15]


def log_probs_logits(device: str) -> torch.Tensor:
    return torch.tensor([PROBS], device=device).log()  # [1, 5]


def make_md(
    params: list[SamplingParams],
    vocab_size: int,
    device: str,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
    eos: int | None = None,
) -> SamplingMetadata:
    R = len(params)
    return build_sampling_metadata(
        params,
        prompts if prompts is not None else [[] for _ in range(R)],
        outputs if outputs is not None else [[] for _ in range(R)],
        generators if generators is not None else [None] * R,
        eos,
        vocab_size,
        device,
    )


def probs_for(params: SamplingParams, device: str) -> torch.Tensor:
    """The distribution one row samples from, for the PROBS logits."""
    logits = log_probs_logits(device)
    md = make_md([params], 5, device)
    return Sampler.compute_probs(Sampler.process_logits(logits, md), md)[0].cpu()


def kept(probs: torch.Tensor) -> set[int]:
    return set(torch.nonzero(probs > 0).flatten().tolist())


def gen(seed: int, device: str) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def test_metadata_fields():
    params = [
        SamplingParams(temperature=0.0, top_k=3, logprobs=1),  # greedy: truncation knobs reset
        SamplingParams(temperature=0.7, top_k=2, min_tokens=2, stop_token_ids=[4]),
        SamplingParams(temperature=1.0, top_k=-1, min_tokens=1, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=1.0, min_tokens=1),
    ]
    g = gen(1, "cpu")
    md = make_md(params, 5, "cpu", prompts=[[1, 2], [3], [], [0, 1, 2]], outputs=[[], [1], [], [2]],
                 generators=[None, g, None, None], eos=2)
    assert md.temperature.tolist() == pytest.approx([0.0, 0.7, 1.0, 1.0])
    assert not md.all_greedy and not md.all_random
    assert md.top_k.dtype == torch.int64 and md.top_k.tolist() == [5, 2, 5, 5]
    assert md.top_p is None and md.min_p is None
    assert md.generators == {1: g}
    assert md.max_num_logprobs == 3
    assert md.no_penalties and md.prompt_token_ids is None and md.repetition_penalties is None
    # row 1: 1 output < 2 -> eos + stop id; row 2: ignore_eos and no stop ids -> nothing; row 3: 1 output >= 1.
    assert md.min_tokens == {1: {2, 4}}
    md = make_md([SamplingParams(repetition_penalty=1.2), SamplingParams()], 5, "cpu", prompts=[[1, 2], [3]])
    assert not md.no_penalties
    assert md.prompt_token_ids.tolist() == [[1, 2], [3, 5]]  # padded with V
    assert md.frequency_penalties.tolist() == [0.0, 0.0] and md.repetition_penalties.tolist() == pytest.approx([1.2, 1])
    assert make_md([SamplingParams(temperature=0)], 5, "cpu").all_greedy
    assert make_md([SamplingParams(top_p=0.5)], 5, "cpu").all_random


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_is_softmax_of_scaled_logits(device, temperature):
    probs = probs_for(SamplingParams(temperature=temperature), device)
    expected = torch.tensor(PROBS) ** (1 / temperature)
    torch.testing.assert_close(probs, expected / expected.sum(), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_sampled_frequencies_follow_temperature(device):
    n = 20000
    for seeded in (False, True):
        logits = log_probs_logits(device).expand(n, 5)
        gens = [gen(i, device) for i in range(n)] if seeded else None
        md = make_md([SamplingParams(temperature=0.5)] * n, 5, device, generators=gens)
        torch.manual_seed(0)
        tokens = Sampler()(logits, md).sampled_token_ids.cpu()
        freq = torch.bincount(tokens, minlength=5).float() / n
        expected = torch.tensor(PROBS) ** 2
        expected /= expected.sum()  # [.035, .561, .009, .316, .079], far from PROBS
        torch.testing.assert_close(freq, expected, atol=0.015, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("top_k, expected", [(1, {1}), (2, {1, 3}), (4, {0, 1, 3, 4}), (5, {0, 1, 2, 3, 4}), (0, {0, 1, 2, 3, 4})])
def test_top_k_keeps_the_k_largest(device, top_k, expected):
    probs = probs_for(SamplingParams(top_k=top_k), device)
    assert kept(probs) == expected
    mass = sum(PROBS[i] for i in expected)
    torch.testing.assert_close(probs, torch.tensor([p / mass if i in expected else 0.0 for i, p in enumerate(PROBS)]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "top_p, expected",
    [(0.3, {1}), (0.41, {1, 3}), (0.65, {1, 3}), (0.75, {1, 3, 4}), (0.9, {0, 1, 3, 4}), (0.96, {0, 1, 2, 3, 4})],
)
def test_top_p_keeps_smallest_prefix_reaching_p(device, top_p, expected):
    probs = probs_for(SamplingParams(top_p=top_p), device)
    assert kept(probs) == expected
    mass = sum(PROBS[i] for i in expected)
    torch.testing.assert_close(probs, torch.tensor([p / mass if i in expected else 0.0 for i, p in enumerate(PROBS)]))


@pytest.mark.parametrize("device", DEVICES)
def test_top_p_boundary_and_off_rows(device):
    # Uniform over 4: probs and their cumulative sums are exact. A prefix whose mass equals p is enough;
    # ties rank by id.
    for top_p, expected in [(0.25, {0}), (0.5, {0, 1}), (0.75, {0, 1, 2}), (0.76, {0, 1, 2, 3})]:
        md = make_md([SamplingParams(top_p=top_p)], 4, device)
        assert kept(Sampler.compute_probs(torch.zeros(1, 4, device=device), md)[0]) == expected
    # top_p = 1 keeps the whole tail even when the cumulative sum rounds to 1.0 after the first token
    # (another row turns top-p on for the batch).
    logits = torch.tensor([[20.0] + [0.0] * 9] * 2, device=device)
    md = make_md([SamplingParams(top_p=1.0), SamplingParams(top_p=0.5)], 10, device)
    probs = Sampler.compute_probs(logits, md).cpu()
    assert kept(probs[0]) == set(range(10)) and kept(probs[1]) == {0}
    torch.testing.assert_close(probs[0], torch.softmax(logits[0].cpu(), -1))
    # min_p = 1 keeps exactly the tokens tied with the top one.
    md = make_md([SamplingParams(min_p=1.0)] * 2, 4, device)
    probs = Sampler.compute_probs(torch.tensor([[0.0] * 4, [0.0, 1.0, 1.0, 0.5]], device=device), md).cpu()
    assert kept(probs[0]) == {0, 1, 2, 3} and kept(probs[1]) == {1, 2}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("min_p, expected", [(0.2, {0, 1, 3, 4}), (0.3, {1, 3, 4}), (0.5, {1, 3}), (0.9, {1})])
def test_min_p_keeps_tokens_above_fraction_of_top(device, min_p, expected):
    # thresholds min_p * 0.4: 0.08, 0.12, 0.2, 0.36
    assert kept(probs_for(SamplingParams(min_p=min_p), device)) == expected


@pytest.mark.parametrize("device", DEVICES)
def test_top_p_applies_to_the_top_k_renormalised_distribution(device):
    # alone, top_p=0.8 keeps {1, 3, 4} (mass before 4 is 0.70); after top_k=3 the mass before 4 is 0.70/0.85 = 0.82.
    assert kept(probs_for(SamplingParams(top_p=0.8), device)) == {1, 3, 4}
    assert kept(probs_for(SamplingParams(top_k=3, top_p=0.8), device)) == {1, 3}
    assert kept(probs_for(SamplingParams(top_k=4, min_p=0.3, temperature=1.0), device)) == {1, 3, 4}


@pytest.mark.parametrize("device", DEVICES)
def test_penalties_match_hand_computed_logits(device):
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 1.0, 0.0]], device=device).expand(5, 6)
    params = [
        SamplingParams(repetition_penalty=2.0),
        SamplingParams(frequency_penalty=0.5),
        SamplingParams(presence_penalty=0.3),
        SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.3),
        SamplingParams(),  # same history, no penalty: unchanged
    ]
    prompts = [[0, 1]] * 4 + [[0, 1, 5, 5, 5, 5]]  # rows of different lengths exercise the padding
    outputs = [[2, 2, 3]] * 4 + [[2, 2, 3, 4]]
    md = make_md(params, 6, device, prompts=prompts, outputs=outputs)
    out = apply_penalties(logits.clone(), md).cpu()
    expected = torch.tensor([
        [1.0, -2.0, 0.25, -1.0, 1.0, 0.0],  # prompt+output tokens 0..3: positive / 2, negative * 2
        [2.0, -1.0, -0.5, -1.0, 1.0, 0.0],  # output only: 2 counted twice, 3 once; prompt tokens 0, 1 untouched
        [2.0, -1.0, 0.2, -0.8, 1.0, 0.0],   # once per distinct output token
        [1.0, -2.0, -1.05, -1.8, 1.0, 0.0],
        [2.0, -1.0, 0.5, -0.5, 1.0, 0.0],
    ])
    torch.testing.assert_close(out, expected)
    # Greedy argmaxes the penalised logits: token 0 wins unpenalised, token 4 once 0 is halved.
    md = make_md([SamplingParams(temperature=0, repetition_penalty=2.0 + 1e-3)], 6, device, prompts=[[0]])
    assert Sampler()(logits[:1], md).sampled_token_ids.tolist() == [4]


@st.composite
def tied_logits(draw):
    R, V = draw(st.integers(1, 4)), draw(st.integers(2, 160))  # torch's unstable sort reorders ties from ~100
    values = draw(st.lists(st.integers(0, 3), min_size=R * V, max_size=R * V))  # small range: many ties
    return torch.tensor(values, dtype=torch.float32).view(R, V)


@pytest.mark.parametrize("device", DEVICES)
@HYPO
@given(logits=tied_logits(), temperature=st.floats(0.05, 3.0), seed=st.integers(0, 2**31))
def test_top_k_1_and_tiny_top_p_equal_greedy(device, logits, temperature, seed):
    logits = logits.to(device)
    R, V = logits.shape
    greedy = Sampler()(logits, make_md([SamplingParams(temperature=0)] * R, V, device)).sampled_token_ids
    assert greedy.tolist() == logits.argmax(dim=-1).tolist()  # ties: the lowest id
    torch.manual_seed(seed)
    for params in (SamplingParams(temperature=temperature, top_k=1), SamplingParams(temperature=temperature, top_p=1e-6)):
        assert Sampler()(logits, make_md([params] * R, V, device)).sampled_token_ids.tolist() == greedy.tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_min_tokens_masks_eos_and_stop_ids(device):
    logits = torch.tensor([[0.0, 1.0, 5.0, 0.5, 4.0, 3.0]], device=device).expand(4, 6)  # eos 2, then stop id 4
    params = [
        SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[4]),
        SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[4]),
        SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[4], ignore_eos=True),
        SamplingParams(temperature=0, stop_token_ids=[4]),
    ]
    outputs = [[1], [1, 1], [1], []]  # row 1 already has 2 outputs; row 3 has min_tokens 0
    md = make_md(params, 6, device, outputs=outputs, eos=2)
    assert md.min_tokens == {0: {2, 4}, 2: {4}}
    assert Sampler()(logits, md).sampled_token_ids.tolist() == [5, 2, 2, 2]
    masked = Sampler.process_logits(logits, md).cpu()
    assert masked[0].tolist() == [0.0, 1.0, -math.inf, 0.5, -math.inf, 3.0]
    # A random row never draws a masked id.
    md = make_md([SamplingParams(min_tokens=1, stop_token_ids=[4])] * 2000, 6, device, eos=2)
    tokens = Sampler()(torch.zeros(2000, 6, device=device), md).sampled_token_ids
    assert set(tokens.tolist()) == {0, 1, 3, 5}


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_raw_with_ids_and_ranks(device):
    logits = torch.cat([log_probs_logits(device)] * 3).to(torch.bfloat16)
    params = [
        SamplingParams(temperature=0, logprobs=2, min_tokens=1),  # eos 1 masked: samples 3, the 2nd
        SamplingParams(temperature=0.3, logprobs=None, repetition_penalty=1.7, top_k=2),
        SamplingParams(temperature=0, logprobs=0, presence_penalty=2.0),  # output [1]: 1 -> 0.40 - 2.0: samples 3
    ]
    md = make_md(params, 5, device, outputs=[[], [], [1]], eos=1)
    out = Sampler()(logits, md)
    raw = torch.log_softmax(logits.float(), dim=-1)
    sampled = out.sampled_token_ids
    assert sampled.dtype == torch.int64 and sampled.device.type == device
    assert sampled[0].item() == 3 and sampled[2].item() == 3 and sampled[1].item() in (1, 3)
    assert out.logprob_token_ids.shape == (3, 3) and out.logprob_token_ids.dtype == torch.int64
    assert out.logprob_token_ids[:, 0].tolist() == sampled.tolist()
    assert out.logprob_token_ids[:, 1:].tolist() == [[1, 3]] * 3
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.logprob_token_ids))
    assert out.logprobs.dtype == torch.float32
    torch.testing.assert_close(out.logprobs[0].cpu(), torch.tensor(PROBS).log()[[3, 1, 3]], atol=0.01, rtol=0)
    assert out.sampled_token_ranks.tolist() == [2, 1 if sampled[1].item() == 1 else 2, 2]
    # Ties count against the sampled token (vLLM's rule).
    ids, lps, ranks = gather_logprobs(torch.log_softmax(torch.tensor([[1.0, 1.0, 0.0]]), -1), 1, torch.tensor([0]))
    assert ranks.tolist() == [2] and ids.tolist() == [[0, 0]] and lps[0, 0] == lps[0, 1]
    assert Sampler()(logits, make_md([SamplingParams()] * 3, 5, device)).logprobs is None


PARAM_CHOICES = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.5, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.7),
    SamplingParams(temperature=0.9, min_p=0.1),
    SamplingParams(temperature=1.0, top_k=20, top_p=0.9, min_p=0.02, repetition_penalty=1.3),
    SamplingParams(temperature=0.8, presence_penalty=0.5, frequency_penalty=0.4, logprobs=3),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("target", PARAM_CHOICES[1:], ids=lambda p: f"T{p.temperature}k{p.top_k}p{p.top_p}")
@HYPO_FEW
@given(others=st.lists(st.tuples(st.integers(0, len(PARAM_CHOICES) - 1), st.none() | st.integers(0, 2**31)),
                       min_size=7, max_size=7),
       row=st.integers(0, 7), seed=st.integers(0, 2**31))
def test_seeded_row_is_batch_invariant(device, target, others, row, seed):
    V = 64
    torch.manual_seed(seed)
    target_logits = torch.randn(1, V).to(device)
    history = ([3, 4, 5], [4, 4, 9])  # prompt, outputs
    alone_gen, batch_gen = gen(1234, device), gen(1234, device)
    params = [PARAM_CHOICES[i] for i, _ in others]
    gens = [None if s is None else gen(s, device) for _, s in others]
    params.insert(row, target)
    gens.insert(row, batch_gen)
    prompts = [[i % V] * (i + 1) for i in range(8)]
    outputs = [[(3 * i) % V] * i for i in range(8)]
    prompts[row], outputs[row] = history
    alone_md = make_md([target], V, device, [history[0]], [history[1]], [alone_gen])
    batch_md = make_md(params, V, device, prompts, outputs, gens)
    for _ in range(3):  # the generator advances identically step after step
        batch_logits = torch.randn(8, V).to(device) * 3
        batch_logits[row] = target_logits[0]
        alone = Sampler()(target_logits, alone_md)
        batch = Sampler()(batch_logits, batch_md)
        assert batch.sampled_token_ids[row].item() == alone.sampled_token_ids[0].item()


@pytest.mark.parametrize("device", DEVICES)
def test_unseeded_rows_reproduce_under_global_seed(device):
    logits = torch.zeros(8, 1000, device=device)  # uniform: any change of noise changes the tokens
    md = make_md([SamplingParams(temperature=1.0, top_p=0.99)] * 8, 1000, device)
    runs = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed)
        runs.append(Sampler()(logits, md).sampled_token_ids.tolist())
    assert runs[0] == runs[1] and runs[0] != runs[2]


@pytest.mark.parametrize("device", DEVICES)
def test_input_logits_are_not_modified(device):
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 1.0, 0.0]], device=device)
    before = logits.clone()
    params = [SamplingParams(temperature=0.5, top_k=2, top_p=0.9, min_p=0.1, repetition_penalty=1.5, min_tokens=1)]
    Sampler()(logits, make_md(params, 6, device, prompts=[[0, 1]], eos=4))
    assert torch.equal(logits, before)
