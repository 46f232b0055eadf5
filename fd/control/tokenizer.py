"""The tokenizer of an HF-format model directory, shared by the API and the engine.

It lives in ``fd/control/`` because both sides need it and neither may import the other: the API
tokenizes prompts and checks their length; the engine turns sampled ids back into text. The
heavy lifting is the ``tokenizers`` library; this module adds what HF's ``transformers`` would
have added on top (the chat template, the EOS ids of ``config.json``) and the raw bytes of each
token, which the engine's incremental detokenizer needs to stream text without ever splitting
a multi-byte character.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Sequence
from datetime import datetime
from typing import Any, Protocol

import jinja2
import jinja2.sandbox
import tokenizers

from fd.control.events import JsonObject

DEFAULT_MAX_MODEL_LEN = 2048


class TokenizerLike(Protocol):
    """What the API and the engine ask of a tokenizer: :class:`Tokenizer`, or a test's
    stand-in, which must then say all of it (no capability is probed for)."""

    #: ids at or past this are refused (the embedding table's size, added tokens included)
    vocab_size: int
    #: which ``dimensions`` /v1/embeddings may cut a vector to: a tuple, True (any), False (none)
    matryoshka: tuple[int, ...] | bool

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def token_strs(self, ids: Sequence[int]) -> list[str]: ...

    def is_special(self, token_id: int) -> bool: ...

    def id_to_bytes(self, token_id: int) -> bytes: ...

    def apply_chat_template(
        self, messages: list[JsonObject], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str: ...


def served_context(asked: int | None, model: int) -> int:
    """The context served (prompt + output, in tokens): ``--max-model-len`` when given, else
    the model's own (``max_position_embeddings``). Here because the API (which refuses longer
    requests) and the engine (which finishes them with an error) must agree on it. Longer than
    the model's own is refused, as vLLM does: positions past it were never trained."""
    if asked is None:
        return model
    if asked < 2 or asked > model:
        raise ValueError(
            f"--max-model-len {asked} must be between 2 and the model's context of "
            f"{model} tokens (max_position_embeddings in config.json)"
        )
    return asked


def _byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's byte-to-printable-character table used by ByteLevel BPE.

    Printable Latin-1 bytes map to themselves; the rest are shifted to code points 256+ in
    byte order, so that every token is a printable string.
    """
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table = {}
    shifted = 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


def _read_json(path: str, *, required: bool) -> dict[str, Any]:
    if not os.path.exists(path):
        if required:
            raise FileNotFoundError(f"missing {os.path.basename(path)} in {os.path.dirname(path)}")
        return {}
    with open(path, encoding="utf-8") as f:
        obj: JsonObject = json.load(f)
    return obj


def _token_text(tok: Any) -> str | None:
    """``bos_token`` and friends appear as a string or as an AddedToken dict."""
    text: str | None = tok.get("content") if isinstance(tok, dict) else tok
    return text


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


class Tokenizer:
    def __init__(
        self,
        tok: tokenizers.Tokenizer,
        *,
        name: str = "",
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        eos_token_ids: Sequence[int] = (),
        max_model_len: int = DEFAULT_MAX_MODEL_LEN,
        byte_level: bool = True,
        matryoshka: tuple[int, ...] | bool = False,
    ):
        self._tok = tok
        self.name = name
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.eos_token_ids: tuple[int, ...] = tuple(eos_token_ids)
        self.max_model_len = int(max_model_len)
        # config.json's is_matryoshka / matryoshka_dimensions (an embedding model trained so a
        # leading part of its vector is an embedding too): which `dimensions` /v1/embeddings
        # may cut its vectors to (True: any).
        self.matryoshka = matryoshka
        self.vocab_size: int = tok.get_vocab_size(with_added_tokens=True)
        self._byte_level = byte_level
        self._special_ids = frozenset(i for i, t in tok.get_added_tokens_decoder().items() if t.special)
        self._bytes: list[bytes] | None = None  # built on first use: the API never needs it
        self._template: jinja2.Template | None = None

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_dir(cls, path: str) -> Tokenizer:
        path = os.fspath(path)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"model directory {path} does not exist")
        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.exists(tok_file):
            raise FileNotFoundError(f"missing tokenizer.json in {path}")
        tok = tokenizers.Tokenizer.from_file(tok_file)
        with open(tok_file, encoding="utf-8") as f:
            decoder = json.load(f).get("decoder") or {}
        tcfg = _read_json(os.path.join(path, "tokenizer_config.json"), required=False)
        cfg = _read_json(os.path.join(path, "config.json"), required=False)
        gen = _read_json(os.path.join(path, "generation_config.json"), required=False)

        template = tcfg.get("chat_template")
        if isinstance(template, list):  # HF's named templates: take the default one
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.exists(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()

        eos_ids: list[int] = []
        for source in (cfg.get("eos_token_id"), gen.get("eos_token_id")):
            for i in source if isinstance(source, list) else [source]:
                if isinstance(i, int) and i not in eos_ids:
                    eos_ids.append(i)
        eos_token = _token_text(tcfg.get("eos_token"))
        if not eos_ids and eos_token is not None:
            eos_id = tok.token_to_id(eos_token)
            if eos_id is not None:
                eos_ids.append(eos_id)

        dims = cfg.get("matryoshka_dimensions")
        if (
            isinstance(dims, list)
            and dims
            and all(isinstance(d, int) and not isinstance(d, bool) for d in dims)
        ):
            matryoshka: tuple[int, ...] | bool = tuple(dims)
        else:
            matryoshka = cfg.get("is_matryoshka") is True

        def is_byte_level(d: JsonObject) -> bool:
            return d.get("type") == "ByteLevel" or any(is_byte_level(x) for x in d.get("decoders") or [])

        return cls(
            tok,
            name=os.path.basename(os.path.normpath(path)),
            chat_template=template,
            bos_token=_token_text(tcfg.get("bos_token")),
            eos_token=eos_token,
            eos_token_ids=eos_ids,
            max_model_len=cfg.get("max_position_embeddings") or DEFAULT_MAX_MODEL_LEN,
            byte_level=is_byte_level(decoder),
            matryoshka=matryoshka,
        )

    def with_chat_template(self, template: str) -> Tokenizer:
        """This tokenizer with another chat template (``--chat-template``), compiled now so a
        broken one is said at start-up, not at the first chat request."""
        other = copy.copy(self)
        other.chat_template, other._template = template, None
        try:
            other._compile()
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"the chat template does not compile: {e}") from None
        return other

    # ------------------------------------------------------------------ text <-> ids

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        """The vocabulary's own pieces of ``ids`` (``Ġthe``, ``<|im_end|>``), as transformers'
        ``convert_ids_to_tokens`` gives them: vLLM's /tokenize ``return_token_strs``."""
        return [self._tok.id_to_token(int(t)) or "" for t in ids]

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def id_to_bytes(self, token_id: int) -> bytes:
        """The raw UTF-8 bytes a token stands for (special tokens: their text).

        A byte-level token may hold part of a character, which is why streaming text must go
        through bytes, not through ``decode`` of each token.
        """
        table = self._bytes
        if table is None:
            table = self._bytes = self._build_bytes()
        if 0 <= token_id < len(table):
            return table[token_id]
        return b""

    def _build_bytes(self) -> list[bytes]:
        added = self._tok.get_added_tokens_decoder()
        n = max(self.vocab_size, max(added, default=-1) + 1)
        byte_of = _byte_decoder()
        out = []
        for i in range(n):
            piece = self._tok.id_to_token(i)
            if piece is None:
                out.append(b"")
            elif i in added:
                out.append(added[i].content.encode("utf-8"))
            elif self._byte_level:
                out.append(bytes(byte_of.get(c, 0x3F) for c in piece))
            elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                out.append(bytes([int(piece[3:5], 16)]))  # SentencePiece byte fallback
            else:
                out.append(piece.replace("\u2581", " ").encode("utf-8"))  # Metaspace
        return out

    # ------------------------------------------------------------------ chat

    def apply_chat_template(
        self, messages: list[JsonObject], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render messages with the model's Jinja chat template, as ``transformers`` does."""
        template = self._template
        if template is None:
            template = self._compile()
        return template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )

    def _compile(self) -> jinja2.Template:
        if not self.chat_template:
            raise ValueError(
                f"model {self.name!r} has no chat_template in tokenizer_config.json "
                "(give one with --chat-template)"
            )
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
        self._template = env.from_string(self.chat_template)
        return self._template
