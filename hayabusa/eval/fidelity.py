"""``hayabusa eval --fidelity``: how far hayabusa's next-token distributions are from a reference on a fixed text.

Metrics over every position of the text (the text is tokenized once and cut into chunks of ``chunk_len`` tokens,
by default max_model_len; each chunk is an independent sequence starting at position 0):
  mean KL(reference || hayabusa) per token (nats), top-1 agreement (argmax equal), and the perplexity of each side
  on the text's own next tokens.

Where hayabusa's logits come from (no engine code changed): the sampler returns only sampled ids and top-K
logprobs, so the full distributions are taken from the engine's own model object
(``llm.llm_engine.runner.model``) and run the way the engine runs a prompt: the chunk is fed in pieces of
max_num_batched_tokens (chunked prefill) through the engine's paged KV cache and attention backend, with a
hand-built one-request ``AttentionMetadata`` (block ids 0..n-1 of a private engine that serves no requests), and
``model.compute_logits`` on every position. So quantized linear layers, the KV-cache dtype and the attention
kernels are all measured; the scheduler, CUDA graphs (decode only) and the sampler are not involved.

References: ``hf`` (Transformers ``AutoModelForCausalLM``; default dtype bfloat16 on CUDA, float32 on CPU) or
``hayabusa-bf16`` (a second engine on the same checkpoint in bfloat16 without quantization or KV-cache dtype), on
the same checkpoint or on ``--reference-model`` (e.g. the unquantized original of an AWQ / GPTQ checkpoint).
Both models are resident at once; each engine gets only the KV blocks of one chunk.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

from hayabusa.attention.metadata import AttentionMetadata, ForwardContext
from hayabusa.errors import HayabusaValidationError

REFERENCES = ("hf", "hayabusa-bf16")
LOGITS_SLICE = 512     # positions per logits / log-softmax slice (bounds memory at 512 x V fp32 per side)
MIN_CHUNK_LEN = 2      # shorter chunks never attend to context (see check_fidelity_args)


@dataclass
class FidelityResult:
    mean_kl: float                 # nats per token, KL(reference || hayabusa)
    max_kl: float
    top1_agreement: float
    num_tokens: int                # positions compared
    num_chunks: int
    chunk_len: int
    ppl: float                     # hayabusa's perplexity on the text's next tokens
    ppl_reference: float
    reference: str
    reference_dtype: str
    dtype: str
    seconds: float
    model: str | None = None             # hayabusa's checkpoint (folder or Hub id)
    quantization: str | None = None      # the method hayabusa ran (None = unquantized)
    kv_cache_dtype: str = "auto"         # hayabusa's KV-cache dtype as given ("auto" = the model dtype)
    reference_model: str | None = None   # the reference's checkpoint (--reference-model, else model)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# ------------------------------------------------------------------------------------------------ logits sources
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def engine_hidden_fn(llm: Any) -> Callable[[list[int]], torch.Tensor]:
    """(ids of one chunk) -> hidden states [T, hidden] from the engine's model via its paged KV cache."""
    engine = llm.llm_engine
    runner, cfg = engine.runner, engine.config
    bs = cfg.cache_config.block_size
    piece = cfg.scheduler_config.max_num_batched_tokens
    dev = runner.device

    @torch.inference_mode()
    def hidden_of(ids: list[int]) -> torch.Tensor:
        T = len(ids)
        nb = _cdiv(T, bs)
        if nb > runner.num_blocks:
            raise HayabusaValidationError(f"chunk of {T} tokens needs {nb} KV blocks; the engine has "
                                          f"{runner.num_blocks}.", parameter="chunk_len", value=T)
        block_table = torch.arange(nb, dtype=torch.int32, device=dev).view(1, nb)
        out = []
        for s in range(0, T, piece):        # chunked prefill: each piece attends to the cache so far
            e = min(s + piece, T)
            meta = AttentionMetadata(
                query_start_loc=torch.tensor([0, e - s], dtype=torch.int32, device=dev),
                seq_lens=torch.tensor([e], dtype=torch.int32, device=dev), block_table=block_table,
                slot_mapping=torch.arange(s, e, dtype=torch.int64, device=dev),   # block i holds tokens i*bs..
                num_reqs=1, max_query_len=e - s, max_seq_len=e)
            ctx = ForwardContext(meta, runner.kv_caches, runner.backend)
            x = torch.tensor(ids[s:e], dtype=torch.int64, device=dev)
            pos = torch.arange(s, e, dtype=torch.int64, device=dev)
            out.append(runner.model(x, pos, ctx))
        return torch.cat(out)

    return hidden_of


def _engine_logits_fn(llm: Any) -> Callable[[list[int]], Callable[[int, int], torch.Tensor]]:
    hidden_of = engine_hidden_fn(llm)
    model = llm.llm_engine.runner.model

    def prepare(ids: list[int]) -> Callable[[int, int], torch.Tensor]:
        h = hidden_of(ids)
        return lambda s, e: model.compute_logits(h[s:e]).float()

    return prepare


def _hf_logits_fn(hf: Any, dev: torch.device) -> Callable[[list[int]], Callable[[int, int], torch.Tensor]]:
    """HF: the decoder's last hidden states once per chunk, the LM head per slice (never [T, V] at once)."""
    head = hf.get_output_embeddings()
    cap = getattr(hf.config, "final_logit_softcapping", None)

    @torch.inference_mode()
    def prepare(ids: list[int]) -> Callable[[int, int], torch.Tensor]:
        x = torch.tensor([ids], dtype=torch.int64, device=dev)
        h = hf.get_decoder()(input_ids=x).last_hidden_state[0]

        def logits(s: int, e: int) -> torch.Tensor:
            z = head(h[s:e]).float()
            return torch.tanh(z / cap) * cap if cap else z

        return logits

    return prepare


# ------------------------------------------------------------------------------------------------ comparison
@torch.inference_mode()
def compare_chunks(chunks: list[list[int]], next_ids: list[list[int]], model_fn: Callable, ref_fn: Callable,
                   use_tqdm: bool = True) -> dict[str, float]:
    """Sum KL, top-1 matches and NLL over every position of every chunk (next_ids[c][j] is the text's token after
    position j of chunk c, -1 where the text ends)."""
    kl_sum = top1 = n = 0
    kl_max = 0.0
    nll = nll_ref = 0.0
    n_next = 0
    from tqdm.auto import tqdm

    for ids, nxt in tqdm(list(zip(chunks, next_ids)), desc="Fidelity chunks", unit="chunk",
                         disable=not use_tqdm or len(chunks) < 2, dynamic_ncols=True):
        mlog, rlog = model_fn(ids), ref_fn(ids)
        for s in range(0, len(ids), LOGITS_SLICE):
            e = min(s + LOGITS_SLICE, len(ids))
            lp = torch.log_softmax(mlog(s, e), dim=-1)               # [t, V] fp32
            rp = torch.log_softmax(rlog(s, e), dim=-1)
            kl = (rp.exp() * (rp - lp)).sum(-1).clamp_min(0.0)       # [t]
            kl_sum += float(kl.double().sum())
            kl_max = max(kl_max, float(kl.max()))
            top1 += int((lp.argmax(-1) == rp.argmax(-1)).sum())
            n += e - s
            tgt = torch.tensor(nxt[s:e], dtype=torch.int64, device=lp.device)
            keep = tgt >= 0
            if bool(keep.any()):
                rows = torch.nonzero(keep).squeeze(1)
                nll -= float(lp[rows, tgt[rows]].double().sum())
                nll_ref -= float(rp[rows, tgt[rows]].double().sum())
                n_next += int(rows.numel())
    return {"kl_sum": kl_sum, "kl_max": kl_max, "top1": top1, "n": n, "nll": nll, "nll_ref": nll_ref,
            "n_next": n_next}


def chunk_text(ids: list[int], chunk_len: int) -> tuple[list[list[int]], list[list[int]]]:
    """Chunks of chunk_len tokens and, per position, the text's next token (-1 after the last token)."""
    chunks = [ids[i:i + chunk_len] for i in range(0, len(ids), chunk_len)]
    nxt = []
    for k, c in enumerate(chunks):
        start = k * chunk_len
        nxt.append([ids[start + j + 1] if start + j + 1 < len(ids) else -1 for j in range(len(c))])
    return chunks, nxt


# ------------------------------------------------------------------------------------------------ driver
def _fidelity_engine(model: str, engine_args: dict[str, Any], chunk_len: int | None) -> Any:
    """An engine with just the KV blocks of one chunk (unless KV sizing was given) and no CUDA graphs."""
    from hayabusa import LLM
    from hayabusa.config import EngineArgs

    args = dict(engine_args)
    args.setdefault("enforce_eager", True)
    if args.get("kv_cache_memory_bytes") is None and args.get("num_gpu_blocks_override") is None:
        cfg = EngineArgs.from_kwargs(model, **{k: v for k, v in args.items()
                                               if k not in ("quantization", "kv_cache_dtype")}).create_engine_config()
        length = max(chunk_len or 0, cfg.scheduler_config.max_model_len)
        args["num_gpu_blocks_override"] = _cdiv(length, args.get("block_size") or 16) + 1
    return LLM(model, **args)


def _refuse_encoder_decoder(model: str, engine_args: dict[str, Any]) -> None:
    """--fidelity scores a causal LM's next token at every position of a text; an encoder-decoder model (T5) has
    no such distribution over its input. Raises HayabusaValidationError naming --fidelity and the architecture."""
    from hayabusa.config import load_hf_config
    from hayabusa.model.loader import resolve_model_dir

    model_dir = resolve_model_dir(model, revision=engine_args.get("revision"),
                                  download_dir=engine_args.get("download_dir"),
                                  allow_pt=engine_args.get("load_format") == "pt")
    cfg = load_hf_config(model_dir, bool(engine_args.get("trust_remote_code")), engine_args.get("revision"))
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    if getattr(text_cfg, "is_encoder_decoder", False):
        arch = (getattr(cfg, "architectures", None) or [type(cfg).__name__])[0]
        raise HayabusaValidationError(
            f"--fidelity measures a decoder-only model's next-token distributions over a text; {arch} is an "
            "encoder-decoder model, whose prompt is its encoder's input. Compare its answers with "
            "`hayabusa eval --data FILE --reference hf` instead.", parameter="model", value=model)


def run_fidelity(model: str, text: str, engine_args: dict[str, Any], reference: str = "hf",
                 reference_dtype: str | None = None, chunk_len: int | None = None,
                 max_text_tokens: int | None = None, reference_model: str | None = None,
                 use_tqdm: bool = True) -> FidelityResult:
    """Compare hayabusa (built from `engine_args`) with the reference over `text`. See the module docstring.
    ``reference_model``: the reference runs this checkpoint instead of ``model`` (the unquantized original of a
    quantized checkpoint; same tokenizer)."""
    check_fidelity_args(reference, reference_dtype, chunk_len, max_text_tokens)
    _refuse_encoder_decoder(model, engine_args)
    t0 = time.perf_counter()
    llm = _fidelity_engine(model, engine_args, chunk_len)
    mc = llm.llm_engine.config.model_config
    dev = llm.llm_engine.runner.device
    chunk_len = chunk_len or mc.max_model_len
    if chunk_len > mc.max_model_len:
        raise HayabusaValidationError(f"chunk_len {chunk_len} exceeds max_model_len {mc.max_model_len}.",
                                      parameter="chunk_len", value=chunk_len)
    tok = llm.get_tokenizer()
    # verbose=False: the text is cut into chunks of at most chunk_len below, so the tokenizer's "longer than the
    # maximum sequence length" warning on the whole text is not the model's
    ids = list(tok(text, verbose=False).input_ids)
    ids = ids[:max_text_tokens] if max_text_tokens else ids
    if len(ids) < 2:
        raise HayabusaValidationError("the text has fewer than 2 tokens.", parameter="text", value=len(ids))
    chunks, nxt = chunk_text(ids, chunk_len)
    ref_obj, ref_fn, ref_dtype = _reference(reference_model or model, reference, reference_dtype, engine_args,
                                            chunk_len, dev)
    quantization = mc.quantization
    kv_cache_dtype = llm.llm_engine.config.cache_config.cache_dtype
    try:
        sums = compare_chunks(chunks, nxt, _engine_logits_fn(llm), ref_fn, use_tqdm=use_tqdm)
    finally:
        del ref_obj, llm
    n, nn = max(sums["n"], 1), max(sums["n_next"], 1)
    return FidelityResult(mean_kl=sums["kl_sum"] / n, max_kl=sums["kl_max"], top1_agreement=sums["top1"] / n,
                          num_tokens=sums["n"], num_chunks=len(chunks), chunk_len=chunk_len,
                          ppl=math.exp(sums["nll"] / nn), ppl_reference=math.exp(sums["nll_ref"] / nn),
                          reference=reference, reference_dtype=ref_dtype, dtype=str(mc.dtype).replace("torch.", ""),
                          seconds=round(time.perf_counter() - t0, 2), model=model, quantization=quantization,
                          kv_cache_dtype=kv_cache_dtype, reference_model=reference_model or model)


def check_fidelity_args(reference: str, reference_dtype: str | None, chunk_len: int | None,
                        max_text_tokens: int | None) -> None:
    """The fidelity flags that need no model. Raises HayabusaValidationError naming the flag and the value."""
    from hayabusa.config import DTYPES

    if reference not in REFERENCES:
        raise HayabusaValidationError(f"--reference for --fidelity must be one of {', '.join(REFERENCES)}, got "
                                      f"{reference!r}.", parameter="reference", value=reference)
    if reference_dtype is not None and reference_dtype != "auto" and reference_dtype not in DTYPES:
        raise HayabusaValidationError(
            f"--reference-dtype {reference_dtype!r}: use float32, float16 or bfloat16 (the reference runs "
            "unquantized; quantize hayabusa with --quantization).", parameter="reference_dtype", value=reference_dtype)
    if chunk_len is not None and chunk_len < MIN_CHUNK_LEN:
        # A 1-token chunk puts every token at position 0 attending only to itself: no context, no KV cache read,
        # no attention kernel difference, so the KL measures next to nothing (it comes out exactly 0).
        raise HayabusaValidationError(
            f"--chunk-len {chunk_len}: must be >= {MIN_CHUNK_LEN}; each chunk restarts at position 0, and a "
            "1-token chunk never reads the KV cache or attends to context, so it measures nothing (leave it out "
            "for max_model_len).", parameter="chunk_len", value=chunk_len)
    if max_text_tokens is not None and max_text_tokens < 2:
        raise HayabusaValidationError(
            f"--fidelity-tokens {max_text_tokens}: must be >= 2 (the first N tokens of the text are compared; "
            "leave it out to use the whole text).", parameter="fidelity_tokens", value=max_text_tokens)


def _reference(model: str, reference: str, reference_dtype: str | None, engine_args: dict[str, Any],
               chunk_len: int, dev: torch.device) -> tuple[Any, Callable, str]:
    """(the object to keep alive, logits-fn factory, dtype name) of the reference."""
    if reference == "hayabusa-bf16":
        args = {k: v for k, v in engine_args.items() if k not in ("quantization", "kv_cache_dtype")}
        args["dtype"] = reference_dtype or "bfloat16"
        ref = _fidelity_engine(model, args, chunk_len)
        quantized = ref.llm_engine.config.model_config.quantization
        if quantized is not None:   # the checkpoint itself is quantized: the "reference" would be the same model
            raise HayabusaValidationError(
                f"{model} is quantized ({quantized}), so the hayabusa-bf16 reference would run quantized too. Use "
                "--reference hf or --reference-model UNQUANTIZED_DIR, or measure the scheme on the unquantized "
                "checkpoint with --quantization.",
                parameter="reference", value=reference)
        return ref, _engine_logits_fn(ref), str(ref.llm_engine.config.model_config.dtype).replace("torch.", "")
    from hayabusa.bench import common
    from hayabusa.model.loader import resolve_model_dir

    dtype = reference_dtype or ("bfloat16" if dev.type == "cuda" else "float32")
    model_dir = resolve_model_dir(model)
    try:
        hf = common.load_hf_model(model_dir, dtype, dev)
    except (ImportError, ValueError) as e:   # e.g. an AWQ / GPTQ / FP8 folder: HF needs gptqmodel / optimum
        raise HayabusaValidationError(
            f"the HF reference cannot load {model} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else e}). "
            "For a quantized checkpoint pass its unquantized original with --reference-model DIR (same "
            "tokenizer), or use --reference hayabusa-bf16 on an unquantized checkpoint with --quantization.",
            parameter="reference_model", value=model) from None
    return hf, _hf_logits_fn(hf, dev), str(hf.dtype).replace("torch.", "")


def format_result(r: FidelityResult) -> str:
    ref_model = "" if r.reference_model in (None, r.model) else f" on {r.reference_model}"
    return (f"fidelity of hayabusa on {r.model} ({r.dtype}, quantization {r.quantization or 'none'}, "
            f"kv_cache_dtype {r.kv_cache_dtype})\n"
            f"  vs reference {r.reference}{ref_model} ({r.reference_dtype}): {r.num_tokens} tokens in "
            f"{r.num_chunks} chunk(s) of <= {r.chunk_len}\n"
            f"  mean KL(ref || hayabusa) {r.mean_kl:.3e} nats/token (max {r.max_kl:.3e})\n"
            f"  top-1 agreement          {r.top1_agreement:.4f}\n"
            f"  perplexity               {r.ppl:.4f} (reference {r.ppl_reference:.4f})\n"
            f"  {r.seconds:.1f} s")
