"""Reading the JSON files of a checkpoint folder (configs, tokenizer files): one error form for every converter."""

from __future__ import annotations

import json
from pathlib import Path

from .key_map import ConversionError


def read_json_object(path: Path) -> dict:
    """The JSON object in `path`; a ConversionError naming the file if it is not valid JSON or not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ConversionError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(data, dict):
        raise ConversionError(f"{path}: expected a JSON object, got a {type(data).__name__}")
    return data
