"""The tokenizer of the tiny model: chat template, round trips, determinism, clear errors."""

from __future__ import annotations

import filecmp
import os

import pytest

from fd.control.tokenizer import Tokenizer
from fd.engine.model.tiny import make_tiny_model

TEXTS = [
    "Hello, world!",
    "The harbour town woke slowly.",
    "emoji 😀👍🏽 and 🇫🇷 flags",
    "中文测试，日本語のテキスト、한국어",
    "mixed: naïve café — ½ ∑ ∞ \t tabs\nnewlines\r\n",
    "  leading and trailing spaces  ",
    "\u0000\u0001 control \U0010ffff",
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("tok") / "tiny"))


@pytest.fixture(scope="module")
def tok(tiny_dir):
    return Tokenizer.from_dir(tiny_dir)


def test_metadata(tok):
    assert tok.vocab_size == 512
    assert tok.name == "tiny"
    assert tok.max_model_len == 2048
    assert tok.eos_token_ids == (tok.encode("</s>")[0], tok.encode("<|im_end|>")[0])


def test_chat_template_renders_chatml(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 😀"}]
    assert tok.apply_chat_template(msgs) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 😀<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(msgs, add_generation_prompt=False).endswith("Hi 😀<|im_end|>\n")


def test_special_tokens_are_single_ids(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 2 and ids[-1] == 3
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_arbitrary_utf8(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert b"".join(tok.id_to_bytes(i) for i in ids) == text.encode("utf-8")


def test_common_words_compress(tok):
    assert len(tok.encode("The request is scheduled when there is room")) < 20


def test_same_seed_gives_identical_files(tiny_dir, tmp_path):
    other = make_tiny_model(str(tmp_path / "again"))
    names = sorted(os.listdir(tiny_dir))
    assert names == sorted(os.listdir(other))
    match, mismatch, errors = filecmp.cmpfiles(tiny_dir, other, names, shallow=False)
    assert mismatch == [] and errors == []
    different = make_tiny_model(str(tmp_path / "seed1"), seed=1)
    assert not filecmp.cmp(
        os.path.join(tiny_dir, "model.safetensors"),
        os.path.join(different, "model.safetensors"),
        shallow=False,
    )


def test_missing_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Tokenizer.from_dir(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(str(tmp_path))


def test_template_raise_exception(tiny_dir, tmp_path):
    t = Tokenizer.from_dir(tiny_dir)
    t.chat_template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}ok"
    assert t.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(Exception, match="user first"):
        t.apply_chat_template([{"role": "assistant", "content": "x"}])
