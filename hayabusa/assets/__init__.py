"""Files shipped with hayabusa: the demo model that ``hayabusa generate`` and ``hayabusa eval`` use when no
``--model`` is given."""

from importlib import resources


def demo_model_dir() -> str:
    """The bundled demo model: Karpathy's stories260K (Llama, 260K parameters, MIT)."""
    return str(resources.files("hayabusa") / "assets" / "stories260K")
