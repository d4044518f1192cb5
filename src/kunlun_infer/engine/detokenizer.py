"""Incremental detokenization with stop strings, safe to stream.

Each new token is decoded together with a few tokens before it (so that
word-boundary spaces come out right) and only the text past what was
already produced is added. Text is held back while it ends in an incomplete
UTF-8 character (decoded as U+FFFD) or while its tail could be the start of a
stop string, so a streaming client never sees a broken character or a
partial stop string. When a stop string appears in text not emitted yet,
:meth:`IncrementalDetokenizer.cut_at_stop_string` cuts the text before it;
whether it ends generation is decided in ``engine/stopping.py``.
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

    def add_tokens(self, token_ids: list[int]) -> None:
        """Decode newly generated tokens (whether a stop string ended the text is decided elsewhere)."""
        for token in token_ids:
            self._token_ids.append(token)
            self._text += self._decode_new()

    def _decode_new(self) -> str:
        ids = self._token_ids
        before = self._decoder.decode(ids[self._prefix_offset:self._read_offset])
        after = self._decoder.decode(ids[self._prefix_offset:])
        if len(after) > len(before) and not after.endswith(_REPLACEMENT_CHAR):
            self._prefix_offset = self._read_offset
            self._read_offset = len(ids)
            return after[len(before):]
        return ""

    def cut_at_stop_string(self) -> bool:
        """Cut the text before the first stop string in the part not emitted yet; True if there was one.

        Emitted text never holds a stop string, nor ends with the start of
        one (see :meth:`emit`), so a stop string is looked for only past it.
        """
        if not self._stop:
            return False
        start = self._num_emitted
        hits = [i for i in (self._text.find(s, start) for s in self._stop) if i >= 0]
        if hits:
            self._text = self._text[:min(hits)]
            self.stopped = True
        return self.stopped

    def flush(self) -> None:
        """Decode the tokens still waiting for the rest of a UTF-8 character as they are (with U+FFFD).

        A full decode of the tokens shows them so; done once the text ends.
        """
        if self.stopped or self._read_offset == len(self._token_ids):
            return
        ids = self._token_ids
        before = self._decoder.decode(ids[self._prefix_offset:self._read_offset])
        self._text += self._decoder.decode(ids[self._prefix_offset:])[len(before):]
        self._read_offset = len(ids)

    def emit(self, final: bool = False) -> str:
        """Text not handed out yet that is safe to show; everything left when ``final`` (see :meth:`flush`)."""
        if final:
            self.flush()
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
