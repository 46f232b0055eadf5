"""Tool calls in a chat model's text: what vLLM's ``--tool-call-parser hermes``,
``llama3_json``, ``pythonic`` and ``mistral`` read.

Hermes-format models (Qwen 2.5 and 3, Hermes 2 and 3, and others trained on it) answer a tool
call as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number of them, with
free text before. :class:`HermesParser` splits a stream of text deltas into content and
complete calls, sans I/O: it holds back only what could still be the start of a tag, and a call
until its closing tag, so content streams as it comes and each call goes out whole (OpenAI's
clients accumulate ``tool_calls`` deltas by index; one delta with the whole call is a valid
stream). Whatever the split of the text into deltas, the parse is the same (tested), which is
what lets any replica's replay render the bytes the original stream did.

Text that does not parse as a call (not JSON, no ``name``) stays content, as in vLLM: the
client sees what the model wrote rather than losing it. Blank text between or after calls (the
newlines models put there) is not content. A call the model did not close before
the request ended (EOS or ``max_tokens``) is taken if what follows its tag parses.

Llama 3.1-3.3 (:class:`Llama3JsonParser`) answer a call with the call alone: an answer that
begins with ``<|python_tag|>`` or ``{`` is one or more JSON objects ``{"name", "parameters"}``
separated by ``;``, any other answer is content (vLLM's rule). Such an answer is held until it
ends, then goes out as its calls, or, if it does not parse as calls, as content.
"""

from __future__ import annotations

import ast
import hashlib
import json
from dataclasses import dataclass

import orjson

PARSERS = ("hermes", "llama3_json", "pythonic", "mistral")  # the names --tool-call-parser takes
OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"  # Mistral's (special tokens)


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI's ``function.arguments``


def call_id(request_id: str, choice: int, index: int, parser: str = "") -> str:
    """A call's id, made from the response's id, the choice and the call's place: the same on
    every replica and in every replay (a random id would differ between the original stream
    and a replay). Mistral's chat templates take back only ids of 9 letters and digits."""
    digest = hashlib.sha256(f"{request_id}#{choice}#{index}".encode()).hexdigest()
    return digest[:9] if parser == "mistral" else "call_" + digest[:24]


def _parse_call(body: str) -> ToolCall | None:
    try:
        obj = orjson.loads(body.strip())
    except orjson.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return ToolCall(obj["name"], text)


def held_prefix(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could begin ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class HermesParser:
    def __init__(self) -> None:
        self._buf = ""
        self._in_call = False
        self.calls = 0  # calls emitted so far
        self._space = ""  # blank text after a call: shown only if more content follows

    def feed(self, text: str) -> list[str | ToolCall]:
        """The content (``str``) and calls that ``text`` completes, in order."""
        self._buf += text
        out: list[str | ToolCall] = []
        while True:
            if not self._in_call:
                i = self._buf.find(OPEN)
                if i < 0:
                    keep = held_prefix(self._buf, OPEN)
                    self._emit_text(out, self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    return out
                self._emit_text(out, self._buf[:i])
                self._buf = self._buf[i + len(OPEN) :]
                self._in_call = True
            j = self._buf.find(CLOSE)
            if j < 0:
                return out
            body, self._buf = self._buf[:j], self._buf[j + len(CLOSE) :]
            self._in_call = False
            self._emit_call(out, body, OPEN + body + CLOSE)

    def finish(self) -> list[str | ToolCall]:
        """What is still held when the text has ended."""
        out: list[str | ToolCall] = []
        if self._in_call:
            self._emit_call(out, self._buf, OPEN + self._buf)
        else:
            self._emit_text(out, self._buf)
        self._buf, self._in_call = "", False
        return out

    def _emit_text(self, out: list, text: str) -> None:
        if not text:
            return
        if self.calls:  # the newlines between and after calls are not content
            text, self._space = self._space + text, ""
            if text.isspace():
                self._space = text
                return
        if out and isinstance(out[-1], str):
            out[-1] += text
        else:
            out.append(text)

    def _emit_call(self, out: list, body: str, raw: str) -> None:
        call = _parse_call(body)
        if call is None:
            self._emit_text(out, raw)
        else:
            self.calls += 1
            self._space = ""  # blank between two calls: nobody's content
            out.append(call)


class _WholeAnswerParser:
    """An answer that is nothing but its calls, told by how it begins: held until it ends,
    then its calls (or, if it does not parse as calls, its text); any other answer streams as
    content."""

    STARTS: tuple[str, ...] = ()

    def __init__(self) -> None:
        self._buf = ""
        self._mode: str | None = None  # "content" or "calls", once the answer's start says

    def feed(self, text: str) -> list[str | ToolCall]:
        if self._mode == "content":
            return [text] if text else []
        self._buf += text
        if self._mode is None:
            start = self._buf.lstrip()
            if not start or any(len(start) < len(s) and s.startswith(start) for s in self.STARTS):
                return []  # not yet known
            if start.startswith(self.STARTS):
                self._mode = "calls"
                return []
            self._mode = "content"
            out, self._buf = self._buf, ""
            return [out]
        return []  # (calls: held until the answer ends)

    def finish(self) -> list[str | ToolCall]:
        text, self._buf = self._buf, ""
        if self._mode == "calls":
            calls = self.calls_of(text)
            if calls:
                return list(calls)
        return [text] if text else []

    @staticmethod
    def calls_of(text: str) -> list[ToolCall] | None:
        raise NotImplementedError


class Llama3JsonParser(_WholeAnswerParser):
    STARTS = (PYTHON_TAG, "{")

    @staticmethod
    def calls_of(text: str) -> list[ToolCall] | None:
        return _json_calls(text)


class PythonicParser(_WholeAnswerParser):
    """vLLM's ``pythonic`` (Llama 3.2 and 4, and others): the answer is a Python list of calls,
    ``[get_weather(city="Paris"), get_time()]``, keyword arguments with literal values (Llama
    4 wraps it in ``<|python_start|>`` ... ``<|python_end|>``)."""

    STARTS = (PYTHON_START, "[")

    @staticmethod
    def calls_of(text: str) -> list[ToolCall] | None:
        return _pythonic_calls(text)


class MistralParser:
    """vLLM's ``mistral``: content, then ``[TOOL_CALLS]`` and the calls to the end of the
    answer: a JSON list of ``{"name", "arguments"}`` (Mistral 7B v0.3 and the v3 tokenizers),
    or ``name[ARGS]{...}`` after each ``[TOOL_CALLS]`` (the v11 tokenizers and later: Mistral
    Small 3.1+, Magistral, Devstral). Content streams, holding back only what could begin the
    tag; the calls are held until the answer ends, and shown as text if they do not parse.
    The tags are special tokens: a request read by this parser keeps their text
    (``skip_special_tokens`` false, as vLLM sets it)."""

    def __init__(self) -> None:
        self._buf = ""
        self._calls = False  # the tag came: the rest is held until the end

    def feed(self, text: str) -> list[str | ToolCall]:
        text = self._buf + text
        if self._calls:
            self._buf = text
            return []
        i = text.find(TOOL_CALLS)
        if i >= 0:
            self._calls, self._buf = True, text[i:]
            return [text[:i]] if i else []
        keep = held_prefix(text, TOOL_CALLS)
        out, self._buf = text[: len(text) - keep], text[len(text) - keep :]
        return [out] if out else []

    def finish(self) -> list[str | ToolCall]:
        text, self._buf = self._buf, ""
        if self._calls:
            calls = _mistral_calls(text)
            if calls:
                return list(calls)
        return [text] if text else []


def _mistral_calls(text: str) -> list[ToolCall] | None:
    """``[TOOL_CALLS][{...}, ...]`` or ``[TOOL_CALLS]f[ARGS]{...}[TOOL_CALLS]g[ARGS]{...}`` (a
    ``[CALL_ID]id`` after a name is dropped) as calls; None if it is not that."""
    parts = [p.strip() for p in text.split(TOOL_CALLS)[1:]]
    if len(parts) == 1 and parts[0].startswith("["):
        try:
            listed = json.loads(parts[0])
        except ValueError:
            return None
        if not isinstance(listed, list) or not listed or not all(isinstance(o, dict) for o in listed):
            return None
        calls = [_parse_call(json.dumps(o)) for o in listed]
        return None if None in calls else calls  # type: ignore[return-value]
    calls = []
    for part in parts:
        if ARGS in part:
            name, args = part.split(ARGS, 1)
        elif "{" in part:
            name, args = part[: part.index("{")], part[part.index("{") :]
        else:
            return None
        name = name.split(CALL_ID, 1)[0].strip()
        try:
            obj = json.loads(args)
        except ValueError:
            return None
        if not name or not isinstance(obj, dict):
            return None
        calls.append(ToolCall(name, json.dumps(obj, ensure_ascii=False)))
    return calls or None


def _pythonic_calls(text: str) -> list[ToolCall] | None:
    """``[f(a=1), g()]`` as calls; None if it is not that (read by ``ast``, never run)."""
    text = text.strip()
    if text.startswith(PYTHON_START):
        text = text[len(PYTHON_START) :]
    if text.endswith(PYTHON_END):
        text = text[: -len(PYTHON_END)]
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for node in tree.body.elts:
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and not node.args
            and all(k.arg is not None for k in node.keywords)
        ):
            return None
        try:
            args = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
        except (ValueError, SyntaxError, TypeError):
            return None
        try:
            calls.append(ToolCall(node.func.id, json.dumps(args, ensure_ascii=False)))
        except TypeError:  # (a literal JSON has no form for: a set, bytes, a complex number)
            return None
    return calls


def _json_calls(text: str) -> list[ToolCall] | None:
    """``{...}; {...}`` (after an optional ``<|python_tag|>``) as calls; None if it is not."""
    text = text.strip()
    if text.startswith(PYTHON_TAG):
        text = text[len(PYTHON_TAG) :]
    decoder = json.JSONDecoder()
    calls, i = [], 0
    while True:
        while i < len(text) and (text[i].isspace() or text[i] == ";"):
            i += 1
        if i == len(text):
            return calls or None
        try:
            obj, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        call = _parse_call(json.dumps(obj)) if isinstance(obj, dict) else None
        if call is None:
            return None
        calls.append(call)


def make_parser(name: str) -> HermesParser | _WholeAnswerParser | MistralParser:
    """The parser ``--tool-call-parser name`` names."""
    if name == "mistral":
        return MistralParser()
    if name == "llama3_json":
        return Llama3JsonParser()
    if name == "pythonic":
        return PythonicParser()
    if name == "hermes":
        return HermesParser()
    raise ValueError(f"unknown tool-call parser {name!r}: one of {', '.join(PARSERS)}")


def parse_all(text: str, name: str = "hermes") -> tuple[str, list[ToolCall]]:
    """A whole text's content and calls (a response that is not streamed)."""
    p = make_parser(name)
    items = p.feed(text) + p.finish()
    return ("".join(x for x in items if isinstance(x, str)), [x for x in items if isinstance(x, ToolCall)])


def forced_spec(mode: str, tools: list[dict], parallel: bool = True) -> dict | None:
    """The structured output (fd.control.guided) that makes the model's whole answer the call:
    a named function's arguments (its parameters' schema), or for ``required`` a list of
    ``{"name", "parameters"}`` objects, one of the tools each (vLLM's forms); just one with
    ``parallel_tool_calls: false``."""

    def params(t: dict) -> dict:
        return t["function"].get("parameters") or {"type": "object"}

    if mode.startswith("named:"):
        name = mode[len("named:") :]
        return {"json": next(params(t) for t in tools if t["function"]["name"] == name)}
    if mode == "required":
        return {
            "json": {
                "type": "array",
                "minItems": 1,
                **({} if parallel else {"maxItems": 1}),
                "items": {
                    "anyOf": [
                        {
                            "type": "object",
                            "additionalProperties": False,
                            "required": ["name", "parameters"],
                            "properties": {"name": {"const": t["function"]["name"]}, "parameters": params(t)},
                        }
                        for t in tools
                    ]
                },
            }
        }
    return None


def forced_calls(mode: str, text: str) -> list[ToolCall] | None:
    """The calls of a forced answer (:func:`forced_spec`); None if it is not one. A named
    function's answer is its call whatever its text, as vLLM's: cut short by max_tokens, the
    call carries the arguments written so far (the client sees finish_reason ``length``); only
    an answer with no text at all (aborted before its first token) makes no call. A
    ``required`` answer cut short names no call it could be sure of, so it is None."""
    try:
        obj = json.loads(text)
    except ValueError:
        obj = None
    if mode.startswith("named:"):
        if not text.strip():
            return None
        return [ToolCall(mode[len("named:") :], text.strip() if isinstance(obj, dict) else text)]
    if not isinstance(obj, list) or not all(
        isinstance(x, dict) and isinstance(x.get("name"), str) for x in obj
    ):
        return None
    return [ToolCall(x["name"], json.dumps(x.get("parameters", {}), ensure_ascii=False)) for x in obj]
