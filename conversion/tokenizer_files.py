"""The tokenizer a converted folder carries: ours (jieba words + WordPiece) over the source's vocabulary.

Both converters use it. The vocabulary is the source's `vocab.txt`, or, in a folder saved by transformers
v5 (which writes no `vocab.txt`), the WordPiece vocabulary inside its `tokenizer.json`, written out as
`vocab.txt`. The built-in `tokenizer.json` itself is never carried over: its pre-tokenizer is a
placeholder that generic loaders silently mis-use. Without a jieba segmenter installed, the vocabulary
and the plain tokenizer files are copied instead, so the folder stays complete.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from .json_object import read_json_object
from .key_map import ConversionError

logger = logging.getLogger(__name__)

# Files worth copying when our tokenizer class cannot be built here (no jieba segmenter).
_PLAIN_FILES = ("vocab.txt", "special_tokens_map.json", "tokenizer_config.json")
# Settings carried over from a built-in folder's tokenizer_config.json.
_SETTINGS = ("do_lower_case", "model_max_length")
_SPECIAL_TOKENS = ("unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_text(value, config_file: Path, key: str) -> str:
    """A special token as saved: a string, or (transformers v4) an `AddedToken` dict with `content`."""
    if isinstance(value, dict):
        value = value.get("content")
    if not isinstance(value, str) or not value:
        raise ConversionError(f"{config_file}: {key} must be a token string, got {value!r}")
    return value


def tokenizer_settings(folder: Path) -> dict:
    """`do_lower_case`, `model_max_length` and the special tokens from `folder/tokenizer_config.json`."""
    config_file = folder / "tokenizer_config.json"
    if not config_file.is_file():
        return {}
    source = read_json_object(config_file)
    settings = {key: source[key] for key in _SETTINGS if key in source}
    for key in _SPECIAL_TOKENS:
        if source.get(key) is not None:  # absent or null: our tokenizer's default (the BERT token)
            settings[key] = _token_text(source[key], config_file, key)
    return settings


def wordpiece_vocab(tokenizer_file: Path) -> list[str] | None:
    """The tokens of the WordPiece vocabulary in a tokenizers `tokenizer.json`, in id order.

    None when the file is absent or holds another kind of model (nothing we can carry over); a
    ConversionError naming the file when it is malformed or its ids are not exactly 0..n-1.
    """
    if not tokenizer_file.is_file():
        return None
    saved = read_json_object(tokenizer_file)
    model = saved.get("model")
    if not isinstance(model, dict) or model.get("type") != "WordPiece":
        kind = model.get("type") if isinstance(model, dict) else None
        logger.warning("%s holds a %s model, not WordPiece: its vocabulary is not carried over", tokenizer_file, kind)
        return None
    vocab = model.get("vocab")
    if not isinstance(vocab, dict) or not all(isinstance(i, int) and not isinstance(i, bool) for i in vocab.values()):
        raise ConversionError(f"{tokenizer_file}: model.vocab must be an object of token -> integer id")
    prefix = model.get("continuing_subword_prefix", "##")
    if prefix != "##":  # our WordPiece, like every RoFormer vocabulary, continues words with ##
        raise ConversionError(f"{tokenizer_file}: continuing_subword_prefix is {prefix!r}, expected '##'")
    tokens = sorted(vocab, key=vocab.__getitem__)
    if [vocab[t] for t in tokens] != list(range(len(tokens))):
        raise ConversionError(
            f"{tokenizer_file}: model.vocab ids are not contiguous 0..{len(tokens) - 1}, "
            "so they cannot be written as vocab.txt lines"
        )
    broken = [t for t in tokens if "\n" in t or "\r" in t]
    if broken:
        raise ConversionError(f"{tokenizer_file}: tokens that cannot be vocab.txt lines: {broken[:5]!r}")
    extra = [
        entry.get("content")
        for entry in saved.get("added_tokens") or []
        if isinstance(entry, dict) and entry.get("content") not in vocab
    ]
    if extra:
        logger.warning("%s: added tokens outside the vocabulary are not carried over: %s", tokenizer_file, extra)
    return tokens


def save_tokenizer(source: Path, out_dir: Path, **settings) -> list[str]:
    """Write our tokenizer for the vocabulary of `source` into `out_dir`; returns the file names written.

    The vocabulary is `source/vocab.txt`, else the WordPiece vocabulary of `source/tokenizer.json`
    (written to `out_dir/vocab.txt` first). A folder with neither gets no tokenizer, with a warning.
    """
    vocab = source / "vocab.txt"
    written: list[str] = []
    if not vocab.is_file():
        tokens = wordpiece_vocab(source / "tokenizer.json")
        if tokens is None:
            logger.warning("no tokenizer written: %s has neither vocab.txt nor a WordPiece tokenizer.json", source)
            return []
        vocab = out_dir / "vocab.txt"
        vocab.write_text("".join(t + "\n" for t in tokens), encoding="utf-8")
        written.append(vocab.name)
        logger.info("%s: vocab.txt written from tokenizer.json (%d tokens)", source, len(tokens))
    try:
        from modeling_roformer_rope.tokenization_roformer_rope import RoFormerRopeTokenizer
    except ImportError as error:  # the tokenizer is optional for conversion; the vocabulary is not
        logger.warning("RoFormerRopeTokenizer unavailable (%s): copying the tokenizer files only", error)
        copied = [name for name in _PLAIN_FILES if name not in written and (source / name).is_file()]
        for name in copied:
            shutil.copyfile(source / name, out_dir / name)
        return written + copied
    try:
        tokenizer = RoFormerRopeTokenizer(vocab_file=str(vocab), **settings)
    except ValueError as error:  # e.g. a special token of tokenizer_config.json missing from the vocabulary
        raise ConversionError(f"{source}: cannot build the tokenizer ({error})") from None
    return [Path(p).name for p in tokenizer.save_pretrained(out_dir)]
