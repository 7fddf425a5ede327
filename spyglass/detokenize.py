"""Incremental detokenisation: a sequence's output text as its tokens arrive, at a cost per step that does not
grow with the output.

`IncrementalDecoder` turns newly appended token ids into the text they complete; `TextStream` adds the stop
strings on top: it finds the first one the text contains, looking only where a new token can complete one, and
releases text to clients without ever showing part of a stop string.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

REPLACEMENT = "\ufffd"  # what a decode shows for the bytes of a character whose last bytes have not arrived yet


class IncrementalDecoder:
    """Emits only the new text for newly appended token ids; the pieces add up to decoding all ids at once.

    It decodes a short window, never the whole output: the ids from `prefix`, the start of the last emitted
    piece, on. The text of the window's first ids (up to `read`) was emitted already, so the new text is the
    window's text less theirs. Decoding them again inside the window, rather than the new ids alone, keeps what
    a tokenizer does to the first token of a decode call (a SentencePiece leading space, for one) where it
    belongs. A window whose text ends in U+FFFD ends inside a character (its remaining bytes come with the next
    tokens), so it is held back until the character is complete, or until `flush` at the end of the output.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._window: list[int] = []  # the ids from `prefix` on
        self._read = 0  # the window's first `_read` ids have their text emitted
        self._emitted: str | None = ""  # their text (None: not decoded yet)
        self.decoded_tokens = 0  # the work done: token ids passed to tokenizer.decode, in total

    def add(self, ids: Iterable[int]) -> str:
        """Append ids; return the text they complete ("" while it ends inside a character)."""
        self._window.extend(ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """The text held back at the end of the output (an incomplete character shows as U+FFFD, as it does when
        the whole output is decoded at once)."""
        return self._emit(final=True)

    def _decode(self, ids: list[int]) -> str:
        self.decoded_tokens += len(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""

    def _emit(self, final: bool) -> str:
        if self._read == len(self._window):
            return ""
        if self._emitted is None:
            self._emitted = self._decode(self._window[: self._read])
        text = self._decode(self._window)
        if len(text) <= len(self._emitted) or (not final and text.endswith(REPLACEMENT)):
            return ""  # nothing new (special tokens only), or a character still incomplete
        new = text[len(self._emitted) :]
        del self._window[: self._read]
        self._read, self._emitted = len(self._window), None
        return new


class TextStream:
    """One sequence's output text: decoded incrementally, watched for stop strings, released to clients.

    `add` decodes new ids and tells whether the text now contains a stop string; it searches only the window a
    new token can complete one in: the last len(longest stop) - 1 characters of the old text plus the new text
    (an earlier occurrence would have been found at an earlier token). `release` hands out the text clients may
    see: while the sequence runs, all but those last characters (they could still begin a stop string); at the
    end, everything up to the first stop string. The released pieces add up to the whole output decoded at once
    and cut at its first stop string.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = ()) -> None:
        self.decoder = IncrementalDecoder(tokenizer)
        self.stop = tuple(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.length = 0  # characters decoded so far
        self.released = 0  # characters handed out by `release`
        self.stop_at: int | None = None  # where the first stop string starts, once the text contains one
        self._pending = ""  # the text decoded but not released: holds at least its last `hold` characters

    @property
    def stopped(self) -> bool:
        return self.stop_at is not None

    def add(self, ids: Iterable[int]) -> bool:
        """Decode appended ids; True when the text (now) contains a stop string."""
        self._take(self.decoder.add(ids))
        return self.stopped

    def release(self, final: bool = False) -> str:
        """The text not handed out yet that clients may see now; `final` (the sequence ended) releases the rest,
        the decoder's held-back text included, up to the first stop string."""
        if final:
            self._take(self.decoder.flush())
        end = self.length if final else self.length - self.hold
        if self.stop_at is not None:
            end = min(end, self.stop_at)
        n = end - self.released
        if n <= 0:
            return ""
        out, self._pending = self._pending[:n], self._pending[n:]
        self.released = end
        return out

    def _take(self, new: str) -> None:
        if not new:
            return
        if self.stop and self.stop_at is None:
            tail = self._pending[len(self._pending) - min(self.hold, len(self._pending)) :]
            window = tail + new
            hits = [window.find(s) for s in self.stop if s in window]
            if hits:
                self.stop_at = self.length - len(tail) + min(hits)
        self._pending += new
        self.length += len(new)


__all__ = ["IncrementalDecoder", "TextStream"]
