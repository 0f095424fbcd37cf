"""The CPU's C kernels, built on first use into one library and called through ctypes: the decode
attention (`kernels/cpu_decode.c`, wrapped here), the few-row bfloat16 linear
(`kernels/cpu_linear.c`, wrapped by kernels/cpu_linear.py), the linear on GGUF's quantized blocks
(`kernels/cpu_quant.c`, and its integer dot products `kernels/cpu_qdot.c`, both wrapped by
kernels/cpu_quant.py), a decoder layer's bfloat16 pointwise
steps (`kernels/cpu_pointwise.c`, wrapped by kernels/cpu_pointwise.py) and the KV store
(`kernels/cpu_store.c`, wrapped by kernels/cpu_store.py).

The decode attention takes float32, bfloat16 and float16 queries and caches (float16 where the
compiler has `_Float16`), in any mix, and computes in float32.

The library is compiled once per source, compiler, CPU and CPU kind (`-march=native`, or a lower
kind's target under `CHATCORE_CPU_ISA`: kernels/cpu_kind.py; the key holds the CPU's flags) into `$XDG_CACHE_HOME/chatcore/kernels` (default `~/.cache`), written to a
temporary name and renamed, so concurrent processes never load a half-written file.

Loading a library runs its code (constructors included), and its name is predictable: a file is
loaded only when the cache folder and the file are ours alone (owned by this user, writable by
neither group nor others; the folder not a link, the file checked on the descriptor that is
loaded). A file that fails is rebuilt in its place; a folder that fails is not written: the
library is built in a new private temporary folder, loaded, and that folder removed. It links
the OpenMP runtime torch already loaded (same soname), so it shares torch's threads instead of
starting a second pool on the same cores. ctypes releases the GIL for the call.

When no C compiler is found or the build fails, `available()` is False, one warning says why,
and `kernels` keeps using the torch reference: the engine runs either way.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from chatcore.kernels import cpu_kind

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name) for name in ("cpu_decode.c", "cpu_linear.c", "cpu_pointwise.c",
                                                               "cpu_qdot.c", "cpu_quant.c", "cpu_store.c"))
HEADERS = (Path(__file__).with_name("bfloat16.h"),)  # included by the sources: part of the library's key
PROFILER_NAME = "kernels::paged_decode_c"  # how a call shows in torch.profiler (bench/step_ops.py)
FLAGS = ("-O3", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared")  # and the CPU kind's target (`cpu_kind.march`)
LIBS = ("-lmvec", "-lm")
_ARGTYPES = (
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
    ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
    ctypes.c_int64, ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_int, ctypes.c_int,
)
_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_INDEX_DTYPE, _INDEX_BYTES = torch.int32, 4  # cpu_decode.c reads block tables and context lengths as int32_t


def _cache_dir() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "chatcore" / "kernels"


def library_name(compiler: str) -> str:
    """The cached library's file name: a hash of the source, flags, compiler version and CPU."""
    version = subprocess.run([compiler, "--version"], check=False, capture_output=True, text=True, timeout=60).stdout
    sources = [source.read_text() for source in (*SOURCES, *HEADERS)]
    flags = " ".join(sorted(cpu_kind.cpu_flags()))
    key = hashlib.sha256("\0".join([*sources, *FLAGS, *cpu_kind.march(), *LIBS, version, flags]).encode()).hexdigest()
    return f"cpu_kernels-{key[:16]}.so"


def _not_ours_alone(info: os.stat_result) -> str | None:
    """Why a file or folder with this status may hold someone else's code; None when it is ours alone."""
    if info.st_uid != os.geteuid():
        return f"is owned by uid {info.st_uid}, not {os.geteuid()}"
    if info.st_mode & 0o022:
        return f"is writable by its group or others (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def _cache_folder() -> Path | None:
    """The cache folder, created 0700 if missing; None (with a warning) when it may not be ours alone."""
    folder = _cache_dir()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = os.lstat(folder)
    problem = _not_ours_alone(info) if stat.S_ISDIR(info.st_mode) else "is not a folder (a link?)"
    if problem is None:
        return folder
    log.warning("the kernel cache %s %s: the C kernels are built in a private temporary folder instead",
                folder, problem)
    return None


def _compile(compiler: str, target: Path) -> None:
    handle, partial = tempfile.mkstemp(dir=target.parent, suffix=".so.partial")
    os.close(handle)
    try:
        result = subprocess.run([compiler, *FLAGS, *cpu_kind.march(), "-o", partial, *map(str, SOURCES), *LIBS],
                                check=False, capture_output=True, text=True, timeout=300)
        if result.returncode:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
        os.chmod(partial, 0o755)  # whatever the umask: a group-writable library would not be loaded
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def _load_if_ours(path: Path) -> ctypes.CDLL | None:
    """`path` loaded when it is a regular file of ours alone (not a link), else None. The checks are
    made on the descriptor that is then loaded, so the file loaded is the file checked."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as error:  # ELOOP: a link at the library's name
        log.warning("not loading %s (%s): rebuilding it", path, error.strerror)
        return None
    try:
        info = os.fstat(fd)
        problem = _not_ours_alone(info) if stat.S_ISREG(info.st_mode) else "is not a regular file"
        if problem is not None:
            log.warning("not loading %s, which %s: rebuilding it", path, problem)
            return None
        return ctypes.CDLL(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)


def _built(compiler: str, target: Path) -> ctypes.CDLL:
    _compile(compiler, target)
    library = _load_if_ours(target)
    if library is None:
        raise RuntimeError(f"{target} is not ours alone right after it was built")
    return library


def _build_and_load(compiler: str) -> ctypes.CDLL:
    """The cached library when it is ours alone; else one built now, in the cache, or in a private
    temporary folder (removed once the library is loaded) when the cache folder is not ours alone."""
    folder = _cache_folder()
    if folder is None:
        private = Path(tempfile.mkdtemp(prefix="chatcore-kernels-"))
        try:
            return _built(compiler, private / library_name(compiler))
        finally:
            shutil.rmtree(private, ignore_errors=True)
    target = folder / library_name(compiler)
    cached = _load_if_ours(target)
    return cached if cached is not None else _built(compiler, target)


def traced(name: str) -> contextlib.AbstractContextManager[object]:
    """A C call's range in torch.profiler under `name`, opened only while a profiler records: the
    range costs ~10 us, a tenth of a few-row linear's call."""
    return torch.profiler.record_function(name) if torch.autograd._profiler_enabled() else contextlib.nullcontext()


@functools.cache
def library() -> ctypes.CDLL | None:
    """The C kernels' library, built or loaded on the first call; None (one warning) when it cannot be."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: CPU decode attention uses the torch reference, few-row linears oneDNN (slower)")
        return None
    try:
        return _build_and_load(compiler)
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        log.warning("building the C kernels failed: CPU decode attention uses the torch reference, few-row linears "
                    "oneDNN: %s", error)
        return None


@functools.cache
def _decode() -> tuple[Callable[..., int], frozenset[torch.dtype]] | None:
    """The decode attention and the dtypes it reads, or None when the library cannot be built."""
    loaded = library()
    if loaded is None:
        return None
    function = loaded.chatcore_paged_decode
    function.argtypes = _ARGTYPES
    function.restype = ctypes.c_int
    dtypes = {torch.float32, torch.bfloat16} | ({torch.float16} if loaded.chatcore_has_f16() else set())
    return function, frozenset(dtypes)


def available() -> bool:
    """Whether the C decode attention is built and loaded (builds it on the first call)."""
    return _decode() is not None


def _layout(decode: tuple[Callable[..., int], frozenset[torch.dtype]], query: torch.Tensor, key_cache: torch.Tensor,
            value_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor) -> tuple[int, ...] | str:
    """The C decode's arguments these tensors give (seqs, heads, kv_heads, head_dim, block_size,
    blocks, the table's width and row stride, the table's and the lengths' addresses, the query's
    and the caches' kinds), or why it cannot take them.

    What the C trusts: CPU tensors; query [seqs, heads, head_dim] and the caches [blocks,
    block_size, kv_heads, head_dim], all contiguous, in dtypes this build reads (both caches one),
    heads a multiple of kv_heads and head_dim a multiple of 8 (16 for bfloat16 caches, read two
    elements a word); int32 block tables [seqs, width] with contiguous rows and int32 context
    lengths [seqs], contiguous, both at 4-byte boundaries (read as int32_t; query and caches are
    read with memcpy, at any address). Metadata only: nothing is read, no device synchronised, a
    few attribute reads."""
    query_shape, cache_shape, table_shape, lens_shape = query.shape, key_cache.shape, block_tables.shape, \
        context_lens.shape
    if not (query.is_cpu and key_cache.is_cpu and value_cache.is_cpu and block_tables.is_cpu and context_lens.is_cpu):
        return "the C decode attention takes CPU tensors only"
    query_dtype, cache_dtype = query.dtype, key_cache.dtype
    if query_dtype not in decode[1] or cache_dtype not in decode[1] or value_cache.dtype is not cache_dtype:
        return (f"the C decode attention reads {sorted(map(str, decode[1]))}, both caches of one: query {query_dtype}, "
                f"caches {cache_dtype} and {value_cache.dtype}")
    if block_tables.dtype is not _INDEX_DTYPE or context_lens.dtype is not _INDEX_DTYPE:
        return f"block_tables and context_lens must be int32, not {block_tables.dtype} and {context_lens.dtype}"
    if len(query_shape) != 3 or len(cache_shape) != 4 or value_cache.shape != cache_shape:
        return (f"query must be [seqs, heads, head_dim] and both caches [blocks, block_size, kv_heads, head_dim]: "
                f"{tuple(query_shape)}, {tuple(cache_shape)} and {tuple(value_cache.shape)}")
    seqs, heads, head_dim = query_shape
    blocks, block_size, kv_heads, cache_head_dim = cache_shape
    if (head_dim != cache_head_dim or not kv_heads or heads % kv_heads or not block_size or not head_dim
            or head_dim % (16 if cache_dtype is torch.bfloat16 else 8)):
        return (f"the C decode attention takes query heads in whole groups per kv head, blocks of at least one token "
                f"and a head_dim shared by query and caches, a multiple of 8 (16 for bfloat16 caches): query "
                f"{tuple(query_shape)}, caches {tuple(cache_shape)}")
    if len(table_shape) != 2 or table_shape[0] != seqs or len(lens_shape) != 1 or lens_shape[0] != seqs:
        return (f"block_tables must be [{seqs}, width] and context_lens [{seqs}], not {tuple(table_shape)} and "
                f"{tuple(lens_shape)}")
    table_strides = block_tables.stride()
    if not (query.is_contiguous() and key_cache.is_contiguous() and value_cache.is_contiguous()
            and context_lens.is_contiguous() and table_strides[1] == 1):
        return "the C decode attention takes contiguous query, caches and context_lens, and table rows"
    table, lens = block_tables.data_ptr(), context_lens.data_ptr()
    if (table | lens) % _INDEX_BYTES:
        return "block_tables and context_lens must start at 4-byte boundaries (the C reads int32_t)"
    return (seqs, heads, kv_heads, head_dim, block_size, blocks, table_shape[1], table_strides[0], table, lens,
            _KINDS[query_dtype], _KINDS[cache_dtype])


def accepts(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
            context_lens: torch.Tensor) -> bool:
    """Whether the C path takes these arguments (and no autograd graph would be lost). Builds the
    library on the first call."""
    decode = _decode()
    return (decode is not None and not (torch.is_grad_enabled() and query.requires_grad)
            and not isinstance(_layout(decode, query, key_cache, value_cache, block_tables, context_lens), str))


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           max_context: int | None = None) -> torch.Tensor:
    """`kernels.reference.paged_decode_attention`'s contract, for arguments the C path takes.
    `max_context`, when the caller knows it, bounds every context length (read from `context_lens`
    otherwise).

    Raises ValueError for arguments the C path does not take (`_layout` says why; `dispatch.route`
    calls this for every layer of a step after checking only the first), and when a context is
    longer than its table row holds, or than `max_context`, or needs a block id outside the pool
    (nothing is read or written out of bounds)."""
    decode = _decode()
    if decode is None:
        raise RuntimeError("the C decode attention is not available")
    layout = _layout(decode, query, key_cache, value_cache, block_tables, context_lens)
    if isinstance(layout, str):
        raise ValueError(layout)
    (num_seqs, num_heads, num_kv_heads, head_dim, block_size, num_blocks, width, table_stride, table, lens, query_kind,
     cache_kind) = layout
    if max_context is None:
        max_context = int(context_lens.max()) if num_seqs else 0
    if max_context > width * block_size:
        raise ValueError("a context is longer than its block table holds")
    out = torch.empty_like(query)
    with traced(PROFILER_NAME):
        status = decode[0](
            query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), table, table_stride, lens, out.data_ptr(),
            num_seqs, num_heads, num_kv_heads, head_dim, block_size, num_blocks, max_context, scale,
            query_kind, cache_kind, torch.get_num_threads())
    if status == -2:
        raise ValueError("a block table entry within a context is outside the cache")
    if status == -4:
        raise ValueError(f"a context is longer than the {max_context} tokens given as the longest")
    if status == -3:
        raise RuntimeError("this build of the C decode attention cannot read float16")
    if status:
        raise MemoryError("the C decode attention could not allocate its scores")
    return out
