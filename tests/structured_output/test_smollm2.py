"""SmolLM2-135M-Instruct extracts the bundled receipt's fields under the bundled schema: parseable, schema-valid
JSON (slow tier; the weights come as in tests/models/test_smollm2.py, else the test skips and says why)."""

from __future__ import annotations

import json

import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

from hayabusa import LLM, SamplingParams  # noqa: E402
from hayabusa.sampling_params import StructuredOutputsParams  # noqa: E402
from hayabusa.structured_output.schemas import load_schema, sample_document  # noqa: E402
from tests.models.test_smollm2 import smollm2_dir  # noqa: E402,F401  (the fixture)

pytestmark = pytest.mark.slow


def test_receipt_extraction_gives_schema_valid_json(smollm2_dir):  # noqa: F811
    schema = load_schema("receipt")
    llm = LLM(smollm2_dir, max_num_seqs=4, max_model_len=2048)
    messages = [{"role": "user", "content": "Extract merchant, date (YYYY-MM-DD), currency, total and items "
                                            "(name, price) from this receipt as JSON.\n\n" + sample_document()}]
    constrained = SamplingParams(temperature=0, max_tokens=400,
                                 structured_outputs=StructuredOutputsParams(json=schema))
    sampled = constrained.clone(temperature=0.7, seed=1, n=2)
    outs = llm.chat([messages, messages], [constrained, sampled], use_tqdm=False)
    texts = [c.text for o in outs for c in o.outputs]
    for o in outs:
        assert all(c.finish_reason == "stop" for c in o.outputs), o
    records = [json.loads(t) for t in texts]
    for r in records:
        jsonschema.validate(r, schema)
    greedy = records[0]
    assert greedy["currency"] == "USD" and greedy["date"] == "2024-03-15", greedy
