"""Image bytes found inside transcripts: base64 payloads and data: URLs."""

from __future__ import annotations

import base64
import binascii
import re
from typing import Any

from conversations.importers.base import Node, Part, image_data_part, text_part

_DATA_URL = re.compile(r"^data:([\w.+/-]*)(;[^,]*)?,", re.IGNORECASE)


def b64_image(data: Any, mime: Any, node: Node, where: str) -> Part:
    """An image part for base64 bytes, or a text placeholder (noted) if they are bad."""
    if not isinstance(data, str) or not data:
        node.note("image_not_imported", f"{where}: no image data")
        return text_part("[image not imported: no data]")
    try:
        raw = base64.b64decode(data, validate=False)
    except (binascii.Error, ValueError):
        node.note("image_not_imported", f"{where}: the base64 data is corrupt")
        return text_part("[image not imported: corrupt data]")
    return image_data_part(raw, mime if isinstance(mime, str) else "", f"node {node.key}")


def url_image(url: Any, node: Node, where: str) -> Part:
    """An image given by URL: data: URLs are decoded; others cannot be fetched offline."""
    text = url if isinstance(url, str) else ""
    match = _DATA_URL.match(text)
    if match and (match.group(2) or "").lower().endswith("base64"):
        return b64_image(text[match.end() :], match.group(1), node, where)
    shown = text[:200] or "(none)"
    node.note("image_missing", f"{where}: image at {shown} is not in the file")
    return text_part(f"[image not in the file: {shown}]")
