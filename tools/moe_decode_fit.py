"""Fit a MoE decode kernel's time as a fixed cost plus bytes over a rate (#16's question: what bounds a
one-token launch), from tools/moe_decode_bench.py --json files taken at several --A (experts a token).

    for A in 1 2 4 8; do python tools/moe_decode_bench.py --types Q4_K --tokens 1 --A $A --json fit_$A.json; done
    python tools/moe_decode_fit.py fit_*.json

For each kernel (gate_up, down, both) and block count, a least-squares line us = fixed + MB / (GB/s)
over the files' rows: the fixed microseconds a launch pays whatever it reads, and the rate its
bytes stream at, beside the copy rate the bench measured. A fixed cost near the one-token time says
fewer launches (fusion, a persistent kernel) pay; a rate far below the copy rate says the kernels
read too slowly.
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

KERNELS = ("gate_up", "down", "both")


def kernel_bytes(row: dict, kernel: str) -> float:
    """Bytes the kernel reads in a row: its GB/s times its microseconds."""
    return row[f"{kernel}_gbps"] * row[f"{kernel}_us"] * 1e3


def fit(points: list[tuple[float, float]]) -> dict:
    """(bytes, us) points -> {"fixed_us", "gbps", "max_residual_us", "points"}: us = fixed + bytes / rate."""
    b = np.array([p[0] for p in points], np.float64)
    us = np.array([p[1] for p in points], np.float64)
    if len(points) < 2 or np.ptp(b) == 0:
        raise ValueError("a fit needs rows at two or more byte counts (several --A)")
    slope, fixed = np.polyfit(b, us, 1)          # us per byte, us
    resid = us - (fixed + slope * b)
    return {"fixed_us": float(fixed), "gbps": float(1e-3 / slope) if slope > 0 else float("inf"),
            "max_residual_us": float(np.abs(resid).max()), "points": len(points)}


def fits(docs: list[dict]) -> list[dict]:
    """One fit per (qtype, T, blocks per SM, kernel) over every document's rows."""
    groups: dict[tuple, list] = {}
    for doc in docs:
        for row in doc["rows"]:
            for k in KERNELS:
                groups.setdefault((row["qtype"], row["T"], row["blocks_per_sm"], k), []).append(
                    (kernel_bytes(row, k), row[f"{k}_us"]))
    out = []
    for (q, T, bps, k), points in sorted(groups.items()):
        out.append({"qtype": q, "T": T, "blocks_per_sm": bps, "kernel": k, **fit(points)})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", help="tools/moe_decode_bench.py --json outputs, one per --A")
    args = p.parse_args(argv)
    docs = []
    for path in args.files:
        try:
            with open(path) as f:
                docs.append(json.load(f))
        except (OSError, ValueError) as exc:
            print(f"moe_decode_fit: {path}: {exc}", file=sys.stderr)
            return 2
    copy = max((d.get("copy_rate_gbps") or 0) for d in docs)
    try:
        rows = fits(docs)
    except ValueError as exc:
        print(f"moe_decode_fit: {exc}", file=sys.stderr)
        return 2
    for r in rows:
        share = f" ({r['gbps'] / copy:.0%} of the {copy:,.0f} GB/s copy rate)" if copy and r["gbps"] < float("inf") else ""
        print(f"{r['qtype']:6s} T {r['T']} bps {r['blocks_per_sm']} {r['kernel']:7s}: {r['fixed_us']:6.2f} us fixed + "
              f"bytes at {r['gbps']:,.0f} GB/s{share}; max residual {r['max_residual_us']:.2f} us over "
              f"{r['points']} points")
    return 0


if __name__ == "__main__":
    sys.exit(main())
