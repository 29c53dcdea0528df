"""A real BLAS under MLX's CPU backend on Linux.

The `mlx-cpu` wheel links a reference BLAS: matrix products run 25-50x slower than they
could and batching gains almost nothing. MLX calls the standard `cblas_*` symbols, so a
library that exports them, loaded first with `LD_PRELOAD`, takes over. Two are found
without asking: oneMKL from PyPI (`mkl`, installed with the worker extra on Linux
x86_64, no root needed) and Debian's OpenBLAS (`apt install libopenblas0-pthread`).
`MLXQ_BLAS` overrides: a library path, or `off`. macOS (Metal) is left alone.

    python -m mlxq.blas COMMAND ...    # run COMMAND with the BLAS in front (make test)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

APPLIED = "MLXQ_BLAS_APPLIED"  # set in the environment once the BLAS was put in front
DEBIAN_OPENBLAS = [Path(f"/usr/lib/{arch}-linux-gnu/openblas-pthread/libblas.so.3") for arch in ("x86_64", "aarch64")]


def find() -> Path | None:
    """The BLAS library to put in front of MLX's, or None (not Linux, none found, or off)."""
    wanted = os.environ.get("MLXQ_BLAS")
    if not sys.platform.startswith("linux") or wanted == "off":
        return None
    if wanted:
        return Path(wanted)
    mkl = sorted(Path(sys.prefix, "lib").glob("libmkl_rt.so*"))
    for candidate in [*mkl, *DEBIAN_OPENBLAS]:
        if candidate.exists():
            return candidate
    return None


def environment(library: Path) -> dict[str, str]:
    """The variables that load `library` first (and pick MKL's threading layer)."""
    preload = " ".join(p for p in (str(library), os.environ.get("LD_PRELOAD", "")) if p)
    env = {"LD_PRELOAD": preload, APPLIED: "1"}
    if "mkl" in library.name:
        has_iomp = (library.parent / "libiomp5.so").exists()
        env["MKL_THREADING_LAYER"] = os.environ.get("MKL_THREADING_LAYER", "INTEL" if has_iomp else "GNU")
    return env


def exec_with_blas(argv: list[str]) -> None:
    """Replace this process with `argv` run with the BLAS in front; returns if there is
    nothing to do (no BLAS found, not Linux, or already applied)."""
    library = find()
    if library is None or os.environ.get(APPLIED):
        return
    os.execve(argv[0], argv, {**os.environ, **environment(library)})


def in_use() -> str:
    """Which BLAS this process runs on: `mkl`, `openblas`, or `reference` (slow)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:  # not Linux: Accelerate/Metal
        return "platform"
    if "libmkl_rt" in maps:
        return "mkl"
    if "openblas-pthread" in maps:  # Debian's; numpy's own OpenBLAS has prefixed symbols and does not count
        return "openblas"
    custom = os.environ.get("MLXQ_BLAS")
    if custom and custom != "off" and custom in maps:
        return custom
    return "reference"


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    exec_with_blas(sys.argv[1:])
    os.execv(sys.argv[1], sys.argv[1:])  # nothing to put in front: run it as it is
