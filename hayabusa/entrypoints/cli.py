"""The ``hayabusa`` command: ``hayabusa generate`` (offline batch generation from a JSONL file) here, and the
subcommands of bench/cli.py (``bench``), entrypoints/openai/cli.py (``serve``) and eval/cli.py (``eval``, ``plan``).
Every one takes its engine flags from ``EngineArgs.add_cli_args``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any

from hayabusa.assets import demo_model_dir
from hayabusa.config import EngineArgs
from hayabusa.errors import HayabusaValidationError
from hayabusa.outputs import logprobs_json

_sp = __import__("hayabusa.sampling_params", fromlist=["SamplingParams"])
SAMPLING_FIELDS = {f.name for f in dataclasses.fields(_sp.SamplingParams)} - _sp.ENGINE_FILLED_FIELDS
SAMPLING_FLAGS: dict[str, Any] = {"temperature": float, "top_p": float, "top_k": int, "min_p": float,
                                  "max_tokens": int, "min_tokens": int, "n": int, "seed": None,
                                  "repetition_penalty": float, "presence_penalty": float,
                                  "frequency_penalty": float}


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hayabusa", description="hayabusa: fast LLM inference.",
                                     allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", allow_abbrev=False, help="generate completions for a JSONL file of prompts",
                       description="Each input line is {\"prompt\": str}, {\"prompt_token_ids\": [...]} or "
                                   "{\"messages\": [{\"role\": ..., \"content\": ...}, ...]} (chat template), with "
                                   "optional SamplingParams fields (temperature, max_tokens, stop, ...) that "
                                   "override the flags.")
    g.add_argument("--model", default=None, help="HF model folder or Hub id (default: the bundled demo model)")
    g.add_argument("--prompts", required=True, help="input JSONL file")
    g.add_argument("--output", default=None, help="output JSONL file (default: stdout)")
    g.add_argument("--no-tqdm", action="store_true", help="no progress bar")
    for name, typ in SAMPLING_FLAGS.items():
        if name != "seed":
            g.add_argument("--" + name.replace("_", "-"), dest="sp_" + name, type=typ, default=None,
                           help=f"SamplingParams.{name} for every line that does not set \"{name}\" itself")
    g.add_argument("--stop", dest="sp_stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", dest="sp_ignore_eos", action="store_true", default=None)
    g.add_argument("--chat-template", default=None, help="Jinja chat template (string or file) for \"messages\" "
                   "lines (default: the tokenizer's)")
    EngineArgs.add_cli_args(g)
    from hayabusa.bench.cli import add_bench_parser

    add_bench_parser(sub)
    from hayabusa.entrypoints.openai.cli import add_serve_parser

    add_serve_parser(sub)
    from hayabusa.eval.cli import add_eval_parser, add_plan_parser

    add_eval_parser(sub)
    add_plan_parser(sub)
    return parser


def _read_prompts(path: str) -> list[tuple[int, dict[str, Any]]]:
    """(1-based line number, request) for every non-blank line; the first malformed line raises, naming it."""
    rows = []
    with open(path, encoding="utf-8") as f:
        try:
            lines = f.readlines()
        except UnicodeDecodeError as e:
            raise HayabusaValidationError(f"{path}: not UTF-8 text ({e.reason}).", parameter="prompts",
                                          value=path) from None
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise HayabusaValidationError(f"{path}:{lineno}: not JSON ({e.msg} at column {e.colno}).",
                                          parameter="prompts", value=lineno) from None
        if isinstance(row, str):
            row = {"prompt": row}
        if not isinstance(row, dict) or not ({"prompt", "prompt_token_ids", "messages", "encoder_prompt"} & set(row)):
            raise HayabusaValidationError(f"{path}:{lineno}: each line needs \"prompt\", \"prompt_token_ids\", "
                                          "\"messages\" or (encoder-decoder models) \"encoder_prompt\".",
                                          parameter="prompts", value=lineno)
        if "messages" in row:
            _check_messages(row["messages"], f"{path}:{lineno}")
        unknown = set(row) - SAMPLING_FIELDS - {"prompt", "prompt_token_ids", "messages", "id", "encoder_prompt",
                                                "decoder_prompt"}
        if unknown:
            raise HayabusaValidationError(f"{path}:{lineno}: unknown field(s) {sorted(unknown)}.",
                                          parameter="prompts", value=sorted(unknown))
        rows.append((lineno, row))
    return rows


def _check_messages(messages: Any, where: str) -> None:
    from hayabusa.entrypoints.chat_utils import normalize_conversation

    try:
        normalize_conversation(messages)
    except HayabusaValidationError as e:
        raise HayabusaValidationError(f"{where}: {e}", parameter="messages", value=e.value) from None


def _sampling_params(ns: argparse.Namespace, rows: list[tuple[int, dict[str, Any]]]) -> list[Any]:
    """One SamplingParams per line: the line's fields over the flags. A bad value raises, naming its line."""
    from hayabusa import SamplingParams

    defaults = {k[3:]: v for k, v in vars(ns).items() if k.startswith("sp_") and v is not None}
    params = []
    for lineno, row in rows:
        fields = {**defaults, **{k: v for k, v in row.items() if k in SAMPLING_FIELDS}}
        try:
            params.append(SamplingParams(**fields))
        except HayabusaValidationError as e:
            raise e.prefixed(f"{ns.prompts}:{lineno}") from None
    return params


def _engine_prompts(llm: Any, ns: argparse.Namespace, rows: list[tuple[int, dict[str, Any]]],
                    params: list[Any]) -> list[dict[str, Any]]:
    """Every line rendered (chat), tokenized and checked against the model (vocabulary, max_model_len) before
    anything runs, so that a bad line is named and no work is wasted. Returns {"prompt", "prompt_token_ids"}."""
    from hayabusa.entrypoints.chat_utils import chat_prompt

    processor = llm.llm_engine.input_processor
    prompts = []
    for (lineno, row), sp in zip(rows, params):
        try:
            mm = None
            if "messages" in row:  # rendered and tokenized as LLM.chat does (images under its media policy)
                prompt = chat_prompt(llm.get_tokenizer(), row["messages"], llm.media_policy,
                                     chat_template=ns.chat_template)
                mm = prompt.pop("multi_modal_data", None)
            elif "encoder_prompt" in row:   # encoder-decoder (T5): vLLM's explicit form, checked by the engine's rule
                prompt = {k: row[k] for k in ("encoder_prompt", "decoder_prompt") if k in row}
            elif "prompt_token_ids" in row:
                prompt = {"prompt_token_ids": row["prompt_token_ids"]}
            else:
                prompt = row["prompt"]
            if llm.llm_engine.config.model_config.is_encoder_decoder:
                from hayabusa.engine.encoder_decoder_inputs import process_encoder_decoder

                # the engine's rule: the encoder limit (the model's, not max_model_len), the decoder prompt
                text, _, ids = process_encoder_decoder(processor, prompt, sp)
                if isinstance(prompt, dict) and "encoder_prompt" in prompt:
                    prompts.append(prompt)
                    continue
            else:
                text, ids = processor.process(prompt, sp)
        except HayabusaValidationError as e:
            raise e.prefixed(f"{ns.prompts}:{lineno}") from None
        prompts.append({"prompt_token_ids": ids} if text is None else {"prompt": text, "prompt_token_ids": ids})
        if mm:
            prompts[-1]["multi_modal_data"] = mm
    return prompts


def _completion_record(c: Any) -> dict[str, Any]:
    """A CompletionOutput as an output line's entry; `logprobs` and `cumulative_logprob` only when the line asked
    for logprobs (as the request's RequestOutput carries them)."""
    rec = {"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
    if c.logprobs is not None:
        rec["logprobs"] = logprobs_json(c.logprobs)
        rec["cumulative_logprob"] = c.cumulative_logprob
    return rec


def cmd_generate(ns: argparse.Namespace) -> int:
    from hayabusa import LLM

    # Every check that needs only the file runs before the model loads; those that need the model (token ids,
    # prompt length) before anything generates.
    rows = _read_prompts(ns.prompts)
    params = _sampling_params(ns, rows)
    model = ns.model
    if model is None:
        model = demo_model_dir()
        print(f"hayabusa: no --model given; using the bundled demo model stories260K ({model}), a 260K-parameter "
              "TinyStories Llama. Pass --model DIR for a real model.", file=sys.stderr)
    t0 = time.perf_counter()
    llm = LLM(model, **EngineArgs.cli_kwargs(ns))
    prompts = _engine_prompts(llm, ns, rows, params)
    t1 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=not ns.no_tqdm)
    t2 = time.perf_counter()
    out_f = open(ns.output, "w", encoding="utf-8") if ns.output else sys.stdout
    try:
        for (_, row), out in zip(rows, outputs):
            rec = {"prompt": out.prompt, "prompt_token_ids": out.prompt_token_ids}
            if out.encoder_prompt_token_ids is not None:   # encoder-decoder: the line's input is the encoder's
                rec.update(encoder_prompt=out.encoder_prompt, encoder_prompt_token_ids=out.encoder_prompt_token_ids)
            rec["outputs"] = [_completion_record(c) for c in out.outputs]
            if out.prompt_logprobs is not None:   # the line asked for them: one entry per prompt token (first null)
                rec["prompt_logprobs"] = logprobs_json(out.prompt_logprobs)
            if "id" in row:
                rec["id"] = row["id"]
            out_f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    finally:
        if out_f is not sys.stdout:
            out_f.close()
    # prompt tokens: the encoder's input too (encoder-decoder models), as the server's usage counts them
    n_in = sum(len(o.prompt_token_ids) + len(o.encoder_prompt_token_ids or ()) for o in outputs)
    n_out = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    secs = t2 - t1
    kv = llm.llm_engine.kv_cache_manager
    cache = f"prefix cache hit rate {100 * kv.prefix_hit_rate:.1f}%" if kv.enable_prefix_caching \
        else "prefix caching off"
    print(f"hayabusa: {len(outputs)} requests, {n_in} prompt tokens, {n_out} output tokens in {secs:.2f} s "
          f"({n_out / secs if secs else 0:.1f} output tok/s; {cache}; engine start {t1 - t0:.2f} s)",
          file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    ns = _build_parser().parse_args(argv)
    try:
        if ns.command == "generate":
            return cmd_generate(ns)
        if ns.command == "bench":
            from hayabusa.bench.cli import run_bench

            return run_bench(ns)
        if ns.command == "serve":
            from hayabusa.entrypoints.openai.cli import run_serve

            return run_serve(ns)
        if ns.command in ("eval", "plan"):
            from hayabusa.eval.cli import run_eval, run_plan

            return run_eval(ns) if ns.command == "eval" else run_plan(ns)
    except HayabusaValidationError as e:
        print(f"hayabusa: error: {e}", file=sys.stderr)
        return 2
    except FileNotFoundError as e:
        print(f"hayabusa: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:   # `hayabusa plan ... | head`: the reader left; stop quietly like other CLI tools
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())   # so the interpreter's final flush does not raise again
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
