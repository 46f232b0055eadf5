"""Token ids to streamed text, one step at a time.

Two kinds of text must be held back between steps: the bytes of a character split across
tokens (a byte-level BPE splits emoji and CJK freely), and a tail that could be the beginning
of a stop string: once emitted, text cannot be taken back when the rest of the stop string
arrives. The held-back text is released as soon as it is decided, or by :meth:`flush` when the
request ends for another reason.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable
from typing import Any

from fd.control.tokenizer import TokenizerLike


def _never(_token_id: int) -> bool:
    return False


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: TokenizerLike,
        stop: tuple[str, ...] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
        skip_special_tokens: bool = True,
        ending: frozenset[int] = frozenset(),
    ):
        self._tok = tokenizer
        self._is_special = tokenizer.is_special if skip_special_tokens else _never
        # Tokens that end the request (EOS, stop_token_ids): counted, never shown (vLLM's
        # rule; include_stop_str_in_output shows them), even when special tokens are.
        self._ending = frozenset() if include_stop_str_in_output else ending
        # "replace" only for bytes that can never become valid; incomplete tails wait
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._stop = tuple(s for s in stop if s)
        self._include = include_stop_str_in_output
        self._min_tokens = min_tokens  # before this many tokens no stop string ends it (vLLM's)
        self._count = 0
        self._held = ""
        self.stop_str: str | None = None  # set once a stop string matched; later pushes are ignored

    @classmethod
    def for_request(
        cls, tokenizer: TokenizerLike, sp: Any, eos_token_ids: Iterable[int] = ()
    ) -> IncrementalDetokenizer:
        """The detokenizer a request's sampling parameters ask for, on a model whose EOS
        tokens are ``eos_token_ids``."""
        eos = tuple(eos_token_ids)
        ending = frozenset(t for t in (*sp.stop_token_ids, *eos) if sp.ends_on(t, eos))
        return cls(
            tokenizer,
            stop=sp.stop,
            include_stop_str_in_output=sp.include_stop_str_in_output,
            min_tokens=sp.min_tokens,
            skip_special_tokens=sp.skip_special_tokens,
            ending=ending,
        )

    def push(self, token_ids: Iterable[int]) -> tuple[str, str | None]:
        """The new text of ``token_ids`` that is safe to emit, and the stop string if one
        matched (the text is then what precedes it, plus it if include_stop_str_in_output)."""
        if self.stop_str is not None:
            return "", None
        token_ids = tuple(token_ids)
        self._count += len(token_ids)
        ending = self._ending
        data = b"".join(
            self._tok.id_to_bytes(t) for t in token_ids if not self._is_special(t) and t not in ending
        )
        held = len(self._held)
        text = self._held + self._utf8.decode(data)
        if not self._stop:
            self._held = ""
            return text, None
        if self._count >= self._min_tokens:
            # The earliest match wins, at equal starts the longest. A match must end in text
            # newer than what was held back: one inside it was written before min_tokens
            # (vLLM's check from then on also sees the stop string that straddles it).
            hit = None
            for s in self._stop:
                i = text.find(s, max(0, held - len(s) + 1))
                if i >= 0 and (hit is None or i < hit[0] or (i == hit[0] and len(s) > len(hit[1]))):
                    hit = (i, s)
            if hit is not None:
                i, s = hit
                self.stop_str, self._held = s, ""
                return text[:i] + (s if self._include else ""), s
        # Hold back a tail that could begin a stop string, before min_tokens too: it may be
        # finished by the token that reaches it.
        hold = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        self._held = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold], None

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character ends as U+FFFD, as decode does)."""
        if self.stop_str is not None:
            return ""
        text = self._held + self._utf8.decode(b"", final=True)
        self._held = ""
        return text
