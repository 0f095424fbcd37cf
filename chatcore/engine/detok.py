"""Incremental detokenization that never splits a multi-byte character, with stop strings.

Text is decoded from a sliding window of ids (`prefix_offset`..end) and compared with the
window without the newest ids, so tokenizers that drop a leading space at the start of a
decode still produce the right delta. A delta ending in U+FFFD waits for the next token.
With stop strings, the last `max(len(stop)) - 1` characters are held back until they cannot
begin a stop string any more; the text before a matched stop string is all that is emitted.
"""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.emitted = 0
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        """Add one generated id; returns the newly safe text (maybe empty)."""
        if self.stopped:
            return ""
        self.ids.append(token_id)
        before = self._decode(self.ids[self.prefix_offset:self.read_offset])
        after = self._decode(self.ids[self.prefix_offset:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
        return self._release(final=False)

    def flush(self) -> str:
        """At the end: whatever is left, incomplete characters included."""
        if not self.stopped:
            tail = self._decode(self.ids[self.prefix_offset:])
            before = self._decode(self.ids[self.prefix_offset:self.read_offset])
            if len(tail) > len(before):
                self.text += tail[len(before):]
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stop and not self.stopped:
            search_from = max(0, self.emitted - self.hold)
            hits = [i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
                final = True
        safe = len(self.text) if final else max(self.emitted, len(self.text) - self.hold)
        delta = self.text[self.emitted:safe]
        self.emitted = safe
        return delta


class Detokenizers:
    """Each sequence's detokenizer, by sequence. The step's update pushes each appended token (stop
    strings are matched on the text, and a stop check decides what the step frees); the output
    processor reads a finished request's texts, then lets them go."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._by_seq: dict[object, IncrementalDetokenizer] = {}

    def push(self, seq: object, stop: tuple[str, ...], token_id: int) -> tuple[str, bool]:
        """Add one generated id to the sequence's text; returns the newly safe text and whether a stop
        string has matched."""
        detok = self._by_seq.get(seq)
        if detok is None:
            detok = self._by_seq[seq] = IncrementalDetokenizer(self.tokenizer, stop)
        return detok.push(token_id), detok.stopped

    def flush(self, seq: object) -> str:
        """The sequence ended: whatever text it held back."""
        return self._by_seq[seq].flush()

    def text(self, seq: object) -> str:
        """The sequence's whole text so far ("" when it has none)."""
        detok = self._by_seq.get(seq)
        return detok.text if detok is not None else ""

    def release(self, seq: object) -> None:
        self._by_seq.pop(seq, None)
