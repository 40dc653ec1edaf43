"""tools/moe_gemm_ab.py on the CPU: a host double of tools/fatbin_driver.Driver computes each launch
the way cuda/moe_gemm.cu's contract says (f16(X) f16(W_g)^T over the tile table; rows of no tile, and
groups whose address is 0, untouched). The tool's checks pass such an arm, fail a perturbed or a
wrong-rows one (exit 1), and its timing pass launches every arm with the contract's arguments."""
import json
import struct

import numpy as np
import pytest

from strata.backends.cuda.moe_gemm import QTYPE_NAMES, TMA_ROWS, WS_BLOCK, WS_SHARED_BYTES, WST_SHARED_BYTES
from strata.quant import QTYPES
from strata.quant.dequant import dequantize
from tests.fixtures import load_tool
from tests.kernels.host_driver import HostDriver


class GemmDriver(HostDriver):
    """cuda/moe_gemm.cu's contract; module paths containing "noisy" or "shifted" give a wrong kernel.
    strata_moe_gemm_wst_f16 reads X and the weights through its two tensor maps (here 128 bytes holding
    the address, dims, stride and box), so a map over the wrong rows or block shows in its results."""

    MAP = struct.Struct("<Q2QQ2Q")

    def tensor_map_f16(self, ptr, dims, strides, box):
        assert len(dims) == 2 and box == (64, TMA_ROWS) and strides[0] % 16 == 0
        return self.MAP.pack(ptr, *dims, *strides, *box).ljust(128, b"\0")

    def launch(self, f, grid, block, args, shared=0):
        (path, name), vals = f, [v for _, v in args]
        kinds = "".join(k for k, _ in args)
        if name == "strata_moe_gemm_wst_f16":
            assert kinds == "PqPPqPqiiiQBB" and block == WS_BLOCK and shared == WST_SHARED_BYTES
            ptrs, part, tiles, X, ldx, Y, ldy, N, K, n_tiles, w_base, mx, mw = vals
            assert grid == min(self.num_sms(), -(-N // 128) * n_tiles)
            (xa, xk, x_rows, x_stride, *_), (wa, wk, w_rows, w_stride, *_) = (self.MAP.unpack(m[:self.MAP.size])
                                                                           for m in (mx, mw))
            assert xk == wk == K and wa == w_base and w_stride == 2 * K
            Xa = self._bytes_at(xa, x_rows * x_stride).view(np.float16).reshape(x_rows, -1)[:, :K]
            Wa = self._bytes_at(wa, w_rows * w_stride).view(np.float16).reshape(w_rows, K)
            P, T, Ya = self._tensor(ptrs), self._tensor(tiles), self._tensor(Y)
            for g, s0, m, _ in T:
                if m <= 0 or P[g] == 0:
                    continue
                r0 = (int(P[g]) + part - w_base) // (2 * K)
                Ya[s0:s0 + m] = Xa[s0:s0 + m].astype(np.float64) @ Wa[r0:r0 + N].astype(np.float64).T
            self.launches.append((path, "F16"))
            return
        if name.startswith("strata_dequant_h_"):     # cuda/dequant.cu's f16 rows (wrong in "noisy" modules)
            assert kinds == "PPq" and block == 256
            qt = next(QTYPES[q] for q in QTYPE_NAMES if name.endswith("_" + q.lower()))
            src, dst, n_blocks = vals
            n = n_blocks * qt.block_size
            h = dequantize(qt.name, self._bytes_at(src, n_blocks * qt.type_size), (n,)).astype(np.float16)
            if "noisy" in path:
                h[0] = -h[0] if h[0] != 0 else np.float16(1)
            self._tensor(dst).reshape(-1).view(np.float16)[:n] = h
            self.launches.append((path, qt.name))
            return
        qtype = next(q for q in QTYPE_NAMES if name.endswith("_" + q.lower()))
        if "_ws" in name:       # cuda/moe_gemm_ws.cu: persistent blocks, the tile count as a tenth argument
            assert kinds == "PqPPqPqiii" and block == WS_BLOCK and shared == WS_SHARED_BYTES
            *vals, n_tiles = vals
            assert n_tiles == self._tensor(vals[2]).shape[0]
            assert self._tensor(vals[3]).dtype == (np.float16 if "_ws16_" in name else np.float32)
            assert grid == min(self.num_sms(), -(-vals[7] // 128) * n_tiles)
        else:
            assert kinds == "PqPPqPqii" and block == 256 and shared == 0
            assert grid == (-(-vals[7] // 128), self._tensor(vals[2]).shape[0])
        ptrs, part, tiles, X, ldx, Y, ldy, N, K = vals
        self.launches.append((path, qtype))
        P, T, Xa, Ya = self._tensor(ptrs), self._tensor(tiles), self._tensor(X), self._tensor(Y)
        assert Xa.shape[1] == ldx and Ya.shape[1] == ldy
        row_bytes = QTYPES[qtype].row_bytes(K)
        for g, s0, m, _ in T:
            if m <= 0 or P[g] == 0:
                continue
            W = dequantize(qtype, self._bytes_at(int(P[g]) + part, N * row_bytes), (N, K))
            x16 = Xa[s0:s0 + m].astype(np.float16).astype(np.float64)
            y = x16 @ W.astype(np.float16).astype(np.float64).T
            if "noisy" in path:
                y = y * (1 + 1e-2 * self.rng.standard_normal(y.shape))
            if "shifted" in path:
                s0 += 1 if s0 + m < Ya.shape[0] else 0
            Ya[s0:s0 + m] = y


def test_checks_pass_a_contract_arm_and_fail_wrong_ones(tmp_path, capsys):
    tool = load_tool("moe_gemm_ab")
    dev = GemmDriver()
    out = tmp_path / "r.json"
    argv = ["--arm", "mma:a.fatbin:strata_moe_gemm", "--arm", "wg:b.fatbin:strata_moe_gemm_wg",
            "--arm", "ws:c.fatbin:strata_moe_gemm_ws:ws", "--arm", "ws16:d.fatbin:strata_moe_gemm_ws16:ws16",
            "--arm", "noisy:noisy.fatbin:strata_moe_gemm_wg", "--arm", "shifted:shifted.fatbin:strata_moe_gemm_wg",
            "--tokens", "64", "--repeats", "2", "--only", "k/v", "--json", str(out)]
    assert tool.main(argv, make_driver=lambda: dev) == 1
    report = json.loads(out.read_text())
    assert report["ok"] == {"mma": True, "wg": True, "ws": True, "ws16": True, "noisy": False, "shifted": False}
    checks = report["checks"]
    assert set(checks["mma"]) == set(tool.QTYPE_NAMES)
    assert all(r["equal_to_first"] == 1.0 for r in checks["wg"].values())
    assert all(r["equal_to_first"] == 1.0 for r in checks["ws"].values())
    assert all(r["equal_to_first"] == 1.0 for r in checks["ws16"].values())
    assert all(r["worst_over_bound"] > 1 for r in checks["noisy"].values())
    assert not any(r["untouched_nan"] for r in checks["shifted"].values())
    # the timing pass: the dense k/v shape at 64 tokens, every arm launched with its entry point
    (t,) = report["times"]
    assert (t["qtype"], t["N"], t["K"], t["rows"]) == ("Q8_0", 512, 2048, 64)
    assert set(t["arms"]) == {"mma", "wg", "ws", "ws16", "noisy", "shifted"}
    assert {("b.fatbin", "Q8_0"), ("c.fatbin", "Q8_0"), ("d.fatbin", "Q8_0")} <= set(dev.launches)
    assert "checks passed: mma yes, wg yes, ws yes, ws16 yes, noisy NO, shifted NO" in capsys.readouterr().out


def _retyped_run(tmp_path, arm: str):
    """moe_gemm_ab over the dense k/v shape at 64 tokens, again as F16 with the dequantization timed, the
    parent arm and `arm`: (tool, the driver, argv, the JSON report)."""
    tool = load_tool("moe_gemm_ab")
    dev = GemmDriver()
    out = tmp_path / "r.json"
    argv = ["--arm", "mma:a.fatbin:strata_moe_gemm", "--arm", arm,
            "--tokens", "64", "--repeats", "2", "--only", "k/v", "--retype", "F16", "--dequant", "dq.fatbin",
            "--json", str(out)]
    assert tool.main(argv, make_driver=lambda: dev) == 0
    return tool, dev, argv, json.loads(out.read_text())


def test_a_tma_arm_takes_the_f16_shapes_through_its_maps(tmp_path):
    """A wst arm (strata_moe_gemm_wst_f16): checked on F16 only, where its outputs equal the parent's bit
    for bit; timed on the --retype F16 shapes only, its "+ dequant" set against the first arm's decoding
    GEMM; the other shapes print '-' for it."""
    _, dev, _, report = _retyped_run(tmp_path, "wst:e.fatbin:strata_moe_gemm_wst:wst")
    assert list(report["checks"]["wst"]) == ["F16"] and report["checks"]["wst"]["F16"]["equal_to_first"] == 1.0
    q8, f16 = report["times"]
    assert set(q8["arms"]) == {"mma"} and set(f16["arms"]) == {"mma", "wst"}
    assert f16["dq_total_ms"] == {"mma": 2.0, "wst": 2.0}
    assert ("e.fatbin", "F16") in dev.launches


def test_all_good_arms_exit_zero():
    tool = load_tool("moe_gemm_ab")
    assert tool.main(["--arm", "a:a.fatbin:strata_moe_gemm", "--no-times"], make_driver=GemmDriver) == 0


@pytest.mark.parametrize("name", ["Q4_K", "F32"])
def test_check_case_has_an_uncovered_row_and_a_null_group(name):
    tool = load_tool("moe_gemm_ab")
    weights, ranges, X = tool.check_case(name, np.random.default_rng(0))
    covered = np.zeros(X.shape[0], bool)
    for g, s0, rows in ranges:
        assert not covered[s0:s0 + rows].any()
        covered[s0:s0 + rows] = True
    assert (~covered).sum() == 1 and ranges[-1][0] == 3
    assert X.shape[1] % max(QTYPES[name].block_size, 8) == 0


def test_retype_and_dequant_times(tmp_path):
    """--retype times each shape again with F16 weights (a ws16 arm's both-operands-copied build);
    --dequant checks strata_dequant_h_<type> against f16(dequantize) and times it; a wrong dequant
    build stops the run."""
    tool, dev, argv, report = _retyped_run(tmp_path, "ws16:d.fatbin:strata_moe_gemm_ws16:ws16")
    q8, f16 = report["times"]
    assert (q8["qtype"], f16["qtype"]) == ("Q8_0", "F16") and q8["dequant_ms"] == 1.0 and "dequant_ms" not in f16
    assert f16["dq_total_ms"] == {"mma": 2.0, "ws16": 2.0} and "dq_total_ms" not in q8
    assert {("d.fatbin", "F16"), ("dq.fatbin", "Q8_0")} <= set(dev.launches)
    with pytest.raises(RuntimeError, match="strata_dequant_h_q8_0: .* differ"):
        tool.main(argv[:-2] + ["--dequant", "noisy.fatbin"], make_driver=GemmDriver)
