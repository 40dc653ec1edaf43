"""Training data for the built-in demo model: the Python standard library's own source.

Everything comes from the interpreter that runs this script (no download): every `*.py` file under
its stdlib directory, minus site-packages, the generated codec tables in encodings/ and the
machine-specific _sysconfigdata; files that are not valid UTF-8 are skipped. From the docstrings of
the training files come short ChatML question/answer pairs, so the chat endpoint has something to say.

`python tools/demo_data.py OUT` writes OUT/tokenizer.json, OUT/tokenizer_config.json,
OUT/tokens_train.npy, OUT/tokens_val.npy (uint16 token streams, documents separated by
<|endoftext|>) and OUT/corpus.json (the interpreter version, the exact file list and its sha256).
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import inspect
import json
import platform
import random
import sys
import sysconfig
from pathlib import Path

import numpy as np

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 8192
SEED = 1234
VAL_EVERY = 40              # every 40th file (sorted order) is held out
SYSTEM_PROMPT = "You are a helpful assistant."
QUESTIONS = ("What does `{name}` do?", "Explain `{name}`.", "What is the {kind} `{name}` for?",
             "Describe the Python {kind} `{name}` in one paragraph.")

# ChatML: one turn per message, then the assistant header when asked.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def corpus_files(stdlib: Path) -> list[Path]:
    """The training files, in sorted order of their path relative to the stdlib directory."""
    out = []
    for p in sorted(stdlib.rglob("*.py"), key=lambda q: q.relative_to(stdlib).as_posix()):
        rel = p.relative_to(stdlib).as_posix()
        if rel.startswith(("site-packages/", "encodings/")) or rel.startswith("_sysconfigdata"):
            continue
        if "__pycache__" in rel or not p.is_file():
            continue
        out.append(p)
    return out


def read_texts(stdlib: Path) -> list[tuple[str, str, str]]:
    """(relative path, text, sha256 of the bytes) of every readable corpus file."""
    out = []
    for p in corpus_files(stdlib):
        raw = p.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        out.append((p.relative_to(stdlib).as_posix(), text, hashlib.sha256(raw).hexdigest()))
    return out


def _module_name(rel: str) -> str:
    mod = rel[:-3].replace("/", ".")
    return mod[:-len(".__init__")] if mod.endswith(".__init__") else mod


def _summary(doc: str) -> str | None:
    para = inspect.cleandoc(doc).split("\n\n")[0].strip()
    if len(para) < 24 or len(para) > 600:
        return None
    return para


def docstring_chats(rel: str, text: str, rng: random.Random) -> list[str]:
    """ChatML conversations asking what a documented function or class does; the answer is its docstring."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    mod = _module_name(rel)
    chats = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}.{child.name}"
                doc = ast.get_docstring(child, clean=False)
                answer = _summary(doc) if doc and not child.name.startswith("_") else None
                if answer:
                    kind = "class" if isinstance(child, ast.ClassDef) else "function"
                    q = rng.choice(QUESTIONS).format(name=name, kind=kind)
                    system = f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n" if rng.random() < 0.5 else ""
                    chats.append(f"{system}<|im_start|>user\n{q}<|im_end|>\n"
                                 f"<|im_start|>assistant\n{answer}<|im_end|>\n")
                if isinstance(child, ast.ClassDef):
                    visit(child, name)

    visit(tree, mod)
    return chats


def train_tokenizer(texts: list[str]):
    """Byte-level BPE over the training texts; the special tokens take ids 0, 1, 2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def tokenizer_config() -> dict:
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>", "unk_token": None, "add_bos_token": False, "add_eos_token": False,
            "model_max_length": 4096, "chat_template": CHAT_TEMPLATE}


def _stream(tok, docs: list[str]) -> np.ndarray:
    eot = tok.token_to_id("<|endoftext|>")
    ids = []
    for enc in tok.encode_batch(docs):
        ids.extend(enc.ids)
        ids.append(eot)
    return np.asarray(ids, dtype=np.uint16)


def build(out: Path, stdlib: Path) -> dict:
    files = read_texts(stdlib)
    rng = random.Random(SEED)
    train_docs, val_docs, val_paths = [], [], []
    for i, (rel, text, _) in enumerate(files):
        if i % VAL_EVERY == VAL_EVERY // 2:
            val_docs.append(text)
            val_paths.append(rel)
        else:
            train_docs.append(text)
            train_docs.extend(docstring_chats(rel, text, rng))
    num_code = len(files) - len(val_docs)
    rng.shuffle(train_docs)
    tok = train_tokenizer(train_docs)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    train, val = _stream(tok, train_docs), _stream(tok, val_docs)
    np.save(out / "tokens_train.npy", train)
    np.save(out / "tokens_val.npy", val)
    listing = "".join(f"{rel} {sha}\n" for rel, _, sha in files)
    info = {"python": sys.version.split()[0], "implementation": platform.python_implementation(),
            "stdlib": str(stdlib), "num_files": len(files), "num_val_files": len(val_docs),
            "num_chat_docs": len(train_docs) - num_code,
            "listing_sha256": hashlib.sha256(listing.encode()).hexdigest(),
            "train_tokens": int(train.size), "val_tokens": int(val.size),
            "files": [[rel, sha] for rel, _, sha in files], "val_files": val_paths}
    (out / "corpus.json").write_text(json.dumps(info, indent=1) + "\n")
    return info


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    args = ap.parse_args(argv)
    info = build(args.out, args.stdlib)
    print(json.dumps({k: v for k, v in info.items() if k not in ("files", "val_files")}, indent=1))


if __name__ == "__main__":
    main()
