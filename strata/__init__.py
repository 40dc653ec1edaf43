"""Strata: Mixture-of-Experts language models on GPUs smaller than the model.

    import strata
    llm = strata.LLM()                       # the built-in demo model
    print(llm.generate("def fib(n):", max_tokens=32).text)

Importing strata never touches CUDA; the GPU is opened when a model is loaded on it.
"""
from .config import EngineConfig, ModelArgs, SamplingParams
from .errors import (DeviceError, FormatError, InvalidArgument, PackError, StrataError,
                     UnsupportedError)

__version__ = "0.1.0"

__all__ = ["LLM", "convert", "EngineConfig", "ModelArgs", "SamplingParams", "StrataError", "InvalidArgument",
           "FormatError", "UnsupportedError", "PackError", "DeviceError", "__version__"]


def __getattr__(name):
    # Heavy modules load on first use, so `import strata` stays quick.
    if name == "LLM":
        from .engine.llm import LLM
        return LLM
    if name == "convert":
        from .pack import convert
        return convert
    raise AttributeError(f"module 'strata' has no attribute {name!r}")
