"""`python -m strata info MODEL`: what a pack (or a GGUF / HF source, read without converting) holds."""
from __future__ import annotations

from pathlib import Path

from ..config import ModelArgs
from .format import layout, read_meta
from .progress import human_bytes


def _ranges(layers: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'."""
    out, start = [], None
    for i, l in enumerate(layers):
        if start is None:
            start = l
        if i + 1 == len(layers) or layers[i + 1] != l + 1:
            out.append(f"{start}-{l}" if l != start else f"{l}")
            start = None
    return ", ".join(out)


def _runs(by_layer: dict[int, object]) -> str:
    """{layer: value} -> 'A (layers 0-3, 9-47), B (layers 4-8)', values in order of first appearance."""
    groups: dict[object, list[int]] = {}
    for layer in sorted(by_layer):
        groups.setdefault(by_layer[layer], []).append(layer)
    return ", ".join(f"{v} (layer{'s' if len(ls) > 1 else ''} {_ranges(ls)})" for v, ls in groups.items())


def _load(model: Path) -> tuple[str, dict, dict]:
    """(description, meta with dense/experts/max_blob/tokenizer/model_args, data file sizes)."""
    if model.is_dir() and (model / "pack.json").exists():
        meta = read_meta(model)
        return "pack", meta, {n: f["bytes"] for n, f in meta["files"].items() if n != "tokenizer.json"}
    from .converter import open_source
    source = open_source(model)
    try:
        plan = layout(source.dense, source.experts, source.args.num_experts)
        sizes = plan.pop("_sizes")
        meta = {**plan, "model_args": source.args.to_dict(), "tokenizer": source.tokenizer_meta}
        what = ("GGUF" + (f", {len(source.paths)} split files" if len(source.paths) > 1 else "")
                if source.kind == "gguf" else "Hugging Face checkpoint")
        return f"{what}, read without converting", meta, sizes
    finally:
        source.close()


def _args_lines(a: ModelArgs) -> list[str]:
    mtp = f" (+1 MTP draft layer, index {a.num_hidden_layers})" if a.num_mtp_layers else ""
    scaling = (a.rope_scaling or {}).get("rope_type", (a.rope_scaling or {}).get("type")) or "none"
    return [f"architecture: {a.architecture}",
            f"  layers {a.num_hidden_layers}{mtp}, hidden {a.hidden_size}, vocab {a.vocab_size}, "
            f"context {a.max_position_embeddings}, tied embeddings: {'yes' if a.tie_word_embeddings else 'no'}",
            f"  attention: {a.num_attention_heads} query heads, {a.num_key_value_heads} KV heads, head dim "
            f"{a.head_dim}, rope theta {a.rope_theta:g} (scaling: {scaling}), rms eps {a.rms_norm_eps:g}",
            f"  experts: {a.num_experts}, top-{a.num_experts_per_tok}"
            f"{' (weights renormalized)' if a.norm_topk_prob else ''}, expert width {a.moe_intermediate_size}"]


def _qtype_lines(meta: dict) -> list[str]:
    kinds: dict[str, dict[int, str]] = {}
    lines = []
    for name, t in meta["dense"].items():
        if name.startswith("blk."):
            _, layer, rest = name.split(".", 2)
            kinds.setdefault(rest.rsplit(".", 1)[0], {})[int(layer)] = t["qtype"]
        else:
            lines.append(f"  {name.rsplit('.', 1)[0]}: {t['qtype']} {t['shape']}")
    for lay in meta["experts"]["layers"]:
        for p, v in lay["parts"].items():
            kinds.setdefault(f"ffn_{p}_exps", {})[lay["layer"]] = v["qtype"]
    lines += [f"  {kind}: {_runs(by_layer)}" for kind, by_layer in kinds.items()]
    return ["quant types:"] + lines


def _size(n: int) -> str:
    return f"{n:,} bytes ({human_bytes(n)})"


def info_text(model) -> str:
    """A human-readable summary of a pack dir, a .gguf (or split) or a HF checkpoint dir."""
    model = Path(model)
    what, meta, sizes = _load(model)
    args = ModelArgs.from_dict(meta["model_args"])
    tok = meta["tokenizer"]
    blobs = {lay["layer"]: f"{lay['blob_bytes']:,} bytes" for lay in meta["experts"]["layers"]}
    lines = [f"{model} ({what})", *_args_lines(args),
             f"tokenizer: bos {tok.get('bos_token_id')}, eos {tok.get('eos_token_ids')}, "
             f"pad {tok.get('pad_token_id')}, "
             f"add_bos {'yes' if tok.get('add_bos_token') else 'no'}, chat template: "
             f"{'yes' if tok.get('chat_template') else 'no'}",
             *_qtype_lines(meta),
             f"expert blobs: {_runs(blobs)}; "
             f"{args.num_experts} per layer, each at a 4096-byte stride",
             f"max_blob: {_size(meta['max_blob'])}"]
    dense, experts = sizes.get("dense.bin", 0), sizes.get("experts.bin", 0)
    lines += [f"dense: {_size(dense)}", f"experts: {_size(experts)}", f"total: {_size(dense + experts)}"]
    return "\n".join(lines)
