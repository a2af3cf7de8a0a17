from __future__ import annotations

import pytest

from fallback_mw.routing import normalise_path


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
