"""attnmt: the Transformer of "Attention Is All You Need", as a command-line NMT toolkit and a Python API.

``from attnmt import Translator`` (``attnmt.api``) loads a trained model once and translates lists of sentences.
"""

__version__ = "0.1.0"

__all__ = ["Translator", "Translation", "ReferenceScore", "Alignment", "UserError"]


def __getattr__(name: str):
    # the API's names, imported on first use so that ``import attnmt`` stays light (no torch)
    if name in ("Translator", "Translation", "ReferenceScore", "Alignment"):
        from attnmt import api

        return getattr(api, name)
    if name == "UserError":
        from attnmt.errors import UserError

        return UserError
    raise AttributeError(f"module 'attnmt' has no attribute {name!r}")
