"""Grammar compilation (xgrammar) and per-request grammar state, on the engine / scheduler side.

- ``StructuredOutputManager.grammar(params)``: checks the constraint now (a bad schema, regex or grammar is a
  HayabusaValidationError naming the field, before anything is queued) and returns a Future of the compiled
  grammar: one per distinct (kind, spec, whitespace) key, compiled on a small thread pool so that add_request and
  the running requests' steps do not wait for it.
- ``StructuredOutputRequest``: one request's GrammarMatcher (made when its grammar is ready; the scheduler does not
  admit the request before); it accepts each sampled token and says when the output is complete.
- ``fill_bitmask``: the next-token bitmask of the step's constrained requests, filled at once ([R, ceil(V / 32)]
  int32, numpy: plain data for the SchedulerOutput).

xgrammar is imported only when a request asks for a constraint; requests without one pay nothing.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from hayabusa.errors import HayabusaValidationError
from hayabusa.sampling_params import StructuredOutputsParams

# At most this many whitespace characters where JSON allows whitespace (unless whitespace_pattern or
# disable_any_whitespace says otherwise): a weak model cannot pad an answer with whitespace until max_tokens.
DEFAULT_MAX_JSON_WHITESPACE = 2
# Compiled grammars kept (a server may see a new schema on every request).
MAX_CACHED_GRAMMARS = 256


def import_xgrammar() -> Any:
    """xgrammar, or a HayabusaValidationError naming structured_outputs saying how to install it."""
    try:
        import xgrammar
    except ImportError:
        raise HayabusaValidationError(
            "structured outputs need xgrammar: pip install 'hayabusa[structured]' (or pip install xgrammar).",
            parameter="structured_outputs", value=None) from None
    return xgrammar


def grammar_key(params: StructuredOutputsParams) -> tuple:
    """The cache key of a constraint: (kind, spec, whitespace settings); a dict schema by its sorted JSON text."""
    kind = params.kind
    spec: Any = getattr(params, kind)
    if kind == "json" and isinstance(spec, dict):
        spec = json.dumps(spec, sort_keys=True)
    elif kind == "choice":
        spec = tuple(spec)
    return kind, spec, params.whitespace_pattern, params.disable_any_whitespace


def _json_grammar(xgr: Any, schema: str, params: StructuredOutputsParams) -> Any:
    if params.disable_any_whitespace:
        return xgr.Grammar.from_json_schema(schema, any_whitespace=False)
    if params.whitespace_pattern is not None:
        # xgrammar takes no whitespace regex: a pattern lifts the bound (any JSON whitespace).
        return xgr.Grammar.from_json_schema(schema, any_whitespace=True)
    return xgr.Grammar.from_json_schema(schema, any_whitespace=True, max_whitespace_cnt=DEFAULT_MAX_JSON_WHITESPACE)


def parse_grammar(params: StructuredOutputsParams) -> Any:
    """The constraint as an xgrammar Grammar (tokenizer-independent; fast).

    Raises:
        HayabusaValidationError: naming ``structured_outputs.<kind>`` when the schema, regex, choice or grammar is
            invalid.
    """
    xgr = import_xgrammar()
    kind = params.kind
    field = f"structured_outputs.{kind}"
    spec = getattr(params, kind)
    try:
        if kind == "json":
            if isinstance(spec, str):
                try:
                    parsed = json.loads(spec)
                except ValueError as e:
                    raise ValueError(f"not valid JSON: {e}") from None
            else:
                parsed = spec
            if not isinstance(parsed, (dict, bool)):
                raise ValueError("a JSON schema is an object")
            _check_schema(parsed)
            return _json_grammar(xgr, json.dumps(parsed), params)
        if kind == "json_object":
            return _json_grammar(xgr, '{"type": "object"}', params)
        if kind == "regex":
            return xgr.Grammar.from_regex(spec)
        if kind == "choice":
            alts = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec)
            return xgr.Grammar.from_ebnf(f"root ::= {alts}")
        return xgr.Grammar.from_ebnf(spec)
    except HayabusaValidationError:
        raise
    except Exception as e:  # xgrammar raises RuntimeError / ValueError / its own errors
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise HayabusaValidationError(f"{field} is invalid: {why[:300]}", parameter=field,
                                      value=spec if isinstance(spec, str) else json.dumps(spec)[:200]) from None


def _check_schema(schema: Any) -> None:
    """Check a JSON schema against its metaschema when jsonschema is installed (xgrammar ignores what it does not
    know, e.g. ``{"type": "strin"}`` would otherwise compile to anything)."""
    try:
        import jsonschema
    except ImportError:
        return
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        raise ValueError(f"{e.message}" + (f" (at {where})" if where else "")) from None


class StructuredOutputRequest:
    """One request's grammar state: the compiled grammar's Future until it is ready, then a GrammarMatcher.

    Args:
        grammar: Future of the compiled grammar (shared by the requests with the same constraint).
        stop_token_ids: the model's EOS ids: the matcher allows them only where the grammar is complete.
        vocab_size: the logits' width (the model's vocabulary, which may exceed the tokenizer's).
    """

    def __init__(self, grammar: Future, stop_token_ids: tuple[int, ...] | list[int], vocab_size: int) -> None:
        self.grammar = grammar
        self.stop_token_ids = list(stop_token_ids)
        self.vocab_size = vocab_size
        self.matcher: Any = None
        self.num_rejected = 0

    def ready(self) -> bool:
        """True once the grammar is compiled (and the matcher made). Raises what the compilation raised."""
        if self.matcher is not None:
            return True
        if not self.grammar.done():
            return False
        xgr = import_xgrammar()
        self.matcher = xgr.GrammarMatcher(self.grammar.result(), override_stop_tokens=self.stop_token_ids)
        return True

    def accept(self, token_ids: list[int]) -> None:
        """Advance the matcher by the sampled tokens (a token the mask allowed is always accepted; one past the
        end, or rejected, is counted and skipped)."""
        m = self.matcher
        for t in token_ids:
            if m.is_terminated() or not m.accept_token(t):
                self.num_rejected += 1

    @property
    def is_terminated(self) -> bool:
        """The output is complete (the matcher accepted a stop token where the grammar ends)."""
        return self.matcher is not None and self.matcher.is_terminated()


# From this many constrained requests in a step the bitmask is filled by xgrammar's thread pool (BatchGrammarMatcher).
BATCH_FILL_MIN = 8
_batch_matcher: list = []   # the BatchGrammarMatcher, made on first use


def fill_bitmask(requests: list[StructuredOutputRequest | None], out: Any = None) -> np.ndarray:
    """The next-token bitmask of each request ([len(requests), ceil(V / 32)] int32; bit j of word w allows token
    32 w + j), filled by their matchers; many at once on xgrammar's threads. The row of a terminated matcher, or of
    None (a request that finished since the step was scheduled), allows everything: its token is dropped.

    Args:
        requests: the step's constrained requests, in ``structured_output_req_ids`` order (None: finished).
        out: a host torch tensor [len(requests), ceil(V / 32)] int32, contiguous, to fill in place (the runner's
            pinned staging buffer: no copy before the device upload); None: a new one.

    Returns:
        the bitmask as a numpy array (a view of ``out`` when given).
    """
    xgr = import_xgrammar()
    vocab_size = next(r.vocab_size for r in requests if r is not None)   # at least one is not None
    if out is None:
        bitmask = xgr.allocate_token_bitmask(len(requests), vocab_size)
    else:
        assert tuple(out.shape) == tuple(xgr.get_bitmask_shape(len(requests), vocab_size)) and out.is_contiguous()
        bitmask = out.fill_(-1)   # every row allows everything until its matcher fills it
    live = [i for i, r in enumerate(requests) if r is not None and not r.matcher.is_terminated()]
    if len(live) >= BATCH_FILL_MIN:
        if not _batch_matcher:
            _batch_matcher.append(xgr.BatchGrammarMatcher())
        _batch_matcher[0].batch_fill_next_token_bitmask([requests[i].matcher for i in live], bitmask, live)
    else:
        for i in live:
            requests[i].matcher.fill_next_token_bitmask(bitmask, i)
    return bitmask.numpy()


class StructuredOutputManager:
    """Compiles grammars for one tokenizer / vocabulary, each distinct constraint once (a cache of Futures), on a
    small thread pool.

    Args:
        tokenizer: the HF tokenizer (None: constraints are refused).
        vocab_size: the model's vocabulary size (the logits' width).
        max_workers: compile threads.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, max_workers: int = 2) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_workers = max_workers
        self.cache: dict[tuple, Future] = {}
        self.compile_seconds: dict[tuple, float] = {}
        self._compiler: Any = None
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                xgr = import_xgrammar()
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
                self._compiler = xgr.GrammarCompiler(info, max_threads=self.max_workers, cache_enabled=False)
                self._pool = ThreadPoolExecutor(self.max_workers, thread_name_prefix="hayabusa-grammar")
            return self._compiler

    def grammar(self, params: StructuredOutputsParams) -> Future:
        """Check the constraint and return the Future of its compiled grammar (cached per key).

        Raises:
            HayabusaValidationError: no tokenizer, xgrammar missing, or an invalid constraint (naming the field).
        """
        if self.tokenizer is None:
            raise HayabusaValidationError("structured outputs need the tokenizer (the engine was started with "
                                          "skip_tokenizer_init).", parameter="structured_outputs", value=None)
        key = grammar_key(params)
        future = self.cache.get(key)
        if future is not None:
            return future
        grammar = parse_grammar(params)
        compiler = self._get_compiler()
        future = self._pool.submit(self._compile, compiler, grammar, key)
        if len(self.cache) >= MAX_CACHED_GRAMMARS:   # oldest first (requests holding it keep their Future)
            del self.cache[next(iter(self.cache))]
        self.cache[key] = future
        return future

    def _compile(self, compiler: Any, grammar: Any, key: tuple) -> Any:
        import time

        t0 = time.perf_counter()
        compiled = compiler.compile_grammar(grammar)
        self.compile_seconds[key] = time.perf_counter() - t0
        return compiled

    def make_request(self, grammar: Future, stop_token_ids: tuple[int, ...]) -> StructuredOutputRequest:
        return StructuredOutputRequest(grammar, stop_token_ids, self.vocab_size)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
