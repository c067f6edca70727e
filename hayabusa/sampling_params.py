"""SamplingParams: vLLM's fields, defaults and semantics.

Checks that need nothing but the parameters themselves happen here, in ``__post_init__``; checks that need the
model (vocabulary size, max_model_len) happen in the engine's input processor.
"""

from __future__ import annotations

import enum
import functools
import math
import numbers
from dataclasses import dataclass, field, fields
from typing import Any

from hayabusa.errors import HayabusaTypeError, HayabusaValidationError

# Below this temperature a request is greedy (vLLM's _SAMPLING_EPS).
SAMPLING_EPS = 1e-5
# Most completions one request may ask for (n, best_of). vLLM has no cap; we need one so that one request cannot
# fill the engine with children. 128 is the OpenAI API's own limit for n.
MAX_N = 128

# SamplingParams fields that the engine fills (not constructor arguments of the user's).
ENGINE_FILLED_FIELDS = frozenset({"all_stop_token_ids", "bad_words_token_ids"})

_BOOL_FIELDS = ("ignore_eos", "detokenize", "skip_special_tokens", "spaces_between_special_tokens",
                "include_stop_str_in_output")
_INT_FIELDS = ("n", "best_of", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
               "truncate_prompt_tokens")
_OPTIONAL_FIELDS = frozenset({"best_of", "seed", "max_tokens", "logprobs", "prompt_logprobs",
                              "truncate_prompt_tokens"})
_FLOAT_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "min_p")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _bad(parameter: str, value: Any, why: str) -> HayabusaValidationError:
    return HayabusaValidationError(f"{parameter} {why}, got {_short(value)}.", parameter=parameter, value=value)


def _bad_type(parameter: str, value: Any, why: str) -> HayabusaTypeError:
    return HayabusaTypeError(f"{parameter} {why}, got {_short(value)} ({type(value).__name__}).",
                             parameter=parameter, value=value)


def _is_int(v: Any) -> bool:
    # plain int first: the ABC check costs ~1 us per field, and every request builds a SamplingParams
    return type(v) is int or (isinstance(v, numbers.Integral) and not isinstance(v, bool))


def _is_real(v: Any) -> bool:
    return type(v) is float or type(v) is int or (isinstance(v, numbers.Real) and not isinstance(v, bool))


def check_utf8(parameter: str, text: str) -> None:
    """Raise HayabusaValidationError naming ``parameter`` when ``text`` cannot be encoded as UTF-8 (a lone
    surrogate such as "\\ud800": JSON and Python strings can hold one; no tokenizer can)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise HayabusaValidationError(
            f"{parameter} is not valid Unicode text: {e.reason} at character {e.start} "
            f"({text[e.start:e.end]!a}).", parameter=parameter, value=text[max(e.start - 20, 0):e.end + 20]) from None


class RequestOutputKind(enum.IntEnum):
    """What a streaming caller (AsyncLLMEngine.generate) gets for a request (vLLM's ``RequestOutputKind``).

    CUMULATIVE: every output holds the whole completion so far (text, token_ids, logprobs).
    DELTA: every output holds only what is new since the previous one: each ``CompletionOutput`` that changed,
        with its new text, token ids and logprobs (``cumulative_logprob`` stays the running total); the prompt
        logprobs not sent yet (usually all in the first output; the rest later when another sample reaches its
        first token before the first sample's prompt is read). Outputs not yet read are merged
        (``RequestOutput.add``), so nothing is lost when the consumer is slower than the engine.
    FINAL_ONLY: one output, when the request has finished.

    ``LLM.generate`` / ``LLM.chat`` always return final outputs, whatever the kind (as vLLM's LLM).
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """A constraint on the output (vLLM's ``StructuredOutputsParams``): exactly one of ``json`` (a JSON schema: a
    dict, its JSON text, or a pydantic model class), ``regex``, ``choice`` (a list of strings), ``grammar`` (EBNF /
    GBNF) or ``json_object=True`` (any JSON object). Compiled by xgrammar (``pip install hayabusa[structured]``).

    Args:
        whitespace_pattern: a regex for the whitespace JSON may hold between tokens; by default JSON output is
            compact-ish (at most 2 whitespace characters where the grammar allows them), so a model cannot pad an
            answer with whitespace until max_tokens.
        disable_any_whitespace: JSON without any optional whitespace (compact separators).
        disable_fallback, disable_additional_properties, structural_tag, backend: accepted for compatibility.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None
    backend: str | None = None

    def __post_init__(self) -> None:
        name = "structured_outputs"
        if isinstance(self.json, type) and hasattr(self.json, "model_json_schema"):
            self.json = self.json.model_json_schema()
        if self.json_object is False:
            self.json_object = None
        given = [k for k in _STRUCTURED_KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise HayabusaValidationError(
                f"{name} needs exactly one of {', '.join(_STRUCTURED_KINDS)}, got "
                f"{', '.join(given) if given else 'none'}.", parameter=name, value=given)
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise _bad_type(f"{name}.json", self.json, "must be a JSON schema (dict or JSON text)")
        for k in ("regex", "grammar", "whitespace_pattern"):
            v = getattr(self, k)
            if v is not None:
                if not isinstance(v, str):
                    raise _bad_type(f"{name}.{k}", v, "must be a string")
                check_utf8(f"{name}.{k}", v)
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice or \
                    not all(isinstance(c, str) for c in self.choice):
                raise _bad_type(f"{name}.choice", self.choice, "must be a non-empty list of strings")
            self.choice = list(self.choice)
        if self.json_object is not None and self.json_object is not True:
            raise _bad_type(f"{name}.json_object", self.json_object, "must be a bool")

    @property
    def kind(self) -> str:
        """Which constraint: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(k for k in _STRUCTURED_KINDS if getattr(self, k) is not None)

    @classmethod
    def from_value(cls, value: Any, parameter: str = "structured_outputs") -> "StructuredOutputsParams | None":
        """None, a StructuredOutputsParams, or a dict of its fields (unknown keys named) -> the params."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            known = {f.name for f in fields(cls)}
            unknown = sorted(set(value) - known)
            if unknown:
                raise HayabusaTypeError(f"{parameter} got an unknown field {unknown[0]!r}; known ones: "
                                        f"{', '.join(sorted(known))}.", parameter=parameter, value=unknown[0])
            return cls(**value)
        raise _bad_type(parameter, value, "must be a StructuredOutputsParams")


# vLLM's older name
GuidedDecodingParams = StructuredOutputsParams


@dataclass
class SamplingParams:
    """How to sample the completion of one prompt (vLLM's ``SamplingParams``).

    Args:
        n: number of completions returned for the prompt, in [1, MAX_N = 128].
        best_of: accepted for compatibility, in [n, MAX_N]; n completions are generated and returned.
        presence_penalty: subtracted once from the logit of every token already generated, in [-2, 2].
        frequency_penalty: subtracted from a token's logit once per time it was generated, in [-2, 2].
        repetition_penalty: > 0; logits of tokens in the prompt or output are divided by it when positive and
            multiplied when negative (CTRL, Keskar et al. 2019). 1.0 = off.
        temperature: >= 0; 0 means greedy (argmax).
        top_p: nucleus sampling (Holtzman et al. 2019) mass, in (0, 1]; 1 = off.
        top_k: keep the k most likely tokens; 0 or -1 = off.
        min_p: drop tokens whose probability is below min_p x the top probability, in [0, 1]; 0 = off.
        seed: per-request seed in [-2**63, 2**64 - 1] (torch.Generator's range): the request's tokens do not depend
            on what else is in the batch.
        stop: string(s) that end the completion; not included in the text unless include_stop_str_in_output.
        stop_token_ids: token ids that end the completion (kept in token_ids, not in the text when special).
        ignore_eos: keep generating after EOS.
        max_tokens: maximum generated tokens per completion (None = up to max_model_len). Default 16.
        min_tokens: EOS and stop_token_ids are suppressed until this many tokens were generated.
        logprobs: number of top logprobs to return per generated token (the sampled token is always included).
        prompt_logprobs: number of top logprobs to return per prompt token (the actual token is always
            included; the first prompt token has none). Such a request takes no prefix-cache hit.
        detokenize: produce text; False returns token ids only.
        skip_special_tokens: drop special tokens from the text.
        spaces_between_special_tokens: passed to the tokenizer when decoding.
        include_stop_str_in_output: keep the matched stop string in the text.
        truncate_prompt_tokens: keep only the last k prompt tokens.
        structured_outputs: a StructuredOutputsParams (or a dict of its fields): constrain the output to a JSON
            schema, regex, choice or grammar. ``guided_decoding`` is vLLM's older name for it.
        output_kind: a RequestOutputKind (or its int value 0, 1, 2): whether AsyncLLMEngine.generate streams
            cumulative outputs (default), deltas, or the final output only.
        logit_bias: token id -> bias added to its logit before sampling (greedy included; the returned logprobs
            stay the raw ones, vLLM's default ``logprobs_mode``). Ids must be in the vocabulary (checked by the
            engine); biases finite. Not clamped here (the OpenAI server clamps to [-100, 100], as vLLM's).
        allowed_token_ids: non-empty list of token ids; every other id is masked to -inf before sampling.
        bad_words: words that are never completed: each is tokenized without and with a leading space (vLLM's
            rule) and the last token of a sequence is banned whenever the output so far ends with the sequence's
            other tokens (a one-token word is always banned). Needs the tokenizer.

    Raises:
        HayabusaValidationError: a value is out of range; the error names the parameter and the value.
            A value of the wrong type (``ignore_eos="false"``, ``n=2.0``, ``temperature=None``) or an unknown
            keyword is a ``HayabusaTypeError``: the same error, also catchable as ``TypeError`` (as vLLM raises).
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    extra_args: dict[str, Any] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Filled by the engine: every token id that ends the request (eos + stop_token_ids).
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)
    # Filled by the engine from bad_words and the tokenizer: the banned token sequences (vLLM's
    # ``_bad_words_token_ids``).
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            raise _bad("stop", self.stop, "must be a string or a list of strings")
        if not isinstance(self.stop_token_ids, (list, tuple, type(None))):
            raise _bad("stop_token_ids", self.stop_token_ids, "must be a list of integers")
        self.stop_token_ids = list(self.stop_token_ids or [])
        so = StructuredOutputsParams.from_value(self.structured_outputs, "structured_outputs")
        gd = StructuredOutputsParams.from_value(self.guided_decoding, "guided_decoding")
        if so is not None and gd is not None and so != gd:
            raise _bad("guided_decoding", gd, "is the older name of structured_outputs; give one of them")
        self.structured_outputs = self.guided_decoding = so if so is not None else gd
        self._verify_types()
        self._verify()
        if self.temperature < SAMPLING_EPS:
            # Greedy: the truncation knobs cannot change argmax.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
        if self.top_k == -1:
            self.top_k = 0
        self.all_stop_token_ids = set(self.stop_token_ids)

    def _verify_types(self) -> None:
        """Every field has its type: bools are bools, ints are ints (not bools; numpy ints become int), floats are
        finite real numbers, strings are valid UTF-8 (no lone surrogates). A wrong type is a HayabusaTypeError
        (a HayabusaValidationError that is also a TypeError) naming the field."""
        for name in _BOOL_FIELDS:
            v = getattr(self, name)
            if v is not True and v is not False:
                raise _bad_type(name, v, "must be a bool (True or False)")
        for name in _INT_FIELDS:
            v = getattr(self, name)
            if type(v) is int or (v is None and name in _OPTIONAL_FIELDS):
                continue
            if not _is_int(v):
                raise _bad_type(name, v, "must be an integer")
            setattr(self, name, int(v))
        for name in _FLOAT_FIELDS:
            v = getattr(self, name)
            if not _is_real(v):
                raise _bad_type(name, v, "must be a number")
            if not math.isfinite(v):
                raise _bad(name, v, "must be a finite number")
        for s in self.stop:
            if not isinstance(s, str):
                raise _bad_type("stop", self.stop, "must be a string or a list of strings")
            check_utf8("stop", s)
        for t in self.stop_token_ids:
            if not _is_int(t):
                raise _bad_type("stop_token_ids", self.stop_token_ids, "must be a list of integers")
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        self._verify_logit_edit_types()
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise _bad_type("extra_args", self.extra_args, "must be a dict")
        if type(self.output_kind) is not RequestOutputKind:
            if not _is_int(self.output_kind) or self.output_kind not in tuple(RequestOutputKind):
                raise _bad_type("output_kind", self.output_kind,
                                "must be a RequestOutputKind (CUMULATIVE = 0, DELTA = 1, FINAL_ONLY = 2)")
            self.output_kind = RequestOutputKind(int(self.output_kind))

    def _verify(self) -> None:  # noqa: C901 - a flat list of checks reads best
        if not 1 <= self.n <= MAX_N:
            raise _bad("n", self.n, f"must be in [1, {MAX_N}]")
        if self.best_of is not None and not self.n <= self.best_of <= MAX_N:
            raise _bad("best_of", self.best_of, f"must be in [n={self.n}, {MAX_N}]")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2.0 <= v <= 2.0:
                raise _bad(name, v, "must be in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            raise _bad("repetition_penalty", self.repetition_penalty, "must be greater than zero")
        if not self.temperature >= 0.0:
            raise _bad("temperature", self.temperature, "must be non-negative")
        if not 0.0 < self.top_p <= 1.0:
            raise _bad("top_p", self.top_p, "must be in (0, 1]")
        if self.top_k < -1:
            raise _bad("top_k", self.top_k, "must be 0 or -1 (disabled), or at least 1")
        if not 0.0 <= self.min_p <= 1.0:
            raise _bad("min_p", self.min_p, "must be in [0, 1]")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise _bad("max_tokens", self.max_tokens, "must be at least 1")
        if self.min_tokens < 0:
            raise _bad("min_tokens", self.min_tokens, "must be greater than or equal to 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _bad("min_tokens", self.min_tokens, f"must be less than or equal to max_tokens={self.max_tokens}")
        if self.logprobs is not None and self.logprobs < 0:
            raise _bad("logprobs", self.logprobs, "must be a non-negative integer")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise _bad("prompt_logprobs", self.prompt_logprobs, "must be a non-negative integer")
        if self.seed is not None and not -2 ** 63 <= self.seed < 2 ** 64:  # torch.Generator.manual_seed's range
            raise _bad("seed", self.seed, "must be in [-2**63, 2**64 - 1]")
        if any(s == "" for s in self.stop):
            raise _bad("stop", self.stop, "must be non-empty strings")
        if any(t < 0 for t in self.stop_token_ids):
            raise _bad("stop_token_ids", self.stop_token_ids, "must be non-negative integers")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1:
            raise _bad("truncate_prompt_tokens", self.truncate_prompt_tokens, "must be at least 1")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise _bad("allowed_token_ids", self.allowed_token_ids, "must not be empty (None = every token)")
            if min(self.allowed_token_ids) < 0:
                raise _bad("allowed_token_ids", self.allowed_token_ids, "must be non-negative token ids")
        if self.logit_bias and min(self.logit_bias) < 0:
            raise _bad("logit_bias", self.logit_bias, "keys must be non-negative token ids")
        if self.bad_words and any(not w.strip() for w in self.bad_words):
            raise _bad("bad_words", self.bad_words, "must be non-empty words")

    def _verify_logit_edit_types(self) -> None:
        """logit_bias: a dict of integer ids (int-like strings too, as vLLM converts them) -> finite numbers, made
        {int: float}; allowed_token_ids: a list of integers, made a list of int; bad_words: a list of UTF-8
        strings."""
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise _bad_type("logit_bias", self.logit_bias, "must be a dict of token id -> bias")
            bias = {}
            for k, v in self.logit_bias.items():
                if _is_int(k):
                    key = int(k)
                elif isinstance(k, str) and k.strip().lstrip("+-").isdigit():
                    key = int(k)
                else:
                    raise _bad_type("logit_bias", self.logit_bias, f"keys must be token ids (integers); key {k!r}")
                if not _is_real(v):
                    raise _bad_type("logit_bias", self.logit_bias, f"values must be numbers; token {k!r}")
                if not math.isfinite(v):
                    raise _bad("logit_bias", self.logit_bias, f"values must be finite numbers; token {k!r}")
                bias[key] = float(v)
            self.logit_bias = bias
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, (list, tuple, set, frozenset)) or not all(_is_int(t) for t in ids):
                raise _bad_type("allowed_token_ids", ids, "must be a list of integers")
            self.allowed_token_ids = [int(t) for t in ids]
        if self.bad_words is not None:
            if not isinstance(self.bad_words, (list, tuple)) or not all(isinstance(w, str) for w in self.bad_words):
                raise _bad_type("bad_words", self.bad_words, "must be a list of strings")
            self.bad_words = list(self.bad_words)
            for w in self.bad_words:
                check_utf8("bad_words", w)

    @property
    def has_logit_edits(self) -> bool:
        """True when logit_bias, allowed_token_ids or bad_words is set (the sampler then edits the logits)."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None or bool(self.bad_words)

    @property
    def has_penalties(self) -> bool:
        """True when a presence, frequency or repetition penalty is on (sampling then reads the token history)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature below 1e-5)."""
        return self.temperature < SAMPLING_EPS

    def clone(self, **changes: Any) -> "SamplingParams":
        """A copy with some fields changed (validated again)."""
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ENGINE_FILLED_FIELDS}
        values["stop"] = list(self.stop)
        values["stop_token_ids"] = list(self.stop_token_ids)
        values.update(changes)
        clone = SamplingParams(**values)
        if "bad_words" not in changes:
            clone.bad_words_token_ids = [list(w) for w in self.bad_words_token_ids]
        return clone


_FIELD_NAMES = frozenset(f.name for f in fields(SamplingParams) if f.name not in ENGINE_FILLED_FIELDS)
_dataclass_init = SamplingParams.__init__


@functools.wraps(_dataclass_init)
def _init(self: SamplingParams, *args: Any, **kwargs: Any) -> None:
    # The dataclass __init__ would raise a bare TypeError for an unknown keyword; name it instead.
    if not _FIELD_NAMES.issuperset(kwargs):
        unknown = sorted(set(kwargs) - _FIELD_NAMES)
        raise HayabusaTypeError(f"SamplingParams got an unknown parameter {unknown[0]!r}; known ones: "
                                f"{', '.join(sorted(_FIELD_NAMES))}.", parameter=unknown[0], value=kwargs[unknown[0]])
    if len(args) > len(_FIELD_NAMES):
        raise HayabusaTypeError(f"SamplingParams takes at most {len(_FIELD_NAMES)} positional arguments, got "
                                f"{len(args)}.", parameter="SamplingParams", value=len(args))
    _dataclass_init(self, *args, **kwargs)


SamplingParams.__init__ = _init  # type: ignore[method-assign]


@dataclass
class BeamSearchParams:
    """Beam search settings (vLLM's ``BeamSearchParams``), for ``LLM.beam_search``.

    Args:
        beam_width: beams kept per prompt (k); each step expands every beam by its top 2k tokens.
        max_tokens: most tokens generated per beam.
        ignore_eos: EOS does not end a beam.
        temperature: accepted for compatibility; beams are ranked by the model's raw logprobs (as HF's
            ``do_sample=False`` beam search), so it changes nothing.
        length_penalty: a finished beam's score is its summed logprob / (generated tokens ** length_penalty).
        include_stop_str_in_output: accepted for compatibility (beam search has no stop strings).
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            v = getattr(self, name)
            if not _is_int(v):
                raise _bad_type(name, v, "must be an integer")
            if v < 1:
                raise _bad(name, v, "must be at least 1")
        for name in ("temperature", "length_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or not math.isfinite(v):
                raise _bad_type(name, v, "must be a finite number")
        if self.temperature < 0:
            raise _bad("temperature", self.temperature, "must be non-negative")
        if not isinstance(self.ignore_eos, bool):
            raise _bad_type("ignore_eos", self.ignore_eos, "must be a bool (True or False)")
