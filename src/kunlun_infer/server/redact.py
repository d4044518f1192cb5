"""What the server says about itself: no response body shows a path of the server's filesystem.

Errors raised deeper down name files so that a local user can fix them
(``.../tokenizer_config.json has no chat template``). Over HTTP the same
message goes to a remote client, to whom the server's folders are none of
their business, so :func:`public_text` rewrites every path of this
filesystem in it to its last component (``tokenizer_config.json``). A word
counts as a path when it has a ``/`` and its first component exists here —
at the root for an absolute path, in the working directory for a relative
one — so API routes (``/v1/completions``) and URLs are left alone.
"""

from __future__ import annotations

import os
import re

#: a run of path characters that begins a word (not inside a URL, a route after a host, or another word)
_PATHLIKE = re.compile(r"(?<![\w/.:~-])(~?/?[\w.~+@-]+(?:/[\w.~+@-]*)+)")


def _is_local_path(word: str) -> bool:
    expanded = os.path.expanduser(word) if word.startswith("~") else word
    first = expanded.lstrip("/").split("/", 1)[0]
    if not first:
        return False
    return os.path.lexists(os.path.join("/", first) if expanded.startswith("/") else first)


def public_text(text: str) -> str:
    """``text`` with each path of this filesystem replaced by its last component."""
    def shorten(match: re.Match[str]) -> str:
        word = match.group(1)
        if not _is_local_path(word):
            return word
        return os.path.basename(word.rstrip("/")) or "<path>"

    return _PATHLIKE.sub(shorten, text)
