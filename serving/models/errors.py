"""The errors of finding, converting and loading a model, shared by the resolver, the GGUF converter and
the loaders (kept apart so that each of them can raise them without importing the others)."""

from __future__ import annotations


class ModelLoadError(RuntimeError):
    """A model could not be found, converted or loaded; the message says which and what to do."""


class ModelNotFoundError(ModelLoadError):
    """The model string names nothing this machine has or can fetch."""


class WeightsMismatchError(ModelLoadError):
    """A checkpoint's tensor names or shapes differ from the model's; nothing was loaded."""
