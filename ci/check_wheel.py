"""Check a built strata-moe wheel: a manylinux tag, the kernels the manifest lists for the archs
asked for (hashes and the archs inside each fatbin), the runtime extension, the demo pack, the
Monitor's static files and the license metadata.

    python ci/check_wheel.py dist/strata_moe-....whl [--archs all|90|80,90] [--source .]

Prints one line per problem and exits 1, or prints what the wheel holds and its size.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import re
import struct
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FATBIN_MAGIC = 0xBA55ED50
FATBIN_PTX, FATBIN_ELF = 1, 2
MANIFEST_FORMAT = 1  # strata/_ext/runtime.pyx reads this format


def setup_literal(source: Path, name: str):
    """A literal assignment of setup.py (SASS_ARCHS, ARCH_SPECIFIC), read without running setup.py,
    whose setuptools may be absent where a wheel is checked; None where setup.py assigns none."""
    for node in ast.parse((source / "setup.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    return None


def all_archs(source: Path) -> list[str]:
    """setup.py's SASS_ARCHS: what STRATA_CUDA_ARCHS=all builds."""
    archs = setup_literal(source, "SASS_ARCHS")
    if archs is None:
        raise SystemExit(f"check_wheel: {source / 'setup.py'} defines no SASS_ARCHS")
    return list(archs)


def arch_specific(source: Path) -> dict[str, str]:
    """setup.py's ARCH_SPECIFIC: libraries built for one arch-specific target only."""
    return dict(setup_literal(source, "ARCH_SPECIFIC") or {})


def expected_targets(archs: list[str]) -> set[str]:
    """SASS for each arch and PTX for the oldest plain one: the manifest's names (setup.gencode_flags)."""
    plain = sorted((a for a in archs if a.isdigit()), key=int)
    return {f"sm_{a}" for a in archs} | ({f"compute_{plain[0]}"} if plain else set())


def fatbin_targets(image: bytes) -> set[str]:
    """The targets inside an nvcc -fatbin image: {"sm_90", "compute_80", ...}. Layout: a 16-byte
    container header (magic, version, header size, payload size), then entries whose header holds
    the kind (1 PTX, 2 ELF) at +0, its own size at +4, the payload size at +8 and the arch at +28."""
    targets, off = set(), 0
    while off + 16 <= len(image):
        magic, _, header_bytes, payload_bytes = struct.unpack_from("<IHHQ", image, off)
        if magic != FATBIN_MAGIC:
            raise ValueError(f"no fatbin header at byte {off}")
        entry, end = off + header_bytes, off + header_bytes + payload_bytes
        while entry < end:
            kind, _, entry_header, entry_payload = struct.unpack_from("<HHIQ", image, entry)
            arch = struct.unpack_from("<I", image, entry + 28)[0]
            if kind not in (FATBIN_PTX, FATBIN_ELF) or entry_header < 32:
                raise ValueError(f"unknown fatbin entry (kind {kind}) at byte {entry}")
            targets.add(f"{'compute' if kind == FATBIN_PTX else 'sm'}_{arch}")
            entry += entry_header + entry_payload
        off = end
    return targets


def check_tag(name: str) -> list[str]:
    m = re.fullmatch(r"strata_moe-[^-]+-(cp\d+)-(cp\d+)-([^-]+)\.whl", name)
    if not m:
        return [f"{name}: not a CPython wheel of strata_moe (name-version-cpXY-cpXY-platform.whl)"]
    if not all(p.startswith("manylinux") for p in m.group(3).split(".")):
        return [f"{name}: platform tag {m.group(3)!r} is not manylinux (run auditwheel repair)"]
    return []


def check_kernels(wheel: zipfile.ZipFile, source: Path, archs: list[str]) -> list[str]:
    names = set(wheel.namelist())
    if "strata/kernels/manifest.json" not in names:
        return ["strata/kernels/manifest.json missing: the wheel was built without kernels"]
    manifest = json.loads(wheel.read("strata/kernels/manifest.json"))
    kernels = manifest.get("kernels", {})
    problems = [] if manifest.get("format") == MANIFEST_FORMAT else [
        f"manifest.json: format {manifest.get('format')!r}, expected {MANIFEST_FORMAT}"]
    special = arch_specific(source)
    plain_archs = {a.rstrip("af") for a in archs}
    # an arch-specific library is built only when its plain arch is asked for, for its target alone
    sources = sorted(cu.stem for cu in (source / "cuda").glob("*.cu")
                     if cu.stem not in special or special[cu.stem].rstrip("af") in plain_archs)
    if sorted(kernels) != sources:
        problems.append(f"manifest.json lists {sorted(set(kernels) ^ set(sources))} unlike cuda/*.cu")
    for lib, entry in sorted(kernels.items()):
        expected = {f"sm_{special[lib]}"} if lib in special else expected_targets(archs)
        path = f"strata/kernels/{entry.get('file')}"
        if path not in names:
            problems.append(f"{path} (in manifest.json) missing from the wheel")
            continue
        image = wheel.read(path)
        if hashlib.sha256(image).hexdigest() != entry.get("sha256"):
            problems.append(f"{path}: sha256 differs from manifest.json's")
        if set(entry.get("archs", [])) != expected:
            problems.append(f"{path}: manifest archs {entry.get('archs')}, expected {sorted(expected)}")
        try:
            inside = fatbin_targets(image)
        except (ValueError, struct.error) as exc:
            problems.append(f"{path}: not a readable fatbin ({exc})")
            continue
        plain = {re.sub(r"[af]$", "", t) for t in expected}  # an sm_90a entry carries arch 90
        if inside != plain:
            problems.append(f"{path}: holds {sorted(inside)}, expected {sorted(plain)}")
    stray = sorted(n for n in names if n.startswith("strata/kernels/") and n.endswith(".fatbin")
                   and n.rsplit("/", 1)[1] not in {e.get("file") for e in kernels.values()})
    problems += [f"{n}: not in manifest.json" for n in stray]
    return problems


def check_extension(wheel: zipfile.ZipFile, name: str, source: Path) -> list[str]:
    tag = re.search(r"-cp(\d+)-", name)
    version = tag.group(1) if tag else r"\d+"
    names = wheel.namelist()
    problems = []
    for pyx in sorted((source / "strata" / "_ext").glob("*.pyx")):
        pattern = rf"strata/_ext/{pyx.stem}\.cpython-{version}-[^/]+\.so"
        if not any(re.fullmatch(pattern, n) for n in names):
            problems.append(f"strata/_ext/{pyx.stem}: no compiled module for this Python in the wheel")
    problems += [f"{n}: generated C++ must not ship" for n in names if n.endswith(".cpp")]
    problems += [f"{n}: a grafted library (something links a non-manylinux library: libcuda must not "
                 f"be linked, cydriver loads it)" for n in names if n.startswith("strata_moe.libs/")]
    return problems


def check_package_data(wheel: zipfile.ZipFile, source: Path) -> list[str]:
    names, problems = set(wheel.namelist()), []
    if "strata/demo/pack.json" not in names:
        return ["strata/demo/pack.json missing: the demo model does not ship"]
    pack = json.loads(wheel.read("strata/demo/pack.json"))
    for file, meta in sorted(pack.get("files", {}).items()):
        path = f"strata/demo/{file}"
        if path not in names:
            problems.append(f"{path} (in the demo pack.json) missing")
        elif hashlib.sha256(wheel.read(path)).hexdigest() != meta.get("sha256"):
            problems.append(f"{path}: sha256 differs from the demo pack.json's")
    static = source / "strata" / "server" / "static"
    for path in sorted(p for p in static.rglob("*") if p.is_file()):
        inside = f"strata/server/{path.relative_to(static.parent).as_posix()}"
        if inside not in names:
            problems.append(f"{inside} missing (the Monitor page)")
        elif wheel.read(inside) != path.read_bytes():
            problems.append(f"{inside} differs from the source tree's")
    return problems


def check_metadata(wheel: zipfile.ZipFile) -> list[str]:
    metas = [n for n in wheel.namelist() if re.fullmatch(r"strata_moe-[^/]+\.dist-info/METADATA", n)]
    if not metas:
        return ["no .dist-info/METADATA"]
    meta = wheel.read(metas[0]).decode()
    problems = [] if re.search(r"^License-Expression: MIT$", meta, re.M) else ["METADATA: no License-Expression: MIT"]
    if not re.search(r"^Requires-Dist: cuda-bindings.*sys_platform == \"linux\"", meta, re.M):
        problems.append("METADATA: cuda-bindings is not a Linux dependency (the GPU path needs it)")
    if not any(n.endswith(".dist-info/licenses/LICENSE") for n in wheel.namelist()):
        problems.append("LICENSE missing from .dist-info/licenses")
    return problems


def parse_archs(text: str, source: Path) -> list[str]:
    if text.strip().lower() == "all":
        return all_archs(source)
    archs = [a.strip().removeprefix("sm_") for a in text.split(",") if a.strip()]
    if not archs or not all(re.fullmatch(r"\d{2,3}[af]?", a) for a in archs):
        raise SystemExit(f"check_wheel: --archs {text!r}: expected all, or archs like 90 or 80,90")
    return archs


def check_wheel(path: Path, archs_text: str, source: Path) -> list[str]:
    archs = parse_archs(archs_text, source)
    with zipfile.ZipFile(path) as wheel:
        return (check_tag(path.name) + check_kernels(wheel, source, archs)
                + check_extension(wheel, path.name, source) + check_package_data(wheel, source)
                + check_metadata(wheel))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheel", type=Path)
    parser.add_argument("--archs", default="all", help="the archs the wheel must hold (STRATA_CUDA_ARCHS form)")
    parser.add_argument("--source", type=Path, default=ROOT, help="the source tree the wheel was built from")
    args = parser.parse_args(argv)
    if not args.wheel.is_file():
        print(f"check_wheel: {args.wheel}: no such file", file=sys.stderr)
        return 1
    problems = check_wheel(args.wheel, args.archs, args.source)
    for problem in problems:
        print(f"check_wheel: {args.wheel.name}: {problem}", file=sys.stderr)
    if problems:
        return 1
    with zipfile.ZipFile(args.wheel) as wheel:
        num_fatbins = sum(n.endswith(".fatbin") for n in wheel.namelist())
    print(f"check_wheel: {args.wheel.name} ok: {num_fatbins} fatbins for {args.archs}, runtime extension, "
          f"demo pack, static files, MIT license; {args.wheel.stat().st_size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
