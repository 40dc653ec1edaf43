"""Diagnostic builds of cuda/attention_ws.cu with one part of the tile loop taken out (#17): where a
tile's time goes. Each is written to /tmp and built to .whl/attention_ws_<name>.fatbin; their results
are wrong by design, so tools/attention_wg_ab.py is run on them for its times only.

    python3 tools/variants/attention_ws_diag.py     -> .whl/attention_ws_{nosoftmax,nopv,nos,ring192}.fatbin
      nosoftmax  no mask, max or exponentials: P is S rounded to f16, O not rescaled
      nopv       no O += P V MMAs
      nos        no S = Q K^T MMAs (S is zeros)
      ring192    not a diagnostic: the K/V ring at 192 KB (3 stages of 128-cell tiles, 6 of 64-cell ones;
                 dynamic shared memory 229,472 and 229,568 bytes), a right result
"""
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = (ROOT / "cuda" / "attention_ws.cu").read_text()
FLAGS = {"ring192": ["-DSTRATA_WS_RING_KB=192"]}
EDITS = {
    "ring192": [],
    "nosoftmax": [("        softmax_to_p(s, o, m, l, pa, cell0, min_pos, row_pos, tq);\n",
                   "#pragma unroll\n        for (int ks = 0; ks < CELLS / 16; ++ks)\n#pragma unroll\n"
                   "            for (int j = 0; j < 4; ++j) pa[ks][j] = pack_half2(s[2 * ks + j / 2][2 * (j % 2)], "
                   "s[2 * ks + j / 2][2 * (j % 2) + 1]);\n")],
    "nopv": [("            wgmma_rs_n128(o, pa[ks], smem_desc(v_tile + 2 * ks * kCellStep, kCellStep, kDimStep));\n",
              "            o[0][0] += __uint_as_float(pa[ks][0] & 1u);\n")],
    "nos": [("            if constexpr (CELLS == 128)\n                wgmma_ss_n128(s, qd, kd, ks > 0);\n"
             "            else\n                wgmma_ss_n64(s, qd, kd, ks > 0);\n",
             "            if (ks == 0)\n#pragma unroll\n                for (int n = 0; n < CTILES; ++n) "
             "s[n][0] = s[n][1] = s[n][2] = s[n][3] = float(qd & 1) + float(kd & 1);\n")],
}


def main() -> int:
    tmp = Path("/tmp/attention_ws_diag")
    tmp.mkdir(exist_ok=True)
    for f in (ROOT / "cuda").glob("*.cuh"):
        shutil.copy(f, tmp / f.name)
    (ROOT / ".whl").mkdir(exist_ok=True)
    procs = []
    for name, edits in EDITS.items():
        text = SRC
        for old, new in edits:
            if old not in text:
                print(f"{name}: the edit's text is not in cuda/attention_ws.cu", file=sys.stderr)
                return 1
            text = text.replace(old, new)
        src = tmp / f"attention_ws_{name}.cu"
        src.write_text(text)
        procs.append(subprocess.Popen(["nvcc", "-fatbin", "-O3", "-std=c++17", *FLAGS.get(name, []),
                                       "-gencode=arch=compute_90a,code=sm_90a", f"-I{tmp}", "-o",
                                       str(ROOT / ".whl" / f"attention_ws_{name}.fatbin"), str(src)]))
    return max(p.wait() for p in procs)


if __name__ == "__main__":
    sys.exit(main())
