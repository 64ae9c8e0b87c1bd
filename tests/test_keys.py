from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from django_idempotency.keys import InvalidKey, header_meta_name, parse_key


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ("8e03978e-40d5-43e8-bc93-6894a57f9324", "8e03978e-40d5-43e8-bc93-6894a57f9324"),
        ('"8e03978e-40d5"', "8e03978e-40d5"),
        ("  padded\t", "padded"),
        ('"with\\"quote"', 'with"quote'),
        ('"back\\\\slash"', "back\\slash"),
        ("~!#$%&'*+-.^_`|", "~!#$%&'*+-.^_`|"),
        ('"with,comma"', "with,comma"),
        ("a" * 255, "a" * 255),
    ],
)
def test_valid_keys(raw, key):
    assert parse_key(raw) == key


@pytest.mark.parametrize(
    "raw",
    [
        "",
        "   ",
        '""',
        "a" * 256,
        '"' + "a" * 256 + '"',
        "has space",
        "tab\tinside",
        "caf\u00e9",
        "new\nline",
        "nul\x00",
        "del\x7f",
        '"bad\\escape"',
        '"inner"quote"',
        "k1,k1",
        "k1, k2",
    ],
)
def test_invalid_keys(raw):
    with pytest.raises(InvalidKey):
        parse_key(raw)


def test_meta_name():
    assert header_meta_name("Idempotency-Key") == "HTTP_IDEMPOTENCY_KEY"


@given(
    st.text(
        min_size=1, max_size=255, alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E)
    )
)
def test_every_printable_key_round_trips_bare(key):
    if key.startswith('"') and key.endswith('"') and len(key) >= 2:
        return  # that is the structured-field form, covered below
    first, comma, rest = key.partition(",")
    if first and comma and all(part == first for part in rest.split(",")):
        with pytest.raises(InvalidKey):
            parse_key(key)  # one key sent twice, joined by the server
        return
    assert parse_key(key) == key


@given(
    st.text(
        min_size=1, max_size=200, alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E)
    )
)
def test_structured_field_form_means_the_same_key(key):
    quoted = '"' + key.replace("\\", "\\\\").replace('"', '\\"') + '"'
    assert parse_key(quoted) == key


@given(st.text(max_size=300))
def test_any_text_is_accepted_or_rejected_cleanly(raw):
    try:
        key = parse_key(raw)
    except InvalidKey:
        return
    assert 1 <= len(key) <= 255
    assert all(0x21 <= ord(c) <= 0x7E for c in key)
