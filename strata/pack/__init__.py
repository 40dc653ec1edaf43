"""Packs: Strata's model format (pack.json, dense.bin, experts.bin, tokenizer.json), its reader, and the
converters from GGUF and Hugging Face checkpoints. docs/DESIGN.md describes the format."""
from .cache import resolve_model
from .converter import convert
from .format import Pack, open_pack
from .info import info_text

__all__ = ["Pack", "open_pack", "convert", "resolve_model", "info_text"]
