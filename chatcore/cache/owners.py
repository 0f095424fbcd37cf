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

from dataclasses import astuple, dataclass
from typing import ClassVar


class _Labelled:
    """An owner's `str()`: its class's `label` filled with its fields, in order."""

    __slots__ = ()
    label: ClassVar[str]

    def __str__(self) -> str:
        return self.label.format(*astuple(self))


@dataclass(frozen=True, slots=True)
class SequenceOwner(_Labelled):
    label: ClassVar[str] = "request {} sequence {}"
    request_id: str
    index: int


@dataclass(frozen=True, slots=True)
class PrefixOwner(_Labelled):
    label: ClassVar[str] = "request {} prefix"
    request_id: str


@dataclass(frozen=True, slots=True)
class PinOwner(_Labelled):
    label: ClassVar[str] = "session {} pin"
    session_id: str


@dataclass(frozen=True, slots=True)
class PrefetchOwner(_Labelled):
    label: ClassVar[str] = "session {} prefetch"
    session_id: str


TableOwner = SequenceOwner | PrefixOwner | PinOwner | PrefetchOwner
