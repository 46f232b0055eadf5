"""A reasoning model's thinking, apart from its answer: what vLLM's ``--reasoning-parser``
reads, rendered as ``reasoning_content`` beside ``content`` in chat responses.

Reasoning models write their thinking between ``<think>`` and ``</think>``, then the answer:

- ``deepseek_r1`` (DeepSeek-R1 and its distills, QwQ, Qwen3 "thinking" 2507 models): their chat
  template opens the ``<think>`` in the prompt, so the output is thinking until ``</think>``
  (a ``<think>`` the model writes itself at the start is dropped), and all thinking if that
  never comes (cut short by ``max_tokens``);
- ``qwen3`` (Qwen3's hybrid models): thinking only if the output begins with ``<think>``;
  otherwise (``"chat_template_kwargs": {"enable_thinking": false}``) all of it is the answer.

:class:`ReasoningParser` splits a stream of text deltas sans I/O, holding back only what could
still be the start of a tag; whatever the split of the text into deltas, the result is the
same (tested), which is what lets any replica's replay render the bytes the original did.
"""

from __future__ import annotations

from fd.api.tool_calls import held_prefix

PARSERS = ("deepseek_r1", "qwen3")  # the names --reasoning-parser takes
START, END = "<think>", "</think>"
REASONING, CONTENT = "reasoning", "content"


class ReasoningParser:
    def __init__(self, kind: str) -> None:
        if kind not in PARSERS:
            raise ValueError(f"unknown reasoning parser {kind!r}: one of {', '.join(PARSERS)}")
        self.kind = kind
        self._buf = ""
        self._state = "start"  # start (not yet known whether it opens with <think>), think, content

    def feed(self, text: str) -> list[tuple[str, str]]:
        """``(REASONING | CONTENT, text)`` pieces that ``text`` lets out, in order."""
        self._buf += text
        out: list[tuple[str, str]] = []
        while True:
            if self._state == "start":
                if START.startswith(self._buf):  # (empty, or a prefix of the tag: wait)
                    return out
                if self._buf.startswith(START):
                    self._buf = self._buf[len(START) :]
                    self._state = "think"
                else:
                    self._state = "think" if self.kind == "deepseek_r1" else "content"
            elif self._state == "think":
                i = self._buf.find(END)
                if i < 0:
                    keep = held_prefix(self._buf, END)
                    self._emit(out, REASONING, self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    return out
                self._emit(out, REASONING, self._buf[:i])
                self._buf = self._buf[i + len(END) :]
                self._state = "content"
            else:
                self._emit(out, CONTENT, self._buf)
                self._buf = ""
                return out

    def finish(self) -> list[tuple[str, str]]:
        """What is still held when the text has ended."""
        out: list[tuple[str, str]] = []
        if self._buf:
            thinking = self._state == "think" or (self._state == "start" and self.kind == "deepseek_r1")
            self._emit(out, REASONING if thinking else CONTENT, self._buf)
        self._buf = ""
        return out

    @staticmethod
    def _emit(out: list[tuple[str, str]], kind: str, text: str) -> None:
        if text:
            out.append((kind, text))


def split_all(kind: str, text: str) -> tuple[str, str]:
    """A whole text's reasoning and content (a response that is not streamed)."""
    p = ReasoningParser(kind)
    items = p.feed(text) + p.finish()
    return ("".join(t for k, t in items if k == REASONING), "".join(t for k, t in items if k == CONTENT))
