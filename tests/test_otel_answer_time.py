"""cli/otel_session.py: what a collector answers an export with is read within the export's
own timeout, not only up to a size. A collector (or whatever answers at its address) that
trickles its answer, a byte every second, passed every read's timeout and stayed under the
size bound: the export thread read it for hours (65,536 s at that pace) and the exporter's
queue filled behind it."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

pytest.importorskip("requests")

from fallback_mw.cli.otel_session import ANSWER_LIMIT, BoundedAnswerSession


@contextmanager
def trickling_collector(gap: float) -> Iterator[str]:
    """Answers 200 with a chunked body of one byte every `gap` seconds, never ending."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    stop = threading.Event()

    def answer() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(5)
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            try:
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\n"
                    b"transfer-encoding: chunked\r\n\r\n"
                )
                while not stop.is_set():
                    conn.sendall(b"1\r\n\0\r\n")
                    stop.wait(gap)
            except OSError:  # the gateway closed it
                return

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/v1/traces"
    finally:
        stop.set()
        listener.close()
        thread.join(5)


@pytest.mark.parametrize("timeout", [1.0, (1.0, 1.0)])
def test_a_trickled_answer_is_read_within_the_exports_timeout(
    timeout: float | tuple[float, float],
) -> None:
    done: list[float] = []

    def export(url: str) -> None:
        started = time.monotonic()
        with BoundedAnswerSession() as session:
            response = session.post(url, data=b"spans", timeout=timeout)
        assert response.status_code == 200
        assert len(response.content) <= ANSWER_LIMIT
        done.append(time.monotonic() - started)

    with trickling_collector(gap=0.05) as url:
        thread = threading.Thread(target=export, args=(url,), daemon=True)
        thread.start()
        thread.join(10)
    assert done, "the export was still reading the collector's answer after 10 s"
    assert done[0] < 3.0


class _Answered:
    """What `_bounded` is handed by a session's `request`: an answer read already."""

    def __init__(self, status: int) -> None:
        self.status_code = status
        self._content_consumed = True


def test_a_redirect_is_said_once_the_log_has_a_handler(monkeypatch: pytest.MonkeyPatch) -> None:
    # serve sets up telemetry before its log handler: an export answered with a redirect in
    # between (a slow start beside a short export interval) was said to the `fallback_mw`
    # logger's NullHandler only, and never again (said once). It is said at the first
    # redirect a handler can show, once.
    import logging

    from fallback_mw.cli import otel_session

    monkeypatch.setattr(otel_session, "_redirect_said", [])
    owner = logging.getLogger("fallback_mw")
    monkeypatch.setattr(owner, "handlers", [logging.NullHandler()])
    monkeypatch.setattr(owner, "propagate", False)
    records: list[logging.LogRecord] = []

    class Kept(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    def send(method: str, url: str, *args: object, **kwargs: object) -> _Answered:
        assert kwargs["allow_redirects"] is False
        return _Answered(307)

    otel_session._bounded(send, "POST", "http://collector/v1/traces")  # type: ignore[arg-type]
    assert otel_session._redirect_said == []  # nothing could show it: not said yet
    owner.handlers = [Kept()]
    for _ in range(3):
        otel_session._bounded(send, "POST", "http://collector/v1/traces")  # type: ignore[arg-type]
    said = [record for record in records if "redirect" in record.getMessage()]
    assert len(said) == 1
    assert said[0].levelno == logging.WARNING
