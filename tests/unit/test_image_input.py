"""Image loading and policy: every refusal is an ImageInputError with a message that says why;
PNG, JPEG and WebP load as RGB; the content hash follows pixels, not the file encoding."""
from __future__ import annotations

import base64
import io
import os

import pytest
from PIL import Image

from deepinfer.multimodal.image_input import (ImageInputError, MediaPolicy, check_image_count,
                                              image_content_hash, load_image)


def encoded(fmt: str, size=(8, 6), color=(200, 30, 40), **save_kwargs) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format=fmt, **save_kwargs)
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


POLICY = MediaPolicy()


@pytest.mark.parametrize("fmt,mime", [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp")])
def test_png_jpeg_webp_load_as_rgb(fmt, mime):
    image = load_image(data_url(encoded(fmt), mime), POLICY)
    assert image.mode == "RGB" and image.size == (8, 6)
    r, g, b = image.getpixel((3, 3))
    assert abs(r - 200) < 12 and abs(g - 30) < 12 and abs(b - 40) < 12


def test_rgba_and_palette_images_become_rgb():
    buf = io.BytesIO()
    Image.new("RGBA", (4, 4), (1, 2, 3, 128)).save(buf, format="PNG")
    assert load_image(data_url(buf.getvalue()), POLICY).mode == "RGB"
    buf = io.BytesIO()
    Image.new("P", (4, 4), 3).save(buf, format="PNG")
    assert load_image(data_url(buf.getvalue()), POLICY).mode == "RGB"


@pytest.mark.parametrize("url,words", [
    ("data:image/png;base64,@@@not base64@@@", "not valid base64"),
    ("data:image/png;base64," + base64.b64encode(b"hello, not an image").decode(), "not a PNG, JPEG or WebP"),
    (data_url(encoded("PNG", size=(64, 64))[:60]), "corrupt or truncated"),
    (data_url(encoded("JPEG", size=(64, 64))[:-200], "image/jpeg"), "corrupt or truncated"),
    (data_url(encoded("GIF"), "image/png"), "Unsupported image format GIF"),
    (data_url(encoded("PNG"), "image/gif"), "Unsupported image MIME type 'image/gif'"),
    ("data:text/plain;base64,aGVsbG8=", "Unsupported image MIME type 'text/plain'"),
    ("data:image/png," + "abc", "base64-encoded"),
    ("data:image/png;base64", "Malformed data URL"),
    ("http://example.com/cat.png", "Remote image URLs are refused (host 'example.com')"),
    ("https://example.com/cat.png", "--allowed-media-domains"),
    ("file:///etc/passwd", "--allowed-local-media-path"),
    ("ftp://example.com/cat.png", "Unsupported image URL scheme 'ftp:'"),
    ("cat.png", "Unsupported image URL scheme none"),
    ("", "non-empty string"),
])
def test_bad_images_raise_image_input_error_with_reason(url, words):
    with pytest.raises(ImageInputError) as info:
        load_image(url, POLICY)
    assert words in str(info.value)
    assert isinstance(info.value, ValueError)


def test_too_many_pixels_is_refused_before_decoding():
    policy = MediaPolicy(max_pixels=100)
    with pytest.raises(ImageInputError, match=r"too many pixels: 20x10 = 200 > 100"):
        load_image(data_url(encoded("PNG", size=(20, 10))), policy)
    assert load_image(data_url(encoded("PNG", size=(10, 10))), policy).size == (10, 10)


def test_file_urls_only_under_the_allowed_path(tmp_path):
    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "cat.png").write_bytes(encoded("PNG"))
    (tmp_path / "secret.png").write_bytes(encoded("PNG"))
    os.symlink(tmp_path / "secret.png", allowed / "link.png")
    policy = MediaPolicy(allowed_local_media_path=str(allowed))
    assert load_image(f"file://{allowed}/cat.png", policy).size == (8, 6)
    for outside in (f"file://{tmp_path}/secret.png", f"file://{allowed}/../secret.png", f"file://{allowed}/link.png"):
        with pytest.raises(ImageInputError, match="outside the allowed media path"):
            load_image(outside, policy)
    with pytest.raises(ImageInputError, match="Could not read the image file"):
        load_image(f"file://{allowed}/missing.png", policy)
    # A sibling directory whose name starts with the allowed one's is still outside.
    (tmp_path / "media2").mkdir()
    (tmp_path / "media2" / "x.png").write_bytes(encoded("PNG"))
    with pytest.raises(ImageInputError, match="outside"):
        load_image(f"file://{tmp_path}/media2/x.png", policy)


def test_remote_fetch_only_for_allowed_domains(monkeypatch):
    """A host outside --allowed-media-domains is refused before any lookup or connection
    (the fetch itself is tested against a local server in test_media_fetch.py)."""
    touched = []
    monkeypatch.setattr("socket.getaddrinfo", lambda *a, **k: touched.append(a) or [])
    monkeypatch.setattr("socket.create_connection", lambda *a, **k: touched.append(a))
    policy = MediaPolicy(allowed_media_domains=("images.example.com",))
    with pytest.raises(ImageInputError, match="refused"):
        load_image("https://evil.example.com/a.png", policy)
    with pytest.raises(ImageInputError, match="refused"):
        load_image("https://images.example.com.evil.net/a.png", MediaPolicy())
    assert touched == []


def test_image_count_limit():
    check_image_count(2, MediaPolicy(limit_per_prompt=2))
    with pytest.raises(ImageInputError, match="At most 2 image"):
        check_image_count(3, MediaPolicy(limit_per_prompt=2))


def test_content_hash_follows_pixels_not_encoding():
    png = load_image(data_url(encoded("PNG")), POLICY)
    webp = load_image(data_url(encoded("WEBP", lossless=True), "image/webp"), POLICY)
    other = load_image(data_url(encoded("PNG", color=(200, 30, 41))), POLICY)
    resized = load_image(data_url(encoded("PNG", size=(6, 8))), POLICY)
    assert image_content_hash(png) == image_content_hash(webp)
    assert len({image_content_hash(png), image_content_hash(other), image_content_hash(resized)}) == 3
    assert len(image_content_hash(png)) == 64


def test_policy_rejects_nonsense():
    with pytest.raises(ValueError):
        MediaPolicy(limit_per_prompt=-1)
    with pytest.raises(ValueError):
        MediaPolicy(max_pixels=0)
