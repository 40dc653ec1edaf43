"""One module per architecture; `build` picks the model class for a pack's ModelArgs."""
from __future__ import annotations

from ..config import ModelArgs


def build(args: ModelArgs, ops, first: bool = True, last: bool = True):
    """The model of args.architecture over these ops. first/last: whether this is the first and the
    last stage of a layer split (strata.engine.layer_split): a later stage takes its input rows from
    ops.hand_in, an earlier one ends without the head (Qwen3Moe.forward)."""
    if args.architecture == "qwen3next":
        from .qwen3next import Qwen3Next
        return Qwen3Next(args, ops, first, last)
    from .qwen3moe import Qwen3Moe
    return Qwen3Moe(args, ops, first, last)
