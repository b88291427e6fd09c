"""The ids the server makes, in OpenAI's styles."""

from __future__ import annotations

import uuid

ID_HEX_CHARS = 24  # as long as OpenAI's ids: unique enough, and what clients that store them expect


def new_id(prefix: str) -> str:
    """``chatcmpl-…``, ``cmpl-…``, ``resp_…``, ``msg_…``, ``fc_…``, ``call_…``."""
    return prefix + uuid.uuid4().hex[:ID_HEX_CHARS]
