"""Streaming detokenization: split characters held back, stop strings never leaked."""

from __future__ import annotations

import pytest

from fd.control.tokenizer import Tokenizer
from fd.engine.core.detokenizer import IncrementalDetokenizer
from fd.engine.model.tiny import make_tiny_model
from tests.kit.api import FakeTokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return Tokenizer.from_dir(make_tiny_model(str(tmp_path_factory.mktemp("detok") / "tiny")))


def _stream(d, ids, step=1):
    deltas, stop = [], None
    for i in range(0, len(ids), step):
        delta, stop = d.push(ids[i : i + step])
        deltas.append(delta)
        if stop:
            break
    return deltas, stop


@pytest.mark.parametrize("text", ["emoji 😀👍🏽 🇫🇷!", "中文测试，日本語のテキスト、한국어", "naïve café ½ ∞"])
@pytest.mark.parametrize("step", [1, 2, 3])
def test_split_characters_never_leak(tok, text, step):
    ids = tok.encode(text)
    assert any(not _valid(tok.id_to_bytes(i)) for i in ids), "the test needs split characters"
    d = IncrementalDetokenizer(tok)
    deltas, stop = _stream(d, ids, step)
    assert stop is None
    assert all("\ufffd" not in x for x in deltas)
    assert "".join(deltas) + d.flush() == tok.decode(ids) == text


def _valid(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_special_tokens_are_skipped(tok):
    ids = tok.encode("hi<|im_end|>")
    d = IncrementalDetokenizer(tok)
    assert "".join(_stream(d, ids)[0]) == "hi"


def test_stop_string_split_across_tokens_is_not_leaked(tok):
    text = "The harbour town woke slowly on winter mornings."
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, stop=("town woke",))
    deltas, stop = _stream(d, ids)
    assert stop == "town woke"
    assert "".join(deltas) == "The harbour "
    assert all("town" not in x for x in deltas)
    assert d.flush() == "" and d.push(ids[:1]) == ("", None)


def test_include_stop_str_in_output(tok):
    ids = tok.encode("count: one, two, three")
    d = IncrementalDetokenizer(tok, stop=("two",), include_stop_str_in_output=True)
    deltas, stop = _stream(d, ids)
    assert stop == "two" and "".join(deltas) == "count: one, two"


def test_earliest_of_several_stops_wins(tok):
    ids = tok.encode("alpha beta gamma")
    d = IncrementalDetokenizer(tok, stop=("gamma", "beta"))
    deltas, stop = _stream(d, ids, step=len(ids))
    assert stop == "beta" and "".join(deltas) == "alpha "


def test_stop_inside_an_emoji_run(tok):
    ids = tok.encode("ab😀cd😀ef")
    d = IncrementalDetokenizer(tok, stop=("d😀",))
    deltas, stop = _stream(d, ids)
    assert stop == "d😀" and "".join(deltas) == "ab😀c"


def test_partial_stop_prefix_is_released_by_flush(tok):
    ids = tok.encode("the end is nea")
    d = IncrementalDetokenizer(tok, stop=("near",))
    deltas, stop = _stream(d, ids)
    assert stop is None
    assert not "".join(deltas).endswith("nea")
    assert "".join(deltas) + d.flush() == "the end is nea"


def test_flush_of_an_incomplete_character(tok):
    ids = tok.encode("x😀")
    d = IncrementalDetokenizer(tok)
    # feed all but the last byte-token of the emoji: nothing partial comes out
    deltas, _ = _stream(d, ids[:-1])
    assert "".join(deltas) == "x"
    assert "x" + d.flush() == tok.decode(ids[:-1]) == "x\ufffd"


def test_min_tokens_lets_a_stop_string_through_until_then():
    from fd.engine.core.detokenizer import IncrementalDetokenizer

    d = IncrementalDetokenizer(FakeTokenizer(), stop=("b",), min_tokens=3)
    assert d.push(b"ab") == ("ab", None)  # 2 tokens: too early to stop
    assert d.push(b"cb") == ("c", "b")  # 4: the stop string ends it


def test_a_stop_string_that_straddles_min_tokens_ends_the_request_unleaked():
    """Its first part came before min_tokens; the token that reaches min_tokens finishes it.
    vLLM matches it there (its check looks back a stop string's length); the part already
    generated was held back, so no client saw it."""

    d = IncrementalDetokenizer(FakeTokenizer(), stop=("STOP",), min_tokens=4)
    assert d.push(b"x") == ("x", None)
    assert d.push(b"S") == ("", None)  # could begin the stop string: held back, early as it is
    assert d.push(b"T") == ("", None)
    assert d.push(b"O") == ("", None)  # three tokens: still too early to stop
    assert d.push(b"P") == ("", "STOP")  # the fifth finishes it, after min_tokens
    assert d.flush() == ""

    # A stop string completed before min_tokens is ordinary text, also when a longer one's
    # beginning holds it back at the boundary ("y" inside the held "xy" of "xyz").
    d = IncrementalDetokenizer(FakeTokenizer(), stop=("xyz", "y"), min_tokens=3)
    assert d.push(b"x") == ("", None)
    assert d.push(b"y") == ("", None)
    assert d.push(b"q") == ("xyq", None)
    assert d.push(b"y") == ("", "y")

    # Held back before min_tokens and then not a stop string after all: all of it comes out.
    d = IncrementalDetokenizer(FakeTokenizer(), stop=("STOP",), min_tokens=2)
    assert d.push(b"S") == ("", None)
    assert d.push(b"TX") == ("STX", None)


def test_the_token_that_ends_a_request_is_counted_but_not_shown(tok):
    """vLLM's rule: an EOS or stop_token_ids token ends the request without its text, even
    with skip_special_tokens false, unless include_stop_str_in_output."""
    from fd.control.sampling import SamplingParams

    ids = tok.encode("The harbour town")
    stop = ids[-1]
    eos = tok.eos_token_ids[0]
    d = IncrementalDetokenizer.for_request(tok, SamplingParams(stop_token_ids=(stop,)), tok.eos_token_ids)
    assert "".join(_stream(d, ids)[0]) + d.flush() == tok.decode(ids[:-1])
    shown = IncrementalDetokenizer.for_request(
        tok, SamplingParams(stop_token_ids=(stop,), include_stop_str_in_output=True), tok.eos_token_ids
    )
    assert "".join(_stream(shown, ids)[0]) + shown.flush() == tok.decode(ids)
    raw = SamplingParams(skip_special_tokens=False)
    d = IncrementalDetokenizer.for_request(tok, raw, tok.eos_token_ids)
    assert "".join(_stream(d, [*ids, eos])[0]) == tok.decode(ids)  # the EOS: not shown
    assert tok.decode([eos], skip_special_tokens=False)  # (though it has text)
    kept = IncrementalDetokenizer.for_request(
        tok, SamplingParams(skip_special_tokens=False, ignore_eos=True), tok.eos_token_ids
    )  # (ignored, it ends nothing)
    assert "".join(_stream(kept, [*ids, eos])[0]) == tok.decode([*ids, eos], skip_special_tokens=False)
