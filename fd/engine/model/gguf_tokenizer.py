"""A GGUF checkpoint's tokenizer, rebuilt with the ``tokenizers`` library as HF's
``tokenizer.json`` (and the special tokens of ``tokenizer_config.json``).

GGUF keeps the vocabulary as lists (``tokenizer.ggml.tokens``, ``merges``, ``token_type``) and
names the pre-tokenizer instead of storing it (``tokenizer.ggml.pre``): llama.cpp maps each
name to the regexes that split text into words before BPE. Those splits decide the tokens (a
Llama 3 tokenizer groups digits by three, Qwen 2's takes them one by one), so the names fd
knows are mapped here to the same pre-tokenizers the models' own ``tokenizer.json`` files
have, and any other name is refused rather than tokenized with a guess. Only byte-level BPE
(``tokenizer.ggml.model`` ``gpt2``, as Llama 3, Qwen and SmolLM use) is rebuilt; SentencePiece
vocabularies (``llama``) and the rest are refused by name.
"""

from __future__ import annotations

from typing import Any

from fd.engine.model.config import UnsupportedModel

# llama.cpp's token types (llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre -> how its text is split: GPT-2's regex (ByteLevel's own), that regex
# after every digit is made a word of its own (StarCoder's and SmolLM's), or a regex of its own
# (Llama 3's, Qwen 2's) before a ByteLevel that splits no further. The names are llama.cpp's.
PRE_TOKENIZERS: dict[str, tuple[str, str | None]] = {
    "gpt-2": ("gpt2", None),
    "gpt2": ("gpt2", None),
    "smollm": ("digits+gpt2", None),
    "starcoder": ("digits+gpt2", None),
    "refact": ("digits+gpt2", None),
    "llama-bpe": ("regex", _LLAMA3),
    "llama3": ("regex", _LLAMA3),
    "llama-v3": ("regex", _LLAMA3),
    "qwen2": ("regex", _QWEN2),
    "deepseek-r1-qwen": ("regex", _QWEN2),
    "stablelm2": ("regex", _QWEN2),
}


def _pre_tokenizer(name: str):
    from tokenizers import Regex, pre_tokenizers

    if name not in PRE_TOKENIZERS:
        raise UnsupportedModel(
            f"tokenizer.ggml.pre {name!r} is not supported (supported: {', '.join(sorted(PRE_TOKENIZERS))})"
        )
    kind, regex = PRE_TOKENIZERS[name]
    if kind == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if kind == "digits+gpt2":
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )


class GGUFVocab:
    """The tokenizer fields of a GGUF file (``meta``: key -> value, as GGUFReader reads them)
    and what HF's files make of them."""

    def __init__(self, meta: dict[str, Any]):
        model = meta.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise UnsupportedModel(
                f"tokenizer.ggml.model {model!r} is not supported (byte-level BPE, 'gpt2', only)"
            )
        self.tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
        self.types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(self.tokens))
        self.merges: list[str] = list(meta.get("tokenizer.ggml.merges") or [])
        self.pre: str = meta.get("tokenizer.ggml.pre") or "gpt-2"
        _pre_tokenizer(self.pre)  # (refused now, before any weights are read)
        self.add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
        self.add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
        self.ids = {
            name: meta.get(f"tokenizer.ggml.{name}_token_id")
            for name in ("bos", "eos", "unknown", "padding", "eot", "eom")
        }
        self.chat_template: str | None = meta.get("tokenizer.chat_template")
        if len(self.types) != len(self.tokens):
            raise UnsupportedModel(
                f"tokenizer.ggml.token_type has {len(self.types)} entries for {len(self.tokens)} tokens"
            )

    def token(self, name: str) -> str | None:
        i = self.ids[name]
        return self.tokens[i] if isinstance(i, int) and 0 <= i < len(self.tokens) else None

    def eos_ids(self) -> list[int]:
        """End of the answer: EOS, and the end-of-turn tokens llama.cpp also stops at (Llama 3's
        <|eot_id|>, <|eom_id|>), as HF's generation_config.json lists them."""
        out: list[int] = []
        for name in ("eos", "eot", "eom"):
            i = self.ids[name]
            if isinstance(i, int) and i not in out:
                out.append(i)
        return out

    def tokenizer(self):
        """The ``tokenizers.Tokenizer``: BPE over the vocabulary and merges, control tokens (and
        the unknown one) as special added tokens, user-defined ones as added tokens that are
        not special (Qwen's <tool_call>: shown in decoded text), as HF's converter makes them."""
        from tokenizers import AddedToken, Tokenizer, decoders, models, processors

        vocab = {t: i for i, t in enumerate(self.tokens)}
        merges = [tuple(m.split(" ", 1)) for m in self.merges]
        bpe = models.BPE(
            vocab=vocab,
            merges=merges,
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=PRE_TOKENIZERS[self.pre][1] == _LLAMA3,
        )
        tok = Tokenizer(bpe)
        tok.pre_tokenizer = _pre_tokenizer(self.pre)
        tok.decoder = decoders.ByteLevel()
        added = [
            AddedToken(t, special=ty in (CONTROL, UNKNOWN), normalized=False)
            for t, ty in zip(self.tokens, self.types, strict=False)
            if ty in (CONTROL, UNKNOWN, USER_DEFINED)
        ]
        tok.add_tokens(added)  # (their ids are already theirs in the vocabulary)
        if self.add_bos or self.add_eos:
            bos, eos = self.token("bos"), self.token("eos")
            pre = [bos] if self.add_bos and bos else []
            post = [eos] if self.add_eos and eos else []
            specials = [(t, vocab[t]) for t in dict.fromkeys(pre + post)]
            tok.post_processor = processors.TemplateProcessing(
                single=" ".join(pre + ["$A"] + post),
                pair=" ".join(pre + ["$A"] + post + pre + ["$B:1"] + post),
                special_tokens=specials,
            )
        return tok

    def tokenizer_config(self, max_len: int) -> dict[str, Any]:
        cfg: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": max_len,
            "add_bos_token": self.add_bos,
            "add_eos_token": self.add_eos,
            "clean_up_tokenization_spaces": False,
        }
        for key, name in (
            ("bos_token", "bos"),
            ("eos_token", "eos"),
            ("unk_token", "unknown"),
            ("pad_token", "padding"),
        ):
            if self.token(name) is not None:
                cfg[key] = self.token(name)
        if self.chat_template:
            cfg["chat_template"] = self.chat_template
        return cfg
