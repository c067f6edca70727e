"""Images in chat messages: content parts -> PIL images, under the operator's media policy.

Content parts (OpenAI's and vLLM's names):
  ``{"type": "image_url", "image_url": {"url": URL}}``  URL: ``data:image/...;base64,...``, ``file:///...``,
                                                         ``http(s)://...``
  ``{"type": "image_pil", "image_pil": PIL.Image}``      (``LLM.chat`` only: Python objects)
  ``{"type": "image", "image": PIL.Image | numpy HWC uint8 | URL}`` (also ``"url"`` / ``"path"`` keys: the
                                                         processors' chat format)
Each image part becomes ``{"type": "image"}`` in the message handed to the chat template (the template writes its
placeholder, ``<|vision_start|><|image_pad|><|vision_end|>`` for Qwen2-VL / Qwen2.5-VL), and the images are
collected in order for ``multi_modal_data={"image": [...]}``.

Policy (vLLM's flag names; stricter defaults): data URLs are always accepted; local files only under
``allowed_local_media_path`` (off by default, as in vLLM); http(s) URLs only for hosts in ``allowed_media_domains``
(off by default -- vLLM fetches any URL unless the list is set; a server here fetches nothing the operator did not
name). A refused source is a HayabusaValidationError (HTTP 400) that names the flag that would allow it.

Decoding: at most ``MAX_IMAGE_BYTES`` encoded bytes; formats limited to ``IMAGE_FORMATS``; the header's width x
height is checked against ``MAX_IMAGE_PIXELS`` (Pillow's own decompression-bomb limit) before any pixel is decoded.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, replace
from typing import Any

from hayabusa.errors import HayabusaValidationError

# Encoded bytes one image may have (a data URL's decoded payload, a file, a download).
MAX_IMAGE_BYTES = 20 << 20
# Pixels one image may have: Pillow's decompression-bomb limit (89,478,485 px, ~ 9459 x 9459), checked from the
# header before decoding. The image processors resize far below this (Qwen2-VL: at most 12,845,056 px).
MAX_IMAGE_PIXELS = 89_478_485
# Pixels all images of one prompt may have together (2^28: twenty 12.8 MP images, ~800 MB as RGB): many small
# encoded images of huge plain pages would otherwise decode to gigabytes from one request body.
MAX_TOTAL_PIXELS = 1 << 28
# Images one prompt may hold when limit_mm_per_prompt does not say (each costs a decode and >= 4 prompt tokens).
MAX_IMAGES_PER_PROMPT = 256
# Formats Pillow decodes in pure, well-fuzzed code paths; anything else (EPS runs Ghostscript, etc.) is refused.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
# Seconds a remote fetch may take (connect + read); vLLM's VLLM_IMAGE_FETCH_TIMEOUT is 5.
FETCH_TIMEOUT = 10.0
IMAGE_PART_TYPES = ("image_url", "image_pil", "image")

_LOCAL_FLAG = "allowed_local_media_path (server: --allowed-local-media-path DIR)"
_DOMAIN_FLAG = "allowed_media_domains (server: --allowed-media-domains HOST ...)"


@dataclass(frozen=True)
class MediaPolicy:
    """Where images may come from and how large they may be.

    Args:
        allowed_local_media_path: a folder; ``file://`` URLs (and plain paths) are read only from under it. None:
            no local files.
        allowed_media_domains: host names whose http(s) URLs are fetched (exact match, case-insensitive; redirects
            are checked too). None: no remote fetching.
        max_images: most images in one conversation (``limit_mm_per_prompt["image"]``), checked before decoding.
    """

    allowed_local_media_path: str | None = None
    allowed_media_domains: tuple[str, ...] | None = None
    max_images: int | None = None
    max_image_bytes: int = MAX_IMAGE_BYTES
    max_image_pixels: int = MAX_IMAGE_PIXELS
    max_total_pixels: int = MAX_TOTAL_PIXELS
    fetch_timeout: float = FETCH_TIMEOUT

    @classmethod
    def from_engine_args(cls, args: Any) -> "MediaPolicy":
        """The policy of ``EngineArgs`` (``allowed_local_media_path``, ``allowed_media_domains``,
        ``limit_mm_per_prompt``).

        Raises:
            HayabusaValidationError: a local media path that is not an existing folder, or domains that are not a
                list of host names.
        """
        local = getattr(args, "allowed_local_media_path", None) or None
        if local is not None:
            if not isinstance(local, (str, os.PathLike)) or not os.path.isdir(local):
                raise HayabusaValidationError(f"allowed_local_media_path={local!r} must be an existing folder.",
                                              parameter="allowed_local_media_path", value=local)
            local = os.path.realpath(local)
        domains = getattr(args, "allowed_media_domains", None)
        if domains is not None:
            if isinstance(domains, str):
                domains = [d for d in domains.split(",") if d.strip()]
            if not isinstance(domains, (list, tuple)) or not all(isinstance(d, str) and d.strip() for d in domains):
                raise HayabusaValidationError(f"allowed_media_domains must be a list of host names, got "
                                              f"{domains!r}.", parameter="allowed_media_domains", value=domains)
            domains = tuple(d.strip().lower() for d in domains)
        limits = getattr(args, "limit_mm_per_prompt", None)
        max_images = limits.get("image") if isinstance(limits, dict) else None
        return cls(local, domains, max_images if isinstance(max_images, int) else None)


def _refused(where: str, why: str, value: Any) -> HayabusaValidationError:
    return HayabusaValidationError(f"{where}: {why}", parameter="messages", value=_short(value))


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# ------------------------------------------------------------------------------------------------ decoding
def decode_image(data: bytes, where: str, policy: MediaPolicy = MediaPolicy()) -> Any:
    """Encoded bytes -> an RGB PIL image (first frame), size-checked before the pixels are decoded.

    Raises:
        HayabusaValidationError: too many bytes or pixels, a format outside IMAGE_FORMATS, not an image, or a
            truncated / corrupt one (the message starts with ``where``).
    """
    from PIL import Image, UnidentifiedImageError

    if len(data) > policy.max_image_bytes:
        raise _refused(where, f"the image has {len(data)} bytes, more than the limit of {policy.max_image_bytes}.",
                       len(data))
    try:
        img = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)   # reads the header only
    except Image.DecompressionBombError as e:
        raise _refused(where, f"the image is too large to decode ({e}).", "decompression bomb") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        raise _refused(where, f"not an image in a supported format ({', '.join(IMAGE_FORMATS)}).",
                       data[:16]) from None
    width, height = img.size
    if width < 1 or height < 1 or width * height > policy.max_image_pixels:
        raise _refused(where, f"the image is {width} x {height} pixels; at most {policy.max_image_pixels} pixels "
                       "are decoded (a decompression bomb otherwise).", f"{width}x{height}")
    try:
        img.load()
        return img.convert("RGB")
    except Exception as e:  # noqa: BLE001 -- truncated data, bad chunks: all the client's
        raise _refused(where, f"the image could not be decoded ({type(e).__name__}: {e}).", data[:16]) from None


def image_from_object(obj: Any, where: str, policy: MediaPolicy = MediaPolicy()) -> Any:
    """A PIL image or a numpy HWC uint8 array (Python callers only) -> RGB PIL image, size-checked."""
    from PIL import Image

    if isinstance(obj, Image.Image):
        img = obj
    elif type(obj).__module__ == "numpy" and hasattr(obj, "shape"):
        if obj.ndim != 3 or obj.shape[2] not in (1, 3, 4) or str(obj.dtype) != "uint8":
            raise _refused(where, f"a numpy image must be uint8 of shape (height, width, 1|3|4), got "
                           f"{obj.dtype} {tuple(obj.shape)}.", tuple(obj.shape))
        img = Image.fromarray(obj[:, :, 0] if obj.shape[2] == 1 else obj)
    else:
        raise _refused(where, f"expected a PIL image, got {type(obj).__name__}.", type(obj).__name__)
    w, h = img.size
    if w < 1 or h < 1 or w * h > policy.max_image_pixels:
        raise _refused(where, f"the image is {w} x {h} pixels; at most {policy.max_image_pixels} are accepted.",
                       f"{w}x{h}")
    return img if img.mode == "RGB" else img.convert("RGB")


# ------------------------------------------------------------------------------------------------ sources
def load_image_url(url: str, where: str, policy: MediaPolicy = MediaPolicy()) -> Any:
    """A data / file / http(s) URL -> RGB PIL image, under ``policy``.

    Raises:
        HayabusaValidationError: a refused source (naming the flag that allows it), a bad URL, or what
            ``decode_image`` raises.
    """
    if not isinstance(url, str) or not url:
        raise _refused(where, "an image URL must be a non-empty string.", url)
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return decode_image(_data_url_bytes(url, where, policy), where, policy)
    if scheme == "file":
        parsed = urllib.parse.urlparse(url)
        if parsed.netloc not in ("", "localhost"):
            raise _refused(where, "a file URL must name a local file (file:///path).", url)
        return decode_image(read_local_file(urllib.parse.unquote(parsed.path), where, policy), where, policy)
    if scheme in ("http", "https"):
        return decode_image(fetch_url(url, where, policy), where, policy)
    raise _refused(where, "an image URL must be a data: URL (base64), a file:// URL or an http(s) URL.", url)


def _data_url_bytes(url: str, where: str, policy: MediaPolicy) -> bytes:
    header, sep, payload = url.partition(",")
    media = header[5:].split(";")
    if not sep or "base64" not in [m.strip().lower() for m in media[1:]]:
        raise _refused(where, "a data URL must be base64: data:image/png;base64,....", url)
    if media[0] and not media[0].lower().startswith("image/"):
        raise _refused(where, f"a data URL of type {media[0]!r} is not an image.", media[0])
    if len(payload) > 4 * (policy.max_image_bytes // 3 + 1) + 4:   # before decoding: the bytes it would give
        raise _refused(where, f"the image has more than {policy.max_image_bytes} bytes.", len(payload))
    try:
        return base64.b64decode(payload.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise _refused(where, "the data URL's payload is not valid base64.", payload[:32]) from None


def read_local_file(path: str, where: str, policy: MediaPolicy) -> bytes:
    """The bytes of a file under ``allowed_local_media_path`` (symlinks resolved first)."""
    root = policy.allowed_local_media_path
    if root is None:
        raise _refused(where, f"local image files are not allowed; set {_LOCAL_FLAG} to a folder that holds them.",
                       path)
    real = os.path.realpath(path)
    if os.path.commonpath([real, root]) != root:
        raise _refused(where, f"{path!r} is outside the allowed local media folder; only files under "
                       f"{_LOCAL_FLAG} are read.", path)
    try:
        size = os.path.getsize(real)
        if size > policy.max_image_bytes:
            raise _refused(where, f"the image file has {size} bytes, more than the limit of "
                           f"{policy.max_image_bytes}.", size)
        with open(real, "rb") as f:
            return f.read(policy.max_image_bytes + 1)
    except OSError as e:
        raise _refused(where, f"cannot read the image file ({e.strerror or e}).", path) from None


class _CheckedRedirects(urllib.request.HTTPRedirectHandler):
    def __init__(self, policy: MediaPolicy, where: str) -> None:
        self.policy, self.where = policy, where

    def redirect_request(self, req: Any, fp: Any, code: int, msg: str, headers: Any, newurl: str) -> Any:
        _check_domain(newurl, self.where, self.policy)          # a redirect may not leave the allowed hosts
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _check_domain(url: str, where: str, policy: MediaPolicy) -> None:
    parsed = urllib.parse.urlparse(url)
    host = (parsed.hostname or "").lower()
    if parsed.scheme.lower() not in ("http", "https") or not host:
        raise _refused(where, "not an http(s) URL with a host name.", url)
    if policy.allowed_media_domains is None:
        raise _refused(where, f"fetching remote images is off; the operator can allow hosts with {_DOMAIN_FLAG} "
                       "(or send the image as a base64 data URL).", url)
    if host not in policy.allowed_media_domains:
        raise _refused(where, f"host {host!r} is not among the allowed media domains; add it to {_DOMAIN_FLAG}.",
                       url)


def fetch_url(url: str, where: str, policy: MediaPolicy) -> bytes:
    """GET an http(s) URL of an allowed host, with the policy's timeout and byte cap (blocking: call it on a
    worker thread, never on an event loop)."""
    _check_domain(url, where, policy)
    opener = urllib.request.build_opener(_CheckedRedirects(policy, where))
    try:
        with opener.open(urllib.request.Request(url, headers={"User-Agent": "hayabusa"}),
                         timeout=policy.fetch_timeout) as resp:
            data = resp.read(policy.max_image_bytes + 1)
    except HayabusaValidationError:
        raise
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise _refused(where, f"could not fetch the image ({type(e).__name__}: {e}).", url) from None
    if len(data) > policy.max_image_bytes:
        raise _refused(where, f"the image has more than {policy.max_image_bytes} bytes.", url)
    return data


# ------------------------------------------------------------------------------------------------ messages
def is_image_part(part: Any) -> bool:
    return isinstance(part, dict) and (part.get("type") in IMAGE_PART_TYPES
                                       or (part.get("type") is None and ("image_url" in part or "image" in part)))


def _image_of_part(part: dict[str, Any], where: str, policy: MediaPolicy, allow_objects: bool,
                   base_dir: str | None) -> Any:
    kind = part.get("type") or ("image_url" if "image_url" in part else "image")
    if kind == "image_url":
        src = part.get("image_url")
        url = src.get("url") if isinstance(src, dict) else src
        if not isinstance(url, str):
            raise _refused(where, "an image_url part needs {\"image_url\": {\"url\": \"data:...\"}}.", src)
        return _from_string(url, where, policy, base_dir)
    src = part.get("image_pil") if kind == "image_pil" else next(
        (part[k] for k in ("image", "url", "path") if part.get(k) is not None), None)
    if src is None:
        raise _refused(where, f"an {kind!r} part needs the image ({'image_pil' if kind == 'image_pil' else 'image'}"
                       " key).", part)
    if isinstance(src, str):
        if kind == "image_pil":
            raise _refused(where, "image_pil must be a PIL image.", src)
        return _from_string(src, where, policy, base_dir)
    if not allow_objects:
        raise _refused(where, "images must be URLs here (data:, file:// or http(s)://).", type(src).__name__)
    return image_from_object(src, where, policy)


def _from_string(src: str, where: str, policy: MediaPolicy, base_dir: str | None) -> Any:
    """A URL; with ``base_dir`` (eval files) also a path relative to it (or absolute)."""
    if base_dir is not None and "://" not in src and not src.startswith("data:"):
        path = src if os.path.isabs(src) else os.path.join(base_dir, src)
        return decode_image(read_local_file(path, where, policy), where, policy)
    return load_image_url(src, where, policy)


def extract_images(messages: Any, policy: MediaPolicy = MediaPolicy(), allow_objects: bool = False,
                   base_dir: str | None = None) -> tuple[Any, list[Any]]:
    """Split a conversation into template messages and images.

    Each image part is replaced by ``{"type": "image"}`` (what chat templates test for) and its image loaded, in
    message order. Messages without image parts are returned as they are; anything that is not a list of dicts
    is returned unchanged for ``normalize_conversation`` to refuse by name.

    Args:
        allow_objects: accept PIL images / numpy arrays (``LLM.chat``); the server passes False.
        base_dir: eval files: relative paths resolve against it (the policy must allow that folder).

    Returns:
        (messages, images).

    Raises:
        HayabusaValidationError: ``messages[i].content[j]: ...`` for a bad or refused image, or more images than
            ``policy.max_images`` (checked before any image is decoded).
    """
    if not isinstance(messages, (list, tuple)):
        return messages, []
    count = sum(1 for m in messages if isinstance(m, dict) and isinstance(m.get("content"), (list, tuple))
                for p in m["content"] if is_image_part(p))
    if count == 0:
        return messages, []
    if policy.max_images is not None and count > policy.max_images:
        raise HayabusaValidationError(f"the messages hold {count} images; at most {policy.max_images} may be given "
                                      f"in one prompt (limit_mm_per_prompt={{'image': {policy.max_images}}}).",
                                      parameter="limit_mm_per_prompt", value=count)
    if count > MAX_IMAGES_PER_PROMPT:
        raise HayabusaValidationError(f"the messages hold {count} images; at most {MAX_IMAGES_PER_PROMPT} are "
                                      "accepted in one prompt.", parameter="messages", value=count)
    out, images = [], []
    left = policy.max_total_pixels        # what the images decoded so far leave to the next ones
    for i, msg in enumerate(messages):
        content = msg.get("content") if isinstance(msg, dict) else None
        if not isinstance(content, (list, tuple)) or not any(is_image_part(p) for p in content):
            out.append(msg)
            continue
        parts = []
        for j, part in enumerate(content):
            if is_image_part(part):
                where = f"messages[{i}].content[{j}]"
                if left < policy.max_image_pixels:
                    where += f" (the prompt's images may hold {policy.max_total_pixels} pixels in all)"
                img = _image_of_part(part, where, replace(policy, max_image_pixels=min(policy.max_image_pixels,
                                                                                        left)),
                                     allow_objects, base_dir)
                left -= img.size[0] * img.size[1]
                images.append(img)
                parts.append({"type": "image"})
            else:
                parts.append(part)
        out.append({**msg, "content": parts})
    return out, images


# What Qwen2-VL / Qwen2.5-VL chat templates write for each {"type": "image"} part (one token the model's
# processing expands to the image's patch count).
IMAGE_PLACEHOLDER = "<|image_pad|>"


def check_placeholders(text: str, num_images: int) -> None:
    """The rendered prompt holds one ``IMAGE_PLACEHOLDER`` per image.

    Raises:
        HayabusaValidationError: another count, i.e. a chat template that does not render image parts.
    """
    found = text.count(IMAGE_PLACEHOLDER)
    if found != num_images:
        raise HayabusaValidationError(
            f"the chat template wrote {found} image placeholder(s) ({IMAGE_PLACEHOLDER}) for {num_images} image(s): "
            "it does not render image content parts. Use the model's multimodal chat template (chat_template=..., "
            "or --chat-template FILE), e.g. Qwen2.5-VL's.", parameter="messages", value=found)
