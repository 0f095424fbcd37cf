"""Content-addressed KV block files: the disk tier's storage format.

A file holds one block across all layers. Its name is the hex of the block's content hash
(never anything taken from user input), under a two-character fan-out directory. Layout:

    MAGIC | header length (4 bytes, little endian) | header (JSON) | payload

The header names the model fingerprint, the block hash, dtype, shape and the payload's
SHA-256. Reading checks all of them; a file that fails any check is deleted and reported
as missing, so corrupt, truncated or foreign KV is never used. Writes go to a temporary
file in the same directory, are fsynced, then renamed: readers (and other replicas sharing
the directory) see either nothing or a whole file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from chatcore.kv.tensors import DTYPES

log = logging.getLogger(__name__)
MAGIC = b"CCKV\x01\n"
HEX_NAME = re.compile(r"[0-9a-f]{32}")


@dataclass(frozen=True, slots=True)
class BlockFile:
    name: str
    size: int
    checksum: str


class DiskBlocks:
    def __init__(self, root: Path, fingerprint: str) -> None:
        self.root = root
        self.fingerprint = fingerprint
        root.mkdir(parents=True, exist_ok=True)

    @staticmethod
    def name_for(block_hash: bytes) -> str:
        digest = block_hash.hex()
        return f"{digest[:2]}/{digest}.kvb"

    def path_for(self, block_hash: bytes) -> Path:
        return self.root / self.name_for(block_hash)

    def write(self, block_hash: bytes, block: torch.Tensor) -> BlockFile:
        block = block.detach().contiguous().cpu()
        payload = block.view(torch.uint8).numpy().tobytes()
        checksum = hashlib.sha256(payload).hexdigest()
        header = json.dumps({
            "model": self.fingerprint,
            "hash": block_hash.hex(),
            "dtype": str(block.dtype).removeprefix("torch."),
            "shape": list(block.shape),
            "payload": len(payload),
            "sha256": checksum,
        }).encode()
        path = self.path_for(block_hash)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(MAGIC + len(header).to_bytes(4, "little") + header + payload)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return BlockFile(self.name_for(block_hash), path.stat().st_size, checksum)

    def read(self, block_hash: bytes, *, missing_ok: bool = True, checksum: str | None = None) -> torch.Tensor | None:
        """The block's tensor, or None (the file is then deleted) if missing or not trustworthy.

        With `missing_ok=False` a missing file raises `FileNotFoundError` instead: another
        replica sharing the directory may delete a block (its byte budget) at any time.
        `checksum`: the payload's SHA-256 as the index recorded it when the file was written; a
        file that is whole but not that one (replaced behind the index's back) is rejected too."""
        path = self.path_for(block_hash)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            if not missing_ok:
                raise
            return None
        problem = self._check(data, block_hash, checksum)
        if isinstance(problem, str):
            log.warning("rejecting KV block file %s: %s", path.name, problem)
            path.unlink(missing_ok=True)
            return None
        return problem

    def _check(self, data: bytes, block_hash: bytes, checksum: str | None) -> torch.Tensor | str:
        if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 4:
            return "bad magic"
        start = len(MAGIC) + 4
        header_len = int.from_bytes(data[len(MAGIC):start], "little")
        try:
            header = json.loads(data[start:start + header_len])
            dtype = DTYPES[header["dtype"]]
            shape = [int(x) for x in header["shape"]]
            expected = int(header["payload"])
        except (ValueError, KeyError, TypeError):
            return "bad header"
        if header.get("model") != self.fingerprint:
            return "written for another model"
        if header.get("hash") != block_hash.hex():
            return "hash mismatch"
        payload = data[start + header_len:]
        if len(payload) != expected:
            return f"truncated ({len(payload)} of {expected} bytes)"
        if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
            return "checksum mismatch"
        if checksum is not None and header.get("sha256") != checksum:
            return "not the file the index recorded (checksum differs)"
        tensor = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        try:
            return tensor.view(dtype).reshape(shape)
        except RuntimeError:
            return "payload does not match its shape"

    def old_files(self, min_age_s: float) -> tuple[list[Path], list[bytes]]:
        """Temporary files, and the hashes of block files, last modified over `min_age_s` ago."""
        cutoff = time.time() - min_age_s
        temporary: list[Path] = []
        blocks: list[bytes] = []
        for path in self.root.glob("*/*"):
            try:
                if path.stat().st_mtime > cutoff:
                    continue
            except FileNotFoundError:
                continue
            if path.name.startswith(".tmp-"):
                temporary.append(path)
            elif path.suffix == ".kvb" and HEX_NAME.fullmatch(path.stem):
                blocks.append(bytes.fromhex(path.stem))
        return temporary, blocks

    def delete(self, block_hash: bytes) -> None:
        self.path_for(block_hash).unlink(missing_ok=True)
