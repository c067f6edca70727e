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


def qwen2_vl_chat_template() -> str:
    """Qwen2-VL's (and Qwen2.5-VL's) chat template: ``{"type": "image"}`` content parts become
    ``<|vision_start|><|image_pad|><|vision_end|>``. Written by ``hayabusa bench --make-model qwen2.5-vl-*``."""
    return (resources.files("hayabusa") / "assets" / "qwen2_vl_chat_template.jinja").read_text(encoding="utf-8")
