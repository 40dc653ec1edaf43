"""strata.backends.cuda.kernels.KERNELS against cuda/*.cu, and the host's launches against the table.
These read sources only: no GPU, no build needed.

The .cu files name most kernels through macros (strata_gemv_##name, parameter lists as
STRATA_GEMV3_ARGS), so a small preprocessor expands each file's own #defines before the
`extern "C" __global__` declarations are read.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from strata.backends.cuda.kernels import KERNELS, Kernel

ROOT = Path(__file__).resolve().parents[2]
IDENT = re.compile(r"[A-Za-z_]\w*")

# C parameter types -> strata._ext.runtime signature letters (a pointer of any type is P)
KINDS = {"int": "i", "int32_t": "i", "unsigned": "I", "unsigned int": "I", "uint32_t": "I",
         "long long": "q", "int64_t": "q", "size_t": "q", "unsigned long long": "Q", "uint64_t": "Q",
         "float": "f", "double": "d", "__grid_constant__ TensorMap": "B"}


def _split_args(text: str) -> list[str]:
    """Top-level comma split of a macro call's or a parameter list's text."""
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
            continue
        depth += ch in "([{"
        depth -= ch in ")]}"
        cur += ch
    out.append(cur)
    return [a.strip() for a in out]


def _close(text: str, i: int) -> int:
    """Index just past the parenthesis closing the one at text[i]."""
    depth = 0
    for j in range(i, len(text)):
        depth += text[j] == "("
        depth -= text[j] == ")"
        if depth == 0:
            return j + 1
    raise AssertionError(f"unbalanced parentheses after {text[i:i + 60]!r}")


def _expand(text: str, macros: dict, depth: int = 0) -> str:
    """text with the macros expanded (function-like ones where a call follows), ## pasted."""
    assert depth < 20, "macro expansion does not terminate"
    out, i = [], 0
    for m in IDENT.finditer(text):
        if m.start() < i or m.group() not in macros:
            continue
        params, body = macros[m.group()]
        j = m.end()
        if params is not None:
            k = j
            while k < len(text) and text[k].isspace():
                k += 1
            if k >= len(text) or text[k] != "(":
                continue
            end = _close(text, k)
            args = _split_args(text[k + 1:end - 1]) if params else []
            assert len(args) == len(params), f"{m.group()} takes {len(params)} arguments, got {args}"
            values = dict(zip(params, args))
            body = IDENT.sub(lambda p: values.get(p.group(), p.group()), body)
            j = end
        body = re.sub(r"\s*##\s*", "", body)
        out += [text[i:m.start()], _expand(body, {n: d for n, d in macros.items() if n != m.group()}, depth + 1)]
        i = j
    return "".join(out) + text[i:]


def _preprocess(source: str) -> str:
    """The file's code with its own #defines expanded (#undef honoured; headers' macros left as they are)."""
    source = re.sub(r"\\\n", " ", source)
    source = re.sub(r"/\*.*?\*/", " ", source, flags=re.S)
    source = re.sub(r"//[^\n]*", "", source)
    macros, code = {}, []
    for line in source.split("\n"):
        d = re.match(r"\s*#\s*define\s+(\w+)(\(([^)]*)\))?\s*(.*)", line)
        if d:
            params = None if d.group(2) is None else [p.strip() for p in d.group(3).split(",") if p.strip()]
            macros[d.group(1)] = (params, d.group(4))
        elif (u := re.match(r"\s*#\s*undef\s+(\w+)", line)):
            macros.pop(u.group(1), None)
        elif not line.lstrip().startswith("#"):
            code.append(_expand(line, macros))
    return "\n".join(code)


def _kind(param: str) -> str:
    if "*" in param or "[" in param:
        return "P"
    words = [w for w in param.split() if w not in ("const", "__restrict__", "volatile")]
    c_type = " ".join(words[:-1])             # the last word is the parameter's name
    assert c_type in KINDS, f"no signature letter for parameter {param!r}"
    return KINDS[c_type]


def kernels_of(source: str) -> dict[str, str]:
    """{kernel name: signature} of every extern "C" __global__ function in a .cu file's text."""
    code = _preprocess(source)
    found = {}
    for m in re.finditer(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*)?', code):
        i = m.end()
        if code[i] == "(":                          # __launch_bounds__(...)
            i = _close(code, i)
        while code[i].isspace():
            i += 1
        name = IDENT.match(code, i).group()
        start = code.index("(", i)
        params = code[start + 1:_close(code, start) - 1].strip()
        found[name] = "".join(_kind(p) for p in _split_args(params)) if params not in ("", "void") else ""
    return found


@pytest.fixture(scope="module")
def sources() -> dict[str, dict[str, str]]:
    return {p.stem: kernels_of(p.read_text()) for p in sorted((ROOT / "cuda").glob("*.cu"))}


def test_the_parser_reads_macro_kernels():
    src = """
#define ARGS const uint8_t *W, float *y, \\
    int rows, long long n
#define K(name) extern "C" __global__ void __launch_bounds__(kWarps * 32) strata_k_##name(ARGS) { body(f(a, b)); }
#define K2(x) K(x) K(x##_b)
K2(q4_0)
// extern "C" __global__ void strata_in_a_comment(int a)
extern "C" __global__ void strata_plain(const unsigned long long* p, uint64_t ns, float s) {}
"""
    assert kernels_of(src) == {"strata_k_q4_0": "PPiq", "strata_k_q4_0_b": "PPiq", "strata_plain": "PQf"}


@pytest.mark.parametrize("op", sorted(KERNELS))
def test_every_table_entry_is_a_kernel_of_its_library(op, sources):
    k = KERNELS[op]
    assert k.library in sources, f"{op}: no cuda/{k.library}.cu"
    assert k.over and all(set(f) == k.field_names for f in k.over), f"{op}: `over` does not give {k.field_names}"
    for name in k.names():
        assert name in sources[k.library], f"{op}: cuda/{k.library}.cu has no extern \"C\" __global__ {name}"
        assert sources[k.library][name] == k.signature, \
            f"{op}: {name} takes {sources[k.library][name]!r} in cuda/{k.library}.cu, the table says {k.signature!r}"


def test_every_kernel_in_cuda_is_in_the_table(sources):
    named = {(k.library, n) for k in KERNELS.values() for n in k.names()}
    missing = sorted(f"{lib}.cu {name}" for lib, found in sources.items() for name in found if (lib, name) not in named)
    assert not missing, f"kernels the table does not name: {missing}"


def test_a_broken_entry_fails(sources):
    """The checks above can fail: a wrong letter, a wrong library, a missing variant."""
    good = KERNELS["gemv_batch"]
    assert sources[good.library][good.name(qtype="Q4_K")] == good.signature
    for bad in (Kernel("gemv", good.entry, "PPPii", 128, "", good.over),
                Kernel("gemv", "strata_gemv_batch_{qtype}", good.signature, 128, "", ({"qtype": "Q7_K"},)),
                Kernel("attention", good.entry, good.signature, 128, "", good.over)):
        assert any(sources[bad.library].get(n) != bad.signature for n in bad.names())


# ---- the host's launches go through the table ---------------------------------------------------------

HOST = [p for d in ("strata/backends/cuda", "strata/engine") for p in sorted((ROOT / d).rglob("*.py"))
        if p.name != "kernels.py"]


def _strings(tree) -> list[tuple[int, str]]:
    """(line, text) of every string constant that is not a docstring, f-strings' literal parts included."""
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


@pytest.mark.parametrize("path", HOST, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_kernel_name_or_signature_outside_the_table(path):
    tree = ast.parse(path.read_text())
    names = [(line, s) for line, s in _strings(tree) if re.search(r"(^|\W)strata_\w+", s) and " " not in s.strip()]
    assert not names, f"{path.name}: kernel names outside strata/backends/cuda/kernels.py: {names}"
    signatures = [(line, s) for line, s in _strings(tree) if re.fullmatch(r"[PiIqQfdB]{2,}", s)]
    assert not signatures, f"{path.name}: signatures outside strata/backends/cuda/kernels.py: {signatures}"
    for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)):
        literal = [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        if call.func.attr == "kernel":            # Library.kernel(device, name, signature)
            assert not literal, f"{path.name}:{call.lineno}: .kernel() with literal {literal}: use kernels.load_kernel"
        if call.func.attr in ("launch", "_launch", "_kernel") and literal:
            assert literal[0] in KERNELS and len(literal) == 1, \
                f"{path.name}:{call.lineno}: {call.func.attr}({literal}) is not a KERNELS op"


def test_the_routing_gate_up_stages_x_only_beside_its_static_shared_memory():
    """strata_moe_gate_up_route_*: its ~4 KB of static shared memory (the layer's expert table, the picks) and
    the staged x share the 48 KB a launch gets, so an x that fits gate_up alone but not beside them is read from
    global memory (shared 0: the same bits); the 30B's x (2,048 Q4_K weights) stays staged."""
    from strata.backends.cuda.moe_decode import (MAX_SHARED_BYTES, ROUTE_STATIC_BYTES, gate_up_launch,
                                                 gate_up_route_launch)
    small = gate_up_route_launch("Q4_K", 1, 8, 768, 2048)
    assert small.op == "moe_gate_up_route" and small.shared_bytes == gate_up_launch("Q4_K", 1, 8, 768, 2048).shared_bytes > 0
    assert small.signature == "PqqPPPiiiPPii" and small.name == "strata_moe_gate_up_route_q4_k"
    D = 10240                                         # staged: 36 floats a 32-weight block (32 values, 4 pad): 45 KB
    plain = gate_up_launch("Q8_0", 1, 8, 64, D)
    assert MAX_SHARED_BYTES - ROUTE_STATIC_BYTES < plain.shared_bytes <= MAX_SHARED_BYTES
    assert gate_up_route_launch("Q8_0", 1, 8, 64, D).shared_bytes == 0
