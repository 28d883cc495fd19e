"""The tokenizer a converted folder carries: ours (jieba words + WordPiece) over the source's vocabulary.

Both converters use it. The vocabulary is the source's `vocab.txt`, or, in a folder saved by transformers
v5 (which writes no `vocab.txt`), the WordPiece vocabulary inside its `tokenizer.json`, written out as
`vocab.txt`. The built-in `tokenizer.json` itself is never carried over: its pre-tokenizer is a
placeholder that generic loaders silently mis-use. What the built-in tokenizer would load besides the
vocabulary is carried over as transformers reads it (`read_source_tokenizer`): the settings, the special
tokens and the added tokens with their ids. Without a jieba segmenter installed, the vocabulary and the
plain tokenizer files are copied instead, so the folder stays complete.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from .json_object import read_json_object
from .key_map import ConversionError

logger = logging.getLogger(__name__)

# Files worth copying when our tokenizer class cannot be built here (no jieba segmenter).
_PLAIN_FILES = ("vocab.txt", "special_tokens_map.json", "added_tokens.json", "tokenizer_config.json")
# Settings carried over from a built-in folder's tokenizer_config.json (the built-in RoFormerTokenizer ignores
# `tokenize_chinese_chars`: its jieba pre-tokenizer splits Chinese text, so ours keeps its own default).
_SETTINGS = ("do_lower_case", "model_max_length", "strip_accents")
_SPECIAL_TOKENS = ("unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# The list of further special tokens: transformers v5's name, then v4's.
_EXTRA_SPECIAL = ("extra_special_tokens", "additional_special_tokens")
_ADDED_TOKEN_FIELDS = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")


def _token_text(value, config_file: Path, key: str) -> str:
    """A special token as saved: a string, or (transformers v4) an `AddedToken` dict with `content`."""
    if isinstance(value, dict):
        value = value.get("content")
    if not isinstance(value, str) or not value:
        raise ConversionError(f"{config_file}: {key} must be a token string, got {value!r}")
    return value


@dataclass
class SourceTokenizer:
    """What a built-in folder's tokenizer loads besides its vocabulary."""

    settings: dict = field(default_factory=dict)  # RoFormerRopeTokenizer keyword arguments
    added: dict = field(default_factory=dict)  # id -> AddedToken field dict (`content`, `special`, ...)
    class_name: str | None = None  # tokenizer_config.json's `tokenizer_class`


def _added_token(value, where: Path) -> dict:
    """An added token as saved (a dict of AddedToken fields, or a bare string) as a complete field dict."""
    if isinstance(value, str):
        value = {"content": value}
    if not isinstance(value, dict) or not isinstance(value.get("content"), str) or not value["content"]:
        raise ConversionError(f"{where}: an added token must be an object with a non-empty content, got {value!r}")
    unknown = sorted(set(value) - set(_ADDED_TOKEN_FIELDS) - {"id", "__type"})
    if unknown:
        raise ConversionError(f"{where}: added token {value['content']!r} has unknown fields {unknown}")
    return {"single_word": False, "lstrip": False, "rstrip": False, "normalized": True, "special": False} | {
        k: value[k] for k in _ADDED_TOKEN_FIELDS if k in value
    }


def _token_id(value, where: Path) -> int:
    try:
        token_id = int(value)
    except (TypeError, ValueError):
        raise ConversionError(f"{where}: added token id {value!r} is not an integer") from None
    if isinstance(value, bool) or token_id < 0:
        raise ConversionError(f"{where}: added token id {value!r} is not a non-negative integer")
    return token_id


def read_source_tokenizer(folder: Path) -> SourceTokenizer:
    """Settings, special tokens and added tokens of the tokenizer in a built-in folder, read as transformers v5's
    `from_pretrained` reads them: `tokenizer_config.json` first; when it has no `added_tokens_decoder` (older
    layouts), `special_tokens_map.json` overrides its special tokens and the added tokens come from
    `added_tokens.json`, then `tokenizer.json`. One difference: an `added_tokens.json` token listed in v4's
    `additional_special_tokens` is special here (transformers v5 checks only its own `extra_special_tokens`)."""
    config_file = folder / "tokenizer_config.json"
    source = read_json_object(config_file) if config_file.is_file() else {}
    settings = {key: source[key] for key in _SETTINGS if key in source}
    named = {key: _token_text(source[key], config_file, key) for key in _SPECIAL_TOKENS if source.get(key) is not None}
    extra = _extra_tokens(source, config_file)
    added: dict[int, dict] = {}
    if "added_tokens_decoder" in source:
        decoder = source["added_tokens_decoder"]
        if not isinstance(decoder, dict):
            raise ConversionError(f"{config_file}: added_tokens_decoder must be an object of id -> token")
        for token_id, value in decoder.items():
            added[_token_id(token_id, config_file)] = _added_token(value, config_file)
    else:
        map_file = folder / "special_tokens_map.json"
        if map_file.is_file():
            saved = read_json_object(map_file)
            named |= {
                key: _token_text(saved[key], map_file, key) for key in _SPECIAL_TOKENS if saved.get(key) is not None
            }
            extra += [token for token in _extra_tokens(saved, map_file) if token not in extra]
        added_file = folder / "added_tokens.json"
        if added_file.is_file():
            specials = set(named.values()) | set(extra)
            for content, token_id in read_json_object(added_file).items():
                special = content in specials
                fields = {"content": content, "normalized": not special, "special": special}
                added[_token_id(token_id, added_file)] = _added_token(fields, added_file)
        tokenizer_file = folder / "tokenizer.json"
        entries = read_json_object(tokenizer_file).get("added_tokens") if tokenizer_file.is_file() else None
        if not isinstance(entries, (list, type(None))):
            raise ConversionError(f"{tokenizer_file}: added_tokens must be a list")
        for entry in entries or []:
            token_id = entry.get("id") if isinstance(entry, dict) else None
            added[_token_id(token_id, tokenizer_file)] = _added_token(entry, tokenizer_file)
    settings |= named  # absent or null: our tokenizer's default (the BERT token)
    if extra:
        settings["extra_special_tokens"] = extra
    class_name = source.get("tokenizer_class") if isinstance(source.get("tokenizer_class"), str) else None
    return SourceTokenizer(settings=settings, added=dict(sorted(added.items())), class_name=class_name)


def _extra_tokens(saved: dict, path: Path) -> list[str]:
    """The further special tokens of a tokenizer_config.json / special_tokens_map.json: v5's `extra_special_tokens`
    (a list, or a dict of model-specific named tokens: its values), else v4's `additional_special_tokens`."""
    key = next((key for key in _EXTRA_SPECIAL if saved.get(key) is not None), None)
    value = saved.get(key) if key else []
    if isinstance(value, dict):
        value = list(value.values())
    if not isinstance(value, list):
        raise ConversionError(f"{path}: {key} must be a list of tokens, got {value!r}")
    return [_token_text(token, path, key) for token in value]


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
    return tokens  # its added tokens: `read_source_tokenizer`


def save_tokenizer(source: Path, out_dir: Path, added: dict | None = None, **settings) -> list[str]:
    """Write our tokenizer for the vocabulary of `source` into `out_dir`; returns the file names written.

    The vocabulary is `source/vocab.txt`, else the WordPiece vocabulary of `source/tokenizer.json`
    (written to `out_dir/vocab.txt` first). A folder with neither gets no tokenizer, with a warning.
    `added` ({id: AddedToken fields}, see `read_source_tokenizer`) are added with the same ids, and
    `settings` are RoFormerRopeTokenizer arguments (`extra_special_tokens` set after the added tokens).
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
    extra = settings.pop("extra_special_tokens", None)
    try:
        tokenizer = RoFormerRopeTokenizer(vocab_file=str(vocab), **settings)
    except ValueError as error:  # e.g. a special token of tokenizer_config.json missing from the vocabulary
        raise ConversionError(f"{source}: cannot build the tokenizer ({error})") from None
    _add_tokens(tokenizer, added or {}, source)
    if extra:
        from tokenizers import AddedToken

        saved = {fields["content"]: fields for fields in (added or {}).values()}  # their flags (lstrip, ...) kept
        tokens = [AddedToken(**{**saved[t], "special": True}) if t in saved else t for t in extra]
        tokenizer.add_special_tokens({"extra_special_tokens": tokens})
    return [Path(p).name for p in tokenizer.save_pretrained(out_dir)]


def _add_tokens(tokenizer, added: dict, source: Path) -> None:
    """Add the source's added tokens in id order, each with the id it has there (the ones past the vocabulary
    must follow it without gaps, as `add_tokens` gives them)."""
    from tokenizers import AddedToken

    for token_id, fields in added.items():
        have = tokenizer.added_tokens_decoder.get(token_id)
        if have is not None and {k: getattr(have, k) for k in fields} == fields:
            continue  # already there as saved (the special tokens our tokenizer registers itself)
        tokenizer.add_tokens([AddedToken(**fields)], special_tokens=fields["special"])
        got = tokenizer.convert_tokens_to_ids(fields["content"])
        if got != token_id:
            raise ConversionError(
                f"{source}: added token {fields['content']!r} has id {token_id} there but would get {got} here "
                f"(added tokens past the {tokenizer.vocab_size}-token vocabulary must follow it without gaps)"
            )
    if added:
        logger.info("%s: %d added tokens carried over", source, len(added))
