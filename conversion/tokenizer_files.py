"""The tokenizer a converted folder carries: ours (jieba words + WordPiece) over the source's vocab.txt.

Both converters use it. The built-in `tokenizer.json` is never carried over: its pre-tokenizer is a
placeholder that generic loaders silently mis-use. Without a jieba segmenter installed, the vocabulary
and the plain tokenizer files are copied instead, so the folder stays complete.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from .key_map import ConversionError

logger = logging.getLogger(__name__)

# Files worth copying when our tokenizer class cannot be built here (no jieba segmenter).
_PLAIN_FILES = ("vocab.txt", "special_tokens_map.json", "tokenizer_config.json")
# Settings carried over from a built-in folder's tokenizer_config.json.
_SETTINGS = ("do_lower_case", "model_max_length")


def tokenizer_settings(folder: Path) -> dict:
    """`do_lower_case` / `model_max_length` from `folder/tokenizer_config.json`, if it exists."""
    config_file = folder / "tokenizer_config.json"
    if not config_file.is_file():
        return {}
    try:
        source = json.loads(config_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ConversionError(f"{config_file}: not valid JSON ({error})") from None
    if not isinstance(source, dict):
        raise ConversionError(f"{config_file}: expected a JSON object, got a {type(source).__name__}")
    return {key: source[key] for key in _SETTINGS if key in source}


def save_tokenizer(source: Path, out_dir: Path, **settings) -> list[str]:
    """Write our tokenizer for `source/vocab.txt` into `out_dir`; returns the file names written."""
    vocab = source / "vocab.txt"
    if not vocab.is_file():
        logger.warning("%s has no vocab.txt: the converted folder has no tokenizer", source)
        return []
    try:
        from modeling_roformer_rope.tokenization_roformer_rope import RoFormerRopeTokenizer
    except ImportError as error:  # the tokenizer is optional for conversion; the vocabulary is not
        logger.warning("RoFormerRopeTokenizer unavailable (%s): copying the tokenizer files only", error)
        copied = [name for name in _PLAIN_FILES if (source / name).is_file()]
        for name in copied:
            shutil.copyfile(source / name, out_dir / name)
        return copied
    tokenizer = RoFormerRopeTokenizer(vocab_file=str(vocab), **settings)
    return [Path(p).name for p in tokenizer.save_pretrained(out_dir)]
