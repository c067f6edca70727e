"""A rinna-style checkpoint: a SentencePiece ``tokenizer.model`` read as ``T5Tokenizer``. transformers converts it
to a fast tokenizer through protobuf (a hayabusa dependency); without it the load fails with a misleading
"tiktoken is required" message."""

from __future__ import annotations

import json
import shutil

from hayabusa.engine.llm_engine import load_tokenizer
from tests.conftest import TOKENIZERS, require_asset


def test_sentencepiece_t5_tokenizer_loads(tmp_path):
    import google.protobuf  # noqa: F401  -- the dependency this test is about
    import sentencepiece

    model = require_asset(TOKENIZERS / "llm-jp-v2.2" / "tokenizer.model")   # a unigram model, as rinna's
    shutil.copy(model, tmp_path / "tokenizer.model")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "T5Tokenizer", "extra_ids": 0}))
    tok = load_tokenizer(str(tmp_path), trust_remote_code=False)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(model))
    text = "吾輩は猫である。Once upon a time, Lily saw a cat."
    assert tok(text, add_special_tokens=False).input_ids == sp.encode(text)
    assert tok(text).input_ids[-1] == tok.eos_token_id        # T5's </s> appended
