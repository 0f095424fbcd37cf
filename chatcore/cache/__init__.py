"""Block bookkeeping for the paged KV cache: pure Python, no torch.

Public API:
* `BlockPool`: blocks, refcounts (`inc_ref`/`dec_ref`), free queue, LRU, watermarks, grow/shrink;
  `DEFAULT_EVICTION`, its eviction policy unless told.
* `BlockTable`: a sequence's blocks; `append_slots`, `fork`, copy-on-write, `commit`, `release`.
* `TableOwner` (`SequenceOwner`, `PrefixOwner`, `PinOwner`, `PrefetchOwner`): who holds a table.
* `cache_salt`, `hash_block`, `chain_hashes`, `longest_prefix`: content hashing and lookup.
* `audit` / `AuditReport`: the invariant check and leak report.
"""

from chatcore.cache.audit import AuditReport, audit
from chatcore.cache.errors import CacheError, NoFreeBlocks
from chatcore.cache.owners import PinOwner, PrefetchOwner, PrefixOwner, SequenceOwner, TableOwner
from chatcore.cache.pool import DEFAULT_EVICTION, BlockPool
from chatcore.cache.prefix import HASH_BYTES, cache_salt, chain_hashes, hash_block, longest_prefix
from chatcore.cache.table import BlockTable

__all__ = [
    "DEFAULT_EVICTION",
    "HASH_BYTES",
    "AuditReport",
    "BlockPool",
    "BlockTable",
    "CacheError",
    "NoFreeBlocks",
    "PinOwner",
    "PrefetchOwner",
    "PrefixOwner",
    "SequenceOwner",
    "TableOwner",
    "audit",
    "cache_salt",
    "chain_hashes",
    "hash_block",
    "longest_prefix",
]
