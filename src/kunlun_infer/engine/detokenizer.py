"""Incremental detokenization with stop strings, safe to stream.

Each new token is decoded together with a few tokens before it (so that
word-boundary spaces come out right) and only the text past what was
already produced is added. Text is held back while it ends in an incomplete
UTF-8 character (decoded as U+FFFD) or while its tail could be the start of a
stop string, so a streaming client never sees a broken character or a
partial stop string. When a stop string appears, the text is cut before it.
"""

from __future__ import annotations

from typing import Protocol

#: prompt tokens decoded as context before the first generated token
_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Text of one request's generated tokens, grown one step at a time."""

    def __init__(self, decoder: Decoder, prompt_token_ids: list[int], stop: tuple[str, ...] = ()) -> None:
        self._decoder = decoder
        self._stop = stop
        self._longest_stop = max((len(s) for s in stop), default=0)
        self._token_ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)
        #: every character decoded so far (possibly with a stop string not yet cut)
        self._text = ""
        #: characters already handed out through :meth:`emit`
        self._num_emitted = 0
        self.stopped = False

    @property
    def text(self) -> str:
        """The final text so far (stable: never shrinks below what was emitted)."""
        return self._text

    @property
    def num_emitted(self) -> int:
        """How many characters of :attr:`text` were handed out."""
        return self._num_emitted

    def add_tokens(self, token_ids: list[int]) -> bool:
        """Decode newly generated tokens; True when a stop string ended the text."""
        for token in token_ids:
            if self.stopped:
                break
            self._token_ids.append(token)
            self._text += self._decode_new()
            self._check_stop()
        return self.stopped

    def _decode_new(self) -> str:
        ids = self._token_ids
        before = self._decoder.decode(ids[self._prefix_offset:self._read_offset])
        after = self._decoder.decode(ids[self._prefix_offset:])
        if len(after) > len(before) and not after.endswith(_REPLACEMENT_CHAR):
            self._prefix_offset = self._read_offset
            self._read_offset = len(ids)
            return after[len(before):]
        return ""

    def _check_stop(self) -> None:
        if not self._stop:
            return
        # emitted text never holds a stop string, nor ends with the start of one
        start = self._num_emitted
        hits = [i for i in (self._text.find(s, start) for s in self._stop) if i >= 0]
        if hits:
            self._text = self._text[:min(hits)]
            self.stopped = True

    def emit(self, final: bool = False) -> str:
        """Text not handed out yet that is safe to show; everything left when ``final``.

        On ``final``, tokens still waiting for the rest of a UTF-8 character
        are decoded as they are (with U+FFFD), as a full decode would show them.
        """
        if final and not self.stopped and self._read_offset < len(self._token_ids):
            ids = self._token_ids
            before = self._decoder.decode(ids[self._prefix_offset:self._read_offset])
            self._text += self._decoder.decode(ids[self._prefix_offset:])[len(before):]
            self._read_offset = len(ids)
            self._check_stop()
        end = len(self._text)
        if not final and not self.stopped:
            end -= self._held_back()
        delta = self._text[self._num_emitted:end]
        self._num_emitted = max(self._num_emitted, end)
        return delta

    def _held_back(self) -> int:
        """Length of the text's tail that could be the start of a stop string."""
        text = self._text
        for n in range(min(self._longest_stop - 1, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self._stop):
                return n
        return 0
