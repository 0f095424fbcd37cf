"""The Triton kernels: paged decode against the torch reference and dense SDPA; store and copy.

On CPU the kernels run in Triton's interpreter (about 1000x slower than compiled code), so
the cases are small; with a GPU the same cases also run compiled on CUDA. TRITON_INTERPRET is
set per test (monkeypatch), not at import: `kernels` picks the mode at each launch (see
kernels/_triton.py), and a module-level assignment would leak into every test collected after
this file, sending the engine's CPU calls through the interpreter.
"""

from __future__ import annotations

import math
import mmap
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from chatcore.kernels import dispatch as kernels
from chatcore.kernels import reference
from chatcore.kernels.paged_decode import pick_num_splits

REPO = Path(__file__).resolve().parents[1]

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 2e-2}


@pytest.fixture(params=["cpu", "cuda"])
def device(request, monkeypatch) -> str:
    if request.param == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    elif not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return request.param


def dense_attention(query, key_cache, value_cache, block_tables, context_lens, scale) -> torch.Tensor:
    """fp32 SDPA of each sequence over its keys and values, gathered one sequence at a time."""
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    out = torch.zeros(num_seqs, num_heads, head_dim)
    for i in range(num_seqs):
        n = int(context_lens[i])
        if n == 0:
            continue
        blocks = block_tables[i, : -(-n // block_size)].long().cpu()
        k = key_cache.cpu()[blocks].reshape(-1, num_kv_heads, head_dim)[:n].float().transpose(0, 1)
        v = value_cache.cpu()[blocks].reshape(-1, num_kv_heads, head_dim)[:n].float().transpose(0, 1)
        group = num_heads // num_kv_heads
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        out[i] = F.scaled_dot_product_attention(query[i].cpu().float()[:, None], k, v, scale=scale)[:, 0]
    return out


def make_case(lens, *, num_kv_heads, group, head_dim, block_size, dtype, device="cpu", seed=0):
    """Random caches, a shuffled (non-contiguous) block table, padding that is out-of-range garbage."""
    gen = torch.Generator().manual_seed(seed)
    used = [-(-n // block_size) for n in lens]
    width = max(used + [1]) + 2
    num_blocks = sum(used) + 3
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    query = torch.randn(len(lens), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    ids = torch.randperm(num_blocks, generator=gen)
    table = torch.randint(-(2**31), 2**31 - 1, (len(lens), width), generator=gen, dtype=torch.int64)
    start = 0
    for i, n in enumerate(used):
        table[i, :n] = ids[start : start + n]
        start += n
    tensors = query, key_cache, value_cache, table.to(torch.int32), torch.tensor(lens, dtype=torch.int32)
    return tuple(t.to(device) for t in tensors)


# (dtype, num_kv_heads, group, head_dim, block_size, context lengths, num_splits)
CASES = [
    (torch.float32, 2, 1, 64, 16, [1, 16, 37, 64], None),
    (torch.float32, 1, 3, 80, 8, [8, 23, 1], 2),
    (torch.float32, 2, 4, 96, 32, [96, 5, 33], 3),
    (torch.float32, 1, 3, 64, 16, [300, 17], 2),  # several tiles per split
    (torch.float16, 1, 3, 64, 64, [64, 130, 1], 2),
    (torch.float16, 3, 3, 64, 32, [32, 200], None),  # the default model's head layout
    (torch.bfloat16, 2, 4, 80, 16, [48, 7, 100], 4),
    (torch.bfloat16, 1, 1, 96, 8, [1, 64], 1),
]


@pytest.mark.parametrize("dtype,num_kv_heads,group,head_dim,block_size,lens,num_splits", CASES)
def test_matches_reference_and_dense(device, dtype, num_kv_heads, group, head_dim, block_size, lens, num_splits):
    case = make_case(lens, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim,
                     block_size=block_size, dtype=dtype, device=device)
    scale = head_dim**-0.5
    got = kernels.paged_decode_attention(*case, scale, num_splits=num_splits)
    assert got.shape == case[0].shape and got.dtype == dtype and got.device == case[0].device
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), reference.paged_decode_attention(*case, scale).float(), atol=tol, rtol=tol)
    torch.testing.assert_close(got.float().cpu(), dense_attention(*case, scale), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,kv_dtype", [(torch.float32, torch.float16), (torch.float32, torch.bfloat16),
                                             (torch.bfloat16, torch.float16)])
def test_reads_a_cache_stored_in_another_dtype(device, dtype, kv_dtype):
    """kv_dtype: the caches are read converted to the query's dtype, as the reference does."""
    query, key_cache, value_cache, *rest = make_case([40, 7, 100], num_kv_heads=3, group=3, head_dim=64,
                                                     block_size=16, dtype=dtype, device=device)
    case = (query, key_cache.to(kv_dtype), value_cache.to(kv_dtype), *rest)
    got = kernels.paged_decode_attention(*case, 0.125, num_splits=2)
    assert got.dtype == dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), reference.paged_decode_attention(*case, 0.125).float(), atol=tol, rtol=tol)
    torch.testing.assert_close(got.float().cpu(), dense_attention(*case, 0.125), atol=tol, rtol=tol)


def test_empty_splits_and_empty_contexts_contribute_nothing(device):
    """More splits than tiles: most splits own no tokens; context 0 must give zeros, not NaN."""
    case = make_case([1, 70, 0, 16], num_kv_heads=1, group=4, head_dim=32, block_size=16,
                     dtype=torch.float32, device=device)
    for num_splits in (1, 6):
        got = kernels.paged_decode_attention(*case, 0.2, num_splits=num_splits)
        assert not got.isnan().any()
        assert torch.equal(got[2].cpu(), torch.zeros(4, 32))
        torch.testing.assert_close(got.cpu(), dense_attention(*case, 0.2), atol=1e-5, rtol=1e-5)


def test_never_reads_masked_slots(device):
    """Slots past each context and blocks only the padding names are NaN: the kernel must not read them."""
    lens = [3, 21, 16]
    query, key_cache, value_cache, table, context_lens = make_case(
        lens, num_kv_heads=2, group=3, head_dim=64, block_size=8, dtype=torch.float16, device=device)
    expected = dense_attention(query, key_cache, value_cache, table, context_lens, 0.125)
    live = torch.zeros(key_cache.shape[:2], dtype=torch.bool, device=device)
    for i, n in enumerate(lens):
        for t in range(n):
            live[table[i, t // 8].long(), t % 8] = True
    key_cache[~live] = float("nan")
    value_cache[~live] = float("nan")
    got = kernels.paged_decode_attention(query, key_cache, value_cache, table, context_lens, 0.125, num_splits=2)
    torch.testing.assert_close(got.float().cpu(), expected, atol=2e-2, rtol=2e-2)


def test_writes_into_out_with_its_strides(device):
    case = make_case([9, 40], num_kv_heads=1, group=3, head_dim=64, block_size=16, dtype=torch.float32, device=device)
    storage = torch.full((2, 64, 3), -7.0, device=device)
    out = storage.transpose(1, 2)  # [2, 3, 64], non-contiguous
    for num_splits in (1, 2):
        got = kernels.paged_decode_attention(*case, 0.125, num_splits=num_splits, out=out)
        assert got is out
        torch.testing.assert_close(out.cpu(), dense_attention(*case, 0.125), atol=1e-5, rtol=1e-5)


def sparse_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor over a sparse, already-unlinked temporary file mapped MAP_SHARED.

    The file has the tensor's full size but no data: the kernel needs real addresses beyond
    2^31 elements, yet only the pages a test touches ever get memory (untouched pages read as
    zeros). A file mapping, unlike an anonymous one, is not charged against the commit limit,
    so this works under strict overcommit too. The interpreter's host copy of an argument is
    the storage itself for CPU tensors, so nothing copies the whole range.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    with tempfile.TemporaryFile() as f:
        f.truncate(nbytes)
        mapping = mmap.mmap(f.fileno(), nbytes)
    return torch.frombuffer(mapping, dtype=dtype).view(shape)


# A pool [num_blocks, 2 (k/v), 16 slots, 1 head, 16 dims] of fp16: a block stride of 512
# elements, so block ids >= 2^23 sit at element offsets >= 2^32 (8 GiB of address space, a
# few pages used). With int32 arithmetic those offsets wrap to (id - 2^23) * 512: a valid
# but wrong (all-zero) block, so a missing int64 cast fails the comparison instead of
# crashing the process.
HIGH = 2**23
BIG_POOL_SHAPE = (HIGH + 64, 2, 16, 1, 16)


@pytest.fixture
def big_pool(monkeypatch) -> torch.Tensor:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return sparse_tensor(BIG_POOL_SHAPE, torch.float16)


def test_block_offsets_beyond_int32(big_pool):
    key_cache, value_cache = big_pool[:, 0], big_pool[:, 1]
    assert key_cache.stride(0) * HIGH >= 2**32
    gen = torch.Generator().manual_seed(1)
    high_ids = torch.tensor([HIGH + 3, HIGH + 17, HIGH + 40, HIGH + 41, HIGH + 60])
    key_cache[high_ids] = torch.randn(5, 16, 1, 16, generator=gen).half()
    value_cache[high_ids] = torch.randn(5, 16, 1, 16, generator=gen).half()
    table = torch.tensor([[HIGH + 40, HIGH + 3, HIGH + 60], [HIGH + 17, HIGH + 41, -1]], dtype=torch.int32)
    context_lens = torch.tensor([40, 32], dtype=torch.int32)
    query = torch.randn(2, 2, 16, generator=gen).half()
    expected = dense_attention(query, key_cache, value_cache, table, context_lens, 0.25)
    for num_splits in (1, 2):
        got = kernels.paged_decode_attention(query, key_cache, value_cache, table, context_lens, 0.25,
                                             num_splits=num_splits)
        torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)


def test_cpu_dispatch_follows_the_variable_per_call(monkeypatch):
    """On CPU tensors, TRITON_INTERPRET picks the Triton kernel or the reference at each call."""
    case = make_case([5, 20], num_kv_heads=1, group=2, head_dim=16, block_size=8, dtype=torch.float32)
    expected = dense_attention(*case, 0.25)
    for mode in ("1", "0", "1"):
        monkeypatch.setenv("TRITON_INTERPRET", mode)
        torch.testing.assert_close(kernels.paged_decode_attention(*case, 0.25, num_splits=2), expected,
                                   atol=1e-5, rtol=1e-5)


def test_split_heuristic():
    # Plenty of programs already (128 seqs x 8 kv heads, 4 per SM on 132 SMs): no split.
    assert pick_num_splits(128, 8, 4096, 132) == 1
    # One long sequence: split it, but never below 256 tokens per split.
    assert pick_num_splits(1, 1, 4096, 132) == 16
    assert pick_num_splits(1, 1, 300, 132) == 2
    # More SMs or fewer sequences never mean fewer splits; the cap holds.
    assert pick_num_splits(32, 3, 4096, 132) <= pick_num_splits(8, 3, 4096, 132) <= 32
    assert pick_num_splits(1, 1, 1 << 20, 1024) == 32
    assert pick_num_splits(4, 2, 1, 132) == 1


def test_rejects_bad_arguments():
    query, key_cache, value_cache, table, lens = make_case([4], num_kv_heads=2, group=2, head_dim=16,
                                                           block_size=8, dtype=torch.float32)
    with pytest.raises(ValueError, match="dtype"):
        kernels.paged_decode_attention(query.double(), key_cache, value_cache, table, lens, 1.0)
    with pytest.raises(ValueError, match="dtype"):
        kernels.paged_decode_attention(query, key_cache, value_cache.half(), table, lens, 1.0)
    with pytest.raises(ValueError, match="int32"):
        kernels.paged_decode_attention(query, key_cache, value_cache, table.long(), lens, 1.0)
    with pytest.raises(ValueError, match="multiple"):
        kernels.paged_decode_attention(query[:, :3], key_cache, value_cache, table, lens, 1.0)
    with pytest.raises(ValueError, match="out"):
        kernels.paged_decode_attention(query, key_cache, value_cache, table, lens, 1.0, out=query[:, :1])


def random_caches(num_blocks, block_size, num_kv_heads, head_dim, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return tuple(torch.randn(shape, generator=gen).to(dtype).to(device) for _ in range(2))


@pytest.mark.parametrize("dtype,block_size,num_kv_heads,head_dim", [
    (torch.float32, 8, 3, 80),
    (torch.bfloat16, 16, 2, 64),
    (torch.float16, 64, 1, 96),
    (torch.bfloat16, 32, 4, 16),
])
def test_store_kv_matches_reference(device, dtype, block_size, num_kv_heads, head_dim):
    caches = random_caches(5, block_size, num_kv_heads, head_dim, dtype, device)
    gen = torch.Generator().manual_seed(1)
    num_tokens = 300 if block_size == 64 else 7  # 300: more than one program's tile, the last one partial
    # fp32 input, non-contiguous: the cast to the cache dtype happens on the way in.
    key = torch.randn(num_kv_heads, num_tokens, head_dim, generator=gen).transpose(0, 1).to(device)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(device)
    slots = torch.randperm(5 * block_size, generator=gen)[:num_tokens]
    slots[[1, 4]] = -1  # skipped tokens
    slots = slots.to(device)
    expected = tuple(c.clone() for c in caches)
    reference.store_kv(key, value, *expected, slots)
    kernels.store_kv(key, value, *caches, slots)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])
    kept = slots >= 0
    assert torch.equal(caches[0].flatten(0, 1)[slots[kept]], key[kept].to(dtype))


@pytest.mark.parametrize("dtype,block_size,num_kv_heads,head_dim", [
    (torch.float32, 8, 3, 80),
    (torch.bfloat16, 64, 2, 96),
])
def test_copy_blocks_matches_reference(device, dtype, block_size, num_kv_heads, head_dim):
    caches = random_caches(7, block_size, num_kv_heads, head_dim, dtype, device)
    src = torch.tensor([2, 0, 6], device=device)
    dst = torch.tensor([5, 3, 1], device=device)
    expected = tuple(c.clone() for c in caches)
    reference.copy_blocks(*expected, src, dst)
    kernels.copy_blocks(*caches, src, dst)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])
    assert torch.equal(caches[1][5], caches[1][2])


def test_store_and_copy_beyond_int32(big_pool):
    """Slots and block ids whose element offsets pass 2^32 (see BIG_POOL_SHAPE)."""
    key_cache, value_cache = big_pool[:, 0], big_pool[:, 1]
    gen = torch.Generator().manual_seed(2)
    key, value = torch.randn(3, 1, 16, generator=gen), torch.randn(3, 1, 16, generator=gen)
    slots = torch.tensor([(HIGH + 9) * 16 + 5, -1, (HIGH + 9) * 16 + 15])
    kernels.store_kv(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache[HIGH + 9, 5], key[0].half())
    assert torch.equal(value_cache[HIGH + 9, 15], value[2].half())
    assert key_cache[9].count_nonzero() == 0  # where int32 offsets would have wrapped to
    kernels.copy_blocks(key_cache, value_cache, torch.tensor([HIGH + 9]), torch.tensor([HIGH + 30]))
    assert torch.equal(key_cache[HIGH + 30], key_cache[HIGH + 9])
    assert torch.equal(value_cache[HIGH + 30], value_cache[HIGH + 9])
    assert key_cache[HIGH + 30].count_nonzero() > 0


COMPILE_FOR_GPU = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime import JITFunction
from chatcore.kernels import cache_ops, paged_decode, unified_attention

def compile_kernel(fn, pointers, constexprs):
    kernel = JITFunction(fn)
    names = kernel.arg_names
    signature = {n: "constexpr" if n in constexprs else pointers.get(n, "i32") for n in names}
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(names.index(n),): v for n, v in constexprs.items()})
    triton.compile(source, target=GPUTarget("cuda", int(sys.argv[1]), 32), options={"num_warps": 4})

# (query and output, caches): the last two read a cache stored narrower or otherwise (kv_dtype).
for dtype, kv, splits in (("fp16", "fp16", 1), ("bf16", "bf16", 4), ("fp32", "fp32", 4), ("fp32", "bf16", 1),
                          ("bf16", "fp16", 4)):
    io = {"q_ptr": "*" + dtype, "out_ptr": "*" + dtype, "k_ptr": "*" + kv, "v_ptr": "*" + kv}
    parts = {n: "*fp32" for n in ("part_acc_ptr", "part_m_ptr", "part_l_ptr")}
    compile_kernel(paged_decode._decode_kernel, {**io, **parts, "block_tables_ptr": "*i32",
                   "context_lens_ptr": "*i32", "scale_log2": "fp32"},
                   dict(GROUP=3, GROUP_PAD=16, HEAD_DIM=80, HEAD_DIM_PAD=128, BLOCK_SIZE=16, TILE_N=64,
                        NUM_SPLITS=splits, DOT_FP32=dtype == "fp32"))
    compile_kernel(unified_attention._unified_kernel, {**io, "block_tables_ptr": "*i32", "cu_seqlens_q_ptr": "*i32",
                   "seq_lens_ptr": "*i32", "scale_log2": "fp32"},
                   dict(GROUP=3, BLOCK_Q=5, BLOCK_M=16, HEAD_DIM=80, HEAD_DIM_PAD=128, BLOCK_SIZE=16, TILE_N=64,
                        DOT_FP32=dtype == "fp32"))
compile_kernel(paged_decode._reduce_kernel, {**parts, "out_ptr": "*bf16"},
               dict(HEAD_DIM=80, HEAD_DIM_PAD=128, NUM_SPLITS=5))
row = dict(NUM_KV_HEADS=3, KV_HEADS_PAD=4, HEAD_DIM=80, HEAD_DIM_PAD=128, BLOCK_SIZE=16)
compile_kernel(cache_ops._store_kv_kernel, {"key_ptr": "*fp16", "value_ptr": "*fp16", "key_cache_ptr": "*fp16",
               "value_cache_ptr": "*fp16", "slot_mapping_ptr": "*i64"}, {**row, "TOKENS": 16})
compile_kernel(cache_ops._copy_blocks_kernel, {"key_cache_ptr": "*fp16", "value_cache_ptr": "*fp16",
               "src_ptr": "*i64", "dst_ptr": "*i64"}, row)
print("compiled")
"""


@pytest.mark.parametrize("capability", [80, 90])
def test_kernels_compile_for_gpus(capability):
    """Compile (no launch, so no GPU needed) for Ampere and Hopper: what the interpreter does not
    check, such as tl.dot's minimum shapes, MMA operand dtypes and shared memory."""
    assert run_python(COMPILE_FOR_GPU, str(capability)) == ["compiled"]


def run_python(code: str, *args: str) -> list[str]:
    """Run code in a fresh interpreter at the repository root, TRITON_INTERPRET unset; its stdout words."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # silences Triton 3.9's warning about the coming default
    result = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.split()


def test_interpreter_works_after_triton_was_imported_compiled():
    """torch._dynamo (and so a test session) may import triton before TRITON_INTERPRET is set."""
    assert run_python("""
import os, torch, triton
from chatcore.kernels import dispatch as kernels
from chatcore.kernels import reference
os.environ["TRITON_INTERPRET"] = "1"
g = torch.Generator().manual_seed(0)
kc, vc = torch.randn(6, 8, 2, 16, generator=g), torch.randn(6, 8, 2, 16, generator=g)
q = torch.randn(2, 4, 16, generator=g)
bt, lens = torch.tensor([[3, 1, 2], [5, 0, 4]], dtype=torch.int32), torch.tensor([20, 9], dtype=torch.int32)
got = kernels.paged_decode_attention(q, kc, vc, bt, lens, 0.25, num_splits=2)
print(torch.allclose(got, reference.paged_decode_attention(q, kc, vc, bt, lens, 0.25), atol=1e-5))
k, v = torch.randn(2, 2, 16, generator=g), torch.randn(2, 2, 16, generator=g)
kernels.store_kv(k, v, kc, vc, torch.tensor([9, -1]))
kernels.copy_blocks(kc, vc, torch.tensor([1]), torch.tensor([5]))
print(torch.equal(kc[5, 1], k[0]) and torch.equal(vc[5, 1], v[0]))
""") == ["True", "True"]
