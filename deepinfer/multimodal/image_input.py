"""Image inputs: where an image may come from (`MediaPolicy`), loading one (`load_image`), and
the content hash that keys its embeddings everywhere (`image_content_hash`).

The engine never reaches the network unless the operator says so: `data:` URLs are always
accepted, `http(s)` only for hosts listed in `allowed_media_domains` (fetched by
`media_fetch`: public addresses only, every redirect re-checked, one deadline), `file://` only
under `allowed_local_media_path`. Every refusal is an `ImageInputError` (a `ValueError`) whose message
is safe to send back to the client as a 400.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import urllib.parse
import warnings
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

from deepinfer.multimodal.media_fetch import FetchRules, MediaFetchError, fetch_remote

# Formats Pillow must report after decoding; the declared MIME type is only a first check.
ALLOWED_FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp"}
ALLOWED_MIME_TYPES = {"image/png", "image/jpeg", "image/jpg", "image/webp"}
# Encoded bytes read from any source; far above any image that fits max_pixels compressed.
MAX_IMAGE_BYTES = 64 * 1024 * 1024
REMOTE_TIMEOUT_S = 10.0


class ImageInputError(ValueError):
    """An image the server will not use; the message says why (it goes back as a 400)."""


@dataclass(frozen=True)
class MediaPolicy:
    """What the operator allows (`--limit-mm-per-prompt`, `--allowed-local-media-path`,
    `--allowed-media-domains`, `--allow-private-media`, `--media-fetch-timeout`,
    `--max-media-redirects`)."""

    limit_per_prompt: int = 4
    max_pixels: int = 16_777_216
    allowed_local_media_path: str | None = None
    allowed_media_domains: tuple[str, ...] = ()
    allow_private_media: bool = False  # private and loopback addresses (never link-local)
    media_fetch_timeout_s: float = REMOTE_TIMEOUT_S  # the whole fetch, redirects included
    max_media_redirects: int = 3
    max_image_bytes: int = MAX_IMAGE_BYTES

    def __post_init__(self) -> None:
        if self.limit_per_prompt < 0:
            raise ValueError(f"limit_per_prompt must be >= 0, got {self.limit_per_prompt}")
        if self.max_pixels < 1:
            raise ValueError(f"max_pixels must be >= 1, got {self.max_pixels}")
        if not self.media_fetch_timeout_s > 0:
            raise ValueError(f"media_fetch_timeout_s must be > 0, got {self.media_fetch_timeout_s}")
        if self.max_media_redirects < 0:
            raise ValueError(f"max_media_redirects must be >= 0, got {self.max_media_redirects}")

    def fetch_rules(self) -> FetchRules:
        return FetchRules(allowed_domains=frozenset(d.lower() for d in self.allowed_media_domains),
                          allowed_mime_types=frozenset(ALLOWED_MIME_TYPES),
                          max_bytes=self.max_image_bytes, timeout_s=self.media_fetch_timeout_s,
                          max_redirects=self.max_media_redirects,
                          allow_private=self.allow_private_media)


def check_image_count(num_images: int, policy: MediaPolicy) -> None:
    """Refuse a prompt with more images than `--limit-mm-per-prompt` allows."""
    if num_images > policy.limit_per_prompt:
        raise ImageInputError(
            f"At most {policy.limit_per_prompt} image(s) may be provided in one prompt, got {num_images} "
            "(set by --limit-mm-per-prompt)")


def load_image(url: str, policy: MediaPolicy) -> Image.Image:
    """Decode the image at `url` into an RGB PIL image, or raise ImageInputError."""
    if not isinstance(url, str) or not url:
        raise ImageInputError("image_url.url must be a non-empty string")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        data = _read_data_url(url)
    elif scheme in ("http", "https"):
        data = _read_remote(url, policy)
    elif scheme == "file":
        data = _read_local(url, policy)
    else:
        shown = f"'{scheme}:'" if scheme else "none"
        raise ImageInputError(
            f"Unsupported image URL scheme {shown}: use a data:image/png|jpeg|webp;base64 URL "
            "(http(s) and file:// only where the server allows them)")
    return decode_image(data, policy)


def decode_image(data: bytes, policy: MediaPolicy) -> Image.Image:
    """Encoded PNG/JPEG/WebP bytes -> RGB image; pixel count checked before decoding."""
    try:
        with warnings.catch_warnings():
            # Pillow's own bomb warning; our max_pixels check below is the limit that counts.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise ImageInputError("The image data is not a PNG, JPEG or WebP image") from None
    except Image.DecompressionBombError:
        raise ImageInputError(f"The image has too many pixels (limit {policy.max_pixels})") from None
    except (OSError, ValueError) as exc:
        raise ImageInputError(f"The image data is corrupt or truncated: {exc}") from None
    if image.format not in ALLOWED_FORMATS:
        raise ImageInputError(f"Unsupported image format {image.format}: use PNG, JPEG or WebP")
    width, height = image.size
    if width * height > policy.max_pixels:
        raise ImageInputError(
            f"The image has too many pixels: {width}x{height} = {width * height} > {policy.max_pixels}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image.load()
            return image.convert("RGB")
    except Image.DecompressionBombError:
        raise ImageInputError(f"The image has too many pixels (limit {policy.max_pixels})") from None
    except (OSError, ValueError, SyntaxError) as exc:
        raise ImageInputError(f"The {image.format} image is corrupt or truncated: {exc}") from None


def image_content_hash(image: Image.Image) -> str:
    """sha256 hex of mode, size and decoded pixel bytes.

    Hashes pixels, not the encoded file: the same pixels sent as PNG or as lossless WebP get
    the same hash (and share embeddings and prefix blocks); a lossy re-encode does not.
    """
    digest = hashlib.sha256()
    digest.update(image.mode.encode())
    digest.update(f"{image.size[0]}x{image.size[1]}".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


def _read_data_url(url: str) -> bytes:
    header, sep, payload = url[len("data:"):].partition(",")
    if not sep:
        raise ImageInputError("Malformed data URL: expected data:image/<type>;base64,<data>")
    parts = [p.strip().lower() for p in header.split(";")]
    mime, params = parts[0], parts[1:]
    if mime not in ALLOWED_MIME_TYPES:
        raise ImageInputError(
            f"Unsupported image MIME type '{mime or '(none)'}' in data URL: use image/png, image/jpeg or image/webp")
    if "base64" not in params:
        raise ImageInputError("Image data URLs must be base64-encoded (data:image/<type>;base64,...)")
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise ImageInputError(f"The image data is larger than {MAX_IMAGE_BYTES} bytes")
    try:
        return base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageInputError(f"The image data URL is not valid base64: {exc}") from None


def _read_remote(url: str, policy: MediaPolicy) -> bytes:
    try:
        return fetch_remote(url, policy.fetch_rules())
    except MediaFetchError as exc:
        raise ImageInputError(str(exc)) from None


def _read_local(url: str, policy: MediaPolicy) -> bytes:
    if policy.allowed_local_media_path is None:
        raise ImageInputError(
            "file:// image URLs are refused: start the server with --allowed-local-media-path to allow a directory")
    parsed = urllib.parse.urlsplit(url)
    if parsed.netloc not in ("", "localhost"):
        raise ImageInputError(f"file:// URLs must name a local path, got host '{parsed.netloc}'")
    # realpath resolves '..' and symlinks, so neither can escape the allowed directory.
    path = os.path.realpath(urllib.parse.unquote(parsed.path))
    root = os.path.realpath(policy.allowed_local_media_path)
    if os.path.commonpath([path, root]) != root:
        raise ImageInputError(
            f"The file {urllib.parse.unquote(parsed.path)} is outside the allowed media path {policy.allowed_local_media_path}")
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_IMAGE_BYTES + 1)
    except OSError as exc:
        raise ImageInputError(f"Could not read the image file: {exc.strerror or exc}") from None
    if len(data) > MAX_IMAGE_BYTES:
        raise ImageInputError(f"The image file is larger than {MAX_IMAGE_BYTES} bytes")
    return data
