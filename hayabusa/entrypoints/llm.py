"""LLM: the offline entry point (vLLM's ``LLM``)."""

from __future__ import annotations

import contextlib
import gc
import itertools
import time
from typing import Any, Callable, Iterator, Sequence

from hayabusa.compat import check_priority
from hayabusa.config import EngineArgs
from hayabusa.engine.input_processor import PromptType
from hayabusa.engine.llm_engine import LLMEngine
from hayabusa.errors import HayabusaTypeError, HayabusaValidationError
from hayabusa.metrics_reader import MetricsList
from hayabusa.multimodal.processor import PreprocessStream
from hayabusa.outputs import RequestOutput
from hayabusa.sampling_params import SamplingParams


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """While a ``generate`` runs, every object alive when it started (torch, transformers, the model, the engine)
    is out of the cyclic garbage collector's reach (``gc.freeze``; the server freezes its startup heap for good, as
    vLLM's engine core does). A big batch allocates fast enough (2,000 W9 prompts of 256 ids) to set off full
    collections, and each one would otherwise walk that whole heap: on the CPU about 160 us per request in
    add_request alone (issue #17). Unfrozen at the end, so nothing is kept that would otherwise be collected (an
    engine let go later, with its reference cycles, is freed as before); a heap already frozen (by the server or
    the caller) is left as it is."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class LLM:
    """Generate text for a batch of prompts with continuous batching (vLLM's ``LLM``).

    Args:
        model: HF model folder or Hub id.
        **kwargs: engine arguments (see ``EngineArgs``): tokenizer, dtype, seed, max_model_len, max_num_seqs,
            max_num_batched_tokens, gpu_memory_utilization, block_size, enforce_eager, skip_tokenizer_init,
            trust_remote_code, download_dir, kv_cache_memory_bytes, num_gpu_blocks_override, device, ...

    Raises:
        HayabusaValidationError: an unknown engine argument (named), a bad value, or a model that cannot be
            loaded; KVCacheCapacityError when one max_model_len sequence does not fit.
    """

    def __init__(self, model: str, **kwargs: Any) -> None:
        from hayabusa.compat import pop_llm_ignored_kwargs
        from hayabusa.entrypoints.media import MediaPolicy

        pop_llm_ignored_kwargs(kwargs)          # e.g. disable_log_requests: one warning naming them
        args = EngineArgs.from_kwargs(model, **kwargs)
        self.media_policy = MediaPolicy.from_engine_args(args)   # where chat images may come from
        self.llm_engine = LLMEngine.from_engine_args(args)
        self._counter = itertools.count()

    def get_metrics(self) -> MetricsList:
        """Engine-wide metrics, as vLLM's ``LLM.get_metrics()``: a list of ``Counter`` / ``Gauge`` / ``Vector``
        objects (``hayabusa.v1.metrics.reader``, vLLM's import path; or ``hayabusa.metrics_reader``) named as vLLM
        names them: ``vllm:prompt_tokens``, ``vllm:generation_tokens``, ``vllm:num_preemptions``, prefix-cache
        queries / hits, ``vllm:spec_decode_num_drafts`` / ``_num_draft_tokens`` / ``_num_accepted_tokens``
        (Counters, int) and ``vllm:spec_decode_num_accepted_tokens_per_pos`` (Vector, length
        num_speculative_tokens), the gauges ``vllm:num_requests_running`` / ``_waiting`` /
        ``vllm:kv_cache_usage_perc``; the CPU KV tier's counters as ``hayabusa:...`` (LLMEngine.get_metrics lists
        them all). The list also answers hayabusa's older dict form by plain key (``m["num_preemptions"]``,
        ``m["spec_decode_num_accepted_tokens"]``, ``.get``, ``in``, ``.keys()`` / ``.items()``)."""
        return self.llm_engine.get_metrics()

    def get_tokenizer(self) -> Any:
        """The tokenizer prompts are encoded and outputs decoded with (transformers)."""
        return self.llm_engine.tokenizer

    def set_tokenizer(self, tokenizer: Any) -> None:
        """Use ``tokenizer`` (a transformers tokenizer) from now on, for prompts, outputs and logprob texts
        (vLLM's LLM.set_tokenizer)."""
        self.llm_engine.set_tokenizer(tokenizer)

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the sampling defaults of the checkpoint's generation_config.json (temperature,
        top_p, top_k, min_p, repetition_penalty, max_new_tokens), as vLLM's LLM.get_default_sampling_params.
        ``generate`` without sampling_params uses SamplingParams() itself."""
        from hayabusa.compat import generation_config_defaults

        return SamplingParams(**generation_config_defaults(self.llm_engine.config.model_config.model))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's LLM.reset_prefix_cache). Returns False while requests run."""
        return self.llm_engine.reset_prefix_cache()

    def beam_search(self, prompts: Any, params: Any, lora_request: Any = None, use_tqdm: bool = False,
                    concurrency_limit: int | None = None) -> list[Any]:
        """Beam search for each prompt (vLLM's LLM.beam_search): a ``BeamSearchParams`` -> one
        ``BeamSearchOutput`` per prompt whose ``sequences`` are the beam_width best beams, best first. Ranking as
        HF's ``generate(num_beams=k, do_sample=False)``; see hayabusa/beam_search.py."""
        from hayabusa.beam_search import beam_search

        if lora_request is not None:
            raise HayabusaValidationError("beam_search() got a lora_request, but LoRA adapters are not supported.",
                                          parameter="lora_request", value=lora_request)
        return beam_search(self, prompts, params)

    def generate(self, prompts: PromptType | Sequence[PromptType] | None = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | Callable[..., Any] = True, prompt_token_ids: list[list[int]] | None = None,
                 priority: list[int] | None = None, **unsupported: Any) -> list[RequestOutput]:
        """Generate completions for every prompt, in input order.

        Args:
            prompts: a str, a list of str, ``{"prompt_token_ids": [...]}`` / ``{"prompt": str}`` or a list of
                those.
            sampling_params: one SamplingParams for all prompts, or one per prompt (default: SamplingParams()).
            use_tqdm: show a progress bar: True (tqdm.auto), False, or a callable that makes the bar (vLLM's
                ``functools.partial(tqdm, leave=False)``), called with tqdm's keywords ``total``, ``desc``,
                ``dynamic_ncols``.
            prompt_token_ids: (old vLLM API) token-id prompts.
            priority: one int per prompt, each 0: requests run first come, first served (vLLM refuses a non-zero
                priority unless its scheduling_policy is "priority", which hayabusa does not have).

        Returns:
            One finished RequestOutput per prompt, in the order given.

        Raises:
            HayabusaValidationError: a bad prompt or parameter (for a batch, the message starts with the prompt's
                index: ``prompts[3]: ...``), a ``priority`` list of the wrong length or with a non-zero value; no
                request of this call is left queued.
        """
        for name, value in unsupported.items():
            if value is not None:
                what = "LoRA adapters are not supported" if name == "lora_request" else "it is not supported"
                raise HayabusaValidationError(f"generate() got {name}={_short(value)}, but {what}; pass "
                                              f"{name}=None or leave it out.", parameter=name, value=value)
        prompt_list = self._as_prompt_list(prompts, prompt_token_ids)
        params = self._as_params_list(sampling_params, len(prompt_list))
        check_priority(priority, len(prompt_list))
        engine = self.llm_engine
        # images: the image processor runs on a thread pool; prompts are queued in order as they are ready, so the
        # engine steps while later prompts' images are still being processed
        ids: list[str] = []

        def feed(block: bool) -> None:
            for i, p in stream.take(block):
                rid = str(next(self._counter))
                try:
                    engine.add_request(rid, p, params[i], output_kind="final")
                except HayabusaValidationError as e:
                    if len(prompt_list) == 1:
                        raise
                    raise e.prefixed(f"prompts[{i}]") from None   # which prompt of the batch
                ids.append(rid)

        with frozen_heap(), PreprocessStream(engine.input_processor.mm_processor, prompt_list) as stream:
            try:
                feed(block=True)
            except Exception:
                engine.abort_request(ids)
                raise
            more = None if stream.done else (stream, feed)
            return self._run_engine(ids, use_tqdm, feed=more, total=len(prompt_list))

    def chat(self, messages: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool | Callable[..., Any] = True, lora_request: Any = None, chat_template: str | None = None,
             chat_template_content_format: str = "auto", add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them (vLLM's ``LLM.chat``).

        Each conversation is rendered with the chat template (``chat_template`` -- a Jinja string or a file --
        or the tokenizer's) and tokenized without adding special tokens, as vLLM does; then ``generate``.
        ``RequestOutput.prompt`` is the rendered text.

        Args:
            messages: ``[{"role": ..., "content": ...}, ...]`` or a list of such conversations. Content may be a
                list of parts: text, and images (``image_url`` with a data / file / http(s) URL, ``image_pil``,
                ``image``; see entrypoints/media.py), which become the prompt's ``multi_modal_data``.
            sampling_params, use_tqdm: as in ``generate``.
            add_generation_prompt / continue_final_message: open a new assistant turn / continue the last message.
            tools, chat_template_kwargs: passed to the template (e.g. ``{"enable_thinking": False}``).

        Raises:
            HayabusaValidationError: no chat template, bad messages, or what ``generate`` raises.
        """
        from hayabusa.entrypoints.chat_utils import chat_prompt, is_conversation_list

        if lora_request is not None:
            raise HayabusaValidationError(f"chat() got lora_request={_short(lora_request)}, but LoRA adapters are "
                                          "not supported; pass lora_request=None or leave it out.",
                                          parameter="lora_request", value=lora_request)
        conversations = messages if is_conversation_list(messages) else [messages]
        takes_images = self.llm_engine.input_processor.mm_processor is not None
        prompts = [chat_prompt(self.get_tokenizer(), conv, self.media_policy, takes_images,
                               chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message, tools=tools,
                               chat_template_kwargs=chat_template_kwargs,
                               content_format=chat_template_content_format) for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    @staticmethod
    def _as_prompt_list(prompts: Any, prompt_token_ids: Any) -> list[PromptType]:
        if prompts is None and prompt_token_ids is not None:
            return [{"prompt_token_ids": p} for p in prompt_token_ids]
        if prompts is None:
            raise HayabusaValidationError("generate() needs prompts.", parameter="prompts", value=None)
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise HayabusaValidationError(
                f"prompts must be a str, a dict, or a list of those, got {type(prompts).__name__}.",
                parameter="prompt", value=type(prompts).__name__)
        prompts = list(prompts)
        if prompts and all(isinstance(t, int) for t in prompts):  # one prompt as token ids
            return [{"prompt_token_ids": prompts}]
        return prompts

    @staticmethod
    def _as_params_list(sp: Any, n: int) -> list[SamplingParams]:
        if sp is None:
            return [SamplingParams() for _ in range(n)]
        if isinstance(sp, SamplingParams):
            return [sp] * n
        if not isinstance(sp, (list, tuple)) or not all(isinstance(p, SamplingParams) for p in sp):
            raise HayabusaTypeError(f"sampling_params must be a SamplingParams or a list of them, got "
                                    f"{_short(sp)} ({type(sp).__name__}).", parameter="sampling_params",
                                    value=type(sp).__name__)
        sp = list(sp)
        if len(sp) != n:
            raise HayabusaValidationError(f"got {len(sp)} sampling_params for {n} prompts; pass one or one per "
                                          "prompt.", parameter="sampling_params", value=len(sp))
        return sp

    def _run_engine(self, ids: list[str], use_tqdm: bool | Callable[..., Any],
                    feed: tuple[PreprocessStream, Any] | None = None, total: int | None = None) -> list[RequestOutput]:
        """Step until every request of ``ids`` is finished. ``feed``: (stream, add) where ``add(block)`` queues the
        stream's next ready prompts (appending to ``ids``) while the engine runs; a bad prompt found then aborts
        this call's requests and raises."""
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            if callable(use_tqdm):
                make_bar = use_tqdm                  # vLLM: a tqdm-like class or factory
            else:
                from tqdm.auto import tqdm as make_bar

            bar = make_bar(total=total or len(ids), desc="Processed prompts", dynamic_ncols=True)
        start, out_tokens = time.perf_counter(), 0
        try:
            while engine.has_unfinished_requests() or (feed is not None and not feed[0].done):
                if feed is not None and not feed[0].done:
                    try:
                        feed[1](not engine.has_unfinished_requests())
                    except HayabusaValidationError:
                        engine.abort_request(ids)
                        raise
                done = 0
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        done += 1
                        if bar is not None:
                            out_tokens += sum(len(c.token_ids) for c in out.outputs)
                if bar is not None and done:
                    # once per step, and the postfix without its own redraw: update() redraws at most every
                    # mininterval (a forced redraw per finished request cost ~40 us each: 80 ms of W9's 2,000)
                    bar.set_postfix_str(f"output {out_tokens / (time.perf_counter() - start):.1f} tok/s",
                                        refresh=False)
                    bar.update(done)
        except HayabusaValidationError:
            raise
        except BaseException:
            # A failed step or Ctrl-C: abort what is in flight so this LLM still serves the next generate().
            engine.abort_all_after_error()
            raise
        finally:
            if bar is not None:
                bar.close()
        missing = [i for i in ids if i not in finished]
        if missing:  # cannot happen unless a request was aborted from outside
            raise RuntimeError(f"requests {missing[:5]} did not finish")
        return [finished[i] for i in ids]
