"""IncrementalDetokenizer against real tokenizers: streamed text equals Hugging Face's decode, split UTF-8 is
held back, stop strings / stop tokens follow vLLM v1. CPU only, a few seconds."""

from __future__ import annotations

import os
import random
import re
from functools import lru_cache
from pathlib import Path

import pytest

from hayabusa.engine.detokenizer import IncrementalDetokenizer
from hayabusa.errors import HayabusaValidationError
from hayabusa.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[2]
ASSETS = Path(os.environ.get("HAYABUSA_ASSETS", REPO.parent / "shared" / "assets"))
TOKENIZER_DIRS = {
    "gpt2": ASSETS / "tokenizers" / "gpt2",  # byte-level BPE
    "qwen3": ASSETS / "tokenizers" / "qwen3",  # byte-level BPE, NFC, 26 added tokens
    "llm-jp-v3.1": ASSETS / "tokenizers" / "llm-jp-v3.1",  # SentencePiece unigram, byte fallback
    "llm-jp-v2.2": ASSETS / "tokenizers" / "llm-jp-v2.2",  # SentencePiece unigram, regex decoders
    "stories260K": ASSETS / "models" / "stories260K",  # Llama SentencePiece BPE, vocab 512, mostly bytes
}
BYTE_LEVEL = {"gpt2", "qwen3"}
ALL = list(TOKENIZER_DIRS)
R = "\ufffd"

if not (ASSETS / "text").exists() or not (ASSETS / "tokenizers").exists():
    pytest.skip(f"text/tokenizer assets not found under {ASSETS}; set HAYABUSA_ASSETS", allow_module_level=True)


@lru_cache(maxsize=None)
def tok(name: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TOKENIZER_DIRS[name]))


@lru_cache(maxsize=None)
def text(name: str, start: int, length: int) -> str:
    return (ASSETS / "text" / name).read_text(encoding="utf-8")[start : start + length]


def decode(t, ids, skip_special_tokens=True):
    return t.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)


def reference(t, prompt, gen, skip_special_tokens=True):
    """vLLM's meaning of the generated text: what the generated ids add to the decoded prompt."""
    full, head = decode(t, prompt + gen, skip_special_tokens), decode(t, prompt, skip_special_tokens)
    assert full.startswith(head)
    return full[len(head) :]


def stream(t, prompt, gen, chunks=None, stop_terminated=False, **params):
    """Feed gen (one id per update, or in the given chunk sizes); returns (detokenizer, deltas, stop string).
    Stops feeding at the first matched stop string, as the engine does."""
    det = IncrementalDetokenizer(t, list(prompt), SamplingParams(**params))
    deltas, matched, i = [], None, 0
    for size in chunks or [1] * len(gen):
        new = gen[i : i + size]
        i += size
        matched = det.update(new, stop_terminated and i >= len(gen), finished=i >= len(gen))
        deltas.append(det.get_next_output_text(finished=matched is not None or i >= len(gen), delta=True))
        if matched is not None:
            break
    return det, deltas, matched


def split_clean(t, ids, at):
    """Split ids into prompt / generated at the first index >= at where the prompt text ends cleanly."""
    while decode(t, ids[:at]).endswith(R):
        at += 1
    return ids[:at], ids[at:]


def byte_ids(t, s):
    """s as SentencePiece byte-fallback tokens <0xNN>."""
    return t.convert_tokens_to_ids([f"<0x{b:02X}>" for b in s.encode()])


JA = text("wagahaiwa_nekodearu.plain.txt", 0, 3000)
EN = text("botchan.plain.txt", 2000, 3000)
EMOJI = " Emoji: 😀🦀🍣👨‍👩‍👧 🇯🇵 寿司と𠮷野家、ｶﾀｶﾅ。\n\tTabs and  spaces, Ünïcödé ∑ 🤖!"


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("lang", ["ja", "en", "emoji"])
def test_streaming_equals_decode_on_real_text(name, lang):
    t = tok(name)
    body = {"ja": JA, "en": EN, "emoji": JA[:40] + EMOJI + EN[:40]}[lang]
    prompt, gen = split_clean(t, t.encode(body), 12)
    det, deltas, _ = stream(t, prompt, gen)
    want = reference(t, prompt, gen)
    assert det.output_text == want and "".join(deltas) == want
    assert det.token_ids == gen and R not in want
    if name in BYTE_LEVEL:
        assert want == decode(t, gen)
    else:
        # The documented exception: SentencePiece decode() drops the leading space of the first piece, so
        # decode(prompt + gen) != decode(prompt) + decode(gen); we keep the space, like vLLM.
        lead = " " if t.convert_ids_to_tokens(gen[0]).startswith("▁") else ""
        assert want == lead + decode(t, gen)
    # Several ids per update (speculative decoding) give the same text.
    rng, chunks = random.Random(len(gen)), []
    while sum(chunks) < len(gen):
        chunks.append(rng.randint(1, 5))
    assert stream(t, prompt, gen, chunks=chunks)[0].output_text == want


@pytest.mark.parametrize("name", ["stories260K", "llm-jp-v3.1", "gpt2", "qwen3"])
def test_split_utf8_is_held_back_never_replaced(name):
    t = tok(name)
    prompt = t.encode("吾輩は猫である。")
    gen = t.encode("名前は𠮷野家の🦀🍣👨‍👩‍👧、まだ無い。", add_special_tokens=False)
    pieces = [t.decode([i]) for i in gen]
    assert sum(R in p for p in pieces) >= 4  # characters really are split across tokens
    det = IncrementalDetokenizer(t, prompt, SamplingParams())
    for i in gen:
        det.update([i], False)
        assert R not in det.output_text
        assert R not in det.get_next_output_text(finished=False, delta=True)
    det.update([], False, finished=True)   # stories260K: the whole text is one byte run, shown when it ends
    assert det.output_text == reference(t, prompt, gen)
    assert det.output_text.strip() == "名前は𠮷野家の🦀🍣👨‍👩‍👧、まだ無い。"


def test_character_split_between_prompt_and_output():
    """A prompt that ends inside a character: its last bytes in the output alone are invalid, so the output
    shows U+FFFD for them, as decode(generated) and vLLM do."""
    t = tok("gpt2")
    ids = t.encode("吾輩は猫")  # 吾 = [28938, 122]
    prompt, gen = ids[:1], ids[1:]
    det, _, _ = stream(t, prompt, gen)
    assert det.output_text == decode(t, gen) == R + "輩は猫"


def test_byte_fallback_run_appears_when_it_ends():
    """A run of byte tokens decodes all or nothing (one invalid byte turns all of it into U+FFFD), so its text
    waits for the run to end: here the non-byte token "▁the"."""
    t = tok("stories260K")
    prompt = [1, 403, 407, 261, 378]  # "<s> Once upon a time"
    gen = [410] + byte_ids(t, "猫") + [265]
    assert t.convert_ids_to_tokens(gen) == ["▁", "<0xE7>", "<0x8C>", "<0xAB>", "▁the"]
    det = IncrementalDetokenizer(t, prompt, SamplingParams())
    seen = []
    for i in gen:
        det.update([i], False)
        seen.append((det.output_text, det.get_next_output_text(finished=False, delta=True)))
    assert seen == [(" ", " "), (" ", ""), (" ", ""), (" ", ""), (" 猫 the", "猫 the")]


def test_many_ids_in_one_update_still_hold_back_a_split_character():
    """More than MAX_PENDING_TOKENS ids at once, the last ones a split character: only that one waits."""
    t = tok("gpt2")
    gen = t.encode("吾輩は猫である。名前はまだ無い。")
    assert len(gen) == 24 and decode(t, gen[:21]).endswith(R)  # gen[20] is the first byte of 無
    det = IncrementalDetokenizer(t, [464], SamplingParams())
    det.update(gen[:21], False)
    assert det.output_text == "吾輩は猫である。名前はまだ"
    det.update(gen[21:], False)
    assert det.output_text == "吾輩は猫である。名前はまだ無い。"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("name", ALL)
def test_random_ids_match_decode(name, skip_special_tokens):
    """Random id sequences: any ids (specials and, with SentencePiece byte fallback, lone byte tokens that make
    invalid runs included) plus whole characters as byte runs. The text equals decode(ids) -- SentencePiece: bar
    the first token's kept leading space -- streamed one id at a time or in chunks, and nothing is held back at
    the end."""
    t = tok(name)
    rng = random.Random(f"{name}-{skip_special_tokens}")
    prompt, _ = split_clean(t, t.encode("Once upon a time, 吾輩は猫である。"), 6)
    specials = sorted(t.all_special_ids)
    vocab = [i for i in range(len(t)) if i not in specials]
    byte_token = re.compile(r"<0x[0-9A-F]{2}>")
    lone_bytes = [i for i, piece in zip(vocab, t.convert_ids_to_tokens(vocab)) if byte_token.fullmatch(piece)]
    assert (name in BYTE_LEVEL) == (not lone_bytes)
    chars = "猫犬あア𠮷é∑😀🦀🍣"
    for k in range(60):
        gen = []
        while len(gen) < 24:
            r = rng.random()
            if r < 0.1:
                gen.append(rng.choice(specials))
            elif r < 0.25 and name not in BYTE_LEVEL:
                gen += byte_ids(t, rng.choice(chars))
            elif r < 0.4 and lone_bytes:
                gen.append(rng.choice(lone_bytes))
            else:
                gen.append(rng.choice(vocab))
        kw = dict(skip_special_tokens=skip_special_tokens)
        chunks = None if k % 2 else [rng.randint(1, 6) for _ in range(len(gen))]
        det, deltas, _ = stream(t, prompt, gen, chunks=chunks, **kw)
        want = decode(t, gen, skip_special_tokens)
        assert det.output_text == "".join(deltas)
        if name in BYTE_LEVEL:
            assert det.output_text == want
        else:
            assert det.output_text in (want, " " + want), (gen, det.output_text, want)


def test_sentencepiece_first_token_keeps_its_space():
    t = tok("stories260K")
    prompt, gen = [1, 403, 407, 261, 378], [383, 286]  # "<s> Once upon a time" + "▁there", "▁was"
    det, _, _ = stream(t, prompt, gen)
    assert det.output_text == " there was"
    # HF's decode is not prefix-stable here: decode(gen) alone strips the first space.
    assert decode(t, gen) == "there was" and decode(t, prompt + gen) == "Once upon a time there was"
    # With only BOS before it there is nothing to separate from: same as decode(gen) (and vLLM).
    assert stream(t, [1], gen)[0].output_text == "there was"


def test_byte_fallback_invalid_run_is_replaced_whole_as_decode_shows_it():
    """HF decodes a run of byte tokens all or nothing: one invalid byte turns "猫" into U+FFFD x 3 as well. The
    run is held back until it is known, so the streamed text equals decode and nothing is taken back."""
    t = tok("stories260K")
    prompt, cat, the = [1, 403, 407, 261, 378], byte_ids(t, "猫"), [265]  # "▁the"
    bad = t.convert_tokens_to_ids(["<0x80>"])  # never valid on its own
    assert decode(t, cat) == "猫" and decode(t, cat + bad + the) == R * 4 + " the"  # not prefix-stable
    det, deltas, _ = stream(t, prompt, cat + bad + the)
    assert deltas == ["", "", "", R * 4, " the"] and det.output_text == R * 4 + " the"
    # Once a run is invalid, every later byte of it is one more final U+FFFD, shown at once.
    more = byte_ids(t, "A猫")
    det, deltas, _ = stream(t, prompt, cat + bad + more + the)
    assert deltas == ["", "", "", R * 4] + [R] * 4 + [" the"] and det.output_text == decode(t, cat + bad + more + the)


@pytest.mark.parametrize("name", ["stories260K", "llm-jp-v3.1"])
def test_byte_fallback_ascii_byte_inside_an_invalid_run(name):
    """An ASCII byte token inside an invalid run is U+FFFD too (decode's rule), not the letter; crafted ids."""
    t = tok(name)
    prompt = t.encode("Once upon a time")
    word = t.encode(" the", add_special_tokens=False)
    gen = byte_ids(t, "猫")[:1] + byte_ids(t, "A") + word     # <0xE7> <0x41>: invalid
    assert decode(t, gen).startswith(R * 2) and "A" not in decode(t, gen)
    for chunks in (None, [len(gen)], [2, len(gen) - 2]):
        det, deltas, _ = stream(t, prompt, gen, chunks=chunks)
        assert det.output_text == "".join(deltas) == reference(t, prompt, gen)
        assert det.output_text.lstrip(" ") == decode(t, gen).lstrip(" ")
    # A byte that can never start a character (0xFC) as the very last token is not lost.
    gen = word + byte_ids(t, "猫")[:2] + t.convert_tokens_to_ids(["<0xFC>"])
    det, deltas, _ = stream(t, prompt, gen)
    assert det.output_text == "".join(deltas) and det.output_text.endswith(R * 3)
    assert det.output_text.lstrip(" ") == decode(t, gen).lstrip(" ")
    # A run still valid but incomplete when the request ends shows as decode shows it.
    gen = word + byte_ids(t, "猫")[:2]
    det, deltas, _ = stream(t, prompt, gen)
    assert det.output_text == "".join(deltas) and det.output_text.lstrip(" ") == decode(t, gen).lstrip(" ")
    assert deltas[-1] == R * 2


@pytest.mark.parametrize("name", ["gpt2", "qwen3"])
def test_byte_level_final_invalid_or_split_byte_is_not_lost(name):
    t = tok(name)
    prompt = t.encode("Once upon a time")
    word = t.encode(" the", add_special_tokens=False)
    cat = t.encode("猫", add_special_tokens=False)
    fc = t.convert_tokens_to_ids(["ü"])    # the byte-level symbol of byte 0xFC: never valid UTF-8
    for gen in (word + fc, word + cat[:-1], word + fc * 30, word + fc * 30 + cat[:-1], word + fc + word):
        for chunks in (None, [len(gen)]):
            det, deltas, _ = stream(t, prompt, gen, chunks=chunks)
            assert det.output_text == "".join(deltas) == decode(t, gen), (gen, chunks)


def test_prompt_context_starts_on_a_character_boundary():
    """A stories260K Japanese prompt is all byte tokens; its last 5 ids start inside a character. A window
    starting there would turn the whole byte run, generated bytes included, into U+FFFD."""
    t = tok("stories260K")
    prompt = t.encode("吾輩は猫である")  # <s>, ▁, then 7 characters x 3 bytes
    assert len(prompt) == 23 and decode(t, prompt[-5:]).startswith(R)
    gen = byte_ids(t, "。名前")
    assert stream(t, prompt, gen)[0].output_text == "。名前" == decode(t, gen)


def test_long_invalid_byte_run_stays_bounded():
    t = tok("stories260K")
    lengths = []

    class Recording:  # a real tokenizer that records how many ids each decode() gets
        all_special_ids = t.all_special_ids
        added_tokens_decoder = t.added_tokens_decoder
        convert_tokens_to_ids = staticmethod(t.convert_tokens_to_ids)

        def decode(self, ids, **kw):
            lengths.append(len(ids))
            return t.decode(ids, **kw)

    gen = t.convert_tokens_to_ids(["<0x80>"]) * 100 + [265]  # 100 invalid bytes, then "▁the"
    det, deltas, _ = stream(Recording(), [1, 403, 407, 261, 378], gen)
    assert det.output_text == R * 100 + " the" == decode(t, gen)
    assert deltas[:100] == [R] * 100     # an invalid run is shown byte by byte
    assert max(lengths) <= 6 and len(lengths) <= 2 * len(gen) + 10
    # A long valid run (300 characters as bytes) is held back without decoding it at every step.
    lengths.clear()
    gen = byte_ids(t, "猫" * 300) + [265]
    det, deltas, _ = stream(Recording(), [1, 403, 407, 261, 378], gen)
    assert det.output_text == "猫" * 300 + " the" and deltas[-1] == det.output_text and len(lengths) <= 10


def test_long_run_of_skipped_special_tokens():
    """ignore_eos: 100 EOS between two words add no text and no window; the space before "▁was" survives."""
    t = tok("stories260K")
    gen = [383] + [2] * 100 + [286]  # "▁there", </s> x 100, "▁was"
    det, _, _ = stream(t, [1, 403, 407, 261, 378], gen, ignore_eos=True)
    assert det.output_text == " there was" and len(det._window) <= 3
    det, _, _ = stream(t, [1, 403, 407, 261, 378], gen, ignore_eos=True, skip_special_tokens=False)
    assert det.output_text == " there" + "</s>" * 100 + " was"


def test_decode_window_is_o_new_tokens():
    t = tok("gpt2")
    lengths, kwargs = [], []

    class Recording:
        all_special_ids = t.all_special_ids

        def decode(self, ids, **kw):
            lengths.append(len(ids))
            kwargs.append(kw)
            return t.decode(ids, **kw)

    prompt, gen = split_clean(t, t.encode(JA), 100)
    det, _, _ = stream(Recording(), prompt, gen)
    assert det.output_text == decode(t, gen) and len(gen) > 2000
    assert max(lengths) <= 8 and len(lengths) <= 2 * len(gen) + 2  # a few ids, at most 2 decodes per id
    assert kwargs[0] == dict(skip_special_tokens=True, clean_up_tokenization_spaces=False)


# -- special tokens ---------------------------------------------------------------------------------


@pytest.mark.parametrize("spaces", [True, False])
def test_skip_special_tokens_and_spaces_between_special_tokens(spaces):
    t = tok("qwen3")
    gen = t.encode("<|im_start|>assistant\nHi there<|im_end|><|endoftext|><|im_start|>")
    for skip, want in [(True, "assistant\nHi there"),
                       (False, "<|im_start|>assistant\nHi there<|im_end|><|endoftext|><|im_start|>")]:
        kw = dict(skip_special_tokens=skip, spaces_between_special_tokens=spaces)
        assert stream(t, [9707], gen, **kw)[0].output_text == want
        # HF's fast tokenizers put no space between special tokens, whatever the flag (vLLM v1 likewise).
        assert t.decode(gen, **kw) == want
    t = tok("llm-jp-v3.1")
    gen = [2, 1, 22564, 2]  # </s> <s> ▁Hello </s>
    assert stream(t, [1, 5721], gen, skip_special_tokens=False)[0].output_text == "</s><s> Hello</s>"
    assert stream(t, [1, 5721], gen, skip_special_tokens=True)[0].output_text == " Hello"


def test_spaces_between_special_tokens_reaches_a_slow_tokenizer():
    """transformers 4.x slow tokenizers declare the flag in _decode (and join added tokens with spaces);
    it is forwarded to those only, since fast tokenizers ignore it and MistralCommonBackend rejects it."""
    t = tok("qwen3")
    seen = []

    class Slow:  # a real tokenizer behind the slow-tokenizer _decode signature
        all_special_ids = t.all_special_ids

        def _decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=None,
                    spaces_between_special_tokens=True):
            seen.append(spaces_between_special_tokens)
            return t.decode(ids, skip_special_tokens=skip_special_tokens)

        def decode(self, ids, **kw):
            return self._decode(ids, **kw)

    gen = t.encode("<|im_start|>Hi<|im_end|>")
    for spaces in (True, False):
        det, _, _ = stream(Slow(), [9707], gen, skip_special_tokens=False, spaces_between_special_tokens=spaces)
        assert det.output_text == "<|im_start|>Hi<|im_end|>" and set(seen) == {spaces}
        seen.clear()


def test_stop_token_text_follows_vllm():
    """stop_terminated: the final id (EOS or a stop_token_id) stays in token_ids, its text is added only
    with include_stop_str_in_output (and then only if decode shows it)."""
    t = tok("stories260K")
    prompt, gen = [1, 403, 407, 261, 378], [383, 286, 2]  # ... "▁there", "▁was", "</s>"
    cases = [
        (dict(), " there was"),
        (dict(skip_special_tokens=False), " there was"),
        (dict(skip_special_tokens=False, include_stop_str_in_output=True), " there was</s>"),
        (dict(include_stop_str_in_output=True), " there was"),  # EOS is special: skipped anyway
    ]
    for kw, want in cases:
        det, _, matched = stream(t, prompt, gen, stop_terminated=True, **kw)
        assert (det.output_text, det.token_ids, matched) == (want, gen, None)
    # A non-special stop token id (gpt2 "." = 13) is dropped from the text the same way.
    g = tok("gpt2")
    gen = [15496, 995, 13]  # "Hello", " world", "."
    det, _, _ = stream(g, [464], gen, stop_terminated=True, stop_token_ids=[13])
    assert det.output_text == "Hello world" and det.token_ids == gen
    det, _, _ = stream(g, [464], gen, stop_terminated=True, stop_token_ids=[13], include_stop_str_in_output=True)
    assert det.output_text == "Hello world."
    # An EOS that did not end the request (ignore_eos) is ordinary text when specials are kept.
    det, _, _ = stream(g, [464], [15496, 50256, 995], skip_special_tokens=False, ignore_eos=True)
    assert det.output_text == "Hello<|endoftext|> world"
    assert stream(g, [464], [15496, 50256, 995], ignore_eos=True)[0].output_text == "Hello world"


# -- stop strings -----------------------------------------------------------------------------------

FOX = [383, 2068, 7586, 21831, 18045, 625, 262, 16931, 3290, 13]  # gpt2 " The quick brown fox jumps over the lazy dog."


def test_stop_string_starts_mid_token_and_spans_tokens_english():
    t = tok("gpt2")
    det = IncrementalDetokenizer(t, [464], SamplingParams(stop=["ick brown f"]))
    assert [det.update([i], False) for i in FOX[:3]] == [None, None, None]
    assert det.update([FOX[3]], False) == "ick brown f"  # " fox" completes it
    assert det.output_text == " The qu" and det.get_next_output_text(finished=True, delta=False) == " The qu"
    det, _, matched = stream(t, [464], FOX, stop=["ick brown f"], include_stop_str_in_output=True)
    assert (det.output_text, matched) == (" The quick brown f", "ick brown f")  # "ox" after it is dropped


@pytest.mark.parametrize("name, want", [("llm-jp-v3.1", "猫で"), ("qwen3", "猫で"), ("stories260K", "猫で"),
                                        ("gpt2", "猫で")])
def test_stop_string_japanese_mid_token(name, want):
    t = tok(name)
    full = t.encode("吾輩は猫である。名前はまだ無い。")
    prompt, gen = split_clean(t, full, len(t.encode("吾輩は")))
    assert decode(t, gen) == "猫である。名前はまだ無い。"
    stop = "ある。名前はま"
    if name in ("llm-jp-v3.1", "qwen3"):  # the stop string starts and ends inside tokens ("である", "まだ")
        boundaries = {len(decode(t, gen[:k])) for k in range(len(gen) + 1)}
        start = decode(t, gen).index(stop)
        assert start not in boundaries and start + len(stop) not in boundaries
    det, deltas, matched = stream(t, prompt, gen, stop=["無い", stop])
    assert (det.output_text, matched, "".join(deltas)) == (want, stop, want)
    det, _, matched = stream(t, prompt, gen, stop=[stop], include_stop_str_in_output=True)
    assert det.output_text == "猫である。名前はま"


def test_several_stop_strings_earliest_match_wins():
    t = tok("gpt2")
    # All ids in one update (speculative decoding): the match that ends first wins, not the first listed.
    for stop, want, want_match in [
        (["lazy", "brown fox", "quick"], " The ", "quick"),
        (["n fox", "brown fox"], " The quick brow", "n fox"),  # same end: list order
        (["brown fox", "n fox"], " The quick ", "brown fox"),
    ]:
        for chunks in ([len(FOX)], None):  # all at once, one at a time
            det, _, matched = stream(t, [464], FOX, chunks=chunks, stop=stop)
            assert (det.output_text, matched) == (want, want_match)


def test_stop_string_in_the_very_first_token():
    t = tok("gpt2")
    det = IncrementalDetokenizer(t, [464], SamplingParams(stop=["ell"]))
    assert det.update([15496], False) == "ell" and det.output_text == "H"  # "Hello"
    det = IncrementalDetokenizer(t, [464], SamplingParams(stop=["Hello"], include_stop_str_in_output=True))
    assert det.update([15496, 995], False) == "Hello" and det.output_text == "Hello"
    det = IncrementalDetokenizer(t, [464], SamplingParams(stop=["Hello"]))
    assert det.update([15496], False) == "Hello" and det.output_text == ""
    assert det.get_next_output_text(finished=True, delta=True) == ""


def test_streamed_text_never_shows_a_partial_stop_string():
    t = tok("gpt2")
    det = IncrementalDetokenizer(t, [464], SamplingParams(stop=["lazy cat"]))  # 8 chars: 7 held back
    shown = []
    for i in FOX[:8]:
        assert det.update([i], False) is None
        shown.append(det.get_next_output_text(finished=False, delta=True))
    assert det.output_text == " The quick brown fox jumps over the lazy"
    assert det.get_next_output_text(finished=False, delta=False) == " The quick brown fox jumps over t"
    assert "".join(shown) == " The quick brown fox jumps over t"
    det.update(FOX[8:], False)  # " dog."
    assert det.get_next_output_text(finished=True, delta=True) == "he lazy dog."
    assert det.get_next_output_text(finished=True, delta=True) == ""
    # include_stop_str_in_output holds nothing back.
    det = IncrementalDetokenizer(t, [464], SamplingParams(stop=["lazy cat"], include_stop_str_in_output=True))
    det.update(FOX[:2], False)
    assert det.get_next_output_text(finished=False, delta=False) == " The quick"


def test_min_tokens_text_is_not_searched():
    t = tok("gpt2")
    det, _, matched = stream(t, [464], FOX, stop=["quick", "over"], min_tokens=3)
    assert (det.output_text, matched) == (" The quick brown fox jumps ", "over")
    # A stop string that ends after the first min_tokens tokens still matches.
    det, _, matched = stream(t, [464], FOX, stop=["brown fox"], min_tokens=3)
    assert (det.output_text, matched) == (" The quick ", "brown fox")
    det, _, matched = stream(t, [464], FOX, chunks=[10], stop=["quick", "over"], min_tokens=3)
    assert (det.output_text, matched) == (" The quick brown fox jumps ", "over")


# -- no detokenization ------------------------------------------------------------------------------


def test_detokenize_false_or_no_tokenizer_only_collects_ids():
    for t, params in [(tok("gpt2"), SamplingParams(detokenize=False)), (None, SamplingParams())]:
        det = IncrementalDetokenizer(t, [464], params)
        assert det.update(FOX[:3], False) is None and det.update([13], True) is None
        assert det.token_ids == FOX[:3] + [13] and det.output_text == ""
        assert det.get_next_output_text(finished=True, delta=False) == ""
    with pytest.raises(HayabusaValidationError) as e:
        IncrementalDetokenizer(tok("gpt2"), [464], SamplingParams(stop=["x"], detokenize=False))
    assert e.value.parameter == "stop"
    with pytest.raises(HayabusaValidationError):
        IncrementalDetokenizer(None, [464], SamplingParams(stop=["x"]))


def test_bulk_update_ending_in_a_split_character_keeps_the_complete_text():
    """LLM.generate detokenizes the whole output at once: a last token that leaves a character incomplete must
    cost only that character, not the whole text."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ASSETS / "tokenizers" / "qwen3"))
    text = "吾輩は猫である🐈‍⬛鰻丼"
    ids = tok(text).input_ids
    # find a prefix of ids whose decode ends inside a character
    cut = next(k for k in range(2, len(ids) + 1) if tok.decode(ids[:k]).endswith("\ufffd"))
    det = IncrementalDetokenizer(tok, [], SamplingParams(max_tokens=64))
    det.update(ids[:cut], stop_terminated=False)
    want = tok.decode(ids[:cut]).rstrip("\ufffd")
    assert want and det.get_next_output_text(finished=False, delta=False) == want
    # When the request ends there, the final text is decode's, U+FFFD included.
    assert det.get_next_output_text(finished=True, delta=False) == tok.decode(ids[:cut])


@pytest.mark.parametrize("name", ["stories260K", "llm-jp-v3.1"])
@pytest.mark.parametrize("include", [False, True])
def test_many_stop_strings_match_as_the_per_string_loop(monkeypatch, name, include):
    """More than _STOP_MATCHER_MIN stop strings take a compiled alternation as a filter first; the stop matched, the
    text kept and where the stream stops equal the per-string loop alone, over random stop lists drawn from the text
    (present ones, some overlapping, and absent ones) fed one id at a time and in chunks."""
    import random

    import hayabusa.engine.detokenizer as dmod

    t = tok(name)
    body = text("wagahaiwa_nekodearu.plain.txt" if name.startswith("llm-jp") else "botchan.plain.txt", 2000, 600)
    ids = t.encode(body, add_special_tokens=False)
    prompt, gen = ids[:8], ids[8:160]
    out = reference(t, prompt, gen)
    rng = random.Random(7)
    matched_any, filtered = 0, dmod._STOP_MATCHER_MIN
    for trial in range(12):
        stops = [out[i:i + rng.randint(1, 6)] for i in rng.sample(range(20, len(out) - 6), 6)]
        stops += ["\u2603zz", "qqqq", "\u3042\u3044\u3046\u3048\u304a" * 2]   # absent
        rng.shuffle(stops)
        chunks = None if trial % 2 == 0 else [rng.randint(1, 5) for _ in range(len(gen))]
        results = []
        for threshold in (filtered, 10 ** 9):   # the filter on, then the loop alone
            monkeypatch.setattr(dmod, "_STOP_MATCHER_MIN", threshold)
            det, deltas, matched = stream(t, prompt, gen, chunks=chunks, stop=stops,
                                          include_stop_str_in_output=include)
            assert (det._stop_any is not None) == (threshold == filtered)
            results.append((matched, det.output_text, "".join(deltas), len(det.token_ids)))
        assert results[0] == results[1], (trial, stops)
        matched_any += results[0][0] is not None
    assert matched_any >= 6   # the lists drawn from the text do stop it
