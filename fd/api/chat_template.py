"""Chat templating, without I/O: a chat's messages and tools validated, vLLM's extensions on
how the template renders them (``add_generation_prompt``, ``continue_final_message``,
``chat_template_kwargs``), the prompt's token ids, and how the answer is guided when the model
thinks first (``--reasoning-parser``) or must call a tool (a forced ``tool_choice``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import orjson

from fd.api.errors import bad_request
from fd.api.reasoning import END as REASONING_END
from fd.api.reasoning import START as REASONING_START
from fd.api.tool_calls import forced_spec
from fd.api.validation import Limits, is_bool, opt
from fd.control.guided import GuidedError, canonical, check, starting_after
from fd.control.sampling import SamplingParams
from fd.control.tokenizer import TokenizerLike

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_TOOLS = 128


def _message_text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise bad_request(
                    f"messages[{i}].content[{j}] must be an object with a 'type'.",
                    f"messages[{i}].content",
                    "invalid_type",
                )
            if part["type"] != "text":
                raise bad_request(
                    f"Content parts of type '{part['type']}' are not supported.",
                    f"messages[{i}].content",
                    "unsupported",
                )
            if not isinstance(part.get("text"), str):
                raise bad_request(
                    f"messages[{i}].content[{j}].text must be a string.",
                    f"messages[{i}].content",
                    "invalid_type",
                )
            parts.append(part["text"])
        return "\n".join(parts)
    raise bad_request(
        f"messages[{i}].content must be a string or a list of text parts.",
        f"messages[{i}].content",
        "invalid_type",
    )


def parse_messages(body: dict) -> list[dict[str, str]]:
    """The chat messages as ``[{"role", "content"}]`` with text content, validated."""
    messages = body.get("messages")
    if messages is None:
        raise bad_request("'messages' is required.", "messages", "missing_required_parameter")
    if not isinstance(messages, list):
        raise bad_request("'messages' must be a list.", "messages", "invalid_type")
    if not messages:
        raise bad_request("'messages' must not be empty.", "messages", "invalid_value")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}] must be an object.", f"messages[{i}]", "invalid_type")
        role = m.get("role")
        if not isinstance(role, str):
            raise bad_request(
                f"messages[{i}].role is required and must be a string.", f"messages[{i}].role", "invalid_type"
            )
        if role not in ROLES:
            raise bad_request(
                f"messages[{i}].role '{role}' is not one of {', '.join(ROLES)}.",
                f"messages[{i}].role",
                "invalid_value",
            )
        calls = _message_tool_calls(m, i) if role == "assistant" else None
        if m.get("content") is None and not calls:
            raise bad_request(
                f"messages[{i}].content is required.", f"messages[{i}].content", "missing_required_parameter"
            )
        msg: dict[str, Any] = {
            "role": "system" if role == "developer" else role,
            "content": "" if m.get("content") is None else _message_text(m["content"], i),
        }
        if calls:
            msg["tool_calls"] = calls
        if role == "assistant" and m.get("reasoning_content") is not None:
            # an earlier answer's thinking, as this server returned it: for the chat template
            # (Qwen3's keeps the latest turn's), as vLLM passes it
            if not isinstance(m["reasoning_content"], str):
                raise bad_request(
                    f"messages[{i}].reasoning_content must be a string.",
                    f"messages[{i}].reasoning_content",
                    "invalid_type",
                )
            msg["reasoning_content"] = m["reasoning_content"]
        if role == "tool":
            for key in ("tool_call_id", "name"):
                if m.get(key) is not None:
                    if not isinstance(m[key], str):
                        raise bad_request(
                            f"messages[{i}].{key} must be a string.", f"messages[{i}].{key}", "invalid_type"
                        )
                    msg[key] = m[key]
        out.append(msg)
    return out


def _message_tool_calls(m: dict, i: int) -> list[dict] | None:
    """An assistant message's earlier ``tool_calls``, for the chat template, their arguments
    as objects (what HF templates expect; OpenAI sends them as JSON text), as vLLM does."""
    calls = m.get("tool_calls")
    if calls is None:
        return None
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise bad_request(f"{where} must be a list.", where, "invalid_type")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(
                f"{where}[{j}] must be an object with a 'function' that has a 'name'.", where, "invalid_type"
            )
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = orjson.loads(args) if args.strip() else {}
            except orjson.JSONDecodeError:
                raise bad_request(
                    f"{where}[{j}].function.arguments is not JSON.", where, "invalid_value"
                ) from None
        out.append(
            {"id": c.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}}
        )
    return out


def parse_tools(body: dict, limits: Limits) -> tuple[list[dict] | None, str | None]:
    """``tools`` for the chat template, and how the model's calls are read (the ``accepted``
    event's ``tool_parser``): the server's parser for ``auto`` (the default with tools; as in
    vLLM it needs a server started with one), ``required`` or ``named:<function>`` for a forced
    call (guided to the tools' schemas: :func:`fd.api.tool_calls.forced_spec`), nothing for
    ``none`` (the model is still shown the tools)."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise bad_request("'tool_choice' needs 'tools'.", "tool_choice", "invalid_value")
        return None, None
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list.", "tools", "invalid_type")
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"At most {MAX_TOOLS} tools.", "tools", "invalid_value")
    for j, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise bad_request(
                f'tools[{j}] must be {{"type": "function", "function": {{...}}}}.', "tools", "invalid_type"
            )
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"tools[{j}].function.name is required.", "tools", "missing_required_parameter")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise bad_request(
                f"tools[{j}].function.parameters must be a JSON Schema object.", "tools", "invalid_type"
            )
    if not tools:
        return None, None
    if choice is None:
        choice = "auto"
    if choice == "none":
        return tools, None
    if choice == "auto":
        if limits.tool_parser is None:
            raise bad_request(
                '"auto" tool choice needs a server started with '
                "--enable-auto-tool-choice and --tool-call-parser.",
                "tool_choice",
                "unsupported",
            )
        return tools, limits.tool_parser
    if choice == "required":
        return tools, "required"
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or name not in {t["function"]["name"] for t in tools}:
            raise bad_request(
                'A named tool_choice must be {"type": "function", "function": {"name": <one of the tools>}}.',
                "tool_choice",
                "invalid_value",
            )
        return tools, "named:" + name
    raise bad_request(
        '\'tool_choice\' must be "none", "auto", "required" or a named function.',
        "tool_choice",
        "invalid_value",
    )


def guide_answer(
    sampling: SamplingParams,
    reasoning: str | None,
    parser: str | None,
    tools: list[dict] | None,
    parallel: bool,
    ids: tuple[int, ...],
    tokenizer: TokenizerLike,
) -> tuple[SamplingParams, str | None]:
    """A chat's sampling and reasoning parser once its answer's shape is known: a structured
    output waits for the end of the thinking, a forced tool call is the whole output (no
    thinking), and a parser whose tags are special tokens gets to see them."""
    if reasoning and sampling.guided:
        # As vLLM: the model thinks freely, and its answer after </think> is the grammar's,
        # unless the prompt closed the thinking already (Qwen3's enable_thinking false). A
        # tokenizer without </think> as one token: the grammar from the first token, and
        # nothing to read as thinking.
        end = tokenizer.encode(REASONING_END)
        if len(end) != 1:
            reasoning = None
        elif not _thinking_closed(ids, tokenizer.encode(REASONING_START), end[0]):
            sampling = dataclasses.replace(sampling, guided=starting_after(sampling.guided, end[0]))
    if parser == "mistral":  # (its tags are special tokens: their text must reach the parser)
        sampling = dataclasses.replace(sampling, skip_special_tokens=False)
    forced = forced_spec(parser, tools, parallel) if parser else None
    if forced is not None:  # tool_choice "required" or a named function: the output is the call
        reasoning = None  # (from its first token: no thinking)
        if sampling.guided:
            raise bad_request(
                "A forced tool_choice and a structured output cannot go together.",
                "tool_choice",
                "invalid_value",
            )
        try:
            guided = canonical(forced)
            check(guided)
        except GuidedError as e:
            raise bad_request(
                f"The tools' parameters do not compile: {e}", "tools", "invalid_value"
            ) from None
        sampling = dataclasses.replace(sampling, guided=guided)
    return sampling, reasoning


def _thinking_closed(ids: tuple[int, ...], start: list[int], end: int) -> bool:
    """The prompt ends its thinking itself: a </think> after the last <think> (if any)."""
    if end not in ids:
        return False
    last_end = len(ids) - 1 - ids[::-1].index(end)
    if len(start) != 1 or start[0] not in ids:
        return True
    return last_end > len(ids) - 1 - ids[::-1].index(start[0])


#: What a chat template is given by fd itself, which ``chat_template_kwargs`` may not replace.
_TEMPLATE_OWN = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


def template_kwargs(body: dict) -> dict[str, Any]:
    """vLLM's ``chat_template_kwargs``: more variables for the chat template, such as Qwen3's
    ``enable_thinking``."""
    kw = opt(body, "chat_template_kwargs", lambda v: isinstance(v, dict), "an object", {})
    taken = sorted(_TEMPLATE_OWN & kw.keys())
    if taken:
        raise bad_request(
            f"'chat_template_kwargs' may not set {', '.join(taken)}.", "chat_template_kwargs", "invalid_value"
        )
    return kw


@dataclass(frozen=True, slots=True)
class ChatRendering:
    """vLLM's chat extensions on how the messages become the prompt."""

    add_generation_prompt: bool = True  # the template's opening of the assistant's turn
    # the last message, the assistant's, is left open for the model to go on with (a prefill):
    # the prompt ends where its text ends, with no end-of-turn and no new turn
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the tokenizer's own (a BOS) on top of the template's


def chat_rendering(body: dict, messages: list[dict], generation_prompt: bool = True) -> ChatRendering:
    """``generation_prompt``: the default of ``add_generation_prompt`` (vLLM's chat embeddings
    leave the assistant's turn unopened)."""
    gen = opt(body, "add_generation_prompt", is_bool, "a boolean", generation_prompt)
    cont = opt(body, "continue_final_message", is_bool, "a boolean", False)
    special = opt(body, "add_special_tokens", is_bool, "a boolean", False)
    if cont and gen:
        raise bad_request(
            "Cannot set both 'continue_final_message' and 'add_generation_prompt' to true.",
            "continue_final_message",
            "invalid_value",
        )
    if cont and messages[-1]["role"] != "assistant":
        raise bad_request(
            "'continue_final_message' needs the last message to be the assistant's.",
            "continue_final_message",
            "invalid_value",
        )
    return ChatRendering(gen, cont, special)


def chat_ids(
    messages: list[dict],
    tokenizer: TokenizerLike,
    how: ChatRendering,
    tools: list[dict] | None = None,
    extra: dict[str, Any] | None = None,
) -> tuple[int, ...]:
    try:
        kw = {**(extra or {}), **({} if tools is None else {"tools": tools})}
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=how.add_generation_prompt, **kw)
    except Exception as e:  # a template that rejects the conversation (e.g. role order)
        raise bad_request(f"The chat template rejected these messages: {e}", "messages") from None
    if how.continue_final_message:
        # as transformers does: the text ends with the last message's (its end-of-turn cut)
        final = messages[-1]["content"].strip()
        if not final:
            raise bad_request(
                "'continue_final_message' needs text in the last message.",
                "continue_final_message",
                "invalid_value",
            )
        at = text.rfind(final)
        if at < 0:
            raise bad_request(
                "The chat template does not show the last message's text as it is, "
                "so it cannot be continued.",
                "continue_final_message",
                "invalid_value",
            )
        text = text[: at + len(final)]
    return tuple(tokenizer.encode(text, add_special_tokens=how.add_special_tokens))
