"""Row and column sums of whole windows in one pass over their bytes: the CPU's digest kernel, in C.

    sums = one_pass_sums()               # None where no C compiler could build it
    if sums is not None:
        sums(matrices, out)              # out[w] = row sums of window w, then its column sums

torch has no reduction that yields two partitions of the same words, so digesting with torch
reads every word twice ([Note: the cost, and why rows and columns] in `residency.device.digests`).
This kernel reads each row once: it adds the row into its row sum and, word by word, into the
window's column sums, which stay in the core's L1 (128 words with the CPU layout).  One call
digests a whole buffer, on as many threads as torch's intra-op pool has, each with at least four
windows to sum (the windows split evenly, the calling thread takes the first share; one join per
call, never a region per window).
The sums wrap modulo 2**64 like torch's int64 sums (unsigned arithmetic in C), so the digests are
the same bits as the torch path's, which stays the fallback.

[Note: building it]
The C source is this module's `_SOURCE`: compiled once per source, compiler and platform into the
user's cache folder (``$XDG_CACHE_HOME/residency``, else ``~/.cache/residency``; a temporary
folder when that cannot be written), about 0.1 s with ``cc -O3``, then loaded with ``ctypes``
(whose calls release the GIL).  Several processes building at once each write their own
temporary file and rename it into place: the last rename wins, every one is complete.  Where no
compiler is found or the build fails, `one_pass_sums` returns None once and for all, with one
log line, and the digests use torch's reductions: the same digests, slower.  The environment
variable ``RESIDENCY_ONE_PASS=0`` asks for the torch path.

[Note: the loaded library is the only state]
`one_pass_sums` caches what it loaded (or that it could not): a loaded library never changes and
is the process's own, like torch's loaded extensions.  Nothing else here keeps state.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

__all__ = ["one_pass_sums"]

_log = logging.getLogger(__name__)

#: The kernel.  ``data``: ``windows * rows * cols`` words; ``out``: ``windows * (rows + cols)``.
_SOURCE = r"""
#include <pthread.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    const uint64_t *data; uint64_t *out; int64_t first, last, rows, cols;
} share_t;

static void sum_share(const share_t *s) {
    const int64_t R = s->rows, C = s->cols;
    for (int64_t w = s->first; w < s->last; ++w) {
        const uint64_t *restrict m = s->data + w * R * C;
        uint64_t *restrict row_sums = s->out + w * (R + C);
        uint64_t *restrict column_sums = row_sums + R;
        memset(column_sums, 0, (size_t)C * sizeof(uint64_t));
        for (int64_t r = 0; r < R; ++r) {
            const uint64_t *restrict row = m + r * C;
            uint64_t sum = 0;
            for (int64_t c = 0; c < C; ++c) {
                sum += row[c];
                column_sums[c] += row[c];
            }
            row_sums[r] = sum;
        }
    }
}

static void *run_share(void *share) {
    sum_share((const share_t *)share);
    return 0;
}

#define MOST_THREADS 64
#define LEAST_WINDOWS_PER_THREAD 4

void residency_row_column_sums(const uint64_t *data, int64_t windows, int64_t rows,
                               int64_t cols, uint64_t *out, int threads) {
    share_t shares[MOST_THREADS];
    pthread_t ids[MOST_THREADS];
    int started[MOST_THREADS];
    if (threads > MOST_THREADS) threads = MOST_THREADS;
    if (threads > windows / LEAST_WINDOWS_PER_THREAD)
        threads = (int)(windows / LEAST_WINDOWS_PER_THREAD);
    if (threads < 1) threads = 1;
    for (int t = 0; t < threads; ++t) {
        shares[t] = (share_t){data, out, windows * t / threads, windows * (t + 1) / threads,
                              rows, cols};
        started[t] = 0;
    }
    for (int t = 1; t < threads; ++t) {
        started[t] = pthread_create(&ids[t], 0, run_share, &shares[t]) == 0;
        if (!started[t]) sum_share(&shares[t]);
    }
    sum_share(&shares[0]);
    for (int t = 1; t < threads; ++t) {
        if (started[t]) pthread_join(ids[t], 0);
    }
}
"""

_FLAGS = ("-O3", "-shared", "-fPIC", "-pthread", "-std=c99")


def one_pass_sums() -> Callable[[torch.Tensor, torch.Tensor], None] | None:
    """The one-pass kernel, built and loaded at the first call; None where it cannot be.

        sums = one_pass_sums()
        sums(matrices, out)   # matrices: int64 (windows, rows, cols), contiguous, on the CPU;
                              # out: int64 (windows, rows + cols), contiguous, on the CPU
    """
    return _loaded()


@functools.cache
def _loaded() -> Callable[[torch.Tensor, torch.Tensor], None] | None:
    if os.environ.get("RESIDENCY_ONE_PASS", "1") == "0":
        return None
    try:
        library = ctypes.CDLL(str(_built()))
    except (OSError, subprocess.SubprocessError) as error:
        _log.info("edit detection uses torch's reductions (two reads of each word): the "
                  "one-pass C kernel could not be built or loaded (%s)", error)
        return None
    kernel = library.residency_row_column_sums
    kernel.restype = None
    kernel.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                       ctypes.c_void_p, ctypes.c_int]

    def sums(matrices: torch.Tensor, out: torch.Tensor) -> None:
        windows, rows, columns = matrices.shape
        if not (matrices.is_contiguous() and out.is_contiguous()
                and out.shape == (windows, rows + columns)):
            raise ValueError("one_pass_sums: contiguous (windows, rows, cols) matrices and a "
                             "contiguous (windows, rows + cols) out are needed")
        kernel(matrices.data_ptr(), windows, rows, columns, out.data_ptr(),
               torch.get_num_threads())

    return sums


def _built() -> Path:
    """The compiled library's path, compiling it first when the cache has none."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or \
        shutil.which("clang")
    if compiler is None:
        raise OSError("no C compiler (cc, gcc or clang) on the PATH, and CC is not set")
    key = hashlib.sha256("\0".join(
        (_SOURCE, compiler, *_FLAGS, platform.machine(), platform.system())).encode())
    folder = _cache_folder()
    target = folder / f"one_pass-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    source = folder / f"one_pass-{os.getpid()}.c"
    partial = folder / f"{target.name}.{os.getpid()}.partial"
    source.write_text(_SOURCE)
    try:
        subprocess.run([compiler, *_FLAGS, "-o", str(partial), str(source)], check=True,
                       capture_output=True, timeout=120)
        os.replace(partial, target)
    except subprocess.CalledProcessError as error:
        raise OSError(f"{compiler} failed: {error.stderr.decode(errors='replace')[-500:]}") \
            from None
    finally:
        source.unlink(missing_ok=True)
        partial.unlink(missing_ok=True)
    return target


def _cache_folder() -> Path:
    """The user's cache folder for residency, made if missing; a temporary one where that cannot
    be written.  A folder is used only when this user owns it and nobody else may write to it:
    a library loaded from it runs as this process."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    for folder in (Path(base) / "residency",
                   Path(tempfile.gettempdir()) / f"residency-{os.getuid()}"):
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            info = folder.stat()
        except OSError:
            continue
        if info.st_uid == os.getuid() and not info.st_mode & 0o022 and \
                os.access(folder, os.W_OK):
            return folder
    raise OSError("no cache folder of this user's own, writable by it alone, for the one-pass "
                  "kernel (set XDG_CACHE_HOME to one)")
