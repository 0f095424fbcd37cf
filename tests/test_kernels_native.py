"""The C decode attention (kernels/cpu_decode.c, the engine's CPU decode path) against the
dense oracle in every dtype mix it reads, its refusals, and its build fallback."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings

from chatcore.kernels import dispatch as kernels
from chatcore.kernels import native, reference
from tests.test_kernels_reference import case_strategies, dense_attention, make_case

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler: the torch reference serves the CPU")


# (query, cache): the model's dtype with `kv_dtype=auto`, and the narrower caches `kv_dtype` picks.
DTYPE_MIXES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
               (torch.float32, torch.bfloat16), (torch.float32, torch.float16), (torch.bfloat16, torch.float16)]
# The oracle runs in float32 on the same (rounded) inputs: what remains is the output's rounding.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.mark.parametrize(("query_dtype", "cache_dtype"), DTYPE_MIXES, ids=lambda d: str(d).removeprefix("torch."))
@settings(max_examples=25, deadline=None)
@given(**case_strategies(max_seqs=12, head_dims=(16, 64, 80, 96, 128)))
def test_decode_matches_dense(query_dtype, cache_dtype, lens, num_kv_heads, group, head_dim, block_size, seed):
    query, key_cache, value_cache, table, context_lens = make_case(
        lens, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim, block_size=block_size,
        dtype=torch.float32, seed=seed)
    case = (query.to(query_dtype), key_cache.to(cache_dtype), value_cache.to(cache_dtype), table, context_lens)
    if not native.accepts(*case):
        assert cache_dtype == torch.float16 or query_dtype == torch.float16  # a compiler without _Float16
        return
    scale = head_dim**-0.5
    got = native.paged_decode_attention(*case, scale)
    assert got.shape == query.shape and got.dtype == query_dtype
    tolerance = TOLERANCE[query_dtype]
    torch.testing.assert_close(got.float(), dense_attention(*case, scale), atol=tolerance, rtol=tolerance)
    assert torch.equal(got[context_lens == 0], torch.zeros_like(got[context_lens == 0]))


def test_half_precision_output_rounds_to_nearest_even():
    """bf16 and fp16 outputs are the float32 result rounded as torch rounds it."""
    query, key_cache, value_cache, table, lens = make_case(
        [3, 50, 64], num_kv_heads=3, group=3, head_dim=64, block_size=16, dtype=torch.float32, seed=5)
    exact = native.paged_decode_attention(query, key_cache.bfloat16(), value_cache.bfloat16(), table, lens, 0.125)
    rounded = native.paged_decode_attention(query.bfloat16(), key_cache.bfloat16(), value_cache.bfloat16(), table,
                                            lens, 0.125)
    widened = native.paged_decode_attention(query.bfloat16().float(), key_cache.bfloat16(), value_cache.bfloat16(),
                                            table, lens, 0.125)
    assert not torch.equal(exact, widened)  # the query really was rounded on the way in
    assert torch.equal(rounded, widened.bfloat16())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_long_contexts_and_a_strided_table_row(dtype):
    """Contexts across many blocks (the prefetch of the next block), table rows taken from a
    wider buffer (the engine's packed step metadata), every kv head split per task and whole."""
    lens = [1, 16, 17, 700, 1500, 2048]
    query, key_cache, value_cache, table, context_lens = make_case(
        lens, num_kv_heads=3, group=3, head_dim=64, block_size=16, dtype=dtype)
    wide = torch.full((len(lens), table.shape[1] + 5), 7, dtype=torch.int32)
    wide[:, : table.shape[1]] = table
    strided = wide[:, : table.shape[1]]
    assert strided.stride(0) != strided.shape[1] and native.accepts(query, key_cache, value_cache, strided,
                                                                      context_lens)
    expected = dense_attention(query, key_cache, value_cache, table, context_lens, 0.125)
    for threads in (1, 2):  # 6 sequences: one kv head per task with 2 threads, whole rows with 1
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            got = native.paged_decode_attention(query, key_cache, value_cache, strided, context_lens, 0.125)
        finally:
            torch.set_num_threads(previous)
        torch.testing.assert_close(got.float(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
        if threads == 1:
            first = got
    assert torch.equal(got, first)  # each row sums in one fixed order, whatever the task split


def test_bad_tables_are_refused_not_read():
    query, key_cache, value_cache, table, lens = make_case([20, 33], num_kv_heads=1, group=2, head_dim=16,
                                                           block_size=8, dtype=torch.float32)
    bad = table.clone()
    bad[1, 2] = key_cache.shape[0]  # the third block of a 33-token context: outside the pool
    with pytest.raises(ValueError, match="outside the cache"):
        native.paged_decode_attention(query, key_cache, value_cache, bad, lens, 0.25)
    too_long = torch.tensor([20, table.shape[1] * 8 + 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="longer than its block table"):
        native.paged_decode_attention(query, key_cache, value_cache, table, too_long, 0.25)


def test_what_the_c_path_declines_goes_to_the_reference(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    case = make_case([5, 40], num_kv_heads=2, group=2, head_dim=16, block_size=8, dtype=torch.float32)
    query, key_cache, value_cache, table, lens = case
    assert torch.equal(kernels.paged_decode_attention(*case, 0.25), native.paged_decode_attention(*case, 0.25))
    odd_dim = make_case([5, 40], num_kv_heads=2, group=2, head_dim=12, block_size=8, dtype=torch.float32)
    # bfloat16 caches are read two elements a word, eight words a vector: head_dim % 16
    odd_bf16 = make_case([5, 40], num_kv_heads=2, group=2, head_dim=24, block_size=8, dtype=torch.bfloat16)
    grad_query = query.clone().requires_grad_()
    strided_cache = (query, key_cache.transpose(1, 2).contiguous().transpose(1, 2), value_cache, table, lens)
    for args in (odd_dim, odd_bf16, (grad_query, *case[1:]), strided_cache):
        assert not native.accepts(*args)
        assert torch.equal(kernels.paged_decode_attention(*args, 0.25), reference.paged_decode_attention(*args, 0.25))


def test_without_a_compiler_the_reference_serves(tmp_path):
    """A machine with no working C compiler still decodes: one warning, then the reference."""
    env = {**os.environ, "CC": str(tmp_path / "no-such-cc"), "XDG_CACHE_HOME": str(tmp_path)}
    env.pop("TRITON_INTERPRET", None)
    code = (
        "import logging, torch\n"
        "from chatcore.kernels import dispatch as kernels, native, reference\n"
        "from tests.test_kernels_reference import make_case\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "case = make_case([9, 30], num_kv_heads=1, group=3, head_dim=16, block_size=8, dtype=torch.float32)\n"
        "same = torch.equal(kernels.paged_decode_attention(*case, 0.25), reference.paged_decode_attention(*case, 0.25))\n"
        "print(native.available(), same)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], check=False, cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "True"]
    assert "uses the torch reference" in result.stderr


# ----- the cached library is loaded only when it is ours alone -----------------------------------
COMPILER = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
PLANTED_C = """#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *marker = fopen(MARKER, "w");
    if (marker) { fputs("the planted library ran", marker); fclose(marker); }
}
"""
DECODE_IN_A_PROCESS = (
    "import torch\n"
    "from chatcore.kernels import native, reference\n"
    "from tests.test_kernels_reference import make_case\n"
    "case = make_case([9, 30], num_kv_heads=1, group=3, head_dim=16, block_size=8, dtype=torch.float32)\n"
    "assert native.accepts(*case)\n"
    "torch.testing.assert_close(native.paged_decode_attention(*case, 0.25),\n"
    "                           reference.paged_decode_attention(*case, 0.25), atol=1e-5, rtol=1e-5)\n"
    "print('same results')\n"
)


def _decode_in_a_process(cache_home: Path) -> subprocess.CompletedProcess[str]:
    """A fresh process that builds or loads the C kernel from `cache_home` and checks it against the reference."""
    env = {**os.environ, "XDG_CACHE_HOME": str(cache_home)}
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run([sys.executable, "-c", DECODE_IN_A_PROCESS], check=False, cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout == "same results\n", result.stderr
    return result


def _plant(path: Path, marker: Path) -> None:
    """A library whose constructor writes `marker` when it is loaded."""
    source = path.with_name("planted.c")
    source.write_text(PLANTED_C)
    subprocess.run([COMPILER, "-shared", "-fPIC", f'-DMARKER="{marker}"', "-o", str(path), str(source)],
                   check=True, timeout=120)
    source.unlink()


PLANTINGS = ["world-writable folder", "group-writable folder", "folder is a link", "world-writable file",
             "file is a link", "file of another user"]


@pytest.mark.parametrize("how", PLANTINGS, ids=lambda how: how.replace(" ", "-"))
def test_a_planted_library_is_never_loaded(tmp_path: Path, how: str) -> None:
    """A library at the kernel's predictable name, in a cache folder others may write or in a file
    that is not ours alone, is never loaded (its constructor would run): the kernel is built again,
    in its place or, when the folder is not ours alone, in a private temporary folder, and gives the
    same results."""
    if how == "file of another user" and os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    marker = tmp_path / "planted-library-ran"
    folder = tmp_path / "cache" / "chatcore" / "kernels"
    elsewhere = tmp_path / "attacker"
    elsewhere.mkdir()
    folder.parent.mkdir(parents=True)
    if how == "folder is a link":
        folder.symlink_to(elsewhere)
    else:
        folder.mkdir(mode=0o700)
    target = folder / native.library_name(COMPILER)
    if how == "file is a link":
        _plant(elsewhere / "planted.so", marker)
        target.symlink_to(elsewhere / "planted.so")
    else:
        _plant(target, marker)
    planted = target.read_bytes()
    changes = {"world-writable folder": (folder, 0o777), "group-writable folder": (folder, 0o770),
               "world-writable file": (target, 0o777)}
    if how in changes:
        changes[how][0].chmod(changes[how][1])
    if how == "file of another user":
        os.chown(target, 65534, 65534)

    result = _decode_in_a_process(tmp_path / "cache")
    assert not marker.exists(), f"the planted library was loaded ({how})"
    assert "not loading" in result.stderr or "private temporary folder" in result.stderr, result.stderr
    if how.endswith("folder") or how == "folder is a link":  # the folder is not written: the build went elsewhere
        assert target.read_bytes() == planted and sorted(p.name for p in folder.iterdir()) == [target.name]
    else:  # rebuilt in place: a file of ours alone
        info = target.lstat()
        assert stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid() and not info.st_mode & 0o022
        assert target.read_bytes() != planted


def test_the_build_is_cached_in_a_private_folder(tmp_path: Path) -> None:
    """The first process builds the library into a 0700 folder; the next loads it without building."""
    _decode_in_a_process(tmp_path)
    folder = tmp_path / "chatcore" / "kernels"
    built = folder / native.library_name(COMPILER)
    first = built.stat()
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and stat.S_IMODE(first.st_mode) == 0o755
    result = _decode_in_a_process(tmp_path)
    again = built.stat()
    assert (again.st_ino, again.st_mtime_ns) == (first.st_ino, first.st_mtime_ns) and result.stderr == ""
    assert sorted(p.name for p in folder.iterdir()) == [built.name]


def test_a_known_longest_context_gives_the_same_output_and_bounds_every_context():
    case = make_case([5, 40, 17], num_kv_heads=2, group=2, head_dim=16, block_size=8, dtype=torch.bfloat16)
    assert torch.equal(native.paged_decode_attention(*case, 0.25, 40), native.paged_decode_attention(*case, 0.25))
    with pytest.raises(ValueError, match="longer than the 39 tokens"):  # its scores would not fit: nothing written
        native.paged_decode_attention(*case, 0.25, 39)


def test_a_steps_route_takes_the_c_kernels_directly_where_they_apply(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from chatcore.kernels import cpu_store

    query, key_cache, value_cache, table, lens = make_case([5, 40], num_kv_heads=2, group=2, head_dim=16,
                                                           block_size=8, dtype=torch.bfloat16)
    key = value = torch.randn(2, 2, 16).to(torch.bfloat16)
    slots = torch.tensor([int(table[0, 0]) * 8 + 4, int(table[1, 4]) * 8 + 7])
    route = kernels.route(query, key, value, key_cache, value_cache, slots, table, lens, 40)
    assert route.store is cpu_store.store_kv
    expected = key_cache.clone(), value_cache.clone()
    kernels.store_kv(key, value, *expected, slots)
    route.store(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected[0]) and torch.equal(value_cache, expected[1])
    assert torch.equal(route.decode(query, key_cache, value_cache, table, lens, 0.25),
                       kernels.paged_decode_attention(query, key_cache, value_cache, table, lens, 0.25))
    # A cast into the caches, or no decode rows: the checked entry points serve what the C kernels do not.
    wide = key.float()
    assert kernels.route(query, wide, wide, key_cache, value_cache, slots, table, lens, 40) == \
        kernels.AttentionRoute(kernels.store_kv, kernels.paged_decode_attention)
    assert kernels.route(query[:0], key, value, key_cache, value_cache, slots, None, None, None) == \
        kernels.AttentionRoute(cpu_store.store_kv, kernels.paged_decode_attention)
    with pytest.raises(ValueError, match="slot_mapping"):  # the first layer's arguments are checked
        kernels.route(query, key, value, key_cache, value_cache, slots.int(), table, lens, 40)


def _shifted(values: torch.Tensor) -> torch.Tensor:
    """`values` in a view one element past a buffer's start: for a half-precision tensor, 2 bytes
    past a 4-byte boundary (torch allocates at 64), so a 32-bit word of it straddles two."""
    buffer = torch.empty(values.numel() + 1, dtype=values.dtype)
    shifted = buffer[1:].view(values.shape).copy_(values)
    assert shifted.is_contiguous() and shifted.data_ptr() % 4 == 2
    return shifted


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_caches_and_queries_at_a_2_byte_offset_are_read_correctly(dtype):
    """bfloat16 rows are read two elements a 32-bit word: from a view at a 2-byte offset (kernels/
    cpu_decode.c once loaded such words as aligned, which UBSan reports) the output is the
    aligned tensors' output, bit for bit, and the torch reference's."""
    case = make_case([1, 16, 40, 100], num_kv_heads=3, group=3, head_dim=64, block_size=16, dtype=dtype, seed=3)
    query, key_cache, value_cache, table, lens = case
    if not native.accepts(*case):
        assert dtype == torch.float16  # a compiler without _Float16
        return
    shifted = (_shifted(query), _shifted(key_cache), _shifted(value_cache), table, lens)
    assert native.accepts(*shifted)
    got = native.paged_decode_attention(*shifted, 0.125)
    assert torch.equal(got, native.paged_decode_attention(*case, 0.125))
    torch.testing.assert_close(got.float(), dense_attention(*case, 0.125), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(got, reference.paged_decode_attention(*case, 0.125), atol=1e-2, rtol=1e-2)


def _at_offset(values: torch.Tensor, offset: int) -> torch.Tensor:
    """`values` copied to a buffer `offset` bytes past an aligned start (as torch.frombuffer may give)."""
    size = values.element_size()
    moved = torch.frombuffer(bytearray(values.numel() * size + offset), dtype=values.dtype, offset=offset,
                             count=values.numel()).view(values.shape)
    return moved.copy_(values)


def _wrong_decode(case: str) -> tuple[torch.Tensor, ...]:
    """A bfloat16 decode of two sequences (6 query heads over 2 kv heads of 16) with the one thing named wrong."""
    query, key_cache, value_cache, table, lens = make_case([5, 40], num_kv_heads=2, group=3, head_dim=16,
                                                           block_size=8, dtype=torch.bfloat16)
    if case == "int64 block tables":  # read as int32: halves of ids
        table = table.long()
    elif case == "int64 context lengths":
        lens = lens.long()
    elif case == "float64 query":
        query = query.double()
    elif case == "a float32 value cache":
        value_cache = value_cache.float()
    elif case == "a value cache of another shape":
        value_cache = value_cache[:-1]
    elif case == "a head_dim the caches do not have":
        query = torch.randn(2, 6, 32).bfloat16()
    elif case == "heads not a multiple of kv heads":
        query = query[:, :5].contiguous()
    elif case == "a bfloat16 head_dim not a multiple of 16":
        query, key_cache, value_cache = query[..., :8].contiguous(), key_cache[..., :8].contiguous(), \
            value_cache[..., :8].contiguous()
    elif case == "a table for one sequence of two":
        table = table[:1]
    elif case == "three context lengths for two":
        lens = torch.tensor([5, 40, 1], dtype=torch.int32)
    elif case == "a 1-d table":
        table = table[0]
    elif case == "a strided query":
        query = query.transpose(0, 1).contiguous().transpose(0, 1)
    elif case == "a strided cache":
        key_cache = key_cache.transpose(1, 2).contiguous().transpose(1, 2)
    elif case == "strided context lengths":
        lens = torch.tensor([5, 0, 40, 0], dtype=torch.int32)[::2]
    elif case == "table rows with a column stride":
        table = table.t().contiguous().t()
    elif case == "a table at a 2-byte offset":
        table = _at_offset(table, 2)
    elif case == "context lengths at a 2-byte offset":
        lens = _at_offset(lens, 2)
    elif case == "blocks of no tokens":
        key_cache, value_cache = key_cache[:, :0], value_cache[:, :0]
    elif case == "caches off the CPU":
        key_cache = torch.empty(key_cache.shape, dtype=key_cache.dtype, device="meta")
    return query, key_cache, value_cache, table, lens


WRONG_DECODE = {
    "int64 block tables": "int32", "int64 context lengths": "int32", "float64 query": "reads",
    "a float32 value cache": "reads", "a value cache of another shape": "both caches",
    "a head_dim the caches do not have": "head_dim shared", "heads not a multiple of kv heads": "whole groups",
    "a bfloat16 head_dim not a multiple of 16": "16 for bfloat16", "a table for one sequence of two": r"\[2, width\]",
    "three context lengths for two": r"context_lens \[2\]", "a 1-d table": r"\[2, width\]",
    "a strided query": "contiguous", "a strided cache": "contiguous", "strided context lengths": "contiguous",
    "table rows with a column stride": "table rows", "a table at a 2-byte offset": "4-byte boundaries",
    "context lengths at a 2-byte offset": "4-byte boundaries", "blocks of no tokens": "at least one token",
    "caches off the CPU": "CPU"}


@pytest.mark.parametrize("case", WRONG_DECODE)
def test_what_the_c_decode_cannot_take_is_refused(case):
    """Refused by `native.paged_decode_attention` itself (a step's route calls it directly for every
    layer), and declined by `accepts`, so the checked entry point gives it to the reference."""
    args = _wrong_decode(case)
    assert not native.accepts(*args)
    with pytest.raises(ValueError, match=WRONG_DECODE[case]):
        native.paged_decode_attention(*args, 0.25, 40)


def test_a_later_layer_of_a_routed_step_is_checked_too(monkeypatch):
    """`dispatch.route` checks a step's first layer only; the decode it hands back still refuses a
    later layer's arguments the C cannot take."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    query, key_cache, value_cache, table, lens = make_case([5, 40], num_kv_heads=2, group=2, head_dim=16,
                                                           block_size=8, dtype=torch.bfloat16)
    key = torch.randn(2, 2, 16).bfloat16()
    slots = torch.tensor([int(table[0, 0]) * 8 + 4, int(table[1, 4]) * 8 + 7])
    route = kernels.route(query, key, key, key_cache, value_cache, slots, table, lens, 40)
    assert route.decode is not kernels.paged_decode_attention  # the C decode, called directly
    with pytest.raises(ValueError, match="head_dim shared"):
        route.decode(torch.randn(2, 4, 32).bfloat16(), key_cache, value_cache, table, lens, 0.25)
    with pytest.raises(ValueError, match="int32"):
        route.decode(query, key_cache, value_cache, table.long(), lens, 0.25)


def test_every_c_source_converts_bfloat16_through_the_one_header() -> None:
    """bfloat16.h holds the one rounding rule (to nearest, ties to even; a NaN stays one): a source
    that converts bfloat16 includes it, and no source spells the rule out again."""
    sources = [path for path in native.SOURCES if "bfloat16" in path.read_text(encoding="utf-8").lower()]
    assert len(sources) >= 3
    for path in sources:
        text = path.read_text(encoding="utf-8")
        assert '#include "bfloat16.h"' in text, path.name
        assert "0x7fffu" not in text, f"{path.name} rounds to bfloat16 itself"
    header = native.HEADERS[0].read_text(encoding="utf-8")
    assert "0x7fffu" in header
