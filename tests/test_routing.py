from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fallback_mw.routing import _normalise, normalise_path


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("/v1/models", "/v1/models"),
        ("/v1/", "/v1/"),
        ("/v1/a/./b", "/v1/a/b"),
        ("/v1//a", "/v1/a"),
        ("/v1/a/../b", "/v1/b"),
        ("/v1/../admin", "/admin"),
        ("/v1/%2e%2e/admin", "/admin"),
        ("/v1%2f..%2fadmin", "/admin"),
        ("/v1/..%5cadmin", "/admin"),
        ("/v1/x/..", "/v1/"),
        ("/..", None),
        ("/a/%00", None),
    ],
)
def test_normalise_path(raw: str, expected: str | None) -> None:
    assert normalise_path(raw) == expected


# Paths built from the pieces normalisation reacts to, and ordinary ones.
_PIECES = st.sampled_from(["/", "a", "v1", ".", "..", "%", "%2e", "%2F", "\\", "\x00", ";", "é"])


@settings(max_examples=400, deadline=None)
@given(st.lists(_PIECES, max_size=12).map(lambda p: "/" + "".join(p)) | st.text(max_size=30))
@example("/v1/chat")
@example("/v1/")
@example("/")
@example("")
@example("v1/chat")
@example("/a\\b")
@example("/a//b")
@example("/a/./b")
@example("/a/..;x=1/b")
@example("/.well-known/x")
@example("/a%2fb")
@example("/a\x00b")
def test_a_path_that_needs_no_normalising_is_returned_as_the_full_normalisation_would(
    raw: str,
) -> None:
    """`normalise_path` returns an already clean path as it is, without its loop: that
    answer must be the one the loop gives, for any path."""
    assert normalise_path(raw) == _normalise(raw)
