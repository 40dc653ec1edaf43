"""Train the built-in demo model (Qwen3-MoE + one MTP draft layer) and turn it into strata/demo/.

Three steps (torch is a development dependency only; the package never imports it):

    python tools/demo_data.py .demo_data                       # CPU: corpus, tokenizer, token streams
    python tools/train_demo.py train --data .demo_data --out OUT/hf   # GPU, about 7 minutes on one H200
    PYTHONPATH=. python tools/train_demo.py pack --hf OUT/hf --data .demo_data --dst strata/demo   # CPU

`train` is seeded (weights, data order); with `--steps auto` it times the first steps and fixes the step
count so that training ends inside `--time-budget-s` (the count used is recorded; pass it as `--steps N`
to repeat the run). GPU kernels with atomics (index_add) make bitwise repeats unlikely, not the recipe.
It writes config.json, bf16 safetensors shards (<= 15 MiB each) and metrics.json (held-out losses of
both heads, MTP greedy acceptance, routing skew, sample completions), all computed on the saved weights.
`pack` converts that directory with strata.convert (Q8_0), then measures the pack's own weights (torch on
the CPU, dequantized) and records them, with the greedy reference the tests check, in metrics.json.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import demo_model as dm

SEED = 20251130
CONFIG = dict(vocab_size=8192, hidden_size=256, num_hidden_layers=6, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, num_experts=16, num_experts_per_tok=4,
              moe_intermediate_size=256, norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=1e6,
              max_position_embeddings=4096, num_nextn_predict_layers=1, router_aux_loss_coef=1e-3,
              bos_token_id=None, eos_token_id=[2, 0], pad_token_id=0)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
REFERENCE_PROMPT = "class Stack:\n    \"\"\"A last-in, first-out stack.\"\"\"\n\n    def __init__(self):"
EOS_IDS = (0, 2)            # <|endoftext|>, <|im_end|>
SAMPLE_PROMPTS = [
    "def fibonacci(n):",
    "import os\n\n\ndef list_python_files(path):\n    \"\"\"",
    "<|im_start|>user\nWhat does `json.dumps` do?<|im_end|>\n<|im_start|>assistant\n",
]


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def train_loss(model, w, S: int, mtp_weight: float, aux_coef: float):
    """w [B, S+2] token windows -> (total loss, main CE, MTP CE, aux)."""
    V = model.config["vocab_size"]
    logits, hidden, aux_main = model.forward_main(w[:, :S])
    main = F.cross_entropy(logits.float().reshape(-1, V), w[:, 1:S + 1].reshape(-1))
    mlogits, aux_mtp = model.forward_mtp(hidden, w[:, 1:S + 1])
    mtp = F.cross_entropy(mlogits.float().reshape(-1, V), w[:, 2:S + 2].reshape(-1))
    aux = (aux_main * model.config["num_hidden_layers"] + aux_mtp) / (model.config["num_hidden_layers"] + 1)
    return main + mtp_weight * mtp + aux_coef * aux, main, mtp, aux


@torch.no_grad()
def evaluate(model, tokens: np.ndarray, S: int, device, max_windows: int | None = None, batch: int = 16) -> dict:
    """Held-out metrics over non-overlapping windows of S+2 tokens, in float32."""
    n = (len(tokens) - 2) // S
    if max_windows:
        n = min(n, max_windows)
    moes = [layer.mlp for layer in model.layers] + [model.mtp.layers[0].mlp]
    for m in moes:
        m.stats = {"mass": torch.zeros(m.E, device=device), "count": torch.zeros(m.E, device=device)}
    sums = dict(main=0.0, mtp=0.0, main_acc=0.0, mtp_acc=0.0, accept=0.0)
    npos = nacc = 0
    for b in range(0, n, batch):
        w = torch.stack([torch.from_numpy(tokens[i * S:i * S + S + 2].astype(np.int64))
                         for i in range(b, min(n, b + batch))]).to(device)
        logits, hidden, _ = model.forward_main(w[:, :S])
        mlogits, _ = model.forward_mtp(hidden, w[:, 1:S + 1])
        V = logits.shape[-1]
        sums["main"] += F.cross_entropy(logits.reshape(-1, V), w[:, 1:S + 1].reshape(-1), reduction="sum").item()
        sums["mtp"] += F.cross_entropy(mlogits.reshape(-1, V), w[:, 2:S + 2].reshape(-1), reduction="sum").item()
        am, at = logits.argmax(-1), mlogits.argmax(-1)
        sums["main_acc"] += (am == w[:, 1:S + 1]).sum().item()
        sums["mtp_acc"] += (at == w[:, 2:S + 2]).sum().item()
        sums["accept"] += (at[:, :-1] == am[:, 1:]).sum().item()   # draft for t+2 vs main's argmax at t+1
        npos += w.shape[0] * S
        nacc += w.shape[0] * (S - 1)
    out = {"val_tokens": npos, "val_loss_main": sums["main"] / npos, "val_loss_mtp": sums["mtp"] / npos,
           "val_top1_main": sums["main_acc"] / npos, "val_top1_mtp": sums["mtp_acc"] / npos,
           "mtp_accept_teacher_forced": sums["accept"] / nacc}
    out["routing"] = routing_report(moes)
    for m in moes:
        m.stats = None
    return out


def routing_report(moes) -> dict:
    """Per layer: routing mass of each expert (normalized) and the share taken by the top 10% of experts."""
    layers = []
    for m in moes:
        mass = (m.stats["mass"] / m.stats["mass"].sum()).cpu().numpy()
        k = max(1, round(0.1 * m.E))
        layers.append({"mass": [round(float(v), 5) for v in mass],
                       "top10pct_share": float(np.sort(mass)[::-1][:k].sum()),
                       "min_share": float(mass.min())})
    k = max(1, round(0.1 * moes[0].E))
    return {"top_k_counted": k, "uniform_share": k / moes[0].E, "layers": layers,
            "mean_top10pct_share": float(np.mean([x["top10pct_share"] for x in layers]))}


@torch.no_grad()
def greedy(model, ids: list[int], n: int, device) -> list[int]:
    """Greedy continuation (full recompute each step: the model is small)."""
    out = list(ids)
    for _ in range(n):
        logits, _, _ = model.forward_main(torch.tensor([out], device=device))
        nxt = int(logits[0, -1].argmax())
        out.append(nxt)
        if nxt in EOS_IDS:
            break
    return out[len(ids):]


@torch.no_grad()
def draft_acceptance(model, seq: list[int], start: int, device) -> tuple[int, int]:
    """Along a greedy sequence: how often the MTP draft at t equals the token greedy chose at t+2."""
    x = torch.tensor([seq], device=device)
    _, hidden, _ = model.forward_main(x[:, :-1])
    mlogits, _ = model.forward_mtp(hidden[:, :-1], x[:, 1:-1])
    draft = mlogits[0].argmax(-1).tolist()                 # draft[t] predicts seq[t+2]
    hits = [draft[t] == seq[t + 2] for t in range(max(0, start - 1), len(seq) - 2)]
    return sum(hits), len(hits)


def samples(model, tok, device, n: int = 64) -> tuple[list[dict], float]:
    out, hit, tot = [], 0, 0
    for p in SAMPLE_PROMPTS:
        ids = tok.encode(p).ids
        gen = greedy(model, ids, n, device)
        h, t = draft_acceptance(model, ids + gen, len(ids), device)
        hit, tot = hit + h, tot + t
        out.append({"prompt": p, "completion": tok.decode(gen, skip_special_tokens=False), "token_ids": gen})
    return out, hit / max(1, tot)


def train(args):
    from tokenizers import Tokenizer
    torch.manual_seed(SEED)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    data = Path(args.data)
    train_tok = np.load(data / "tokens_train.npy")
    val_tok = np.load(data / "tokens_val.npy")
    tok = Tokenizer.from_file(str(data / "tokenizer.json"))
    cfg = dict(CONFIG, **(TINY if args.tiny else {}))
    model = dm.DemoModel(cfg)
    model.init_weights(SEED)
    model.to(device)
    nparams = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=device.type == "cuda")
    rng = np.random.default_rng(SEED)
    B, S = args.batch, args.seq
    max_steps = int(args.max_epochs * len(train_tok) / (B * S))
    total = max_steps if args.steps == "auto" else int(args.steps)
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    log, best, t0 = [], None, time.time()
    print(f"params {nparams}  train tokens {len(train_tok)}  val tokens {len(val_tok)}  device {device}", flush=True)
    step = 0
    while step < total:
        starts = rng.integers(0, len(train_tok) - S - 2, size=B)
        w = torch.from_numpy(np.stack([train_tok[s:s + S + 2] for s in starts]).astype(np.int64)).to(device)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, args.lr, args.warmup)
        with amp:
            loss, main, mtp, aux = train_loss(model, w, S, args.mtp_weight, cfg["router_aux_loss_coef"])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step == 10:
            t10 = time.time()
        if args.steps == "auto" and step == 40:
            # Fix the schedule's length from the measured step time so training ends inside the budget.
            if device.type == "cuda":
                torch.cuda.synchronize()
            dt = (time.time() - t10) / 30
            total = min(max_steps, step + int((args.time_budget_s - (time.time() - t0)) / dt))
            print(f"step time {dt * 1000:.1f} ms -> {total} steps", flush=True)
        if step % args.log_every == 0 or step == total:
            rec = {"step": step, "loss": loss.item(), "main": main.item(), "mtp": mtp.item(), "aux": aux.item(),
                   "lr": opt.param_groups[0]["lr"], "elapsed_s": round(time.time() - t0, 1)}
            if step % args.eval_every == 0 or step == total:
                model.eval()
                rec["val_main"] = evaluate(model, val_tok, S, device, max_windows=32)["val_loss_main"]
                model.train()
                if best is None or rec["val_main"] < best[0]:
                    best = (rec["val_main"], step, {k: v.detach().clone() for k, v in model.state_dict().items()})
            log.append(rec)
            print(json.dumps(rec), flush=True)
    train_s = time.time() - t0
    if best[1] != step:
        model.load_state_dict(best[2])
    # Round to bf16 (the saved precision), then measure everything on exactly those weights.
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    model.eval()
    torch.set_float32_matmul_precision("highest")
    metrics = evaluate(model, val_tok, S, device, max_windows=args.eval_windows)
    metrics["samples"], metrics["mtp_accept_greedy"] = samples(model, tok, device, 8 if args.tiny else 64)
    metrics.update({"params": nparams, "params_by_part": param_breakdown(model),
                    "steps": step, "kept_step": best[1], "batch": B, "seq": S, "tokens_trained": step * B * S,
                    "epochs": step * B * S / len(train_tok), "train_s": round(train_s, 1),
                    "train_tokens_available": int(len(train_tok)), "config": cfg, "seed": SEED,
                    "hparams": {k: getattr(args, k) for k in ("lr", "warmup", "mtp_weight", "max_epochs")},
                    "torch": torch.__version__, "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
                    "log": log})
    out = Path(args.out)
    files = dm.save_hf(model, out)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    summary = {k: metrics[k] for k in ("params", "tokens_trained", "steps", "kept_step", "val_loss_main",
                                       "val_loss_mtp", "mtp_accept_teacher_forced", "mtp_accept_greedy")}
    summary["skew"] = metrics["routing"]["mean_top10pct_share"]
    print(json.dumps(summary), files, flush=True)


def param_breakdown(model) -> dict:
    parts = {"embedding": 0, "output": 0, "attention": 0, "router": 0, "experts": 0, "mtp_proj": 0, "norms": 0}
    for name, p in model.named_parameters():
        key = ("embedding" if "embed_tokens" in name else "output" if "lm_head" in name
               else "experts" if ".w_" in name else "router" if "mlp.gate" in name
               else "attention" if "self_attn" in name and "norm" not in name
               else "mtp_proj" if "mtp.fc" in name else "norms")
        parts[key] += p.numel()
    parts["active_per_token"] = (parts["attention"] + parts["router"] + parts["mtp_proj"] + parts["output"]
                                 + parts["experts"] * model.config["num_experts_per_tok"]
                                 // model.config["num_experts"])
    return parts


def pack(args):
    """HF dir (+ tokenizer files) -> strata pack at dst via strata.convert, with metrics.json beside it."""
    import strata
    hf, data, dst = Path(args.hf), Path(args.data), Path(args.dst)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(data / name, hf / name)
    gen = {"eos_token_id": list(CONFIG["eos_token_id"]), "pad_token_id": CONFIG["pad_token_id"]}
    (hf / "generation_config.json").write_text(json.dumps(gen, indent=1) + "\n")
    strata.convert(hf, dst, qtype=args.qtype)
    metrics = json.loads((hf / "metrics.json").read_text())
    corpus = json.loads((data / "corpus.json").read_text())
    metrics["corpus"] = {k: v for k, v in corpus.items() if k not in ("files", "stdlib")}
    metrics["pack"] = pack_eval(dst, data, args.qtype, args.eval_windows)
    (dst / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    (dst / "corpus_files.txt").write_text("".join(f"{sha}  {rel}\n" for rel, sha in corpus["files"]))
    print(f"pack written to {dst}")


def pack_eval(dst: Path, data: Path, qtype: str, windows: int) -> dict:
    """The pack's weights, dequantized, in torch on the CPU: held-out metrics, samples, the test reference."""
    from tokenizers import Tokenizer
    model = dm.model_from_pack(dst)
    tok = Tokenizer.from_file(str(dst / "tokenizer.json"))
    out = {"qtype": qtype, "eval_windows": windows}
    out.update(evaluate(model, np.load(data / "tokens_val.npy"), 1024, "cpu", max_windows=windows, batch=4))
    out["samples"], out["mtp_accept_greedy"] = samples(model, tok, "cpu")
    out["reference"] = greedy_reference(model, tok)
    return out


@torch.no_grad()
def greedy_reference(model, tok, n: int = 24) -> dict:
    """The greedy continuation of REFERENCE_PROMPT, with the smallest top-1/top-2 logit gap along it."""
    ids = tok.encode(REFERENCE_PROMPT).ids
    gen = greedy(model, ids, n, "cpu")
    logits, _, _ = model.forward_main(torch.tensor([ids + gen[:-1]]))
    top2 = logits[0, len(ids) - 1:].topk(2, dim=-1).values
    return {"prompt": REFERENCE_PROMPT, "prompt_ids": ids, "greedy_ids": gen,
            "greedy_text": tok.decode(gen, skip_special_tokens=False),
            "min_logit_gap": float((top2[:, 0] - top2[:, 1]).min())}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("--data", required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--steps", default="auto")
    t.add_argument("--time-budget-s", type=float, default=380.0)
    t.add_argument("--max-epochs", type=float, default=8.0)
    t.add_argument("--batch", type=int, default=32)
    t.add_argument("--seq", type=int, default=1024)
    t.add_argument("--lr", type=float, default=1.5e-3)
    t.add_argument("--warmup", type=int, default=100)
    t.add_argument("--mtp-weight", type=float, default=0.3)
    t.add_argument("--log-every", type=int, default=50)
    t.add_argument("--eval-every", type=int, default=200)
    t.add_argument("--eval-windows", type=int, default=None)
    t.add_argument("--tiny", action="store_true", help="a toy config for a CPU smoke test")
    p = sub.add_parser("pack")
    p.add_argument("--hf", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--dst", required=True)
    p.add_argument("--qtype", default="Q8_0")
    p.add_argument("--eval-windows", type=int, default=64)
    args = ap.parse_args(argv)
    train(args) if args.cmd == "train" else pack(args)


if __name__ == "__main__":
    sys.exit(main())
