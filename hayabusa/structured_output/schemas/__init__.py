"""Bundled JSON schemas (and a sample document) for structured outputs: the extraction schema that `hayabusa bench
--structured-output json` adds to every request, and a receipt the SmolLM2 test extracts fields from."""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def load_schema(name: str = "receipt") -> dict:
    """A bundled schema by name (``receipt``)."""
    return json.loads((HERE / f"{name}.schema.json").read_text())


def sample_document(name: str = "receipt") -> str:
    """A bundled document to extract fields from (``receipt``)."""
    return (HERE / f"{name}.txt").read_text()
