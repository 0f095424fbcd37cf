"""Who holds a block table: one small frozen type per kind of holder.

Every table names its holder with one of these (`BlockTable.owner`), so the pool's registry of live
tables (`BlockPool.tables`) says who maps each block, and readers (the operators' block map, the
audit's report) match on the type and read its fields: nothing builds a name to parse back.

* `SequenceOwner`: one sequence (a sample or a beam, by its index) of a running request.
* `PrefixOwner`: the prefix prepared for a request as it is added (a session's pin taken over, or
  blocks read back from disk), held until the scheduler admits the request.
* `PinOwner`: a session's pin, held between its turns.
* `PrefetchOwner`: a session's blocks being installed from the disk tier, for the install's length.

`str()` of each is its label in the audit's report, for people; no code reads it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SequenceOwner:
    request_id: str
    index: int

    def __str__(self) -> str:
        return f"request {self.request_id} sequence {self.index}"


@dataclass(frozen=True, slots=True)
class PrefixOwner:
    request_id: str

    def __str__(self) -> str:
        return f"request {self.request_id} prefix"


@dataclass(frozen=True, slots=True)
class PinOwner:
    session_id: str

    def __str__(self) -> str:
        return f"session {self.session_id} pin"


@dataclass(frozen=True, slots=True)
class PrefetchOwner:
    session_id: str

    def __str__(self) -> str:
        return f"session {self.session_id} prefetch"


TableOwner = SequenceOwner | PrefixOwner | PinOwner | PrefetchOwner
