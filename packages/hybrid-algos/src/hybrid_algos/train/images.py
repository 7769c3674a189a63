"""A prompt record's images: where a record keeps them, read and decoded before Ray starts, each bad one refused by
its record.

With ``--max_images_per_prompt N`` (N > 0) a record's images are, in order:

* the image parts of its chat messages (``--input_key`` holding ``[{"role", "content": [...]}]``), as transformers'
  chat templates take them: ``{"type": "image", "image": ...}`` (or ``"url"`` / ``"path"`` / ``"base64"``, or
  OpenAI's ``{"type": "image_url", "image_url": {"url": ...}}``); a part without a payload (``{"type": "image"}``)
  takes the next image of ``--image_key``;
* else the ``--image_key`` field (OpenRLHF's, default ``images``): one image or a list. With a text prompt they go
  before the text (or where it writes ``<image>``, one mark per image); with chat messages, at the start of the
  first user message.

An image is a path (relative to the dataset file's folder, or absolute), a ``data:image/...;base64,`` URL or bare
base64 text (JSONL), bytes (Parquet's binary column), a ``{"bytes": ..., "path": ...}`` struct (Hugging Face's
``Image`` feature in Parquet) or a PIL image (a ``datasets`` folder). Web URLs are refused: nothing is downloaded at
run time. Every image is decoded once here (PIL), so a missing file, bytes that are no image, or more images than
``--max_images_per_prompt`` stop the run before Ray starts with the record (index, and its line in a JSONL file)
and the fix. With ``--max_images_per_prompt 0`` (text training) a record that holds images is refused, not read as
text without them.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hybrid_core.errors import ConfigError

#: An image's mark in a plain-text prompt (LLaVA's and OpenRLHF's), replaced by the model's own placeholder.
IMAGE_MARK = "<image>"
_BASE64 = re.compile(r"^[A-Za-z0-9+/=\s]+$")
_IMAGE_PART_KEYS = ("image", "url", "path", "base64")


@dataclass(frozen=True)
class Place:
    """Where a record is, for error messages: ``record 3 (line 5) of 'data.jsonl'``."""

    source: str
    index: int
    path: str | None = None  # the file it was read from (paths in it are relative to its folder)

    def __str__(self) -> str:
        line = _jsonl_line(self.path, self.index) if self.path else None
        return f"record {self.index}{f' (line {line})' if line else ''} of {self.source!r}"

    @property
    def base_dir(self) -> str:
        if self.path and os.path.isdir(self.path):  # a folder of data files: paths relative to it
            return os.path.abspath(self.path)
        return os.path.dirname(os.path.abspath(self.path)) if self.path and os.path.isfile(self.path) else os.getcwd()


def _jsonl_line(path: str, index: int) -> int | None:
    """The line of the ``index``-th record of a JSONL file (blank lines are not records), or None."""
    if not path.lower().endswith((".jsonl", ".json")) or not os.path.isfile(path):
        return None
    seen = -1
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if raw.strip():
                if lineno == 1 and raw.lstrip().startswith(b"["):
                    return None  # a JSON array: records are not lines
                seen += 1
                if seen == index:
                    return lineno
    return None


@dataclass(frozen=True)
class RecordImages:
    """A record's prompt with each image part reduced to ``{"type": "image"}`` (what a chat template renders as the
    model's placeholder), or its text with one :data:`IMAGE_MARK` per image; and the images' encoded bytes."""

    prompt: Any  # str or chat messages
    images: tuple[bytes, ...]


def record_images(
    record: dict[str, Any], *, input_key: str, image_key: str, max_images: int, place: Place
) -> RecordImages:
    """The prompt and images of one record (see the module docstring); every image read and decoded."""
    value = record[input_key]
    listed = _as_list(record.get(image_key))
    if _is_messages(value):
        messages, parts, pending = _message_images(value)
        given = iter(listed)
        images: list[Any] = []
        for payload in parts:
            if payload is not None:
                images.append(payload)
                continue
            nxt = next(given, None)
            if nxt is None:
                raise ConfigError(
                    "image_key",
                    f"{place}: its messages have {pending} image part(s) without an image, but "
                    f"{image_key!r} holds only {len(listed)} image(s).",
                    f"Give each {{'type': 'image'}} part its image (an 'image' key), or list them in {image_key!r}.",
                )
            images.append(nxt)
        rest = list(given)
        if rest and parts:
            raise ConfigError(
                "image_key",
                f"{place}: its messages have {len(parts)} image part(s), {pending} of them without an image, and "
                f"{image_key!r} holds {len(listed)} image(s): {len(rest)} left over.",
                "Give each image one {'type': 'image'} part (a part without an 'image' key takes the next image "
                f"of {image_key!r}), or drop the extra ones.",
            )
        if rest:  # OpenRLHF's layout: the images in their own field, the messages text only
            messages = _prepend_to_first_user(messages, len(rest), place)
            images = rest
        prompt: Any = messages
    else:
        images = listed
        if isinstance(value, str) and images:
            marks = value.count(IMAGE_MARK)
            if marks not in (0, len(images)):
                raise ConfigError(
                    "image_key",
                    f"{place}: its prompt has {marks} {IMAGE_MARK} mark(s) for {len(images)} image(s).",
                    f"Write one {IMAGE_MARK} per image (or none: the images then go before the text).",
                )
            if marks == 0:
                value = IMAGE_MARK * len(images) + value
        prompt = value
    if len(images) > max_images:
        raise ConfigError(
            "max_images_per_prompt",
            f"{place} holds {len(images)} images, more than --max_images_per_prompt {max_images}.",
            f"Raise --max_images_per_prompt to {len(images)}, or drop images from that record.",
        )
    data = tuple(load_image(img, place=place, number=i + 1) for i, img in enumerate(images))
    return RecordImages(prompt, data)


def refuse_unrequested_images(
    records: Sequence[dict[str, Any]], *, input_key: str, image_key: str, source: str, path: str | None = None
) -> None:
    """Text training (``--max_images_per_prompt 0``): a record holding images is refused, not read without them."""
    for i, record in enumerate(records):
        listed = _as_list(record.get(image_key)) if image_key in record else []
        value = record.get(input_key)
        in_messages = isinstance(value, list) and _is_messages(value) and any(_message_images(value)[1])
        if listed or in_messages:
            where = f"{image_key!r}" if listed else "its chat messages' image parts"
            raise ConfigError(
                "max_images_per_prompt",
                f"{Place(source, i, path)} holds images (in {where}), but --max_images_per_prompt is 0: text training "
                "would drop them.",
                "Set --max_images_per_prompt N (the most images one prompt has) to train on them, or remove them "
                "(or point --image_key at a field the records do not have).",
            )


# ---- one image ---------------------------------------------------------------------------------------------------
def load_image(value: Any, *, place: Place, number: int) -> bytes:
    """One image's encoded bytes, decoded once to check it is an image."""
    what = f"{place}: image {number}"
    data = _image_bytes(value, what, place.base_dir)
    try:
        from PIL import Image
    except ImportError:
        raise ConfigError(
            "image_key", "reading images needs Pillow, which is not installed.", "pip install pillow"
        ) from None
    try:
        with Image.open(io.BytesIO(data)) as img:
            img.load()
    except Exception as e:  # PIL raises many kinds (UnidentifiedImageError, OSError, SyntaxError, ...)
        raise ConfigError(
            "image_key",
            f"{what} ({len(data)} bytes) cannot be decoded as an image: {type(e).__name__}: {e}.",
            "Replace it with a PNG or JPEG file (or its bytes / base64), or drop it from the record.",
        ) from None
    return data


def _image_bytes(value: Any, what: str, base_dir: str) -> bytes:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, dict):  # Hugging Face's Image feature: {"bytes": ..., "path": ...}
        if value.get("bytes"):
            return bytes(value["bytes"])
        if value.get("path"):
            return _image_bytes(value["path"], what, base_dir)
        raise ConfigError("image_key", f"{what} is a mapping without 'bytes' or 'path' ({sorted(value)}).")
    if hasattr(value, "save") and hasattr(value, "mode"):  # a PIL image (datasets folders decode Image features)
        buf = io.BytesIO()
        value.save(buf, format="PNG")
        return buf.getvalue()
    if not isinstance(value, str):
        raise ConfigError(
            "image_key",
            f"{what} is a {type(value).__name__}; an image is a path, base64 text, bytes or a PIL image.",
            "Write images as file paths (relative to the dataset file) or base64 strings.",
        )
    text = value.strip()
    if text.startswith("data:"):
        _, _, text = text.partition(",")
        return _b64(text, what)
    if text.startswith(("http://", "https://")):
        raise ConfigError(
            "image_key",
            f"{what} is a web address ({text[:80]!r}); images are not downloaded at run time.",
            "Download the images once and give their paths (relative to the dataset file) or their bytes.",
        )
    path = text[7:] if text.startswith("file://") else text
    full = path if os.path.isabs(path) else os.path.join(base_dir, path)
    if os.path.isfile(full):
        with open(full, "rb") as f:
            return f.read()
    if len(text) >= 64 and _BASE64.match(text):
        return _b64(text, what)
    raise ConfigError(
        "image_key",
        f"{what}: no file {path!r} (looked for {full}; relative paths are read from the dataset file's folder).",
        "Fix the path or put the image there (or give the image itself: base64 text or bytes).",
    )


def _b64(text: str, what: str) -> bytes:
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise ConfigError(
            "image_key", f"{what} is not valid base64 ({e}).", "Encode the image file with base64."
        ) from None


# ---- where a record keeps its images -------------------------------------------------------------------------------
def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [v for v in value if v is not None]
    if hasattr(value, "tolist") and not isinstance(value, (bytes, str)):  # numpy arrays from Parquet
        return [v for v in value.tolist() if v is not None]
    return [value]


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "role" in m for m in value)


def _message_images(messages: list[dict]) -> tuple[list[dict], list[Any], int]:
    """(the messages with image parts reduced to ``{"type": "image"}``, each part's payload or None, the parts
    without one)."""
    out, payloads, pending = [], [], 0
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image_url":  # OpenAI's shape
                url = part.get("image_url")
                payload = url.get("url") if isinstance(url, dict) else url
            elif kind == "image":
                payload = next((part[k] for k in _IMAGE_PART_KEYS if part.get(k) is not None), None)
            else:
                parts.append(part)
                continue
            payloads.append(payload)
            pending += payload is None
            parts.append({"type": "image"})
        out.append({**message, "content": parts})
    return out, payloads, pending


def _prepend_to_first_user(messages: list[dict], count: int, place: Place) -> list[dict]:
    for i, message in enumerate(messages):
        if message.get("role") == "user":
            content = message.get("content")
            parts = content if isinstance(content, list) else [{"type": "text", "text": content or ""}]
            images = [{"type": "image"} for _ in range(count)]
            return [*messages[:i], {**message, "content": images + list(parts)}, *messages[i + 1 :]]
    raise ConfigError(
        "image_key",
        f"{place} has images but no user message to put them in.",
        "Add a user message (the images go at its start), or place them with {'type': 'image'} parts.",
    )
