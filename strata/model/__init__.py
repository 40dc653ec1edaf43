"""One module per architecture; `build` picks the model class for a pack's ModelArgs."""
from __future__ import annotations

from ..config import ModelArgs


def build(args: ModelArgs, ops):
    """The model of args.architecture over these ops."""
    if args.architecture == "qwen3next":
        from .qwen3next import Qwen3Next
        return Qwen3Next(args, ops)
    from .qwen3moe import Qwen3Moe
    return Qwen3Moe(args, ops)
