"""Each way an https:// upstream's TLS can fail, on both engines: failure kind `tls`,
booked to the upstream, and a 502 whose message says what failed and what would change it.
The message said "set ca_file to the CA that signed it" for a certificate that had expired
or names another host (ca_file changes neither); "check the url's scheme and port" for a
server that offers only TLS 1.0 / 1.1 or refuses the handshake; nothing at all, and kind
`transport`, for one that asks for a client certificate under TLS 1.3 (the alert comes on
the first read, after the handshake); and a server that reset the handshake was
"transport (could not connect) ... check that the upstream is running" on aiohttp, `tls`
on httpx. Real TLS servers (Python's ssl, OpenSSL's handshake), certificates from trustme."""

from __future__ import annotations

import asyncio
import datetime
import logging
import shutil
import socket
import ssl
import struct
import subprocess
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_tls_upstreams import ENGINES, config, get, https_upstream, trustme

pytestmark = [pytest.mark.e2e, pytest.mark.anyio]


@pytest.fixture
def ca() -> Any:
    return trustme.CA()


@pytest.fixture
def ca_pem(ca: Any, tmp_path: Path) -> str:
    path = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(path))
    return str(path)


@contextmanager
def tls_server(handle: Callable[[socket.socket], None]) -> Iterator[str]:
    """A listener on 127.0.0.1 whose every connection `handle` serves in a thread (a
    blocking ssl socket writes its alert before the handshake call raises)."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            conn.settimeout(5)
            with conn, suppress(OSError):
                handle(conn)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"https://localhost:{port}"
    finally:
        stop.set()
        thread.join(timeout=5)
        listener.close()


def refusing(context: ssl.SSLContext) -> Callable[[socket.socket], None]:
    """A TLS server that tries the handshake (and one request) with `context`."""

    def handle(conn: socket.socket) -> None:
        # The alert is written as the handshake fails. What the client sent meanwhile (its
        # request, under TLS 1.3) is read before closing, as OpenSSL's s_server does:
        # closed unread, the kernel resets the connection and the client may lose the alert.
        with conn.dup() as raw:
            try:
                with context.wrap_socket(conn, server_side=True) as tls:
                    tls.recv(65536)
                    tls.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            except ssl.SSLError:
                raw.settimeout(0.5)
                while raw.recv(65536):
                    pass

    return handle


def resetting(conn: socket.socket) -> None:
    """Reads the ClientHello, then resets the connection (no alert)."""
    conn.recv(65536)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def server_context(ca: Any, *identities: str, **options: Any) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(*identities, **options).configure_cert(context)
    return context


async def failed(engine: str, url: str, ca_pem: str, caplog: pytest.LogCaptureFixture) -> str:
    """The 502's message for one request to `url` alone; asserts kind `tls` on the log line."""
    caplog.clear()
    response = await get(config(engine, url, ca_file=ca_pem))
    error = response.json()["error"]
    assert (response.status_code, error["code"]) == (502, "upstream_failed"), error
    assert "last failure: tls at 'primary'" in error["message"], error["message"]
    lines = [r.getMessage() for r in caplog.records if r.name == "fallback_mw.request"]
    assert lines and lines[-1].endswith(" failures=primary:tls"), lines
    return str(error["message"])


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_certificate_that_expired_or_names_another_host_is_not_told_to_set_ca_file(
    engine: str, ca: Any, ca_pem: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="fallback_mw.request")
    past = datetime.datetime(2020, 2, 1, tzinfo=datetime.UTC)
    expired = server_context(
        ca, "localhost", not_before=past - datetime.timedelta(days=30), not_after=past
    )
    async with https_upstream(ca, expired) as url:
        message = await failed(engine, url, ca_pem, caplog)
    assert "has expired" in message and "ca_file cannot change that" in message, message
    async with https_upstream(ca, server_context(ca, "api.example.test")) as url:
        message = await failed(engine, url, ca_pem, caplog)
    assert "is not for the url's host" in message and "ca_file cannot" in message, message
    # The untrusted CA keeps its advice: ca_file is what changes that.
    async with https_upstream(ca) as url:
        other = trustme.CA()
        path = Path(ca_pem).with_name("other.pem")
        other.cert_pem.write_to_path(str(path))
        message = await failed(engine, url, str(path), caplog)
    assert "set ca_file" in message and "did not verify" in message, message


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_handshake_the_upstream_refuses_says_why_the_same_on_both_engines(
    engine: str, ca: Any, ca_pem: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="fallback_mw.request")
    old = server_context(ca, "localhost")
    with warnings.catch_warnings():  # TLS 1.0 / 1.1 are deprecated: that is the point
        warnings.simplefilter("ignore", DeprecationWarning)
        old.minimum_version = ssl.TLSVersion.TLSv1
        old.maximum_version = ssl.TLSVersion.TLSv1_1
    old.set_ciphers("DEFAULT:@SECLEVEL=0")
    with tls_server(refusing(old)) as url:
        message = await failed(engine, url, ca_pem, caplog)
    assert "no TLS version the gateway accepts (TLS 1.2 or later)" in message, message

    client_ca = trustme.CA()
    for version in (ssl.TLSVersion.TLSv1_3, ssl.TLSVersion.TLSv1_2):
        asking = server_context(ca, "localhost")
        asking.maximum_version = version
        asking.verify_mode = ssl.CERT_REQUIRED
        client_ca.configure_trust(asking)
        with tls_server(refusing(asking)) as url:
            message = await failed(engine, url, ca_pem, caplog)
        # TLS 1.3 names the client certificate; TLS 1.2 says handshake_failure, which is
        # that or no cipher in common.
        assert "client certificate" in message and "scheme" not in message, message

    with tls_server(resetting) as url:
        message = await failed(engine, url, ca_pem, caplog)
    assert "closed the connection during the TLS handshake" in message, message
    assert "could not connect" not in message and "is running" not in message, message


@pytest.mark.parametrize("engine", ENGINES)
async def test_both_engines_offer_alpn_http_1_1(engine: str, ca: Any, ca_pem: str) -> None:
    # httpcore sets ALPN `http/1.1` on the TLS context as it connects; aiohttp sent no
    # ALPN with the gateway's context, so an upstream choosing by ALPN saw two clients.
    chosen: list[str | None] = []
    context = server_context(ca, "localhost")
    context.set_alpn_protocols(["h2", "http/1.1"])

    def handle(conn: socket.socket) -> None:
        with context.wrap_socket(conn, server_side=True) as tls:
            chosen.append(tls.selected_alpn_protocol())
            tls.recv(65536)
            tls.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")

    with tls_server(handle) as url:
        response = await get(config(engine, url, ca_file=ca_pem))
    assert (response.status_code, response.text) == (200, "ok")
    assert chosen == ["http/1.1"]


@pytest.mark.parametrize("engine", ENGINES)
async def test_an_upstream_that_speaks_only_h2_is_refused_the_same_on_both_engines(
    engine: str, ca: Any, ca_pem: str, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    # OpenSSL's own server, accepting ALPN `h2` alone: it refused the httpx engine's
    # handshake (the message said to check the url's scheme and port) and served the
    # aiohttp engine, which offered no ALPN. Both are refused now, and told why.
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed")
    caplog.set_level(logging.INFO, logger="fallback_mw.request")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    leaf = ca.issue_cert("localhost")
    leaf.cert_chain_pems[0].write_to_path(str(cert))
    leaf.private_key_pem.write_to_path(str(key))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    arguments = ["s_server", "-accept", f"127.0.0.1:{port}", "-cert", str(cert),
                 "-key", str(key), "-alpn", "h2", "-www", "-quiet"]  # fmt: skip
    server = await asyncio.create_subprocess_exec(
        openssl, *arguments, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        for _ in range(100):
            with socket.socket() as attempt:
                if attempt.connect_ex(("127.0.0.1", port)) == 0:
                    break
            await asyncio.sleep(0.05)
        message = await failed(engine, f"https://localhost:{port}", ca_pem, caplog)
    finally:
        server.terminate()
        await asyncio.wait_for(server.wait(), 10)
    assert "no application protocol the gateway speaks" in message, message
    assert "scheme" not in message, message


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_host_name_that_does_not_resolve_is_could_not_connect_on_both_engines(
    engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A typo in an upstream's host: aiohttp said "transport (could not connect)" and to
    # check each candidate's url; the httpx engine, whose guarded backend resolves the
    # name itself, let the resolver's error through bare: "transport", nothing more.
    loop = asyncio.get_running_loop()
    real = loop.getaddrinfo

    async def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host == "api.typo.example":
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return await real(host, *args, **kwargs)

    monkeypatch.setattr(loop, "getaddrinfo", getaddrinfo)
    conf = config(engine, "https://api.typo.example")
    conf["gateway"]["allow_hosts"] = ["api.typo.example", "127.0.0.1"]
    response = await get(conf)
    error = response.json()["error"]
    assert (response.status_code, error["code"]) == (502, "upstream_failed"), error
    assert "last failure: transport (could not connect)" in error["message"], error
    assert "check each candidate's url" in error["message"], error


def self_signed(tmp_path: Path, *, ca: bool) -> tuple[str, str]:
    """A self-signed certificate for localhost (CA:TRUE or CA:FALSE) and its key."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), False)
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / f"self-{ca}.pem", tmp_path / f"self-{ca}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return str(cert_path), str(key_path)


@pytest.mark.parametrize("engine", ENGINES)
async def test_an_upstreams_own_self_signed_certificate_can_be_its_ca_file(
    engine: str, ca: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A self-signed certificate written CA:FALSE (Go's generate_cert, many appliances) is
    # the trust anchor OpenSSL verifies it by; the loader refused it as "holds no CA
    # certificate", so the one way to trust such an upstream was closed. Untrusted, it is
    # still refused at the handshake.
    caplog.set_level(logging.INFO, logger="fallback_mw.request")
    for is_ca in (False, True):
        cert, key = self_signed(tmp_path, ca=is_ca)
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(cert, key)
        async with https_upstream(ca, context) as url:
            trusted = await get(config(engine, url, ca_file=cert))
            untrusted = await get(config(engine, url))
        assert (trusted.status_code, trusted.text) == (200, "over tls"), trusted.text
        assert untrusted.status_code == 502
        assert "did not verify: set ca_file" in untrusted.json()["error"]["message"]
