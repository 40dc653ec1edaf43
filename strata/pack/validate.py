"""pack.json checked in full when a pack is opened, so a damaged pack fails at load, never mid-request.

pack.json carries no checksum of its own, so every number in it is checked against what the format
rules and ModelArgs imply: the tensor table is exactly the one the model needs (names, quant types,
shapes, byte counts), every offset and stride is the one `format.layout` gives for that table (so
nothing overlaps, nothing is misaligned, nothing reads outside dense.bin or experts.bin), and the
model numbers are usable. The data files' own sizes and sha256 are checked after this, by
format.verify_files.
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from ..config import ModelArgs
from ..errors import InvalidArgument, PackError
from ..quant import QTYPES, tensor_bytes
from .checks import is_int, is_number, model_args_problem, rope_scaling_problem
from .source import EXPERT_PARTS, NEXTN_OPTIONAL, dense_shapes, expert_shapes

# The layout rules format.layout writes by and this module checks by. They live here, not in
# format.py, because format.py reads packs through check_meta: this module may not import it back.
DENSE_ALIGN = 256
BLOB_ALIGN = 4096
DATA_FILES = ("dense.bin", "experts.bin", "tokenizer.json")


def round_up(n: int, align: int) -> int:
    return -(-n // align) * align


_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_FIELD_KINDS = {int: is_int, float: is_number, bool: lambda v: isinstance(v, bool), str: lambda v: isinstance(v, str)}


class _Bad(Exception):
    """One problem, as a sentence; check_meta prefixes the file."""


def _dict(v, what: str) -> dict:
    if not isinstance(v, dict):
        raise _Bad(f"{what} is not an object")
    return v


def _count(v, what: str) -> int:
    if not is_int(v) or v < 0:
        raise _Bad(f"{what} = {v!r:.80} is not an integer >= 0")
    return v


def _model_args(d) -> ModelArgs:
    d = _dict(d, "model_args")
    problem = rope_scaling_problem(d.get("rope_scaling"))    # before ModelArgs, which reads it as a dict
    if problem:
        raise _Bad(f"model_args: {problem}")
    for f in dataclasses.fields(ModelArgs):
        if f.name not in d:
            if f.default is dataclasses.MISSING:
                raise _Bad(f"model_args.{f.name} is missing")
            continue
        name = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
        kind = {"int": int, "float": float, "bool": bool, "str": str}.get(name)
        if kind is not None and not _FIELD_KINDS[kind](d[f.name]):
            raise _Bad(f"model_args.{f.name} = {d[f.name]!r:.80} is not a{'n' if kind is int else ''} "
                       f"{'finite number' if kind is float else kind.__name__}")
    try:
        args = ModelArgs.from_dict(d)
    except (TypeError, InvalidArgument) as e:
        raise _Bad(f"bad model_args ({e})") from None
    problem = model_args_problem(args)
    if problem:
        raise _Bad(f"model_args: {problem}")
    return args


def _files(files) -> dict:
    files = _dict(files, "files")
    for name in DATA_FILES:
        if name not in files:
            raise _Bad(f"no entry for {name} in 'files'")
    for name, entry in files.items():
        if not isinstance(name, str) or name not in DATA_FILES:
            raise _Bad(f"files: unexpected entry {name!r:.80}")
        entry = _dict(entry, f"files.{name}")
        _count(entry.get("bytes"), f"files.{name}.bytes")
        if not isinstance(entry.get("sha256"), str) or not _SHA256.match(entry["sha256"]):
            raise _Bad(f"files.{name}.sha256 is not a sha256 hex digest")
    return files


def _tokenizer(tok, vocab_size: int) -> None:
    tok = _dict(tok, "tokenizer")
    if tok.get("file", "tokenizer.json") != "tokenizer.json":
        raise _Bad(f"tokenizer.file = {tok['file']!r:.80}; a pack's tokenizer is tokenizer.json")
    ids = [("bos_token_id", tok.get("bos_token_id")), ("pad_token_id", tok.get("pad_token_id"))]
    eos = tok.get("eos_token_ids", [])
    if not isinstance(eos, list):
        raise _Bad("tokenizer.eos_token_ids is not a list")
    ids += [("eos_token_ids", v) for v in eos]
    fim = tok.get("fim_token_ids")
    if fim is not None and (not isinstance(fim, list) or len(fim) != 3):
        raise _Bad("tokenizer.fim_token_ids is not a list of three token ids (prefix, suffix, middle)")
    ids += [("fim_token_ids", v) for v in fim or ()]
    for key, v in ids:
        if (v is not None or key in ("eos_token_ids", "fim_token_ids")) and (not is_int(v) or not 0 <= v < vocab_size):
            raise _Bad(f"tokenizer.{key}: {v!r:.80} is not a token id below the vocabulary size {vocab_size}")
    if not isinstance(tok.get("add_bos_token", False), bool):
        raise _Bad("tokenizer.add_bos_token is not true or false")
    if tok.get("chat_template") is not None and not isinstance(tok["chat_template"], str):
        raise _Bad("tokenizer.chat_template is not a string")


def _tensor(entry, what: str, shape: tuple, offset: int) -> int:
    """Check one table entry {qtype, shape, offset, nbytes} against its expected shape and offset; -> nbytes."""
    entry = _dict(entry, what)
    qtype = entry.get("qtype")
    if not isinstance(qtype, str) or qtype not in QTYPES:
        raise _Bad(f"{what}: quant type {qtype!r:.80} is not one of {', '.join(QTYPES)}")
    got = entry.get("shape")
    if not isinstance(got, list) or not all(is_int(d) for d in got) or tuple(got) != shape:
        raise _Bad(f"{what}: shape {got!r:.80}, model_args imply {list(shape)}")
    try:
        nbytes = tensor_bytes(qtype, shape)
    except Exception:
        raise _Bad(f"{what}: rows of {shape[-1]} are not whole {qtype} blocks") from None
    if entry.get("nbytes") != nbytes or not is_int(entry.get("nbytes")):
        raise _Bad(f"{what}: nbytes {entry.get('nbytes')!r:.80}, {qtype} {list(shape)} takes {nbytes}")
    if entry.get("offset") != offset or not is_int(entry.get("offset")):
        raise _Bad(f"{what}: offset {entry.get('offset')!r:.80}, the pack layout puts it at {offset}")
    return nbytes


def _dense(table, args: ModelArgs, file_bytes: int) -> None:
    table = _dict(table, "dense")
    shapes = dense_shapes(args)
    optional = f"blk.{args.num_hidden_layers}.{NEXTN_OPTIONAL}.weight"
    if args.num_mtp_layers and optional in table:
        shapes[optional] = (args.hidden_size,)
    missing = [n for n in shapes if n not in table]
    extra = [n for n in table if n not in shapes]
    if missing or extra:
        raise _Bad("dense: " + (f"missing {', '.join(missing[:3])}" if missing else f"unexpected {extra[0]!r:.80}")
                   + f" for a model of {args.num_hidden_layers} layers")
    end = 0
    for name, entry in table.items():        # offsets follow the table's order, as layout() writes them
        offset = round_up(end, DENSE_ALIGN)
        end = offset + _tensor(entry, f"dense tensor {name}", shapes[name], offset)
    if end != file_bytes:
        raise _Bad(f"dense: the table ends at byte {end}, files says dense.bin has {file_bytes}")


def _experts(experts, args: ModelArgs, file_bytes: int) -> int:
    layers = _dict(experts, "experts").get("layers")
    num = args.num_hidden_layers + args.num_mtp_layers
    if not isinstance(layers, list) or len(layers) != num:
        raise _Bad(f"experts.layers is not a list of {num} layers")
    shapes, end, max_blob = expert_shapes(args), 0, 0
    for i, lay in enumerate(layers):
        what = f"experts.layers[{i}]"
        lay = _dict(lay, what)
        if lay.get("layer") != i or not is_int(lay.get("layer")):
            raise _Bad(f"{what}.layer = {lay.get('layer')!r:.80}, expected {i}")
        parts = _dict(lay.get("parts"), f"{what}.parts")
        if list(parts) != list(EXPERT_PARTS):
            raise _Bad(f"{what}.parts are {list(parts)!r:.80}, expected {list(EXPERT_PARTS)}")
        blob = 0
        for p in EXPERT_PARTS:
            blob += _tensor(parts[p], f"{what}.parts.{p}", shapes[p], blob)
        offset, stride = round_up(end, BLOB_ALIGN), round_up(blob, BLOB_ALIGN)
        for key, want in (("blob_bytes", blob), ("stride", stride), ("offset", offset)):
            if lay.get(key) != want or not is_int(lay.get(key)):
                raise _Bad(f"{what}.{key} = {lay.get(key)!r:.80}, the pack layout gives {want}")
        end, max_blob = offset + args.num_experts * stride, max(max_blob, blob)
    if end != file_bytes:
        raise _Bad(f"experts: the layers end at byte {end}, files says experts.bin has {file_bytes}")
    return max_blob


def check_meta(meta_path: Path, meta: dict) -> ModelArgs:
    """PackError (one line, naming pack.json and the field) unless every entry of pack.json is usable."""
    try:
        files = _files(meta["files"])
        args = _model_args(meta["model_args"])
        _tokenizer(meta["tokenizer"], args.vocab_size)
        # experts first: its list's length bounds the layer count before dense_shapes builds names by it
        max_blob = _experts(meta["experts"], args, files["experts.bin"]["bytes"])
        _dense(meta["dense"], args, files["dense.bin"]["bytes"])
        if meta["max_blob"] != max_blob or not is_int(meta["max_blob"]):
            raise _Bad(f"max_blob = {meta['max_blob']!r:.80}, the largest expert blob is {max_blob} bytes")
        if not isinstance(meta.get("source", {}), dict):
            raise _Bad("source is not an object")
    except _Bad as e:
        raise PackError(f"{meta_path}: {e}") from None
    return args
