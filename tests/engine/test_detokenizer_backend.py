"""The detokenizer calls a fast tokenizer's backend (``tokenizers.Tokenizer.decode``) directly instead of
transformers' ``decode``; the text must be the same for every test tokenizer, with and without special tokens."""

from __future__ import annotations

import random

import pytest

from hayabusa.engine.detokenizer import _backend_decode
from tests.conftest import STORIES, TOKENIZERS

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("path", [TOKENIZERS / "gpt2", TOKENIZERS / "llm-jp-v3.1", TOKENIZERS / "qwen3", STORIES])
def test_backend_decode_gives_the_text_of_tokenizer_decode(path):
    if not path.exists():
        pytest.skip(f"{path} is missing (HAYABUSA_ASSETS)")
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    backend = _backend_decode(tok)
    assert backend is not None, f"{type(tok).__name__} should take the backend path"
    rng = random.Random(0)
    special = sorted(tok.all_special_ids)
    for _ in range(500):
        ids = [rng.choice(special) if special and rng.random() < 0.1 else rng.randrange(len(tok))
               for _ in range(rng.randint(1, 12))]
        for skip in (True, False):
            assert backend(ids, skip_special_tokens=skip) == tok.decode(
                ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False), (ids, skip)


def test_a_tokenizer_with_its_own_decode_keeps_it():
    class Custom:
        _tokenizer = object()

        def decode(self, ids, **kw):
            return "custom"

    assert _backend_decode(Custom()) is None
