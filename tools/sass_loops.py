"""The loops of a kernel's SASS, counted on the CPU: how many instructions one trip through each loop
issues, and of what kind. Where a kernel is issue-bound (the quantized decode attention, #14), bytes
per instruction of its main loop say more than a guess, and a variant can be weighed before a device
call. Registers and spills come from ptxas.

    python tools/sass_loops.py cuda/kv_quant.cu strata_attention_decode_q4_0_d128_g8 [--arch sm_90]
                               [--min 100] [-I cuda] [-D NAME=VALUE ...]

Needs nvcc and cuobjdump. cuobjdump is not in every CUDA install; PyPI's nvidia-cuda-cuobjdump wheel
has it (`pip download --no-deps nvidia-cuda-cuobjdump`, unzip, point STRATA_CUOBJDUMP at
nvidia/cu13/bin/cuobjdump), and cuobjdump -sass runs nvdisasm, from the nvidia-cuda-nvdisasm wheel the same
way (its nvidia/cu13/bin on PATH, or NVDISASM_PATH). A loop is the span from a backward branch's target to the branch; its
count is the static instructions in it (branches inside a loop, like a skipped rescale, still count).
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"\bBRA\s+(?:(?:!?P\d|!?PT),\s*)?0x([0-9a-f]+)")


class Loop(NamedTuple):
    start: int                  # the branch's target
    end: int                    # the backward branch
    ops: collections.Counter    # opcode -> instructions of the loop body

    @property
    def count(self) -> int:
        return sum(self.ops.values())


def parse_sass(text: str) -> list[tuple[int, str]]:
    """(address, instruction) of each SASS line of a cuobjdump -sass listing, predicates kept."""
    return [(int(m.group(1), 16), m.group(2)) for m in map(_INSTR.search, text.splitlines()) if m]


def opcode(instruction: str) -> str:
    """The opcode without its modifiers: `@!P0 IMAD.WIDE.U32 R2, ...` -> IMAD."""
    words = instruction.split()
    return (words[1] if words[0].startswith("@") and len(words) > 1 else words[0]).split(".")[0]


def loops(instructions: list[tuple[int, str]], smallest: int = 1) -> list[Loop]:
    """Every backward branch's loop, innermost (shortest) first, of at least `smallest` instructions."""
    index = {addr: i for i, (addr, _) in enumerate(instructions)}
    found = []
    for i, (addr, text) in enumerate(instructions):
        m = _BRANCH.search(text)
        if not m or "BRA.DIV" in text:
            continue
        target = int(m.group(1), 16)
        if target < addr and target in index:     # a kernel ends on a branch to itself
            body = instructions[index[target]:i + 1]
            if len(body) >= smallest:
                found.append(Loop(target, addr, collections.Counter(opcode(t) for _, t in body)))
    return sorted(found, key=lambda lp: lp.count)


def ptxas_stats(log: str, kernel: str) -> str:
    """ptxas -v's registers and spills of `kernel` (the lines after its "Compiling entry function")."""
    lines = log.splitlines()
    for i, line in enumerate(lines):
        if f"Compiling entry function '{kernel}'" in line:
            block = []
            for later in lines[i + 1:i + 6]:
                if "stack frame" in later or "Used" in later:
                    block.append(later.split("info    :")[-1].strip())
                if "Used" in later:
                    break
            return " | ".join(block)
    return "(ptxas gave no statistics)"


def tool(name: str, env: str) -> str:
    path = os.environ.get(env) or shutil.which(name)
    if not path:
        sys.exit(f"sass_loops: {name} not found (set {env}, or put it on PATH; see the module doc)")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("source", type=Path, help="a cuda/*.cu file (or a variant of one)")
    ap.add_argument("kernel", help="the entry point's name")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--min", type=int, default=100, help="smallest loop to show, in instructions")
    ap.add_argument("-I", dest="include", action="append", default=[], help="include directory (cuda/ by default)")
    ap.add_argument("-D", dest="define", action="append", default=[], help="macro for nvcc")
    args = ap.parse_args(argv)
    nvcc, cuobjdump = tool("nvcc", "STRATA_NVCC"), tool("cuobjdump", "STRATA_CUOBJDUMP")
    includes = args.include or [str(Path(__file__).resolve().parents[1] / "cuda")]
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        build = subprocess.run([nvcc, "-cubin", f"-arch={args.arch}", "-std=c++17", "-O3", "-Xptxas", "-v",
                                *(f"-I{d}" for d in includes), *(f"-D{d}" for d in args.define),
                                "-o", str(cubin), str(args.source)], capture_output=True, text=True)
        if build.returncode:
            sys.exit(f"sass_loops: nvcc failed:\n{build.stderr[-2000:]}")
        sass = subprocess.run([cuobjdump, "-sass", "-fun", args.kernel, str(cubin)], capture_output=True, text=True)
    instructions = parse_sass(sass.stdout)
    if not instructions:
        sys.exit(f"sass_loops: no SASS for {args.kernel} in {args.source} (is the name an entry point?)")
    print(f"{args.kernel} ({args.arch}): {len(instructions)} instructions")
    print("  " + ptxas_stats(build.stderr, args.kernel))
    for lp in loops(instructions, args.min):
        top = ", ".join(f"{op} {n}" for op, n in lp.ops.most_common(10))
        print(f"  loop {lp.start:#x}..{lp.end:#x}: {lp.count} instructions ({top})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
