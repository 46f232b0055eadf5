"""The model runner's side of guided decoding: one llguidance matcher per guided request, the
mask of the tokens its grammar allows next, and the token it then took.

A matcher is state the scheduler does not keep, so the runner keeps it, but only as a cache:
every step of a guided request carries its output so far (``ScheduledSeq.history``, as for
penalties), and a matcher that is missing or stands elsewhere (the request was preempted and
skipped steps, or another engine generated its start) is rebuilt from that. So a request can
move between steps, engines and restarts without the runner remembering anything, and the
matchers of requests that left are simply dropped after each step.

A grammar that is complete leaves only EOS; a matcher in an error state (a hand-written spec
whose grammar does not compile against this vocabulary) likewise: the request ends instead
of generating unconstrained text it did not ask for.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from fd.control.guided import GuidedError, after_token, grammar

log = logging.getLogger("fd.engine")


class Guides:
    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]):
        import llguidance

        self._llg = llguidance
        self.vocab_size = vocab_size
        self.eos = np.asarray(list(eos_token_ids), dtype=np.int64)
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids) or None
        )
        self._grammars: dict[str, str | None] = {}  # spec -> compiled grammar (None: bad)
        self._matchers: dict[str, tuple[object, int]] = {}  # request -> (matcher, tokens taken)

    def _grammar(self, spec: str) -> str | None:
        if spec not in self._grammars:
            if len(self._grammars) > 1024:
                self._grammars.clear()
            try:
                self._grammars[spec] = grammar(spec)
            except GuidedError as e:
                log.warning("guided spec does not compile: %s", e)
                self._grammars[spec] = None
        return self._grammars[spec]

    def _after(self, spec: str) -> int | None:
        try:
            return after_token(spec)
        except GuidedError:
            return None  # (a bad spec: its matcher is in an error state, see _matcher)

    def _matcher(self, rid: str, spec: str, output: Sequence[int]):
        got = self._matchers.get(rid)
        if got is not None and got[1] == len(output):
            return got[0]
        g = self._grammar(spec)
        m = self._llg.LLMatcher(self.tokenizer, g if g is not None else '{"grammars": []}', log_level=0)
        if output:
            m.consume_tokens(list(output))
        self._matchers[rid] = (m, len(output))
        return m

    def allowed(self, rid: str, spec: str, output: Sequence[int]) -> np.ndarray | None:
        """Which tokens may come next ([vocab] bool) for a request whose output so far is
        ``output``; None for any (a spec that holds only after a token not yet generated:
        a reasoning model still thinking)."""
        after = self._after(spec)
        if after is not None:
            try:
                start = output.index(after) + 1
            except ValueError:
                self._matchers.pop(rid, None)
                return None
            output = output[start:]
        m = self._matcher(rid, spec, output)
        if m.is_error() or m.is_stopped():
            mask = np.zeros(self.vocab_size, dtype=bool)
            mask[self.eos] = True
            return mask
        bits = np.frombuffer(m.compute_bitmask(), dtype=np.uint8)
        return np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)

    def took(self, rid: str, token: int) -> None:
        """The request sampled ``token`` (from the mask :meth:`allowed` gave)."""
        got = self._matchers.get(rid)
        if got is not None:
            got[0].consume_token(int(token))
            self._matchers[rid] = (got[0], got[1] + 1)

    def keep_only(self, rids) -> None:
        """Forget the matchers of requests not in the step just run (rebuilt if they return)."""
        for rid in [r for r in self._matchers if r not in rids]:
            del self._matchers[rid]
