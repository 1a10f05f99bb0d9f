"""Building and loading the C kernels of :mod:`attnlab.kernels`.

Each kernel is one C file beside this module (with the headers beside it: ``parallel.h``, the threads), built on
first use with the system C compiler (``$CC``, else ``cc``; ``-O3 -march=native -ffast-math -fopenmp``, so that exp
and tanh are vectorised through glibc's libmvec) into a shared library loaded with ctypes. Builds are cached in
``$ATTNLAB_KERNEL_CACHE`` (default ``~/.cache/attnlab/kernels``) under a hash of the source and the headers, the
flags, the compiler's version and the CPU, so later processes load them in milliseconds; a build goes to a temporary
file that is then renamed, so parallel sweep jobs may build at once.

Where a kernel cannot be built (no compiler, Windows), :meth:`Library.get` returns None and :attr:`Library.error`
says why in one line; the callers then use their PyTorch code. ``ATTNLAB_FUSED_KERNELS=0`` turns every kernel off.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

__all__ = ["DTYPES", "KernelBuildError", "Library", "build_library", "cache_dir"]

# Tried in order: the first set the compiler accepts is used (-march=native is not known to every compiler).
FLAG_SETS: tuple[tuple[str, ...], ...] = (
    ("-O3", "-march=native", "-ffast-math", "-fPIC", "-fopenmp"),
    ("-O3", "-ffast-math", "-fPIC", "-fopenmp"),
    ("-O3", "-march=native", "-ffast-math", "-fPIC"),
    ("-O3", "-ffast-math", "-fPIC"),
)
"""With ``-fopenmp`` a kernel's rows run on the process's OpenMP threads (``parallel.h``): torch's, since the library
links ``libgomp.so.1``, which torch has loaded already (the same runtime, the same thread pool). Without it (a compiler
without OpenMP) on threads of its own (pthreads), which compete with torch's workers spinning after an operation:
the softmax kernel took 7.1 ms after a matrix product instead of 3.9 ms alone (2 threads)."""
LINK_FLAGS = ("-shared", "-lm", "-lpthread")
DTYPES = {torch.float32: 0, torch.float64: 1}  # the kernels' dtype codes


class KernelBuildError(RuntimeError):
    """A kernel could not be built or loaded; the message is one line saying why."""


def cache_dir() -> Path:
    """Where built kernels are kept: ``$ATTNLAB_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/attnlab/kernels``, else
    ``~/.cache/attnlab/kernels``."""
    if os.environ.get("ATTNLAB_KERNEL_CACHE"):
        return Path(os.environ["ATTNLAB_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "attnlab" / "kernels"


def _cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return "".join(line for line in lines[:40] if line.startswith(("model name", "flags", "Features")))


def _run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)


def build_library(source: Path, directory: Path | None = None, compiler: str | None = None) -> Path:
    """Builds the C file ``source`` into a shared library in ``directory`` (default :func:`cache_dir`) unless a
    build of the same source, flags, compiler and CPU is there already → its path. Raises
    :class:`KernelBuildError`."""
    if sys.platform == "win32":
        raise KernelBuildError("attnlab's C kernels are built with a POSIX C compiler; not on Windows")
    compiler = compiler or os.environ.get("CC") or "cc"
    exe = shutil.which(compiler)
    if exe is None:
        raise KernelBuildError(f"no C compiler '{compiler}' on PATH (set $CC to one)")
    try:
        version = _run([exe, "--version"]).stdout.splitlines()[:1]
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelBuildError(f"C compiler '{compiler}' does not run: {e}") from e
    directory = cache_dir() if directory is None else Path(directory)
    text = b"".join(h.read_bytes() for h in [Path(source), *sorted(Path(source).parent.glob("*.h"))])  # + headers
    error = "failed"
    for flags in FLAG_SETS:
        parts = [text, " ".join(flags + LINK_FLAGS).encode(), *(v.encode() for v in version)]
        key = hashlib.sha256(b"\0".join([*parts, _cpu_model().encode(), platform.machine().encode()])).hexdigest()
        target = directory / f"{Path(source).stem}-{key[:16]}.so"
        if target.exists():
            return target
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise KernelBuildError(f"cannot create the kernel cache {directory}: {e.strerror}") from e
        with tempfile.TemporaryDirectory(dir=directory) as tmp:
            obj, lib = Path(tmp) / "kernel.o", Path(tmp) / "kernel.so"
            # compile and link separately: -ffast-math at link time would add crtfastmath.o, which turns on
            # flush-to-zero for the whole process when the library loads
            try:
                compiled = _run([exe, *flags, "-c", str(source), "-o", str(obj)])
                link = [*LINK_FLAGS, *(f for f in flags if f == "-fopenmp")]
                linked = compiled.returncode == 0 and _run([exe, str(obj), "-o", str(lib), *link]).returncode == 0
            except subprocess.SubprocessError as e:  # a compiler that hangs past the time limit
                raise KernelBuildError(f"'{compiler}' did not finish building {Path(source).name}: {e}") from e
            if linked:
                os.replace(lib, target)  # atomic: a parallel build of the same key writes the same bytes
                return target
            lines = (compiled.stderr or "link failed").strip().splitlines()
            said = [line for line in lines if "error" in line.lower()] or lines
            error = said[0].strip() if said else error
    raise KernelBuildError(f"'{compiler}' could not build {Path(source).name}: {error}")


class Library:
    """One kernel's shared library, built and loaded on first use (once per process); ``declare`` sets the
    ctypes signatures of its functions."""

    def __init__(self, source: Path, declare: Callable[[ctypes.CDLL], None]) -> None:
        self.source = source
        self._declare = declare
        self._lib: ctypes.CDLL | None = None
        self._error: str | None = None
        self._tried = False

    def get(self) -> ctypes.CDLL | None:
        """The loaded library, or None (see :attr:`error`)."""
        if not self._tried:
            self._tried = True
            if os.environ.get("ATTNLAB_FUSED_KERNELS", "1") == "0":
                self._error = "disabled by ATTNLAB_FUSED_KERNELS=0"
            else:
                try:
                    lib = ctypes.CDLL(str(build_library(self.source)))
                    self._declare(lib)
                    self._lib = lib
                except (KernelBuildError, OSError, AttributeError) as e:
                    self._error = str(e).splitlines()[0]
        return self._lib

    @property
    def error(self) -> str | None:
        """One line saying why the library is not available, or None when it is."""
        self.get()
        return self._error

    def require(self) -> ctypes.CDLL:
        """The loaded library; raises :class:`KernelBuildError` when it is not available."""
        lib = self.get()
        if lib is None:
            raise KernelBuildError(f"the {self.source.stem} kernel is not available: {self._error}")
        return lib
