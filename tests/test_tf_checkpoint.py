"""The numpy TF-checkpoint reader against TensorFlow's own reads, recorded in tests/fixtures.

Each fixture folder holds a checkpoint written by TensorFlow (bert4keras' `save_weights_as_checkpoint`
or a plain `tf.train.Saver`) and `tf_variables.npz`: every variable as `tf.train.load_variable`
returned it (see tests/fixtures/generate_tf_fixtures.py). No TensorFlow is needed here.
"""

import shutil
from pathlib import Path

import numpy as np
import pytest

from roformer_rope.conversion.tf_checkpoint import (
    FOOTER_SIZE,
    TFCheckpointError,
    TFCheckpointReader,
    crc32c,
    list_variables,
    load_all,
    load_variable,
    mask_crc,
    unmask_crc,
)

FIXTURES = Path(__file__).parent / "fixtures"
MODEL_KINDS = ["v1", "v1_emb", "sim", "gpt", "v2", "v1_pool"]
ALL_KINDS = MODEL_KINDS + ["dtypes", "sharded"]
UNSUPPORTED = "^unsupported/"  # the string variable in dtypes/ and sharded/


def tf_values(kind: str) -> dict[str, np.ndarray]:
    with np.load(FIXTURES / kind / "tf_variables.npz") as data:
        return {name: data[name] for name in data.files}


def prefix_of(folder: Path) -> Path:
    (index,) = folder.glob("*.index")
    return index.with_suffix("")


def assert_one_line_error(exc_info: pytest.ExceptionInfo, *fragments: str) -> None:
    message = str(exc_info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, (fragment, message)


@pytest.fixture
def v1_copy(tmp_path: Path) -> Path:
    """A private copy of the v1 checkpoint to corrupt; returns its prefix."""
    folder = tmp_path / "v1"
    shutil.copytree(FIXTURES / "v1", folder)
    return folder / "bert_model.ckpt"


# --- crc32c -------------------------------------------------------------------------------------


def byte_loop_crc32c(data: bytes) -> int:
    """Oracle: the textbook bit-at-a-time reflected CRC-32C."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
    return crc ^ 0xFFFFFFFF


def test_crc32c_published_vectors():
    # RFC 3720 appendix B.4 and the classic check value
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(bytes(32)) == 0x8A9136AA
    assert crc32c(b"\xff" * 32) == 0x62A8AB43
    assert crc32c(bytes(range(32))) == 0x46DD794E
    assert crc32c(b"") == 0


@pytest.mark.parametrize("size", [1, 255, 16383, 16384, 16385, 70001, 300_000])
def test_crc32c_chunk_parallel_path_matches_bit_loop(size: int):
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    assert crc32c(data) == byte_loop_crc32c(data)


def test_crc_mask_round_trip():
    for crc in (0, 1, 0xE3069283, 0xFFFFFFFF):
        assert unmask_crc(mask_crc(crc)) == crc


# --- equality with TensorFlow's reads -----------------------------------------------------------


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_listing_matches_tensorflow(kind: str):
    expected = tf_values(kind)
    listing = list_variables(FIXTURES / kind, skip=UNSUPPORTED)
    assert sorted(listing) == sorted(expected)
    for name, (shape, dtype) in listing.items():
        assert shape == expected[name].shape, name
        assert dtype == expected[name].dtype, name


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_load_all_equals_tensorflow_exactly(kind: str):
    expected = tf_values(kind)
    loaded = load_all(FIXTURES / kind, skip=UNSUPPORTED)
    assert sorted(loaded) == sorted(expected)
    for name, value in loaded.items():
        assert value.dtype == expected[name].dtype, name
        assert value.shape == expected[name].shape, name
        np.testing.assert_array_equal(value, expected[name], err_msg=name)
        assert value.flags.writeable  # torch.from_numpy warns on read-only arrays


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_load_variable_equals_tensorflow_exactly(kind: str):
    reader = TFCheckpointReader(FIXTURES / kind / "bert_model.ckpt")
    for name, value in tf_values(kind).items():
        np.testing.assert_array_equal(reader.load_variable(name), value, err_msg=name)


def test_original_variable_names_are_listed():
    names = set(list_variables(FIXTURES / "v1_emb"))
    assert "bert/encoder/embedding_hidden_mapping_in/kernel" in names
    assert "cls/predictions/output_bias" in names
    assert "bert/pooler/dense/kernel" in list_variables(FIXTURES / "sim")
    assert not any("bias" in n or "LayerNorm" in n for n in list_variables(FIXTURES / "v2"))


def test_dtypes_and_special_shapes():
    loaded = load_all(FIXTURES / "dtypes", skip=UNSUPPORTED)
    assert loaded["float16/vector"].dtype == np.float16
    assert loaded["float64/scalar"].shape == ()
    assert loaded["int64/vector"].dtype == np.int64
    assert loaded["bool/flags"].dtype == np.bool_
    assert loaded["float32/empty"].shape == (0, 3)
    assert loaded["bfloat16/matrix"].dtype == np.float32  # widened exactly
    assert int(loaded["global_step"]) == 123456789012


def test_skip_regex_drops_optimizer_slots():
    names = load_all(FIXTURES / "dtypes", skip=r"adam_[mv]$|global_step|^many/|^unsupported/")
    assert "bert/embeddings/word_embeddings" in names
    assert not any(n.endswith(("adam_m", "adam_v")) or n == "global_step" for n in names)


@pytest.mark.parametrize(
    "path",
    [
        "v1",
        "v1/bert_model.ckpt",
        "v1/bert_model.ckpt.index",
        "v1/bert_model.ckpt.data-00000-of-00001",
    ],
)
def test_accepts_prefix_folder_or_file(path: str):
    reader = TFCheckpointReader(FIXTURES / path)
    assert reader.prefix == str(FIXTURES / "v1" / "bert_model.ckpt")


def test_folder_with_checkpoint_state_file_picks_the_named_prefix(tmp_path: Path):
    for name in ("old", "new"):
        for file in (FIXTURES / "v1").glob("bert_model.ckpt.*"):
            shutil.copy(file, tmp_path / file.name.replace("bert_model", name))
    (tmp_path / "checkpoint").write_text('model_checkpoint_path: "/elsewhere/new.ckpt"\n')
    assert TFCheckpointReader(tmp_path).prefix == str(tmp_path / "new.ckpt")
    (tmp_path / "checkpoint").unlink()
    with pytest.raises(TFCheckpointError) as exc_info:
        TFCheckpointReader(tmp_path)
    assert_one_line_error(exc_info, "several checkpoints")


def test_state_file_pointing_outside_the_folder_is_refused(tmp_path: Path, caplog):
    release, elsewhere = tmp_path / "release", tmp_path / "elsewhere"
    for folder, name in ((release, "mine"), (elsewhere, "other")):
        folder.mkdir()
        for file in (FIXTURES / "v1").glob("bert_model.ckpt.*"):
            shutil.copy(file, folder / file.name.replace("bert_model", name))
    (release / "checkpoint").write_text(f'model_checkpoint_path: "{elsewhere / "other.ckpt"}"\n')
    with pytest.raises(TFCheckpointError) as exc_info:
        TFCheckpointReader(release)
    assert_one_line_error(exc_info, str(release / "checkpoint"), str(elsewhere / "other.ckpt"), "outside")
    (release / "checkpoint").write_text('model_checkpoint_path: "../elsewhere/other.ckpt"\n')
    with pytest.raises(TFCheckpointError, match="outside"):
        TFCheckpointReader(release)
    # inside the folder (relative, as TF writes it for a moved folder) it is followed and logged
    (release / "checkpoint").write_text('model_checkpoint_path: "mine.ckpt"\n')
    with caplog.at_level("INFO"):
        assert TFCheckpointReader(release).prefix == str(release / "mine.ckpt")
    assert "mine.ckpt" in caplog.text


def test_huge_entry_is_refused_before_allocating(v1_copy: Path):
    """A crafted index may claim terabytes; the data file's size is checked before any allocation."""
    reader = TFCheckpointReader(v1_copy)
    name = "bert/embeddings/word_embeddings"
    entry = reader.entries[name]
    huge = (1 << 20, 1 << 20)  # 4 TiB of float32
    reader.entries[name] = type(entry)(**{**entry.__dict__, "shape": huge, "size": 4 << 40, "offset": 0})
    with pytest.raises(TFCheckpointError) as exc_info:
        reader.load_variable(name)
    assert_one_line_error(exc_info, name, "truncated", "but the file has")


def test_unknown_variable_is_a_key_error():
    with pytest.raises(KeyError):
        load_variable(FIXTURES / "v1", "bert/embeddings/position_embeddings")


def test_unsupported_dtype_is_named():
    with pytest.raises(TFCheckpointError) as exc_info:
        load_variable(FIXTURES / "dtypes", "unsupported/string")
    assert_one_line_error(exc_info, "model.ckpt.index", "unsupported/string", "string")
    with pytest.raises(TFCheckpointError):
        list_variables(FIXTURES / "dtypes")  # listing without skipping it says so too


# --- broken files -------------------------------------------------------------------------------


def test_missing_index(tmp_path: Path):
    with pytest.raises(TFCheckpointError) as exc_info:
        TFCheckpointReader(tmp_path / "bert_model.ckpt")
    assert_one_line_error(exc_info, "bert_model.ckpt.index", "no such file")
    with pytest.raises(TFCheckpointError) as exc_info:
        TFCheckpointReader(tmp_path)
    assert_one_line_error(exc_info, str(tmp_path), "no *.index")


def test_missing_data_shard(v1_copy: Path):
    data = Path(f"{v1_copy}.data-00000-of-00001")
    data.unlink()
    reader = TFCheckpointReader(v1_copy)  # the index alone still lists
    assert len(reader.list_variables()) == 41
    with pytest.raises(TFCheckpointError) as exc_info:
        reader.load_all()
    assert_one_line_error(exc_info, data.name, "missing")


def test_missing_second_shard(tmp_path: Path):
    folder = tmp_path / "sharded"
    shutil.copytree(FIXTURES / "sharded", folder)
    (folder / "model.ckpt.data-00001-of-00002").unlink()
    with pytest.raises(TFCheckpointError) as exc_info:
        load_all(folder, skip=UNSUPPORTED)
    assert_one_line_error(exc_info, "model.ckpt.data-00001-of-00002", "missing")


def test_truncated_data(v1_copy: Path):
    data = Path(f"{v1_copy}.data-00000-of-00001")
    data.write_bytes(data.read_bytes()[:-100])
    with pytest.raises(TFCheckpointError) as exc_info:
        load_all(v1_copy)
    assert_one_line_error(exc_info, data.name, "truncated")


def test_corrupted_data_fails_crc(v1_copy: Path):
    data = Path(f"{v1_copy}.data-00000-of-00001")
    reader = TFCheckpointReader(v1_copy)
    entry = reader.entries["bert/encoder/layer_1/attention/self/query/kernel"]
    raw = bytearray(data.read_bytes())
    raw[entry.offset + 5] ^= 0x40
    data.write_bytes(bytes(raw))
    with pytest.raises(TFCheckpointError) as exc_info:
        load_all(v1_copy)
    assert_one_line_error(exc_info, data.name, "crc32c mismatch", entry.name)
    # without verification the flipped byte comes through: proof the crc did the catching
    unchecked = load_variable(v1_copy, entry.name, verify_crc=False)
    assert not np.array_equal(unchecked, tf_values("v1")[entry.name])


@pytest.mark.parametrize(
    "cut",
    [lambda n: 0, lambda n: 30, lambda n: n // 2, lambda n: n - 1],
    ids=["empty", "30 bytes", "half", "last byte missing"],
)
def test_truncated_index(v1_copy: Path, cut):
    index = Path(f"{v1_copy}.index")
    raw = index.read_bytes()
    index.write_bytes(raw[: cut(len(raw))])
    with pytest.raises(TFCheckpointError) as exc_info:
        TFCheckpointReader(v1_copy)
    assert_one_line_error(exc_info, index.name)


def test_corrupted_index_block_fails_crc(v1_copy: Path):
    index = Path(f"{v1_copy}.index")
    raw = bytearray(index.read_bytes())
    position = raw.index(b"token_type_embeddings")
    raw[position] ^= 0x01  # a key character: still parses, so only the crc can tell
    index.write_bytes(bytes(raw))
    with pytest.raises(TFCheckpointError) as exc_info:
        TFCheckpointReader(v1_copy)
    assert_one_line_error(exc_info, index.name, "crc mismatch")


def test_bad_magic(v1_copy: Path):
    index = Path(f"{v1_copy}.index")
    raw = bytearray(index.read_bytes())
    raw[-1] ^= 0xFF
    index.write_bytes(bytes(raw))
    with pytest.raises(TFCheckpointError) as exc_info:
        TFCheckpointReader(v1_copy)
    assert_one_line_error(exc_info, index.name, "magic")


def test_snappy_block_is_refused_clearly(v1_copy: Path):
    index = Path(f"{v1_copy}.index")
    raw = bytearray(index.read_bytes())
    footer = raw[-FOOTER_SIZE:]
    # footer = metaindex handle, index handle (varints); TF's are short: decode by hand
    pos, handles = 0, []
    for _ in range(4):
        value, shift = 0, 0
        while True:
            byte = footer[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
        handles.append(value)
    index_offset, index_size = handles[2], handles[3]
    raw[index_offset + index_size] = 1  # the trailer's compression type: snappy
    index.write_bytes(bytes(raw))
    with pytest.raises(TFCheckpointError) as exc_info:
        TFCheckpointReader(v1_copy)
    assert_one_line_error(exc_info, index.name, "snappy")


def test_entry_size_mismatch_is_reported(v1_copy: Path):
    """A consistent index whose entry disagrees with its shape (hand-edited) is refused on load."""
    reader = TFCheckpointReader(v1_copy)
    name = "cls/predictions/output_bias"
    entry = reader.entries[name]
    reader.entries[name] = type(entry)(**{**entry.__dict__, "shape": (entry.shape[0] + 1,)})
    with pytest.raises(TFCheckpointError) as exc_info:
        reader.load_variable(name)
    assert_one_line_error(exc_info, "bert_model.ckpt.index", name, "bytes")


def test_header_fields():
    reader = TFCheckpointReader(FIXTURES / "sharded")
    assert reader.header.num_shards == 2 and not reader.header.big_endian
    assert {e.shard_id for e in reader.entries.values()} == {0, 1}
