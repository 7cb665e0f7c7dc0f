"""contract.wire, property-based: what is formatted parses back to the same value, and every malformed form of
Range, Content-Range, ETag and the digest headers is rejected (MalformedHeader), never half-read."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from app.api.errors import lookup
from contract import wire
from contract.wire import MalformedHeader, RangeNotSatisfiable

relaxed = settings(deadline=None)  # two shared cores: a slow example is not a failure
MAX_TOTAL = 10**15 - 1  # Content-Range numbers are at most 15 digits

digits = st.integers(min_value=0, max_value=10**9)
hex64 = st.binary(min_size=0, max_size=64).map(lambda b: hashlib.sha256(b).hexdigest())


@st.composite
def spans(draw: st.DrawFn, *, max_total: int = 10**12) -> tuple[int, int, int]:
    total = draw(st.integers(min_value=1, max_value=max_total))
    start = draw(st.integers(min_value=0, max_value=total - 1))
    end = draw(st.integers(min_value=start + 1, max_value=total))
    return start, end, total


# -- round trips ---------------------------------------------------------------------------------------------------


@relaxed
@given(spans())
@example((0, 1, 1))
@example((0, MAX_TOTAL, MAX_TOTAL))
def test_range_round_trip(span: tuple[int, int, int]) -> None:
    start, end, size = span
    assert wire.parse_range(wire.format_range(start=start, end=end), size=size) == (start, end)


@relaxed
@given(spans(max_total=MAX_TOTAL))
@example((0, MAX_TOTAL, MAX_TOTAL))
def test_content_range_round_trip(span: tuple[int, int, int]) -> None:
    start, end, total = span
    parsed = wire.parse_content_range(wire.format_content_range(start=start, end=end, total=total))
    assert (parsed.start, parsed.end, parsed.total, parsed.size) == (start, end, total, end - start)


@relaxed
@given(hex64, st.booleans())
def test_etag_round_trip(digest: str, upper: bool) -> None:
    quoted = wire.quote_etag(digest.upper() if upper else digest)
    assert quoted.startswith('"') and quoted.endswith('"')
    assert wire.unquote_etag(quoted) == digest
    assert wire.unquote_etag(f"  {quoted} ") == digest


@relaxed
@given(hex64, st.booleans())
def test_digest_header_round_trip(digest: str, upper: bool) -> None:
    assert wire.parse_digest(digest.upper() if upper else digest) == digest
    assert wire.parse_digest(None) is None


# -- ranges that are well-formed but select nothing ----------------------------------------------------------------


@relaxed
@given(st.integers(min_value=0, max_value=10**12), st.integers(min_value=0, max_value=10**6))
def test_range_past_the_end_is_unsatisfiable(size: int, extra: int) -> None:
    with pytest.raises(RangeNotSatisfiable) as err:
        wire.parse_range(f"bytes={size + extra}-", size=size)
    assert err.value.size == size


@relaxed
@given(st.integers(min_value=1, max_value=10**12), st.integers(min_value=0, max_value=10**12))
def test_suffix_range_is_the_last_bytes(size: int, n: int) -> None:
    if n == 0:
        with pytest.raises(RangeNotSatisfiable):
            wire.parse_range("bytes=-0", size=size)
    else:
        assert wire.parse_range(f"bytes=-{n}", size=size) == (max(0, size - n), size)


@relaxed
@given(spans(max_total=MAX_TOTAL))
def test_content_range_past_its_total_is_unsatisfiable(span: tuple[int, int, int]) -> None:
    start, end, _total = span
    with pytest.raises(RangeNotSatisfiable) as err:
        wire.parse_content_range(f"bytes {start}-{end - 1}/{end - 1}")
    assert err.value.size == end - 1


# -- every malformed form is rejected ------------------------------------------------------------------------------

NON_ASCII_DIGITS = ["\u0663", "\u00b2", "\uff11", "\u0967"]  # Arabic-Indic 3, superscript 2, fullwidth 1, Devanagari 1
junk = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=6)


@st.composite
def malformed_ranges(draw: st.DrawFn) -> str:
    a, b = draw(digits), draw(digits)
    forms = [
        f"bytes={a}-{b},{a}-{b}",  # several ranges
        f"bytes {a}-{b}",  # no '='
        f"items={a}-{b}",  # another unit
        f"bytes={a}",  # no '-'
        "bytes=-",  # neither end
        f"bytes={a}--{b}",
        f"bytes=+{a}-{b}",
        f"bytes={a}-{b}/{b}",
        f"bytes={'9' * 19}-",  # more digits than any object has bytes
        f"bytes={a}-{draw(st.sampled_from(NON_ASCII_DIGITS))}",
        f"bytes={a} -{b}",
        f"x{draw(junk)}bytes={a}-{b}",
        f"bytes={a}-{b}{draw(junk)}x",
        "",
    ]
    return draw(st.sampled_from(forms))


@relaxed
@given(malformed_ranges(), st.integers(min_value=0, max_value=10**12))
def test_malformed_range_is_rejected(spec: str, size: int) -> None:
    with pytest.raises(MalformedHeader):
        wire.parse_range(spec, size=size)


@st.composite
def malformed_content_ranges(draw: st.DrawFn) -> str:
    start, end, total = draw(spans())
    last = end - 1
    forms = [
        f"bytes={start}-{last}/{total}",  # a Range's '='
        f"bytes {start}-{last}",  # no total
        f"bytes {start}-{last}/*",  # unknown total: a 416's form, not a part's
        f"bytes */{total}",
        f"bytes {start}-/{total}",
        f"bytes -{last}/{total}",
        f"items {start}-{last}/{total}",
        f"bytes {start}-{last}/{total},{start}-{last}/{total}",
        f"bytes {'1' * 16}-{'1' * 16}/{'2' * 16}",  # more than 15 digits
        f"bytes {start}-{draw(st.sampled_from(NON_ASCII_DIGITS))}/{total}",
        f"bytes  {start}-{last}/{total}",
        f"bytes {start} - {last}/{total}",
        f"bytes {end}-{start}/{total + end}",  # end before start
        f"x{draw(junk)}bytes {start}-{last}/{total}",
        "",
    ]
    return draw(st.sampled_from(forms))


@relaxed
@given(malformed_content_ranges())
def test_malformed_content_range_is_rejected(value: str) -> None:
    with pytest.raises(MalformedHeader):
        wire.parse_content_range(value)


@relaxed
@given(
    st.one_of(
        hex64.map(lambda d: d[:63]),  # short
        hex64.map(lambda d: d + "0"),  # long
        hex64.map(lambda d: f'"{d}"'),  # quoted: that is an ETag, not the digest header
        hex64.map(lambda d: d[:10] + "g" + d[11:]),  # not hex
        hex64.map(lambda d: d[:10] + "\uff10" + d[11:]),  # a fullwidth 0
        hex64.map(lambda d: f"sha256={d}"),
        st.just(""),
    )
)
def test_malformed_digest_is_rejected(value: str) -> None:
    with pytest.raises(MalformedHeader, match=wire.PART_DIGEST_HEADER):
        wire.parse_digest(value, header=wire.PART_DIGEST_HEADER)


@relaxed
@given(hex64)
def test_weak_or_empty_etag_carries_no_digest(digest: str) -> None:
    assert wire.unquote_etag(f'W/"{digest}"') is None
    assert wire.unquote_etag('""') is None
    assert wire.unquote_etag(None) is None


@relaxed
@given(st.integers(min_value=0, max_value=10**12), st.integers(min_value=0, max_value=10**12))
def test_formatting_refuses_empty_or_inverted_spans(a: int, b: int) -> None:
    start, end = max(a, b), min(a, b)  # end <= start
    with pytest.raises(ValueError):
        wire.format_range(start=start, end=end)
    with pytest.raises(ValueError):
        wire.format_content_range(start=start, end=end, total=start + 1)
    with pytest.raises(ValueError):  # past the object
        wire.format_content_range(start=end, end=start + 2, total=start + 1)


@relaxed
@given(st.integers(min_value=0, max_value=10**9), st.sampled_from(["", "-", "+", "s", ".5", "\u00b2", "\u0663"]))
def test_retry_after_seconds_and_malformed_forms(seconds: int, junk: str) -> None:
    assert wire.retry_after_s(f" {seconds} ") == float(seconds)
    if junk:
        assert wire.retry_after_s(f"{seconds}{junk}") is None  # malformed: no wait asked, never an exception
        assert wire.retry_after_s(junk) is None


def test_unsatisfied_content_range() -> None:
    assert wire.unsatisfied_content_range(1234) == "bytes */1234"


# -- the gateway speaks this grammar -------------------------------------------------------------------------------


@relaxed
@given(malformed_content_ranges())
@example("bytes \u0663-4/10")  # an Arabic-Indic 3: the gateway's old \d pattern took it for a 3
def test_the_gateways_part_put_refuses_malformed_content_range(value: str) -> None:
    with pytest.raises(MalformedHeader) as err:
        wire.parse_content_range(value)
    assert lookup(err.value)[0] == 400  # the error table's answer


@relaxed
@given(malformed_ranges(), st.integers(min_value=0, max_value=10**12))
def test_the_gateways_get_refuses_malformed_range(spec: str, size: int) -> None:
    with pytest.raises(MalformedHeader) as err:
        wire.parse_range(spec, size=size)
    assert lookup(err.value)[0] == 400


def test_the_gateway_maps_unsatisfiable_ranges_to_416_with_the_size() -> None:
    with pytest.raises(RangeNotSatisfiable) as err:
        wire.parse_range("bytes=10-", size=10)
    assert err.value.size == 10 and lookup(err.value)[0] == 416
    with pytest.raises(RangeNotSatisfiable) as err:
        wire.parse_content_range("bytes 0-10/10")
    assert err.value.size == 10 and lookup(err.value)[0] == 416
