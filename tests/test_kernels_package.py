"""The `chatcore.kernels` package as the engine sees it: cheap import, CPU dispatch, and no shadowing of
Hugging Face's `kernels`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from chatcore.kernels import dispatch as kernels
from chatcore.kernels import reference

REPO = Path(__file__).resolve().parents[1]


def run_python(code: str) -> str:
    """Run code in a fresh interpreter at the repository root, without TRITON_INTERPRET."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_import_is_cheap():
    out = run_python("import sys, chatcore.kernels.dispatch; print('torch' in sys.modules, 'triton' in sys.modules)")
    assert out.split() == ["False", "False"]


def test_the_checkout_root_shadows_no_kernels_package():
    """From the checkout root, `import kernels` is Hugging Face's distribution, which transformers imports;
    ours is `chatcore.kernels` alone, and kernels/ is no regular package (no __init__.py)."""
    out = run_python(
        "import importlib.metadata, kernels, transformers.modeling_utils\n"
        "from chatcore.kernels import dispatch\n"
        "print(kernels.__file__)\n"
        "print(importlib.metadata.packages_distributions()['kernels'])\n"
        "print(dispatch.__name__)\n"
    )
    origin, dists, name = out.splitlines()
    assert not Path(origin).is_relative_to(REPO / "kernels"), origin
    assert dists == "['kernels']"
    assert name == "chatcore.kernels.dispatch"
    assert not (REPO / "kernels" / "__init__.py").exists()
    assert not (REPO / "bench" / "__init__.py").exists()


def test_cpu_calls_run_the_c_path_or_the_reference_without_triton():
    out = run_python(
        "import sys, torch\n"
        "from chatcore.kernels import dispatch as kernels, native, reference\n"
        "g = torch.Generator().manual_seed(0)\n"
        "kc, vc = torch.randn(6, 8, 2, 16, generator=g), torch.randn(6, 8, 2, 16, generator=g)\n"
        "q = torch.randn(2, 4, 16, generator=g)\n"
        "bt = torch.tensor([[3, 1, -9], [5, 99, 99]], dtype=torch.int32)\n"
        "lens = torch.tensor([11, 8], dtype=torch.int32)\n"
        "cpu = native if native.available() else reference\n"
        "same = torch.equal(kernels.paged_decode_attention(q, kc, vc, bt, lens, 0.25),\n"
        "                   cpu.paged_decode_attention(q, kc, vc, bt, lens, 0.25))\n"
        "half = (q.half(), kc.half(), vc.half(), bt, lens)\n"
        "same &= torch.equal(kernels.paged_decode_attention(*half, 0.25), (native if native.accepts(*half) else reference)\n"
        "                   .paged_decode_attention(*half, 0.25))\n"
        "odd = (q[..., :12].contiguous(), kc[..., :12].contiguous(), vc[..., :12].contiguous(), bt, lens)\n"
        "same &= torch.equal(kernels.paged_decode_attention(*odd, 0.25), reference.paged_decode_attention(*odd, 0.25))\n"
        "k, v = torch.randn(2, 2, 16, generator=g), torch.randn(2, 2, 16, generator=g)\n"
        "kernels.store_kv(k, v, kc, vc, torch.tensor([0, -1]))\n"
        "kernels.copy_blocks(kc, vc, torch.tensor([0]), torch.tensor([4]))\n"
        "stored = torch.equal(kc[4, 0], k[0]) and torch.equal(vc[4, 0], v[0])\n"
        "print(same, stored, 'triton' in sys.modules)\n"
    )
    assert out.split() == ["True", "True", "False"]


def test_out_is_filled_on_the_cpu_path(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    gen = torch.Generator().manual_seed(3)
    key_cache, value_cache = torch.randn(4, 16, 1, 32, generator=gen), torch.randn(4, 16, 1, 32, generator=gen)
    query = torch.randn(1, 3, 32, generator=gen)
    table, lens = torch.tensor([[2, 0]], dtype=torch.int32), torch.tensor([20], dtype=torch.int32)
    out = torch.empty(1, 3, 32)
    got = kernels.paged_decode_attention(query, key_cache, value_cache, table, lens, 0.2, out=out)
    assert got is out
    torch.testing.assert_close(out, reference.paged_decode_attention(query, key_cache, value_cache, table, lens, 0.2),
                               atol=1e-5, rtol=1e-5)
