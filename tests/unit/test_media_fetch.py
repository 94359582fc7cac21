"""Remote image fetching against a real HTTP server on 127.0.0.1: loopback is refused unless
--allow-private-media, every redirect hop is re-checked (a redirect to the metadata address
or to a host not allowed is refused before connecting), one deadline ends a slow body, the
byte cap and the content type hold, and each refusal is an ImageInputError (a 400)."""
from __future__ import annotations

import io
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from PIL import Image

from deepinfer.multimodal.image_input import ImageInputError, MediaPolicy, load_image
from deepinfer.multimodal.media_fetch import is_refused_address


def png_bytes() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 6), (10, 200, 30)).save(out, format="PNG")
    return out.getvalue()


PNG = png_bytes()


class Handler(BaseHTTPRequestHandler):
    hits: list[str] = []

    def log_message(self, *args) -> None:
        pass

    def _send(self, status: int, body: bytes = b"", content_type: str = "image/png",
              headers: dict | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self.hits.append(self.path)
        routes = {
            "/img.png": lambda: self._send(200, PNG),
            "/to-img": lambda: self._send(302, headers={"Location": "/img.png"}),
            "/to-metadata": lambda: self._send(
                302, headers={"Location": "http://169.254.169.254/latest/meta-data/"}),
            "/to-other-host": lambda: self._send(
                302, headers={"Location": "http://other.example/img.png"}),
            "/loop": lambda: self._send(302, headers={"Location": "/loop"}),
            "/html": lambda: self._send(200, b"<html></html>", content_type="text/html"),
            "/big": lambda: self._send(200, PNG + b"\0" * 5000),
        }
        if self.path == "/slow":  # headers at once, then one byte every 0.2 s
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(PNG)))
            self.end_headers()
            try:
                for byte in PNG:
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                    time.sleep(0.2)
            except OSError:
                pass
            return
        if self.path == "/chunked-big":  # no Content-Length to check up front
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for _ in range(10):
                self.wfile.write(b"400\r\n" + b"\0" * 1024 + b"\r\n")
            self.wfile.write(b"0\r\n\r\n")
            return
        routes.get(self.path, lambda: self._send(404, b"no"))()


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def policy(**fields) -> MediaPolicy:
    fields.setdefault("allowed_media_domains", ("127.0.0.1", "169.254.169.254", "localhost"))
    return MediaPolicy(**fields)


def refused(url: str, pattern: str, **fields) -> None:
    with pytest.raises(ImageInputError, match=pattern):
        load_image(url, policy(**fields))


def test_loopback_is_refused_by_default_and_served_with_allow_private_media(server):
    Handler.hits.clear()
    refused(f"{server}/img.png", "not a public address")
    port = server.rsplit(":", 1)[1]
    refused(f"http://localhost:{port}/img.png", "resolves to .* not a public address")
    assert Handler.hits == []  # refused before connecting
    image = load_image(f"{server}/img.png", policy(allow_private_media=True))
    assert image.size == (8, 6) and image.getpixel((0, 0)) == (10, 200, 30)


def test_each_redirect_hop_is_checked_again(server):
    private = dict(allow_private_media=True)
    assert load_image(f"{server}/to-img", policy(**private)).size == (8, 6)
    Handler.hits.clear()
    # Link-local (the metadata service) stays refused even with --allow-private-media.
    refused(f"{server}/to-metadata", "169.254.169.254.* not a public address", **private)
    refused(f"{server}/to-other-host", "redirected to host 'other.example'", **private)
    refused(f"{server}/loop", "redirected more than 3 times", **private)
    refused(f"{server}/to-img", "more than 0 times", max_media_redirects=0, **private)
    assert Handler.hits == ["/to-metadata", "/to-other-host"] + ["/loop"] * 4 + ["/to-img"]


def test_a_slow_body_is_cut_at_the_total_deadline(server):
    started = time.monotonic()
    refused(f"{server}/slow", "longer than 1 s", allow_private_media=True,
            media_fetch_timeout_s=1.0)
    # The body alone would take len(PNG) * 0.2 s; the fetch ends at its deadline.
    assert time.monotonic() - started < len(PNG) * 0.2 / 4


def test_a_resolver_that_never_answers_is_cut_at_the_deadline(monkeypatch):
    from deepinfer.multimodal import media_fetch
    release = threading.Event()

    def stuck_lookup(*args, **kwargs):
        release.wait(30)
        raise OSError("released")

    monkeypatch.setattr(media_fetch.socket, "getaddrinfo", stuck_lookup)
    started = time.monotonic()
    try:
        refused("http://slow-dns.example/img.png", "Resolving the image host slow-dns.example "
                "took longer than 0.5 s", allowed_media_domains=("slow-dns.example",),
                media_fetch_timeout_s=0.5)
        assert time.monotonic() - started < 3
        # The abandoned lookups are bounded: with every slot held, a new fetch is refused at
        # its own deadline instead of starting another thread.
        for _ in range(media_fetch.MAX_CONCURRENT_LOOKUPS - 1):
            with pytest.raises(ImageInputError):
                load_image("http://slow-dns.example/a.png", policy(
                    allowed_media_domains=("slow-dns.example",), media_fetch_timeout_s=0.05))
        refused("http://slow-dns.example/b.png", "Too many image host lookups",
                allowed_media_domains=("slow-dns.example",), media_fetch_timeout_s=0.2)
    finally:
        release.set()  # the stuck lookups end and give their slots back
    deadline = time.monotonic() + 10
    while media_fetch._lookups._value < media_fetch.MAX_CONCURRENT_LOOKUPS:
        assert time.monotonic() < deadline, "lookup slots not returned"
        time.sleep(0.01)


def test_size_cap_and_content_type(server):
    private = dict(allow_private_media=True, max_image_bytes=len(PNG) + 100)
    assert load_image(f"{server}/img.png", policy(**private)).size == (8, 6)
    refused(f"{server}/big", "larger than", **private)
    refused(f"{server}/chunked-big", "larger than", **private)
    refused(f"{server}/html", "content type 'text/html'", **private)
    refused(f"{server}/missing.png", "HTTP 404", **private)


def test_scheme_rules():
    refused("ftp://127.0.0.1/a.png", "Unsupported image URL scheme")
    refused("gopher://127.0.0.1/a.png", "Unsupported image URL scheme")
    refused("http://[::1]:99999/a.png", "Malformed image URL")


@pytest.mark.parametrize("address,allow_private,is_refused", [
    ("8.8.8.8", False, False), ("2001:4860:4860::8888", False, False),
    ("127.0.0.1", False, True), ("127.0.0.1", True, False), ("10.1.2.3", False, True),
    ("192.168.0.1", True, False), ("::1", False, True), ("::ffff:127.0.0.1", False, True),
    ("169.254.169.254", True, True), ("fe80::1", True, True), ("0.0.0.0", True, True),
    ("224.0.0.1", True, True), ("100.64.0.1", False, True)])
def test_address_rules(address, allow_private, is_refused):
    assert is_refused_address(address, allow_private) is is_refused


def test_admission_comes_before_any_fetch(server):
    """Over the waiting limit a request with images is a 429 before its images are fetched;
    admitted, it fetches, and a failure after admission releases its reservation."""
    import asyncio

    from deepinfer.server.admission import AdmissionGate
    from deepinfer.server.errors import APIError
    from deepinfer.server.protocol import ChatCompletionRequest
    from deepinfer.server.serving_chat import OpenAIServingChat
    from tests.unit.test_api_request_fields import make

    class Processor:
        def __init__(self) -> None:
            self.images = []

        def process_chat(self, messages, add_generation_prompt):
            self.images += [p["image"] for m in messages for p in m["content"]]
            raise ValueError("this stub renders no prompt")

    chat, processor, waiting = make(OpenAIServingChat), Processor(), [1]
    chat.gate = AdmissionGate(1, lambda: waiting[0])
    chat.enable_images(processor, policy(allow_private_media=True))
    request = ChatCompletionRequest(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": f"{server}/img.png"}}]}])
    Handler.hits.clear()
    with pytest.raises(APIError) as e:
        asyncio.run(chat.create(request))
    assert e.value.status_code == 429 and Handler.hits == [] and processor.images == []
    waiting[0] = 0
    with pytest.raises(APIError) as e:
        asyncio.run(chat.create(request))
    assert e.value.status_code == 400 and "stub renders" in str(e.value)
    assert Handler.hits == ["/img.png"] and processor.images[0].size == (8, 6)
    assert chat.gate.num_reserved == 0
