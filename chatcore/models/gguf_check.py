"""A GGUF file read and checked before anything is built from it.

transformers builds the model a GGUF's header declares (`{arch}.block_count`, `embedding_length`,
`feed_forward_length`, the vocabulary), allocating all of it, then copies in the tensors it finds and
leaves the others as they were initialized: a 2 MB file declaring 48 wide layers would allocate
gigabytes, and a file without its weight tensors would serve random weights. So, before that:

- the header's sizes are checked against the tensors the file holds: the embedding is
  [embedding_length, vocabulary]; every declared layer has its weights (for Llama each of its nine, their
  shapes against embedding_length and feed_forward_length; for another architecture at least one tensor),
  and no tensor belongs to a layer past the declared count;
- the model's float32 copy (every tensor dequantized, and the LM head when it is tied to the embedding)
  must fit in the memory available now.

Each refusal is one line (`UnsupportedGGUF`). Shapes are GGUF's, the fastest dimension first.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from chatcore.kv.sizing import available_ram_bytes
from chatcore.models.errors import ModelUnavailable

FLOAT32_BYTES = 4
# A Llama layer's tensors and their shapes: "E" embedding_length, "F" feed_forward_length, None not checked.
LLAMA_LAYER: dict[str, tuple[str | None, ...]] = {
    "attn_norm": ("E",), "attn_q": ("E", None), "attn_k": ("E", None), "attn_v": ("E", None),
    "attn_output": (None, "E"), "ffn_norm": ("E",), "ffn_gate": ("E", "F"), "ffn_up": ("E", "F"),
    "ffn_down": ("F", "E")}
_LAYER = re.compile(r"blk\.(\d+)\.")


class UnsupportedGGUF(ModelUnavailable):
    """A GGUF file that cannot be served; the message names what is wrong, in one line."""


def read_gguf(path: Path) -> Any:
    """The file's `GGUFReader` (memory-mapped), parsed whole: a truncated file, or a tensor that reaches
    past the file's end, fails here."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
        architecture(reader)
    except Exception as exc:  # GGUFReader's parse fails in many ways on a bad file: all one line
        why = str(exc).splitlines()[0][:160] if str(exc) else ""
        raise UnsupportedGGUF(f"GGUF file {path} is truncated or corrupt ({type(exc).__name__}: {why})") from None
    return reader


def architecture(reader: Any) -> str:
    field = reader.fields["general.architecture"]
    return bytes(field.parts[field.data[0]]).decode()


def check_declared(reader: Any, path: Path, available_bytes: int | None = None) -> None:
    """`UnsupportedGGUF` unless the header's sizes match the tensors and the float32 model fits in
    `available_bytes` (default: the memory available now)."""
    arch = architecture(reader)
    tensors = {t.name: [int(n) for n in t.shape] for t in reader.tensors}
    sizes = {"E": _number(reader, f"{arch}.embedding_length"), "F": _number(reader, f"{arch}.feed_forward_length")}
    layers = _number(reader, f"{arch}.block_count") or 0
    embedding = tensors.get("token_embd.weight")
    if embedding is None:
        raise UnsupportedGGUF(f"GGUF file {path} has no token_embd.weight: its weight tensors are missing")
    if sizes["E"] is not None and embedding[0] != sizes["E"]:
        raise UnsupportedGGUF(f"GGUF file {path} declares embedding_length {sizes['E']}, but token_embd.weight is "
                              f"{embedding}")
    _check_layers(tensors, layers, path)
    if arch == "llama":
        _check_llama_layers(tensors, layers, sizes, path)
    _check_memory(reader, embedding, path, available_bytes)


def _number(reader: Any, key: str) -> int | None:
    field = reader.fields.get(key)
    return int(field.parts[field.data[0]][0]) if field is not None and field.data else None


def _check_layers(tensors: dict[str, list[int]], layers: int, path: Path) -> None:
    present = {int(m.group(1)) for name in tensors if (m := _LAYER.match(name))}
    missing = sorted(set(range(layers)) - present)
    if missing:
        raise UnsupportedGGUF(f"GGUF file {path} declares {layers} layers, but has no tensors for {len(missing)} of "
                              f"them (layer {missing[0]} the first): its weight tensors are missing")
    beyond = sorted(present - set(range(layers)))
    if beyond:
        raise UnsupportedGGUF(f"GGUF file {path} declares {layers} layers, but holds tensors of layer {beyond[0]}")


def _check_llama_layers(tensors: dict[str, list[int]], layers: int, sizes: dict[str, int | None], path: Path) -> None:
    for layer in range(layers):
        for kind, dims in LLAMA_LAYER.items():
            name = f"blk.{layer}.{kind}.weight"
            shape = tensors.get(name)
            if shape is None:
                raise UnsupportedGGUF(f"GGUF file {path} has no {name}: its weight tensors are missing")
            wanted = [sizes[d] if d is not None else None for d in dims]
            if len(shape) != len(dims) or any(w is not None and w != n for w, n in zip(wanted, shape, strict=False)):
                shown = [w if w is not None else "*" for w in wanted]
                raise UnsupportedGGUF(f"GGUF file {path}: {name} is {shape}, but the header declares {shown}")


def _check_memory(reader: Any, embedding: list[int], path: Path, available_bytes: int | None) -> None:
    elements = sum(int(t.n_elements) for t in reader.tensors)
    if not any(t.name == "output.weight" for t in reader.tensors):
        elements += embedding[0] * embedding[1]  # the LM head, tied to the embedding, gets its own copy
    need = elements * FLOAT32_BYTES
    available = available_ram_bytes() if available_bytes is None else available_bytes
    if need > available:
        raise UnsupportedGGUF(f"GGUF file {path} declares {elements} weights, {need / 2**30:.2f} GiB as float32; "
                              f"{available / 2**30:.2f} GiB of memory is available")
