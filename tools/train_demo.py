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

Tool calls (strata/demo/DATA.md has the recipe and its numbers): `finetune` is a short CPU run that starts
from a pack's own weights (dequantized, MTP layer included) and trains on a seeded mix of the original
stream and the tool-call chats of tools/tool_chats.py (loss on the assistant's tokens only for those),
then writes an HF dir for `pack`, as `train` does; `toolcalls` asks a pack (the strata engine, greedy,
tool_choice auto) the held-out tool prompts and counts well-formed calls, right names and exact arguments:

    PYTHONPATH=. python tools/train_demo.py finetune --data .demo_data --out OUT/hf --steps 300   # CPU
    PYTHONPATH=. python tools/train_demo.py pack --hf OUT/hf --data .demo_data --dst strata/demo
    PYTHONPATH=. python tools/train_demo.py toolcalls --pack strata/demo
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


def finetune(args):
    """Start from a pack's own weights (dequantized) and train on a mix of tool chats and the original
    stream, on the CPU; writes an HF dir that `pack` turns into strata/demo (as after `train`)."""
    import tool_chats as tc
    from tokenizers import Tokenizer
    torch.manual_seed(SEED)
    torch.set_num_threads(args.threads or torch.get_num_threads())
    data, src = Path(args.data), Path(args.init)
    rng = np.random.default_rng(SEED + 1)
    train_tok = np.load(data / "tokens_train.npy")
    val_tok = np.load(data / "tokens_val.npy")
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    model = dm.DemoModel(CONFIG)
    model.load_state_dict(dm.model_from_pack(src).state_dict())
    cfg = model.config
    # Tool chats: the training set and a held-out set drawn with another seed, each one stream + loss mask.
    tr_chats, ho_chats = tc.chats(args.tool_chats, tc.SEED), tc.chats(args.held_out_chats, tc.HELD_OUT_SEED)
    tr_stream, tr_mask, tr_starts = _chat_stream(tc.encode(tr_chats))
    ho_stream, ho_mask, _ = _chat_stream(tc.encode(ho_chats))
    B, S, Bt = args.batch, args.seq, args.tool_batch
    model.eval()
    before = {"orig": evaluate(model, val_tok, S, "cpu", max_windows=args.eval_windows, batch=4),
              "tool": tool_eval(model, ho_stream, ho_mask, S)}
    before["orig"].pop("routing")
    print(json.dumps({"before": before}), flush=True)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    log, t0 = [], time.time()
    for step in range(args.steps):
        rows, masks = [], []
        for s in rng.integers(0, len(train_tok) - S - 2, size=B - Bt):
            rows.append(train_tok[s:s + S + 2])
            masks.append(np.ones(S + 2, np.float32))
        for s in tr_starts[rng.integers(0, len(tr_starts), size=Bt)]:
            rows.append(_take(tr_stream, s, S + 2))
            masks.append(_take(tr_mask, s, S + 2).astype(np.float32))
        w = torch.from_numpy(np.stack(rows).astype(np.int64))
        m = torch.from_numpy(np.stack(masks))
        m[:B - Bt] /= (B - Bt) * S                                  # original rows: mean over their tokens
        for part in (slice(1, S + 1), slice(2, S + 2)):              # tool rows: mean over the assistant's tokens
            sub = m[B - Bt:, part]
            m[B - Bt:, part] = sub * args.tool_weight / sub.sum().clamp(min=1)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        loss, main, mtp, aux = masked_loss(model, w, m, S, args.mtp_weight, cfg["router_aux_loss_coef"])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            rec = {"step": step + 1, "loss": loss.item(), "main": main.item(), "mtp": mtp.item(),
                   "lr": opt.param_groups[0]["lr"], "elapsed_s": round(time.time() - t0, 1)}
            log.append(rec)
            print(json.dumps(rec), flush=True)
    train_s = time.time() - t0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    model.eval()
    after = {"orig": evaluate(model, val_tok, S, "cpu", max_windows=args.eval_windows, batch=4),
             "tool": tool_eval(model, ho_stream, ho_mask, S)}
    metrics = dict(after["orig"])
    after["orig"].pop("routing")
    metrics["samples"], metrics["mtp_accept_greedy"] = samples(model, tok, "cpu")
    metrics.update({"params": sum(p.numel() for p in model.parameters()), "params_by_part": param_breakdown(model),
                    "config": cfg, "seed": SEED, "torch": torch.__version__, "gpu": None,
                    "base_training": _base_training(src),
                    "finetune": {"init": str(src), "steps": args.steps, "batch": B, "tool_rows": Bt, "seq": S,
                                 "tokens_seen": args.steps * B * S, "tool_chats": args.tool_chats,
                                 "tool_chat_tokens": int(len(tr_stream)), "held_out_chats": args.held_out_chats,
                                 "hparams": {k: getattr(args, k) for k in ("lr", "warmup", "mtp_weight", "tool_weight")},
                                 "threads": torch.get_num_threads(), "train_s": round(train_s, 1),
                                 "eval_windows": args.eval_windows, "before": before, "after": after, "log": log}})
    out = Path(args.out)
    dm.save_hf(model, out)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    print(json.dumps({"train_s": round(train_s, 1), "before": before, "after": after}), flush=True)


def _base_training(src: Path) -> dict | None:
    """The pack's own training record (the run that made the weights a fine-tune starts from)."""
    path = src / "metrics.json"
    if not path.is_file():
        return None
    m = json.loads(path.read_text())
    keep = ("steps", "kept_step", "batch", "seq", "tokens_trained", "epochs", "train_s", "hparams", "gpu", "seed",
            "val_tokens", "val_loss_main", "val_loss_mtp", "val_top1_main", "val_top1_mtp", "base_training",
            "finetune")
    return {k: m[k] for k in keep if k in m}


def _chat_stream(encoded) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Chats one after another, <|endoftext|> between them: (ids, loss mask, each chat's start)."""
    ids, mask, starts = [], [], []
    for i, mk in encoded:
        starts.append(len(ids))
        ids += list(i) + [0]
        mask += list(mk) + [0]
    return np.asarray(ids, np.uint16), np.asarray(mask, np.uint8), np.asarray(starts)


def _take(a: np.ndarray, s: int, n: int) -> np.ndarray:
    """n items of a from s, wrapping around (a window may start near the stream's end)."""
    return np.take(a, np.arange(s, s + n), mode="wrap")


def masked_loss(model, w, m, S: int, mtp_weight: float, aux_coef: float):
    """Like train_loss, with the per-token weights m [B, S+2] (at each target's index; they sum to the
    batch's loss scale) instead of a plain mean."""
    V = model.config["vocab_size"]
    logits, hidden, aux_main = model.forward_main(w[:, :S])
    ce = F.cross_entropy(logits.float().reshape(-1, V), w[:, 1:S + 1].reshape(-1), reduction="none")
    main = (ce * m[:, 1:S + 1].reshape(-1)).sum()
    mlogits, aux_mtp = model.forward_mtp(hidden, w[:, 1:S + 1])
    mce = F.cross_entropy(mlogits.float().reshape(-1, V), w[:, 2:S + 2].reshape(-1), reduction="none")
    mtp = (mce * m[:, 2:S + 2].reshape(-1)).sum()
    L = model.config["num_hidden_layers"]
    aux = (aux_main * L + aux_mtp) / (L + 1)
    return main + mtp_weight * mtp + aux_coef * aux, main, mtp, aux


@torch.no_grad()
def tool_eval(model, stream: np.ndarray, mask: np.ndarray, S: int, batch: int = 4) -> dict:
    """Held-out tool chats: main-head loss and top-1 accuracy over the assistant's tokens only."""
    n = (len(stream) - 1 + S - 1) // S
    loss = hits = count = 0.0
    for b in range(0, n, batch):
        starts = range(b * S, min(n, b + batch) * S, S)
        w = torch.from_numpy(np.stack([_take(stream, s, S + 1) for s in starts]).astype(np.int64))
        mk = torch.from_numpy(np.stack([_take(mask, s, S + 1) for s in starts]).astype(np.float32))
        ends = torch.tensor([min(S, len(stream) - 1 - s) for s in starts])
        mk[:, 1:] *= (torch.arange(S)[None, :] < ends[:, None]).float()     # no wrapped targets
        logits, _, _ = model.forward_main(w[:, :S])
        V = logits.shape[-1]
        ce = F.cross_entropy(logits.reshape(-1, V), w[:, 1:].reshape(-1), reduction="none")
        mm = mk[:, 1:].reshape(-1)
        loss += (ce * mm).sum().item()
        hits += ((logits.argmax(-1).reshape(-1) == w[:, 1:].reshape(-1)).float() * mm).sum().item()
        count += mm.sum().item()
    return {"assistant_tokens": int(count), "loss": loss / count, "top1": hits / count}


def tool_calls(args):
    """With tool_choice auto, greedy replies of a pack (the strata engine on the CPU) to held-out tool
    prompts: how often it emits a well-formed call, the right function, the exact arguments; and on
    the plain prompts, how often it answers without a call."""
    import strata
    import tool_chats as tc
    from strata.server.tools import split_calls
    llm = strata.LLM(args.pack, device="cpu")
    cs = tc.chats(args.n, tc.HELD_OUT_SEED)
    res = {"prompts": 0, "well_formed": 0, "right_name": 0, "exact_arguments": 0, "plain_prompts": 0,
           "plain_without_call": 0}
    t0 = time.time()
    examples = []
    for c in cs:
        text = llm.generate(c["prompt"], max_tokens=args.max_tokens, temperature=0).text
        _, calls = split_calls(text)
        if c["call"] is None:
            res["plain_prompts"] += 1
            res["plain_without_call"] += not calls
            continue
        res["prompts"] += 1
        if calls:
            res["well_formed"] += 1
            res["right_name"] += calls[0]["name"] == c["call"]["name"]
            try:
                res["exact_arguments"] += (calls[0]["name"] == c["call"]["name"]
                                           and json.loads(calls[0]["arguments"]) == c["call"]["arguments"])
            except ValueError:
                pass
        if len(examples) < 4:
            examples.append({"user": c["messages"][-4]["content"] if len(c["messages"]) >= 4 else "",
                             "reply": text})
    res["seconds"] = round(time.time() - t0, 1)
    res["examples"] = examples
    print(json.dumps(res, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")


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
    f = sub.add_parser("finetune", help="a short CPU run from a pack's weights on tool chats + the original data")
    f.add_argument("--data", required=True)
    f.add_argument("--init", default=str(Path(__file__).resolve().parent.parent / "strata" / "demo"))
    f.add_argument("--out", required=True)
    f.add_argument("--steps", type=int, default=300)
    f.add_argument("--batch", type=int, default=6)
    f.add_argument("--tool-batch", type=int, default=4, help="rows of each batch drawn from the tool chats")
    f.add_argument("--seq", type=int, default=512)
    f.add_argument("--lr", type=float, default=3e-4)
    f.add_argument("--warmup", type=int, default=20)
    f.add_argument("--mtp-weight", type=float, default=0.3)
    f.add_argument("--tool-weight", type=float, default=1.0)
    f.add_argument("--tool-chats", type=int, default=480)
    f.add_argument("--held-out-chats", type=int, default=40)
    f.add_argument("--eval-windows", type=int, default=8)
    f.add_argument("--threads", type=int, default=2)
    f.add_argument("--log-every", type=int, default=20)
    c = sub.add_parser("toolcalls", help="tool_choice auto on held-out tool prompts: how often a pack calls")
    c.add_argument("--pack", required=True)
    c.add_argument("--n", type=int, default=60)
    c.add_argument("--max-tokens", type=int, default=96)
    c.add_argument("--json")
    args = ap.parse_args(argv)
    {"train": train, "pack": pack, "finetune": finetune, "toolcalls": tool_calls}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
