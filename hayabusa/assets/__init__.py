"""Files shipped with hayabusa: the demo model that ``hayabusa generate`` and ``hayabusa eval`` use when no
``--model`` is given."""

from importlib import resources


def demo_model_dir() -> str:
    """The bundled demo model: Karpathy's stories260K (Llama, 260K parameters, MIT)."""
    return str(resources.files("hayabusa") / "assets" / "stories260K")


def receipts_data_path() -> str:
    """A small receipts-to-JSON extraction set (5 items, English and Japanese OCR-like text, gold merchant / date /
    currency / total) in ``hayabusa eval``'s JSONL format, phrased for text-to-text models such as T5
    (``hayabusa eval --data receipts``)."""
    return str(resources.files("hayabusa") / "assets" / "receipts_t5.jsonl")
