"""tools/attention_wg_ab.py on the CPU: a host double of the driver computes each launch as
cuda/attention_tc.cu's contract says (f16 K/V, a causal softmax over cells 0..position, the grid's
blocks of 64 flattened (token, head) rows). The tool passes such an arm, fails one that reads past
the last position (the NaN cells) or one that misplaces heads, and times every arm."""
import json
import math
import struct

import numpy as np
import pytest

from tests.fixtures import load_tool
from tests.kernels.host_driver import HostDriver


class AttentionDriver(HostDriver):
    """Paths containing "overread" attend to one cell past each position; "heads" swaps query heads;
    "ws" is cuda/attention_ws.cu's build: Dh 128 only, 128 rows a block of 384 threads with dynamic
    shared memory; "wst" its TMA build, which reads K and V through the two tensor maps that follow
    (here 128 bytes holding the address, dims, strides and box), so a map over too few cells or of
    the wrong cache shows in its results."""

    def tensor_map_f16(self, ptr, dims, strides, box):
        return struct.pack("<Q3Q2Q3Q", ptr, *dims, *strides, *box).ljust(128, b"\0")

    def function(self, mod, name):
        if "ws" in mod and not name.endswith("_d256" if "wst64" in name else "_d128"):
            raise RuntimeError("CUDA driver error CUDA_ERROR_NOT_FOUND")
        return mod, name

    def launch(self, f, grid, block, args, shared=0):
        (path, name), vals = f, [v for _, v in args]
        q_p, k_p, v_p, pos_p, out_p, T, H, Hk, scale = vals[:9]
        dh = int(name.rsplit("_d", 1)[1])
        dyn = 197696 if "wst64" in name else 164928 if "wst" in path else 163968
        rows, threads, dyn = (128, 384, dyn) if "ws" in path else (64, 256 if dh == 256 else 128, 0)
        kinds = "PPPPPiiif" + "BB" * ("wst" in path)
        assert "".join(k for k, _ in args) == kinds and (block, shared) == (threads, dyn)
        box = 64 if "wst64" in name else rows
        cells = None
        if "wst" in path:                   # K and V as the maps give them: cells past their end read 0
            (k_p, *kmap), (v_p, *vmap) = (struct.unpack("<Q3Q2Q3Q", m[:72]) for m in vals[9:])
            assert kmap == vmap and kmap[3:5] == [kmap[0] * 2, kmap[0] * kmap[1] * 2] and kmap[5:] == [64, 1, box]
            cells = kmap[2]
        assert grid == (-(-T * (H // Hk) // rows), Hk)
        assert math.isclose(scale, 1 / math.sqrt(dh), rel_tol=1e-6)
        self.launches.append((path, name))
        q, k, v = self._tensor(q_p).reshape(T, H, dh), self._tensor(k_p), self._tensor(v_p)
        if cells is not None:
            k, v = (np.where(np.arange(len(x))[:, None, None] < cells, x, 0) for x in (k, v))
        pos, out = self._tensor(pos_p), self._tensor(out_p).reshape(T, H, dh)
        G = H // Hk
        for t in range(T):
            last = int(pos[t]) + 1 + ("overread" in path)
            for h in range(H):
                hq = (h + 1) % H if "heads" in path else h
                s = k[:last, h // G].astype(np.float64) @ q[t, hq].astype(np.float64) * scale
                w = np.exp(s - s.max())
                out[t, h] = w @ v[:last, h // G].astype(np.float64) / w.sum()


def test_checks_pass_a_contract_arm_and_fail_wrong_ones(tmp_path, capsys):
    tool = load_tool("attention_wg_ab")
    dev = AttentionDriver()
    out = tmp_path / "r.json"
    argv = ["--arm", "tc:a.fatbin:strata_attention_prefill_tc_f16",
            "--arm", "wg:b.fatbin:strata_attention_prefill_wg_f16",
            "--arm", "over:overread.fatbin:strata_attention_prefill_wg_f16",
            "--arm", "heads:heads.fatbin:strata_attention_prefill_wg_f16", "--chunks", "40@3", "--repeats", "2",
            "--json", str(out)]
    assert tool.main(argv, make_driver=lambda: dev) == 1
    report = json.loads(out.read_text())
    assert report["ok"] == {"tc": True, "wg": True, "over": False, "heads": False}
    assert set(report["checks"]["tc"]) == {c[0] for c in tool.CASES}
    assert all(r["max_diff_from_first"] == 0.0 for r in report["checks"]["wg"].values())
    assert all(r["worst_over_bound"] > 1 for r in report["checks"]["heads"].values())
    (t,) = report["times"]
    assert (t["T"], t["offset"]) == (40, 3) and set(t["arms"]) == {"tc", "wg", "over", "heads"}
    assert ("b.fatbin", "strata_attention_prefill_wg_f16_d64") in dev.launches
    assert ("b.fatbin", "strata_attention_prefill_wg_f16_d128") in dev.launches
    assert "checks passed: tc yes, wg yes, over NO, heads NO" in capsys.readouterr().out


def test_reference_is_a_causal_softmax():
    tool = load_tool("attention_wg_ab")
    q, k, v, pos = tool.make_case(np.random.default_rng(1), 64, 4, 2, 3, 2)
    assert np.isnan(k[5:]).all() and pos.tolist() == [2, 3, 4]
    ref = tool.reference(q, k, v, pos).reshape(3, 4, 64)
    # token 0 at position 2 sees cells 0..2 only; head 3 reads KV head 1
    s = k[:3, 1].astype(np.float64) @ q[0, 3].astype(np.float64) / 8
    w = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
    np.testing.assert_allclose(ref[0, 3], w @ v[:3, 1].astype(np.float64), rtol=1e-12)


# name -> (arm, its head dim, the shape it is timed at)
ARMS = {"ws": ("ws:ws.fatbin:strata_attention_prefill_ws128_f16:128:384:163968", 128, "30b"),
        "wst": ("wst:wst.fatbin:strata_attention_prefill_wst128_f16:128:384:164928:tma", 128, "30b"),
        "wst64": ("wst64:wst64.fatbin:strata_attention_prefill_wst64_f16:128:384:197696:tma64", 256, "80b")}


@pytest.mark.parametrize("name", sorted(ARMS))
def test_an_arm_of_other_rows_and_head_dims(tmp_path, name):
    """A ROWS:THREADS:SHARED arm launches its own grid, and a case of a head dim it has no entry point
    for is skipped for it, not failed, and is timed only at a shape of its head dim. A 'tma' arm gets K's
    and V's tensor maps after the contract's arguments, over the cells up to the chunk's last position
    (the NaN cells past it never read), boxes of its cells ('tma64': 64)."""
    tool = load_tool("attention_wg_ab")
    dev = AttentionDriver()
    out = tmp_path / "r.json"
    spec, dh, shape = ARMS[name]
    argv = ["--arm", "tc:a.fatbin:strata_attention_prefill_tc_f16", "--arm", spec, "--chunks", "40@3",
            "--repeats", "2", "--json", str(out), "--shape", shape]
    assert tool.main(argv, make_driver=lambda: dev) == 0
    report = json.loads(out.read_text())
    assert report["ok"] == {"tc": True, name: True}
    dims = {label: d for label, d, *_ in tool.CASES}
    assert {label for label in report["checks"][name]} == {label for label, d in dims.items() if d == dh}
    assert all(r["max_diff_from_first"] < 1e-6 for r in report["checks"][name].values())
    prefix = spec.split(":")[2]
    assert (f"{name}.fatbin", f"{prefix}_d{dh}") in dev.launches
    assert set(report["times"][0]["arms"]) == {"tc", name}
    assert ("a.fatbin", f"strata_attention_prefill_tc_f16_d{dh}") in dev.launches
