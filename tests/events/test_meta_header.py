"""X-KVGate-Block-Meta: what a writer may say about a block, bounded; and the wire form of hashes."""

from __future__ import annotations

import pytest

from app.events.wire import wire_hash
from contract.wire import MAX_BLOCK_META_TOKENS as MAX_META_TOKENS
from contract.wire import BlockMetaValue, MalformedHeader, format_block_meta, parse_block_meta

PARENT = "ab" * 32


def test_parse() -> None:
    assert parse_block_meta(f"parent={PARENT.upper()}; tokens=1,2,3") == BlockMetaValue(PARENT, (1, 2, 3))
    assert parse_block_meta("tokens=5") == BlockMetaValue(None, (5,))
    assert parse_block_meta("") == BlockMetaValue(None, ())


@pytest.mark.parametrize(
    "value",
    [
        "tokens=1,-2",
        "tokens=1,,2",
        "parent=xyz",
        "parent=" + "a" * 65,
        "parent=" + "a" * 17,  # odd: no whole bytes (passed the grammar, then failed the ZMQ encoder: issue 26)
        "parent=" + "a" * 14,
        "colour=red",
        "tokens",
        "tokens=" + ",".join(["1"] * (MAX_META_TOKENS + 1)),
        "tokens=" + "1" * 9000,
        "tokens=\u00b2",  # '²': str.isdigit() said yes, int() no: a 500 (issue 26)
        "tokens=1,\u0661",  # an Arabic-Indic digit: int() takes it, the ASCII grammar does not
        "tokens=" + "9" * 12,
    ],
)
def test_refused(value: str) -> None:
    with pytest.raises(MalformedHeader):
        parse_block_meta(value)


def test_wire_hash_is_vllms_default_form() -> None:
    # vllm.v1.core.kv_cache_utils.maybe_convert_block_hash: int.from_bytes(h, "big") & (2**64 - 1)
    h = bytes(range(32))
    assert wire_hash(h.hex(), as_int=True) == int.from_bytes(h, "big") & ((1 << 64) - 1)
    assert wire_hash(h.hex(), as_int=False) == h


def test_format_round_trips_and_stays_within_the_limits() -> None:
    meta = format_block_meta(parent=bytes.fromhex(PARENT), tokens=[0, 7, 151643])
    assert meta == f"parent={PARENT}; tokens=0,7,151643"
    assert parse_block_meta(meta) == BlockMetaValue(PARENT, (0, 7, 151643))
    assert parse_block_meta(format_block_meta(parent=None, tokens=[5]) or "") == BlockMetaValue(None, (5,))
    assert format_block_meta(parent=None, tokens=[]) is None  # nothing to say: no header
    assert format_block_meta(parent=PARENT, tokens=[1] * (MAX_META_TOKENS + 1)) is None  # the gateway would refuse it
    longest = format_block_meta(parent=PARENT, tokens=[10**11 - 1] * MAX_META_TOKENS)
    assert longest is None  # over 8 KiB
    fits = format_block_meta(parent=PARENT, tokens=[99999] * MAX_META_TOKENS)
    assert fits is not None and parse_block_meta(fits).tokens == (99999,) * MAX_META_TOKENS


@pytest.mark.parametrize(
    "value",
    ["", "tokens=5", f"parent={PARENT}", f"parent={PARENT.upper()}; tokens=0,7,151643", "tokens=1,2; ", "parent="],
)
def test_the_stored_form_reads_back_equal(value: str) -> None:
    """The event log keeps a meta as ``header()`` (app/index/eventlog.py): whatever the gateway accepted, the
    publisher reads back the same meta."""
    meta = parse_block_meta(value)
    assert parse_block_meta(meta.header()) == meta
