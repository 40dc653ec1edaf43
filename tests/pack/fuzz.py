"""Seeded mutations of a small GGUF and a small pack, each run in a capped worker process.

A case is (kind, seed): kind "gguf" mutates the GGUF and runs convert, then load and logits; kind
"pack" mutates a converted pack and runs load and logits. Every case is derived from its seed
alone, so a failure replays with `run_case(base, kind, seed)`.

Outcomes: "ok" (loads, finite logits), "clean" (a StrataError at convert or load), "late" (an error
only after a healthy load: at logits, chat template or decode), "other" (anything not a StrataError,
BaseException included), "nonfinite" (loads, logits NaN/inf: a silent wrong output), "hang" (over
the time limit), "crash" (the worker died: a signal, or memory beyond the cap).

The workers are `python -c` subprocesses fed one case per line over a pipe; a worker that overruns
its case is killed by its pid and replaced, so one hang costs one case.
"""
from __future__ import annotations

import copy
import json
import math
import os
import select
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]

# ------------------------------------------------------------------------------------------
# GGUF structure (our own walker, so mutations do not trust the reader under test)

_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


@dataclass
class Gguf:
    version: int
    kvs: list           # [key, vtype, raw value bytes]
    tensors: list       # [name, ne list, ggml type, offset]
    data: bytes         # the data section (from the aligned start)
    fields: list        # (pos, struct fmt, role) of every fixed-size field in the original bytes


def _skip_value(buf: bytes, pos: int, vtype: int, fields: list) -> int:
    if vtype in _SCALAR:
        fields.append((pos, _SCALAR[vtype], "value"))
        return pos + struct.calcsize(_SCALAR[vtype])
    if vtype == 8:
        fields.append((pos, "Q", "strlen"))
        return pos + 8 + struct.unpack_from("<Q", buf, pos)[0]
    if vtype == 9:
        itype, count = struct.unpack_from("<IQ", buf, pos)
        fields += [(pos, "I", "arrtype"), (pos + 4, "Q", "arrcount")]
        pos += 12
        for _ in range(count):
            pos = _skip_value(buf, pos, itype, fields if len(fields) < 4096 else [])
        return pos
    raise ValueError(vtype)


def _string(buf: bytes, pos: int, fields: list) -> tuple[str, int]:
    """A GGUF string at pos (u64 length, bytes): (text, the position after it); its length field is
    recorded among the fields a mutation may hit."""
    fields.append((pos, "Q", "strlen"))
    n = struct.unpack_from("<Q", buf, pos)[0]
    return buf[pos + 8:pos + 8 + n].decode(), pos + 8 + n


def parse_gguf(buf: bytes) -> Gguf:
    fields = [(4, "I", "version"), (8, "Q", "count"), (16, "Q", "count")]
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    pos, kvs, tensors = 24, [], []
    for _ in range(n_kv):
        key, pos = _string(buf, pos, fields)
        fields.append((pos, "I", "vtype"))
        vtype = struct.unpack_from("<I", buf, pos)[0]
        end = _skip_value(buf, pos + 4, vtype, fields)
        kvs.append([key, vtype, buf[pos + 4:end]])
        pos = end
    for _ in range(n_tensors):
        name, pos = _string(buf, pos, fields)
        fields.append((pos, "I", "ndims"))
        nd = struct.unpack_from("<I", buf, pos)[0]
        ne = list(struct.unpack_from(f"<{nd}Q", buf, pos + 4))
        fields += [(pos + 4 + 8 * i, "Q", "ne") for i in range(nd)]
        pos += 4 + 8 * nd
        fields += [(pos, "I", "ggml_type"), (pos + 4, "Q", "tensor_offset")]
        gtype, off = struct.unpack_from("<IQ", buf, pos)
        tensors.append([name, ne, gtype, off])
        pos += 12
    start = -(-pos // 32) * 32
    return Gguf(version, kvs, tensors, buf[start:], fields)


def _gstr(s) -> bytes:
    raw = s if isinstance(s, bytes) else s.encode()
    return struct.pack("<Q", len(raw)) + raw


def write_gguf(g: Gguf) -> bytes:
    out = [b"GGUF", struct.pack("<IQQ", g.version, len(g.tensors), len(g.kvs))]
    for key, vtype, raw in g.kvs:
        out += [_gstr(key), struct.pack("<I", vtype), raw]
    for name, ne, gtype, off in g.tensors:
        out += [_gstr(name), struct.pack("<I", len(ne)), struct.pack(f"<{len(ne)}Q", *ne),
                struct.pack("<IQ", gtype, off)]
    head = b"".join(out)
    return head + bytes(-len(head) % 32) + g.data


# ------------------------------------------------------------------------------------------
# GGUF mutations

_INT_FMTS = {"B": 8, "b": 8, "H": 16, "h": 16, "I": 32, "i": 32, "Q": 64, "q": 64}
_BIG = [0, 1, 2, 3, 7, 255, 256, 4095, 4096, 1 << 16, 1 << 20, 1 << 24, 1 << 31, 1 << 32, 1 << 40, 1 << 62, 1 << 63]


def _extreme_int(rng, bits: int, orig: int) -> int:
    mask = (1 << bits) - 1
    pick = rng.integers(6)
    if pick == 0:
        return orig ^ (1 << int(rng.integers(bits)))            # one flipped bit
    if pick == 1:
        return (orig + int(rng.choice([-2, -1, 1, 2, 32, -32]))) & mask
    if pick == 2:
        return -[1, 2, 1 << 31, 1 << (bits - 1)][int(rng.integers(4))] & mask     # "negative"
    if pick == 3:
        return mask - int(rng.integers(3))
    return _BIG[int(rng.integers(len(_BIG)))] & mask


def _set_field(buf: bytearray, pos: int, fmt: str, rng) -> str:
    if fmt in _INT_FMTS:
        bits = _INT_FMTS[fmt]
        orig = int.from_bytes(buf[pos:pos + bits // 8], "little")
        new = _extreme_int(rng, bits, orig)
        buf[pos:pos + bits // 8] = new.to_bytes(bits // 8, "little")
        return f"{orig}->{new}"
    if fmt in "fd":
        v = float(rng.choice([np.nan, np.inf, -np.inf, -1.0, 0.0, 1e38, 1e-45, -1e-6]))
        struct.pack_into("<" + fmt, buf, pos, v)
        return f"float {v}"
    buf[pos] = int(rng.choice([0, 1, 2, 255]))
    return f"bool {buf[pos]}"


def _nested(depth: int) -> tuple[int, bytes]:
    # depth - 1 arrays of one array each, then one array of one u32
    return 9, struct.pack("<IQ", 9, 1) * (depth - 1) + struct.pack("<IQ", 4, 1) + struct.pack("<I", 7)


def _random_value(rng) -> tuple[int, bytes]:
    pick = int(rng.integers(12))
    if pick < 5:
        vtype = int(rng.choice([0, 1, 2, 3, 4, 5, 10, 11, 7]))
        fmt = _SCALAR[vtype]
        bits = _INT_FMTS.get(fmt, 8)
        v = _extreme_int(rng, bits, int(rng.integers(1, 64)))
        return vtype, v.to_bytes(bits // 8, "little")
    if pick < 7:
        vtype = int(rng.choice([6, 12]))
        v = float(rng.choice([np.nan, np.inf, -np.inf, -1.0, 0.0, 1e-30, 1e30, 64.5]))
        return vtype, struct.pack("<" + _SCALAR[vtype], v)
    if pick == 7:
        return 8, _gstr(rng.choice(["", "none", "yarn", "gpt2", "\xff", "{{ x", "a" * 300]))
    if pick == 8:
        return _nested(int(rng.choice([2, 5, 100, 5000, 200000])))
    if pick == 9:
        n = int(rng.integers(0, 5))
        return 9, struct.pack("<IQ", 4, n) + struct.pack(f"<{n}I", *rng.integers(0, 1 << 32, n, dtype=np.uint64))
    if pick == 10:
        return 9, struct.pack("<IQ", 8, [1 << 20, 1 << 40, (1 << 64) - 1][int(rng.integers(3))])   # count past the end
    return 9, struct.pack("<IQ", 6, 2) + struct.pack("<2f", np.nan, 1.0)


_KEY_HINT = ("block_count", "embedding_length", "head_count", "expert", "rope", "epsilon", "context_length",
             "key_length", "alignment", "tokenizer.ggml", "chat_template", "nextn")


def _mutate_semantic(g: Gguf, rng) -> str:
    pick = int(rng.integers(10))
    if pick <= 4:
        keys = [i for i, kv in enumerate(g.kvs) if any(h in kv[0] for h in _KEY_HINT)]
        i = int(rng.choice(keys))
        g.kvs[i][1], g.kvs[i][2] = _random_value(rng)
        return f"set {g.kvs[i][0]} to type {g.kvs[i][1]}"
    if pick == 5:
        key = str(rng.choice(["general.alignment", "qwen3moe.nextn_predict_layers", "qwen3moe.rope.scaling.type",
                              "qwen3moe.rope.scaling.factor", "split.count", "tokenizer.ggml.eot_token_id"]))
        g.kvs = [kv for kv in g.kvs if kv[0] != key] + [[key, *_random_value(rng)]]
        return f"add {key}"
    if pick == 6:
        i = int(rng.integers(len(g.kvs)))
        return f"drop {g.kvs.pop(i)[0]}"
    t = g.tensors[int(rng.integers(len(g.tensors)))]
    if pick == 7:
        if t[1] and rng.random() < 0.5:
            t[1] = t[1][:-1] if rng.random() < 0.5 else t[1][1:]
        else:
            t[1] = t[1] + [int(rng.choice([1, 2, 0]))]
        return f"tensor {t[0]} dims {t[1]}"
    if pick == 8:
        other = g.tensors[int(rng.integers(len(g.tensors)))]
        t[3] = int(rng.choice([other[3], t[3] + 32, t[3] + 1, 0]))
        return f"tensor {t[0]} offset {t[3]}"
    g.tensors.remove(t)
    return f"drop tensor {t[0]}"


def mutate_gguf(data: bytes, seed: int) -> tuple[bytes, str]:
    """One seeded mutation of a GGUF file's bytes, and what it was."""
    rng = np.random.default_rng(seed)
    g = parse_gguf(data)
    head_end = len(data) - len(g.data)
    pick = int(rng.integers(10))
    buf = bytearray(data)
    if pick <= 1:                   # bit flips, mostly in the header where they change meaning
        where = head_end if rng.random() < 0.8 else len(data)
        flips = [int(rng.integers(where * 8)) for _ in range(int(rng.choice([1, 1, 1, 2, 4])))]
        for b in flips:
            buf[b // 8] ^= 1 << (b % 8)
        return bytes(buf), f"flip bits {flips}"
    if pick == 2:
        n = int(rng.integers(len(data))) if rng.random() < 0.5 else int(rng.integers(head_end + 1))
        return data[:n], f"truncate to {n}"
    if pick <= 5:                   # an integer or float field set to an extreme
        roles = sorted({r for _, _, r in g.fields})
        role = rng.choice(roles)
        cands = [f for f in g.fields if f[2] == role]
        pos, fmt, _ = cands[int(rng.integers(len(cands)))]
        return bytes(buf), f"{role} at {pos}: " + _set_field(buf, pos, fmt, rng)
    if pick == 6:                   # a type tag changed
        cands = [f for f in g.fields if f[2] in ("vtype", "arrtype", "ggml_type")]
        pos, fmt, role = cands[int(rng.integers(len(cands)))]
        new = int(rng.choice([int(rng.integers(0, 40)), 0xFFFFFFFF, 9, 8]))
        struct.pack_into("<I", buf, pos, new)
        return bytes(buf), f"{role} at {pos} -> {new}"
    what = _mutate_semantic(g, rng)
    return write_gguf(g), what


# ------------------------------------------------------------------------------------------
# Pack mutations

_PALETTE = [0, -1, 1, 2, 3, 4096, -4096, 1 << 31, 1 << 40, 1 << 63, 1 << 64, 0.5, 1e308, -1e-6, float("nan"),
            float("inf"), float("-inf"), True, False, None, "", "x", "F32", "Q8_0", "../../x", [], [1], [[[]]], {}]


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, prefix + (i,))


def _at(node, path):
    for k in path:
        node = node[k]
    return node


def mutate_pack_meta(meta: dict, rng) -> str:
    """Mutate pack.json's parsed tree in place; returns what changed."""
    paths = [p for p in _paths(meta) if p and p[0] != "source"]
    path = paths[int(rng.integers(len(paths)))]
    parent, key = _at(meta, path[:-1]), path[-1]
    old = parent[key]
    pick = int(rng.integers(6))
    if pick == 0 and isinstance(parent, dict):
        del parent[key]
        return f"delete {path}"
    if pick <= 2 and isinstance(old, (int, float)) and not isinstance(old, bool):
        delta = int(rng.choice([1, -1, 2, 256, -256, 4096, -4096, 10 ** 6]))
        new = old * int(rng.choice([0, 2, -1])) if rng.random() < 0.3 else old + delta
        # ints stay ints of any size (np.isfinite refuses those past int64); a float may overflow to inf
        parent[key] = type(old)(new) if isinstance(new, int) or math.isfinite(new) else new
        return f"{path}: {old!r} -> {parent[key]!r}"
    if pick == 3 and isinstance(parent, dict):
        siblings = [k for k in parent if k != key]
        if siblings:
            other = siblings[int(rng.integers(len(siblings)))]
            parent[key], parent[other] = parent[other], old
            return f"swap {path} with {other!r}"
    # a copy: the palette's lists and dicts are shared, so a second mutation could set one inside
    # itself (a cycle json.dumps refuses) or change the palette for every later case of the worker
    parent[key] = copy.deepcopy(_PALETTE[int(rng.integers(len(_PALETTE)))])
    return f"{path}: set to {parent[key]!r}"


def mutate_pack(pack: Path, seed: int) -> str:
    """One seeded mutation of the pack directory at `pack` (a private copy), in place."""
    rng = np.random.default_rng(seed)
    meta_path = pack / "pack.json"
    pick = int(rng.integers(10))
    if pick <= 6:
        meta = json.loads(meta_path.read_text())
        whats = [mutate_pack_meta(meta, rng) for _ in range(int(rng.choice([1, 1, 1, 2])))]
        meta_path.write_text(json.dumps(meta))
        return "; ".join(whats)
    if pick == 7:
        raw = bytearray(meta_path.read_bytes())
        b = int(rng.integers(len(raw) * 8))
        raw[b // 8] ^= 1 << (b % 8)
        meta_path.write_bytes(bytes(raw))
        return f"pack.json bit {b}"
    name = str(rng.choice(["dense.bin", "experts.bin", "tokenizer.json"]))
    size = (pack / name).stat().st_size
    if pick == 8:
        n = int(rng.integers(size))
        with open(pack / name, "r+b") as f:
            f.truncate(n)
        return f"truncate {name} to {n}"
    meta = json.loads(meta_path.read_text())           # truncated, and pack.json agrees on the size
    n = int(rng.integers(size))
    with open(pack / name, "r+b") as f:
        f.truncate(n)
    meta["files"][name]["bytes"] = n
    meta_path.write_text(json.dumps(meta))
    return f"truncate {name} to {n}, pack.json too"


# ------------------------------------------------------------------------------------------
# Running one case (inside a worker)

def _load_and_run(pack: Path) -> str:
    """Load a pack and use it the way the first request would; "ok" or "nonfinite"."""
    import strata
    from strata.errors import StrataError
    llm = strata.LLM(pack, device="cpu", max_context=64)
    try:
        # llm.logits does not check the context (a tiny context_length is legal): stay inside it
        logits = llm.logits([1, 2, 3, min(4, llm.args.vocab_size - 1)][:llm.max_context])
        text = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
        llm.tokenizer.decode(llm.tokenizer.encode(text))
    except StrataError as e:
        raise _Late(f"{type(e).__name__}: {e}") from None
    except BaseException as e:
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise _Late(f"{type(e).__name__} (not a StrataError): {e}") from None
    return "ok" if np.isfinite(logits).all() else "nonfinite"


class _Late(Exception):
    pass


def run_case(base: dict, kind: str, seed: int, work: Path) -> tuple[str, str, str]:
    """(outcome, mutation, detail) of one case; `base` holds the paths of the valid GGUF and pack."""
    from strata.errors import StrataError
    from strata.pack import convert
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        if kind == "gguf":
            data, what = mutate_gguf(Path(base["gguf"]).read_bytes(), seed)
            (work / "m.gguf").write_bytes(data)
            pack = convert(work / "m.gguf", work / "pack", progress=False)
        else:
            pack = work / "pack"
            shutil.copytree(base["pack"], pack)
            (pack / ".verified.json").unlink(missing_ok=True)
            what = mutate_pack(pack, seed)
        try:
            return _load_and_run(pack), what, ""
        except _Late as e:
            return "late", what, str(e)
    except StrataError as e:
        return "clean", what if "what" in locals() else "?", f"{type(e).__name__}: {e}"
    except BaseException as e:     # tokenizers' PanicException is a BaseException
        if isinstance(e, KeyboardInterrupt):
            raise
        return "other", what if "what" in locals() else "?", f"{type(e).__name__}: {str(e)[:300]}"
    finally:
        shutil.rmtree(work, ignore_errors=True)


def worker_main() -> None:
    """Read {"base", "kind", "seed"} lines on stdin, answer one JSON line each on stdout."""
    import resource
    cap = int(os.environ.get("FUZZ_MEM_BYTES", str(4 << 30)))
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    out = sys.stdout
    sys.stdout = sys.stderr             # a stray print must not corrupt the protocol
    work = Path(os.environ["FUZZ_WORK"])
    import strata  # noqa: F401  (imported before the first case, so a case's time is its own)
    for line in sys.stdin:
        req = json.loads(line)
        outcome, what, detail = run_case(req["base"], req["kind"], req["seed"], work)
        out.write(json.dumps({"outcome": outcome, "what": what, "detail": detail}) + "\n")
        out.flush()


# ------------------------------------------------------------------------------------------
# The pool (in the parent)

class _Worker:
    def __init__(self, work: Path, mem_bytes: int):
        env = dict(os.environ, FUZZ_WORK=str(work), FUZZ_MEM_BYTES=str(mem_bytes), PYTHONPATH=str(REPO),
                   RAYON_NUM_THREADS="1", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", RUST_BACKTRACE="0")
        self.proc = subprocess.Popen([sys.executable, "-c", "from tests.pack.fuzz import worker_main; worker_main()"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     cwd=REPO, env=env, text=True)
        self.case, self.started = None, 0.0

    def send(self, base, case) -> None:
        self.case, self.started = case, time.monotonic()
        self.proc.stdin.write(json.dumps({"base": base, "kind": case[0], "seed": case[1]}) + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def run_cases(base: dict, cases: list, workdir: Path, num_workers: int = 2, case_timeout_s: float = 10.0,
              mem_bytes: int = 4 << 30, first_timeout_s: float = 60.0):
    """Yield (kind, seed, outcome, mutation, detail, seconds) for every case, in completion order."""
    todo = list(reversed(cases))
    workers = [_Worker(workdir / f"w{i}", mem_bytes) for i in range(num_workers)]
    warm = set()
    try:
        while todo or any(w.case for w in workers):
            for w in workers:
                if w.case is None and todo:
                    w.send(base, todo.pop())
            busy = [w for w in workers if w.case is not None]
            ready, _, _ = select.select([w.proc.stdout for w in busy], [], [], 0.05)
            now = time.monotonic()
            for i, w in enumerate(workers):
                if w.case is None:
                    continue
                limit = case_timeout_s if id(w) in warm else first_timeout_s + case_timeout_s
                if w.proc.stdout in ready:
                    line = w.proc.stdout.readline()
                    took = now - w.started
                    if line:
                        r = json.loads(line)
                        res = (r["outcome"], r["what"], r["detail"])
                        warm.add(id(w))
                    else:                       # died: a signal, or an allocation past the cap
                        res = ("crash", "?", f"worker exit {w.proc.wait()}")
                    yield (*w.case, *res, took)
                    w.case = None
                    if not line:
                        workers[i] = _Worker(workdir / f"w{i}", mem_bytes)
                elif now - w.started > limit:
                    yield (*w.case, "hang", "?", f"over {limit:.0f} s", now - w.started)
                    w.kill()
                    workers[i] = _Worker(workdir / f"w{i}", mem_bytes)
    finally:
        for w in workers:
            w.kill()


def _tiny_gguf(path: Path) -> Path:
    """fixtures.make_gguf's tiny qwen3moe file, without the transformers oracle model (seconds to import)."""
    import gguf
    from strata.quant import qtype as qtype_of
    from tests.fixtures import SHAPES, _gguf_metadata, gguf_tensor_specs, make_tokenizer, pick_qtype, \
        random_tensor_bytes
    shape, rng = SHAPES["tiny"], np.random.default_rng(1)
    w = gguf.GGUFWriter(path, "qwen3moe")
    _gguf_metadata(w, shape, make_tokenizer(shape["vocab_size"]), "fuzz-base")
    for name, kind, layer, tshape in gguf_tensor_specs(shape):
        qname = pick_qtype({}, kind, max(layer, 0))
        data = random_tensor_bytes(qname, tshape, rng, kind)
        rows = data.reshape(*tshape[:-1], qtype_of(qname).row_bytes(tshape[-1]))
        w.add_tensor(name, rows, raw_dtype=gguf.GGMLQuantizationType[qname])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def scratch_dir() -> tempfile.TemporaryDirectory:
    """A temporary directory in RAM where there is one: each case converts a pack, and the converter's
    fsyncs on a disk would make the run wait on I/O, not on the code under test."""
    shm = Path("/dev/shm")
    return tempfile.TemporaryDirectory(prefix="strata-fuzz-", dir=shm if os.access(shm, os.W_OK) else None)


def make_bases(root: Path) -> dict:
    """The valid inputs every case starts from: a tiny GGUF and the pack converted from it."""
    from strata.pack import convert
    path = _tiny_gguf(root / "fuzz-base.gguf")
    pack = convert(path, root / "fuzz-base-pack", progress=False)
    return {"gguf": str(path), "pack": str(pack)}
