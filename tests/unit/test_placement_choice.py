"""Placement's choice (fd/api/placement.py) over given cards: the engine holding the prompt's
prefix wins while its batch is small enough; a hot prefix spills over once recomputing it on an
idle engine is cheaper; cold prompts spread; fewer than two engines, or stale cards, place
nothing."""

from __future__ import annotations

import time

from fd.api.placement import Placement
from fd.control.events import Request
from fd.control.lanes import Card
from fd.control.prefix import chain, short
from fd.control.request_data import RequestData
from fd.control.sampling import SamplingParams

SYSTEM = list(range(100, 228))  # 8 blocks of 16


def req(rid: str, tokens: list[int]) -> Request:
    return Request(
        request_id=rid, data=RequestData(prompt_token_ids=tuple(tokens), sampling=SamplingParams())
    )


def card(engine: str, blocks: list[int] | None = None, running: int = 0) -> Card:
    held = frozenset(short(h) for h in chain(blocks or [], 16))
    return Card(engine, 16, running, 0, 100, 100, 8, 1, held)


def placement(*cards: Card) -> Placement:
    p = Placement(bus=None)  # type: ignore[arg-type]  (choices read no Redis)
    p.cards = {c.engine: c for c in cards}
    p.read_at = time.monotonic()
    return p


def test_the_engine_holding_the_prefix_wins():
    seen: list[str] = []
    p = placement(card("A"), card("B", SYSTEM), card("C"))
    p.on_choice = lambda result, _s: seen.append(result)
    assert p.choose(req("r", [*SYSTEM, 1, 2, 3])) == "B"
    assert seen == ["hit"]


def test_a_hot_prefix_spills_over_as_its_engine_fills():
    p = placement(card("A", SYSTEM), card("B"))
    picks = [p.choose(req(f"r{i}", [*SYSTEM, i, i + 1])) for i in range(10)]
    # A takes while it has a slot (8) and its uncached suffix times its batch undercuts B's
    # whole prompt; then B, which has slots
    assert picks == ["A"] * 8 + ["B"] * 2
    # and where the prefix is a smaller part of the prompt the batch tips it sooner: 20
    # uncached tokens x 3 on A outweigh 52 x 1 on B
    p = placement(card("A", SYSTEM[:32]), card("B"))
    picks = [p.choose(req(f"s{i}", [*SYSTEM[:32], *range(50 * i, 50 * i + 20)])) for i in range(3)]
    assert picks == ["A", "A", "B"]


def test_cold_prompts_spread_and_count_what_was_placed():
    p = placement(card("A"), card("B"), card("C"), card("D"))
    picks = [p.choose(req(f"c{i}", [i] * 40)) for i in range(8)]
    assert sorted(picks) == ["A", "A", "B", "B", "C", "C", "D", "D"]


def test_nothing_is_placed_with_one_engine_or_stale_cards():
    p = placement(card("A", SYSTEM))
    assert p.choose(req("r", SYSTEM)) is None
    p = placement(card("A"), card("B"))
    p.read_at -= p.stale_s + 1
    assert p.choose(req("r", SYSTEM)) is None


def test_a_lora_prompt_meets_only_its_adapters_blocks():
    p = placement(card("A", SYSTEM), card("B"))
    lora = Request(
        request_id="l",
        data=RequestData(prompt_token_ids=tuple(SYSTEM), sampling=SamplingParams(lora="x")),
    )
    choice = p._choose(lora)
    assert choice is not None and choice.cached_tokens == 0


def test_a_malformed_card_is_no_card():
    good = card("A").fields()
    raw = {k.encode(): str(v).encode() if not isinstance(v, bytes) else v for k, v in good.items()}
    assert Card.of("A", raw) is not None
    for field, bad in [
        ("block_size", b"0"),
        ("max_seqs", b"0"),
        ("running", b"-1"),
        ("v", b"2"),
        ("seq", b"x"),
    ]:
        assert Card.of("A", {**raw, field.encode(): bad}) is None, field
    assert Card.of("A", {k: v for k, v in raw.items() if k != b"running"}) is None
