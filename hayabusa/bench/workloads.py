"""The fixed workloads of BENCHMARKS.md, as lists of token-id requests.

Every workload draws from one ``numpy.random.default_rng(0)``: first the lengths (where they vary), then the
token ids, uniform in [100, 10000). Decoding is greedy with EOS ignored, except W7 (temperature 0.9, n=64,
per-request seed). ``scale`` shrinks request counts and lengths proportionally (each at least 1) for quick CPU
runs; scale 1 is the workload of record.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

TOKEN_LOW, TOKEN_HIGH = 100, 10000
W4_MAX_NUM_SEQS = [1, 4, 8, 14, 16, 32, 64]
W8_MAX_NUM_SEQS = [1, 4, 8, 14, 16, 32]
W8_TEXT = ("Extract every personnel change on these pages as JSON with the fields name, company, old_position, "
           "new_position, effective_date.")
# HF generate at batch 1 takes ~27 s per W8 request on an H200: the baseline runs the first few requests only.
W8_HF_REQUESTS = 5
W9_HF_BATCH_SIZES = [1, 16, 64, 256]     # HF baseline batch 1 and the batches its best is taken from
W9_HF_BATCH1_REQUESTS = 100              # HF batch 1 times the first 100 requests (all 2,000 take ~an hour)
W11_MAX_NUM_SEQS = [1, 4, 16]
WORKLOADS = ("W1", "W2", "W3", "W4", "W5", "W6", "W7", "W8", "W9", "W10", "W11", "W1P", "startup")
DESCRIPTIONS = {
    "W1": "offline batch throughput: 256 x (512 prompt, 256 output)",
    "W2": "offline mixed lengths: 256 x (U[100,1024] prompt, U[100,1024] output)",
    "W3": "one stream, decode-bound: 1 x (128 prompt, 512 output)",
    "W4": "document extraction: 100 x (2048 prompt, 128 output) at max_num_seqs 1,4,8,14,16,32,64",
    "W5": "shared prefix: 256 x (1024 shared + 128 own prompt, 64 output), prefix caching on vs off",
    "W6": "online serving: 512 x (512 prompt, 128 output), Poisson arrivals at 1,4,16,64,inf req/s (--base-url)",
    "W7": "many samples: 8 prompts x n=64, 256 prompt, 256 output, temperature 0.9",
    "W9": "encoder-decoder extraction (T5): 2000 x (256 encoder tokens -> 64 output), requests/s and ms per "
          "request; HF generate at batch 1 (first 100 requests) and batches 16, 64, 256",
    "W8": "page images to JSON (Qwen2.5-VL): 100 x (2-5 random images up to 1024x768 + ~60 text tokens, 256 "
          "output) at max_num_seqs 1,4,8,14,16,32",
    "W10": "prefixes that outgrow the GPU: 8 system prompts x 64 x (1024 shared + 128 own, 64 output), "
           "num_gpu_blocks_override=384 whatever the GPU (one running round plus 2 idle prefixes; the 8 prefixes "
           "need 512), CPU KV tier on (swap_space=4) vs off",
    "W11": "copy-heavy extraction (speculative decoding; a TRAINED model): 64 x (a ~40-line order list + a "
           "question whose answer copies lines of it, 128 output) at max_num_seqs 1,4,16; TPOT and acceptance",
    "W1P": "a W1-like batch that must preempt on 8k-token contexts: 32 x (7168 prompt, 1024 output), "
           "max_model_len=8192, num_gpu_blocks_override=4096 (8 full contexts) whatever the GPU; preemption by "
           "swapping the KV to the CPU tier (swap_space=4) vs by recompute; time to finish",
    "startup": "engine construction (load, profile, CUDA graphs) and the first request",
}


@dataclass
class BenchRequest:
    """One request of a workload."""

    prompt_token_ids: list[int]
    max_tokens: int
    n: int = 1
    temperature: float = 0.0
    seed: int | None = None     # per-request seed (sampled workloads)
    # image workloads (W8): the prompt is the chat template over one user message of these images, then `text`;
    # prompt_token_ids stays empty until the runner renders it with the checkpoint's template
    images: list[np.ndarray] | None = None   # each [h, w, 3] uint8 RGB
    text: str | None = None
    # text workloads (W11): the prompt is the chat template over one user message `text`, then `answer_prefix`
    answer_prefix: str | None = None


@dataclass
class Workload:
    """A named list of requests plus how to run it.

    Attributes:
        name: "W1" ... "startup".
        requests: the requests, in submission order.
        scale: the scale it was built with (1.0 = the workload of record).
        variants: engine-argument overrides, one run each (W4: max_num_seqs list; W5: prefix caching on/off);
            [{}] = one run with the user's arguments.
        ceiling: "matmul" (compute floor), "bandwidth" (decode floor) or None (no fraction reported).
        hf_batch1_requests: the HF baseline at batch size 1 times only the first this many requests (None: all):
            W9 (its batch-1 variant; the larger batches run all) and W8 (whose baseline runs at batch 1 only).
        reports_tpot: its records keep TPOT (``tpot_ms``, the median over requests, and ``tpot_mean_ms``): the
            workloads whose target is a per-token latency, W3 (one stream) and W11 (issue #21: speculation's TPOT
            at batch 1 / 4 / 16); throughput workloads leave them None.
        warmup_requests: 0 (the default): the warm-up is a few short requests (``runner.warmup_requests``). N > 0:
            the warm-up is N requests of the workload's own first lengths and max_tokens (fresh ids), so that it
            reaches what the timed run reaches beyond the first steps: W1P's N overflow the GPU cache, so its
            warm-up preempts (by swap or recompute, as the variant says) before the clock starts.
    """

    name: str
    requests: list[BenchRequest]
    scale: float = 1.0
    variants: list[dict] = field(default_factory=lambda: [{}])
    ceiling: str | None = None
    vocab_size: int | None = None   # set by fit_to_vocab when the model's vocabulary is below TOKEN_HIGH
    hf_batch1_requests: int | None = None
    engine_defaults: dict = field(default_factory=dict)   # engine arguments of record (flags override them)
    warmup_requests: int = 0
    reports_tpot: bool = False

    @property
    def has_images(self) -> bool:
        return any(r.images for r in self.requests)

    @property
    def has_text(self) -> bool:
        """Prompts are text (W11: rendered with the checkpoint's chat template), not token ids."""
        return any(r.text and not r.images for r in self.requests)

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens counted once per request (n samples share one prompt)."""
        return sum(len(r.prompt_token_ids) for r in self.requests)

    @property
    def num_output_tokens(self) -> int:
        """Output tokens the workload asks for (every sample runs to max_tokens: EOS is ignored)."""
        return sum(r.max_tokens * r.n for r in self.requests)

    @property
    def max_seq_len(self) -> int:
        """Longest prompt + output of any request (tokens; image workloads: their max_model_len of record)."""
        if self.has_images or self.has_text:
            return int(self.engine_defaults.get("max_model_len", 8192))
        return max(len(r.prompt_token_ids) + r.max_tokens for r in self.requests)


def token_range(vocab_size: int | None) -> tuple[int, int]:
    """[low, high) of workload token ids: [TOKEN_LOW, TOKEN_HIGH), shrunk to fit a vocabulary smaller than that."""
    if vocab_size is None or vocab_size >= TOKEN_HIGH:
        return TOKEN_LOW, TOKEN_HIGH
    return min(TOKEN_LOW, vocab_size // 4), vocab_size


def fit_to_vocab(workload: Workload, vocab_size: int | None) -> Workload:
    """The workload with every prompt id mapped into the model's vocabulary (in place; a no-op for every shape of
    record, whose vocabularies exceed TOKEN_HIGH). The map is one-to-one on ids, so shared prefixes stay shared;
    lengths and counts are unchanged. Lets `hayabusa bench` run on small trained models (stories260K: 512 ids)."""
    lo, hi = token_range(vocab_size)
    if (lo, hi) == (TOKEN_LOW, TOKEN_HIGH) or workload.has_images:   # image prompts are the template's text
        return workload
    for r in workload.requests:
        r.prompt_token_ids = [lo + (t - TOKEN_LOW) % (hi - lo) for t in r.prompt_token_ids]
    workload.vocab_size = vocab_size
    return workload


def _n(x: int, scale: float) -> int:
    return max(1, int(round(x * scale)))


def _tokens(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(TOKEN_LOW, TOKEN_HIGH, size=n).tolist()


def _fixed(rng: np.random.Generator, num: int, prompt: int, out: int) -> list[BenchRequest]:
    return [BenchRequest(_tokens(rng, prompt), out) for _ in range(num)]


def w1(scale: float = 1.0) -> Workload:
    rng = np.random.default_rng(0)
    return Workload("W1", _fixed(rng, _n(256, scale), _n(512, scale), _n(256, scale)), scale, ceiling="matmul")


def w2(scale: float = 1.0) -> Workload:
    rng = np.random.default_rng(0)
    num = _n(256, scale)
    lo, hi = _n(100, scale), _n(1024, scale)
    prompt_lens = rng.integers(lo, hi + 1, size=num)          # U[100, 1024], inclusive
    out_lens = rng.integers(lo, hi + 1, size=num)
    reqs = [BenchRequest(_tokens(rng, int(p)), int(o)) for p, o in zip(prompt_lens, out_lens)]
    return Workload("W2", reqs, scale, ceiling="matmul")


def w3(scale: float = 1.0) -> Workload:
    rng = np.random.default_rng(0)
    return Workload("W3", _fixed(rng, 1, _n(128, scale), _n(512, scale)), scale, ceiling="bandwidth",
                    reports_tpot=True)


def w4(scale: float = 1.0) -> Workload:
    rng = np.random.default_rng(0)
    reqs = _fixed(rng, _n(100, scale), _n(2048, scale), _n(128, scale))
    return Workload("W4", reqs, scale, variants=[{"max_num_seqs": m} for m in W4_MAX_NUM_SEQS], ceiling="matmul")


def w5(scale: float = 1.0) -> Workload:
    rng = np.random.default_rng(0)
    shared = _tokens(rng, _n(1024, scale))
    own = _n(128, scale)
    reqs = [BenchRequest(shared + _tokens(rng, own), _n(64, scale)) for _ in range(_n(256, scale))]
    return Workload("W5", reqs, scale,
                    variants=[{"enable_prefix_caching": True}, {"enable_prefix_caching": False}])


def w6(scale: float = 1.0) -> Workload:
    """Sent to a running server by serve_bench.py (hayabusa bench --workload W6 --base-url URL)."""
    rng = np.random.default_rng(0)
    return Workload("W6", _fixed(rng, _n(512, scale), _n(512, scale), _n(128, scale)), scale)


def w7(scale: float = 1.0) -> Workload:
    rng = np.random.default_rng(0)
    n = _n(64, scale)
    reqs = [BenchRequest(_tokens(rng, _n(256, scale)), _n(256, scale), n=n, temperature=0.9, seed=i)
            for i in range(_n(8, scale))]
    return Workload("W7", reqs, scale)


def w9(scale: float = 1.0) -> Workload:
    """T5 receipt extraction: the 256 prompt ids are the encoder input; greedy, 64 outputs, EOS ignored."""
    rng = np.random.default_rng(0)
    reqs = _fixed(rng, _n(2000, scale), _n(256, scale), _n(64, scale))
    return Workload("W9", reqs, scale, variants=[{"hf_batch_size": b} for b in W9_HF_BATCH_SIZES],
                    hf_batch1_requests=_n(W9_HF_BATCH1_REQUESTS, scale))


def w8(scale: float = 1.0) -> Workload:
    """BENCHMARKS.md's W8 exactly: per request k = U[2, 5] images, each w = U[512, 1024], h = U[384, 768] and
    uniform random pixels, drawn in that order from one default_rng(0); greedy, 256 tokens, EOS ignored. `scale`
    shrinks the request count and output length, not the images."""
    rng = np.random.default_rng(0)
    reqs = []
    for _ in range(_n(100, scale)):
        images = []
        for _ in range(int(rng.integers(2, 6))):
            w, h = int(rng.integers(512, 1025)), int(rng.integers(384, 769))
            images.append(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        reqs.append(BenchRequest([], _n(256, scale), images=images, text=W8_TEXT))
    return Workload("W8", reqs, scale, variants=[{"max_num_seqs": m} for m in W8_MAX_NUM_SEQS],
                    engine_defaults={"max_model_len": 8192, "limit_mm_per_prompt": {"image": 5}},
                    hf_batch1_requests=W8_HF_REQUESTS)


W11_ITEMS = ("blue ceramic mug", "oak cutting board", "steel water bottle", "wool scarf", "linen napkin set",
             "glass teapot", "bamboo tray", "cotton tote bag")
W11_CITIES = ("Gdansk", "Porto", "Lyon", "Graz", "Tartu", "Bergen", "Leeds", "Turin")


def w11(scale: float = 1.0) -> Workload:
    """Copy-heavy extraction: each of 64 requests holds 40 order lines drawn from one default_rng(0) (order number
    U[1000, 9999], quantity U[1, 9], item, city, day U[1, 28]) and asks for the lines of one city copied exactly;
    the answer starts with the first such line's first five words (so a small instruct model copies). Greedy, 128
    output tokens, EOS ignored; max_num_seqs 1, 4, 16. Needs a trained model and its chat template."""
    rng = np.random.default_rng(0)
    reqs = []
    for _ in range(_n(64, scale)):
        lines, city = [], W11_CITIES[int(rng.integers(0, len(W11_CITIES)))]
        for _ in range(40):
            lines.append(f"Order {int(rng.integers(1000, 10000))}: {int(rng.integers(1, 10))} x "
                         f"{W11_ITEMS[int(rng.integers(0, len(W11_ITEMS)))]} shipped to "
                         f"{W11_CITIES[int(rng.integers(0, len(W11_CITIES)))]} on 2024-03-"
                         f"{int(rng.integers(1, 29)):02d}.")
        first = next((ln for ln in lines if city in ln), lines[0])
        text = "\n".join(lines) + f"\n\nCopy every order shipped to {city}, each line exactly as written above."
        reqs.append(BenchRequest([], _n(128, scale), text=text, answer_prefix=" ".join(first.split()[:5])))
    return Workload("W11", reqs, scale, variants=[{"max_num_seqs": m} for m in W11_MAX_NUM_SEQS],
                    engine_defaults={"max_model_len": 2048}, reports_tpot=True)


def image_chat_messages(r: BenchRequest) -> list[dict]:
    """The one user message of an image request: its images, then its text (the chat template's content list)."""
    return [{"role": "user", "content": [{"type": "image"} for _ in r.images or []] + [{"type": "text",
                                                                                       "text": r.text or ""}]}]


def startup(scale: float = 1.0) -> Workload:
    """One short request after construction: 'the first request can run' (16 prompt tokens, 1 output)."""
    rng = np.random.default_rng(0)
    return Workload("startup", _fixed(rng, 1, 16, 1), scale)


W10_IDLE_PREFIXES = 2   # prefixes the GPU cache holds beside one running round: fewer than the 8 it cycles through


def w10(scale: float = 1.0) -> Workload:
    """W5 with 8 different system prompts whose KV does not all fit the GPU: rounds of 16 requests per prompt,
    cycling through the 8 prompts 4 times, so each round comes back to a prefix evicted since. The GPU cache
    (``num_gpu_blocks_override``, 16-token blocks) holds one running round (its prefix and 16 requests' own blocks)
    plus ``W10_IDLE_PREFIXES`` idle prefixes: too small for all 8 prefixes, as the workload's definition says (at
    scale 1: 64 + 16 x 12 + 2 x 64 = 384 blocks; the 8 prefixes alone need 512). ``scale`` shrinks the lengths and
    the cache together, never the 16 requests of a round: a round's running requests must outgrow the cache's
    room beside the prefixes, or the tier has nothing to restore (2-request rounds at scale 0.1 never evicted a
    prefix)."""
    rng = np.random.default_rng(0)
    prefix_len, own, out, per_round = _n(1024, scale), _n(128, scale), _n(64, scale), 16
    prompts = [_tokens(rng, prefix_len) for _ in range(8)]
    reqs = [BenchRequest(prompts[p] + _tokens(rng, own), out)
            for _ in range(4) for p in range(8) for _ in range(per_round)]
    prefix_blocks = -(-prefix_len // 16)
    own_blocks = -(-(prefix_len + own + out) // 16) - prefix_len // 16   # a request's blocks past the shared ones
    blocks = prefix_blocks * (1 + W10_IDLE_PREFIXES) + per_round * own_blocks
    return Workload("W10", reqs, scale, variants=[{"swap_space": 4}, {"swap_space": 0}],
                    engine_defaults={"num_gpu_blocks_override": blocks, "enable_prefix_caching": True,
                                     "max_model_len": _n(2048, scale)})


W1P_REQUESTS = 32           # not scaled: 4 waves of ~8 running requests at every scale (blocks scale with lengths)
W1P_RESIDENT_CONTEXTS = 8   # full contexts the GPU cache holds (num_gpu_blocks_override)
W1P_WARMUP_REQUESTS = W1P_RESIDENT_CONTEXTS + 2   # untimed: two more full contexts than the cache holds


def w1p(scale: float = 1.0) -> Workload:
    """W1's batch with 8k-token contexts on a GPU cache of 8 full contexts: 32 requests of 7,168 prompt + 1,024
    output token ids (``default_rng(0)``); about 9 prompts fit when admitted, their decodes outgrow the cache, so
    the latest admitted is preempted over and over. Two runs: ``preemption_mode="swap"`` (its KV copied to the CPU
    tier and back) and ``"recompute"`` (its prefill re-run); both with ``swap_space=4``, so only the mode differs.
    ``scale`` shrinks the lengths and the cache alike (16-token blocks), never the request count. The warm-up runs
    ``W1P_WARMUP_REQUESTS`` requests of the same lengths (fresh ids): more than the cache holds, so it preempts, and
    the one-time costs of the preemption path fall outside the timed run whichever variant runs first."""
    rng = np.random.default_rng(0)
    prompt, out, ctx = _n(7168, scale), _n(1024, scale), _n(8192, scale)
    reqs = _fixed(rng, W1P_REQUESTS, prompt, out)
    blocks = max(-(-W1P_RESIDENT_CONTEXTS * ctx // 16), 8)
    return Workload("W1P", reqs, scale, variants=[{"preemption_mode": "swap"}, {"preemption_mode": "recompute"}],
                    engine_defaults={"num_gpu_blocks_override": blocks, "max_model_len": -(-ctx // 16) * 16,
                                     "swap_space": 4}, warmup_requests=W1P_WARMUP_REQUESTS)


BUILDERS = {"W1": w1, "W2": w2, "W3": w3, "W4": w4, "W5": w5, "W6": w6, "W7": w7, "W8": w8, "W9": w9,
            "W10": w10, "W11": w11, "W1P": w1p, "startup": startup}


def get_workload(name: str, scale: float = 1.0) -> Workload:
    """Build workload `name` ("W1", "w1", ... or "startup") at `scale` (0 < scale <= 1 typically).

    Raises:
        ValueError: unknown name, or a scale that is not a finite number > 0 (the message says which names exist).
    """
    key = name.strip()
    key = key.upper() if key.lower() != "startup" else "startup"
    if key not in BUILDERS:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}.")
    if not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"--scale must be a finite number > 0 (1 = the workload of record), got {scale}.")
    return BUILDERS[key](scale)
