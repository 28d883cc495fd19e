"""Read TensorFlow 1.x V2 checkpoints (the "tensor bundle" format) with numpy only.

The released RoFormer weights are bert4keras checkpoints: `bert_model.ckpt.index` plus
`bert_model.ckpt.data-0000K-of-0000N`. Converting them should not require installing TensorFlow,
so this module decodes the format by hand:

- `PREFIX.index` is an SSTable (LevelDB table format): data blocks of prefix-compressed
  key/value entries followed by restart offsets, an index block whose values are BlockHandles of
  the data blocks, and a 48-byte footer (metaindex handle, index handle, zero padding, magic
  0xdb4775248b80fb57). Each block is followed by a 5-byte trailer: compression type (0 = none,
  1 = snappy) and the masked crc32c of contents + type byte.
- Keys are variable names; the value at key "" is a `BundleHeaderProto` (num_shards, endianness,
  version), every other value a `BundleEntryProto` (dtype, shape, shard_id, offset, size,
  masked crc32c of the tensor bytes). Both are decoded from the protobuf wire format directly.
- `PREFIX.data-{shard:05d}-of-{num_shards:05d}` holds the raw tensor bytes.

Integrity: every index block's crc is checked. Tensor crcs are checked too unless
`verify_crc=False`; the crc32c below runs chunk-parallel in numpy (about 200 MB/s on one core
here), so verifying a ~400 MB base checkpoint costs about 2 s. bfloat16 tensors are returned widened to
float32 (exact), since neither numpy nor `torch.from_numpy` has a bfloat16 dtype.

Example:
    >>> from roformer_rope.conversion.tf_checkpoint import load_all
    >>> weights = load_all("chinese_roformer_L-12_H-768_A-12/", skip=r"adam_[mv]$|global_step")
"""

import logging
import math
import os
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "TFCheckpointError",
    "TFCheckpointReader",
    "TensorEntry",
    "crc32c",
    "list_variables",
    "load_all",
    "load_variable",
    "resolve_prefix",
]

logger = logging.getLogger(__name__)

TABLE_MAGIC = 0xDB4775248B80FB57
FOOTER_SIZE = 48  # two BlockHandles padded to 40 bytes + 8-byte magic
BLOCK_TRAILER_SIZE = 5  # compression type byte + masked crc32c
COMPRESSION_NONE, COMPRESSION_SNAPPY = 0, 1

# tensorflow/core/framework/types.proto DataType -> numpy dtype (little-endian on disk)
DTYPES: dict[int, np.dtype] = {
    1: np.dtype("<f4"),  # DT_FLOAT
    2: np.dtype("<f8"),  # DT_DOUBLE
    3: np.dtype("<i4"),  # DT_INT32
    4: np.dtype("u1"),  # DT_UINT8
    5: np.dtype("<i2"),  # DT_INT16
    6: np.dtype("i1"),  # DT_INT8
    8: np.dtype("<c8"),  # DT_COMPLEX64
    9: np.dtype("<i8"),  # DT_INT64
    10: np.dtype("?"),  # DT_BOOL
    14: np.dtype("<u2"),  # DT_BFLOAT16: raw bits, widened to float32 on load
    17: np.dtype("<u2"),  # DT_UINT16
    18: np.dtype("<c16"),  # DT_COMPLEX128
    19: np.dtype("<f2"),  # DT_HALF
    22: np.dtype("<u4"),  # DT_UINT32
    23: np.dtype("<u8"),  # DT_UINT64
}
DT_BFLOAT16 = 14
DTYPE_NAMES = {
    7: "string",
    11: "qint8",
    12: "quint8",
    13: "qint32",
    15: "qint16",
    16: "quint16",
    20: "resource",
    21: "variant",
}


class TFCheckpointError(ValueError):
    """A checkpoint file is missing, truncated, corrupt or uses an unsupported feature."""


# ---------------------------------------------------------------------------------------------
# crc32c (Castagnoli), as used by LevelDB tables and tensor bundles
# ---------------------------------------------------------------------------------------------

CRC32C_POLY = 0x82F63B78  # reflected Castagnoli polynomial
CRC_MASK_DELTA = 0xA282EAD8
PARALLEL_MIN_BYTES = 1 << 14  # below this a plain byte loop is faster than numpy set-up


def _make_table() -> np.ndarray:
    table = np.zeros(256, dtype=np.uint32)
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ CRC32C_POLY if crc & 1 else crc >> 1
        table[byte] = crc
    return table


CRC_TABLE = _make_table()
_CRC_TABLE_LIST = [int(x) for x in CRC_TABLE]


def _crc_bytes(crc: int, data: bytes | memoryview) -> int:
    """Raw (no pre/post inversion) byte-at-a-time update; for short inputs."""
    table = _CRC_TABLE_LIST
    for byte in bytes(data):
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc


def _apply(matrix: list[int], vector: int) -> int:
    """Multiply a GF(2) 32x32 matrix (list of 32 column words) by a 32-bit vector."""
    out, i = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


def _compose(a: list[int], b: list[int]) -> list[int]:
    """Matrix product a @ b: first apply b, then a."""
    return [_apply(a, col) for col in b]


_ONE_ZERO_BYTE = [_crc_bytes(1 << i, b"\0") for i in range(32)]


def _zeros_operator(n_bytes: int) -> list[int]:
    """The linear map 'append n zero bytes' on a raw crc state, by square-and-multiply."""
    result = [1 << i for i in range(32)]  # identity
    power = _ONE_ZERO_BYTE
    while n_bytes:
        if n_bytes & 1:
            result = _compose(power, result)
        n_bytes >>= 1
        if n_bytes:
            power = _compose(power, power)
    return result


def _apply_many(matrix: list[int], vectors: np.ndarray) -> np.ndarray:
    """`_apply` over an array of crc states at once."""
    out = np.zeros_like(vectors)
    for i, column in enumerate(matrix):
        out ^= np.where((vectors >> np.uint32(i)) & np.uint32(1), np.uint32(column), np.uint32(0))
    return out


def _crc_parallel(data: memoryview) -> tuple[int, int]:
    """Raw crc (initial state 0) of the longest prefix of `data` split into 2^k equal chunks.

    A crc is linear over GF(2), so the chunks are processed side by side (one numpy step per
    byte column), then merged pairwise: crc(A + B) = zeros_operator(len(B)) @ crc(A) ^ crc(B).
    Returns (raw crc, number of bytes consumed).
    """
    n = len(data)
    chunks = 1 << min(16, (n // 256).bit_length() - 1)  # chunks of >= 256 bytes
    length = n // chunks
    grid = np.frombuffer(data, dtype=np.uint8, count=chunks * length).reshape(chunks, length)
    state = np.zeros(chunks, dtype=np.uint32)
    step = 256  # transpose a slab at a time: contiguous columns without copying everything
    for start in range(0, length, step):
        slab = np.ascontiguousarray(grid[:, start : start + step].T)
        for column in slab:
            state = CRC_TABLE[(state ^ column) & 0xFF] ^ (state >> np.uint32(8))
    span = length
    while len(state) > 1:
        state = _apply_many(_zeros_operator(span), state[0::2]) ^ state[1::2]
        span *= 2
    return int(state[0]), chunks * length


def crc32c(data: bytes | bytearray | memoryview) -> int:
    """Standard CRC-32C of `data` (crc32c(b"123456789") == 0xE3069283)."""
    view = memoryview(data).cast("B")
    crc, done = 0, 0
    if len(view) >= PARALLEL_MIN_BYTES:
        crc, done = _crc_parallel(view)
    # fold in the standard initial value 0xFFFFFFFF, which the parallel part started without
    crc ^= _apply(_zeros_operator(done), 0xFFFFFFFF) if done else 0xFFFFFFFF
    return _crc_bytes(crc, view[done:]) ^ 0xFFFFFFFF


def unmask_crc(masked: int) -> int:
    """Undo LevelDB's crc masking (rotate right 15 after subtracting a constant)."""
    rot = (masked - CRC_MASK_DELTA) & 0xFFFFFFFF
    return ((rot >> 17) | (rot << 15)) & 0xFFFFFFFF


def mask_crc(crc: int) -> int:
    """LevelDB's crc masking, so crcs of data that embeds crcs stay well distributed."""
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + CRC_MASK_DELTA) & 0xFFFFFFFF


# ---------------------------------------------------------------------------------------------
# protobuf wire format
# ---------------------------------------------------------------------------------------------


def _varint(buf: bytes | memoryview, pos: int) -> tuple[int, int]:
    """Decode a base-128 varint at `pos`; return (value, next position)."""
    result, shift = 0, 0
    while True:
        if pos >= len(buf):
            raise TFCheckpointError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise TFCheckpointError("varint longer than 10 bytes")


def _signed64(value: int) -> int:
    """Protobuf int64/int32 fields store negatives as 10-byte two's complement varints."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _fields(buf: bytes | memoryview) -> Iterator[tuple[int, int | memoryview]]:
    """Yield (field number, value): ints for varint/fixed fields, memoryviews for bytes fields."""
    buf = memoryview(buf)
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            value, pos = struct.unpack_from("<Q", buf, pos)[0], pos + 8
        elif wire == 2:
            length, pos = _varint(buf, pos)
            value, pos = buf[pos : pos + length], pos + length
        elif wire == 5:
            value, pos = struct.unpack_from("<I", buf, pos)[0], pos + 4
        else:
            raise TFCheckpointError(f"unsupported protobuf wire type {wire}")
        if pos > len(buf):
            raise TFCheckpointError("truncated protobuf message")
        yield field, value


@dataclass(frozen=True)
class BundleHeader:
    """`BundleHeaderProto`: how many data shards, and their byte order."""

    num_shards: int = 1
    big_endian: bool = False
    version_producer: int = 0


@dataclass(frozen=True)
class TensorEntry:
    """`BundleEntryProto`: where one variable's bytes are and what they hold."""

    name: str
    dtype_enum: int
    shape: tuple[int, ...]
    shard_id: int
    offset: int
    size: int
    crc32c: int | None  # unmasked; None when the writer stored none
    sliced: bool  # a partitioned variable, stored as slices under other keys


def _parse_header(value: memoryview) -> BundleHeader:
    num_shards, big_endian, producer = 1, False, 0
    for field, v in _fields(value):
        if field == 1:
            num_shards = v
        elif field == 2:
            big_endian = v == 1
        elif field == 3:
            producer = next((x for f, x in _fields(v) if f == 1), 0)
    return BundleHeader(num_shards, big_endian, producer)


def _parse_shape(value: memoryview) -> tuple[int, ...]:
    dims = []
    for field, v in _fields(value):
        if field == 2:  # repeated Dim {int64 size = 1; string name = 2}
            dims.append(next((_signed64(x) for f, x in _fields(v) if f == 1), 0))
        elif field == 3 and v:
            raise TFCheckpointError("tensor shape of unknown rank")
    return tuple(dims)


def _parse_entry(name: str, value: memoryview) -> TensorEntry:
    dtype, shape, shard, offset, size, crc, sliced = 0, (), 0, 0, 0, None, False
    for field, v in _fields(value):
        if field == 1:
            dtype = v
        elif field == 2:
            shape = _parse_shape(v)
        elif field == 3:
            shard = v
        elif field == 4:
            offset = _signed64(v)
        elif field == 5:
            size = _signed64(v)
        elif field == 6:
            crc = unmask_crc(v)  # the writer stores crc32c::Mask(crc)
        elif field == 7:
            sliced = True
    return TensorEntry(name, dtype, shape, shard, offset, size, crc, sliced)


# ---------------------------------------------------------------------------------------------
# SSTable (LevelDB table) reading
# ---------------------------------------------------------------------------------------------


def _block_handle(buf: memoryview, pos: int) -> tuple[int, int, int]:
    """Decode a BlockHandle (varint offset, varint size); return (offset, size, next pos)."""
    offset, pos = _varint(buf, pos)
    size, pos = _varint(buf, pos)
    return offset, size, pos


def _read_block(table: memoryview, offset: int, size: int) -> memoryview:
    """Return a block's contents after checking its trailer (compression type and crc)."""
    end = offset + size
    if end + BLOCK_TRAILER_SIZE > len(table) - FOOTER_SIZE:
        raise TFCheckpointError(f"block at {offset}+{size} runs past the end of the file (truncated?)")
    compression = table[end]
    if compression == COMPRESSION_SNAPPY:
        raise TFCheckpointError("snappy-compressed index block: not supported (TensorFlow writes uncompressed tables)")
    if compression != COMPRESSION_NONE:
        raise TFCheckpointError(f"unknown block compression type {compression}")
    (stored,) = struct.unpack_from("<I", table, end + 1)
    if crc32c(table[offset : end + 1]) != unmask_crc(stored):
        raise TFCheckpointError(f"crc mismatch in index block at offset {offset} (corrupt file)")
    return table[offset:end]


def _block_entries(block: memoryview) -> Iterator[tuple[bytes, memoryview]]:
    """Yield (key, value) from a block: keys share a prefix with the previous key."""
    if len(block) < 4:
        raise TFCheckpointError("block too short for its restart count")
    (num_restarts,) = struct.unpack_from("<I", block, len(block) - 4)
    limit = len(block) - 4 - 4 * num_restarts  # restart offsets only speed up seeks: skip them
    if limit < 0:
        raise TFCheckpointError(f"block claims {num_restarts} restart points, more than fit")
    pos, key = 0, b""
    while pos < limit:
        shared, pos = _varint(block, pos)
        unshared, pos = _varint(block, pos)
        value_len, pos = _varint(block, pos)
        if shared > len(key) or pos + unshared + value_len > limit:
            raise TFCheckpointError(f"malformed block entry at byte {pos}")
        key = key[:shared] + bytes(block[pos : pos + unshared])
        pos += unshared
        yield key, block[pos : pos + value_len]
        pos += value_len


def _table_items(table: memoryview) -> Iterator[tuple[bytes, memoryview]]:
    """All (key, value) pairs of an SSTable, in key order."""
    if len(table) < FOOTER_SIZE:
        raise TFCheckpointError(f"file is {len(table)} bytes, shorter than a table footer (truncated?)")
    footer = table[len(table) - FOOTER_SIZE :]
    (magic,) = struct.unpack_from("<Q", footer, FOOTER_SIZE - 8)
    if magic != TABLE_MAGIC:
        raise TFCheckpointError(f"bad table magic {magic:#018x} (truncated, or not a TF V2 checkpoint index)")
    _, _, pos = _block_handle(footer, 0)  # metaindex: TF writes none worth reading
    index_offset, index_size, _ = _block_handle(footer, pos)
    for _, handle in _block_entries(_read_block(table, index_offset, index_size)):
        offset, size, _ = _block_handle(handle, 0)
        yield from _block_entries(_read_block(table, offset, size))


# ---------------------------------------------------------------------------------------------
# the reader
# ---------------------------------------------------------------------------------------------


def resolve_prefix(path: str | os.PathLike) -> str:
    """Turn a prefix, an `.index`/`.data-*` file or a folder into the checkpoint prefix.

    A folder must hold exactly one `*.index`, or a TF `checkpoint` state file naming one.
    """
    path = Path(path)
    if path.is_dir():
        return _prefix_in_folder(path)
    text = str(path)
    if text.endswith(".index"):
        return text[: -len(".index")]
    match = re.fullmatch(r"(.*)\.data-\d{5}-of-\d{5}", text)
    return match.group(1) if match else text


def _inside(path: Path, folder: Path) -> bool:
    path, folder = path.resolve(), folder.resolve()
    return path.parent == folder or folder in path.parents


def _prefix_in_folder(folder: Path) -> str:
    """The prefix a folder holds: the one its `checkpoint` state file names, or its only `*.index`.

    The state file is only followed inside the folder. TF writes absolute paths into it, so a folder
    copied elsewhere names its old location: the file of that name in the folder is read instead (and
    logged). A state file naming a checkpoint outside the folder that the folder does not hold is refused
    rather than silently reading another model's weights.
    """
    state = folder / "checkpoint"
    if state.is_file():
        try:
            text = state.read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            raise TFCheckpointError(f"{state}: cannot read ({exc.strerror})") from None
        match = re.search(r'^model_checkpoint_path:\s*"(.*)"', text, re.M)
        if match:
            named = Path(match.group(1))
            named = named if named.is_absolute() else folder / named
            if Path(f"{named}.index").is_file() and _inside(named, folder):
                logger.info("%s names %s: reading it", state, named)
                return str(named)
            named_here = folder / named.name  # folder moved since saving: the state holds old paths
            if Path(f"{named_here}.index").is_file():
                logger.info("%s names %s (outside the folder): reading %s instead", state, named, named_here)
                return str(named_here)
            if Path(f"{named}.index").is_file():
                raise TFCheckpointError(
                    f"{state}: names {named}, outside {folder}; pass that prefix as --checkpoint if you mean it"
                )
    indexes = sorted(folder.glob("*.index"))
    if len(indexes) == 1:
        return str(indexes[0])[: -len(".index")]
    if not indexes:
        raise TFCheckpointError(f"{folder}: no *.index file (not a TF checkpoint folder)")
    names = ", ".join(p.name for p in indexes)
    raise TFCheckpointError(f"{folder}: several checkpoints ({names}); pass the prefix of one")


def _compile_skip(skip: str | re.Pattern | None) -> re.Pattern | None:
    return re.compile(skip) if isinstance(skip, str) else skip


class TFCheckpointReader:
    """Random access to the variables of one TF V2 checkpoint, without TensorFlow.

    Args:
        path: the checkpoint prefix (`.../bert_model.ckpt`), its `.index` file, or a folder.
        verify_crc: check each tensor's crc32c when loading it (index blocks are always checked).
    """

    def __init__(self, path: str | os.PathLike, verify_crc: bool = True) -> None:
        self.prefix = resolve_prefix(path)
        self.index_path = f"{self.prefix}.index"
        self.verify_crc = verify_crc
        self.header, self.entries = self._read_index()

    def _read_index(self) -> tuple[BundleHeader, dict[str, TensorEntry]]:
        try:
            data = Path(self.index_path).read_bytes()
        except FileNotFoundError:
            raise TFCheckpointError(f"{self.index_path}: no such file (not a TF V2 checkpoint prefix?)") from None
        except OSError as exc:
            raise TFCheckpointError(f"{self.index_path}: cannot read ({exc.strerror})") from None
        header, entries = None, {}
        try:
            for key, value in _table_items(memoryview(data)):
                if key == b"":
                    header = _parse_header(value)
                else:
                    name = key.decode("utf-8")
                    entries[name] = _parse_entry(name, value)
        except TFCheckpointError as exc:
            raise TFCheckpointError(f"{self.index_path}: {exc}") from None
        except (UnicodeDecodeError, struct.error, IndexError) as exc:
            raise TFCheckpointError(f"{self.index_path}: corrupt index ({exc})") from None
        if header is None:
            raise TFCheckpointError(f"{self.index_path}: no bundle header (a TF V1 checkpoint or another SSTable?)")
        return header, entries

    def __contains__(self, name: object) -> bool:
        return name in self.entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def shard_path(self, shard_id: int) -> str:
        return f"{self.prefix}.data-{shard_id:05d}-of-{self.header.num_shards:05d}"

    def _entry(self, name: str) -> TensorEntry:
        entry = self.entries.get(name)
        if entry is None:
            raise KeyError(f"{name!r} is not a variable of {self.prefix}")
        if entry.sliced:
            raise TFCheckpointError(f"{self.index_path}: {name} is a partitioned (sliced) variable, not supported")
        return entry

    def _dtype(self, entry: TensorEntry) -> np.dtype:
        """On-disk numpy dtype of an entry; raises for dtypes we do not decode."""
        dtype = DTYPES.get(entry.dtype_enum)
        if dtype is None:
            what = DTYPE_NAMES.get(entry.dtype_enum, f"enum {entry.dtype_enum}")
            raise TFCheckpointError(f"{self.index_path}: {entry.name} has unsupported dtype {what}")
        return dtype.newbyteorder(">") if self.header.big_endian else dtype

    def list_variables(self, skip: str | re.Pattern | None = None) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """{name: (shape, dtype of the array `load_variable` returns)}, minus names matching `skip`."""
        pattern = _compile_skip(skip)
        listing = {}
        for name, entry in self.entries.items():
            if pattern is not None and pattern.search(name):
                continue
            dtype = np.dtype(np.float32) if entry.dtype_enum == DT_BFLOAT16 else self._dtype(entry).newbyteorder("=")
            listing[name] = (entry.shape, dtype)
        return listing

    def load_variable(self, name: str) -> np.ndarray:
        """One variable as a writable, native-byte-order numpy array."""
        entry = self._entry(name)
        with self._open_shard(entry.shard_id) as f:
            return self._read(entry, f)

    def load_all(self, skip: str | re.Pattern | None = None) -> dict[str, np.ndarray]:
        """Every variable whose name does not match `skip`, read shard by shard in file order."""
        pattern = _compile_skip(skip)
        wanted = [self._entry(n) for n in self.entries if pattern is None or not pattern.search(n)]
        result = {}
        for shard_id in sorted({e.shard_id for e in wanted}):
            with self._open_shard(shard_id) as f:
                for entry in sorted((e for e in wanted if e.shard_id == shard_id), key=lambda e: e.offset):
                    result[entry.name] = self._read(entry, f)
        return {e.name: result[e.name] for e in wanted}  # index (= name) order, like TF lists them

    def _open_shard(self, shard_id: int):
        path = self.shard_path(shard_id)
        if not 0 <= shard_id < self.header.num_shards:
            raise TFCheckpointError(f"{self.index_path}: shard {shard_id} out of range 0..{self.header.num_shards - 1}")
        try:
            return open(path, "rb")
        except FileNotFoundError:
            raise TFCheckpointError(f"{path}: missing data shard") from None
        except OSError as exc:
            raise TFCheckpointError(f"{path}: cannot read ({exc.strerror})") from None

    def _read(self, entry: TensorEntry, f) -> np.ndarray:
        dtype = self._dtype(entry)
        count = math.prod(entry.shape)  # exact: np.prod would wrap around on a crafted shape
        if min(entry.shape, default=0) < 0 or count * dtype.itemsize != entry.size:
            raise TFCheckpointError(
                f"{self.index_path}: {entry.name} has {entry.size} bytes, expected {count * dtype.itemsize} "
                f"for shape {entry.shape}"
            )
        available = os.fstat(f.fileno()).st_size
        if entry.offset < 0 or entry.size < 0 or entry.offset + entry.size > available:
            # checked before allocating: a corrupt or crafted index may claim terabytes
            raise TFCheckpointError(
                f"{f.name}: truncated, {entry.name} needs bytes {entry.offset}..{entry.offset + entry.size} "
                f"but the file has {available}"
            )
        buf = bytearray(entry.size)
        f.seek(entry.offset)
        if f.readinto(buf) != entry.size:
            raise TFCheckpointError(
                f"{f.name}: truncated, {entry.name} needs bytes {entry.offset}..{entry.offset + entry.size}"
            )
        if self.verify_crc and entry.crc32c is not None and crc32c(buf) != entry.crc32c:
            raise TFCheckpointError(f"{f.name}: crc32c mismatch for {entry.name} (corrupt data)")
        array = np.frombuffer(buf, dtype=dtype, count=count).reshape(entry.shape)
        if entry.dtype_enum == DT_BFLOAT16:
            # bfloat16 is the top half of a float32: widening is exact
            return (array.astype(np.uint32) << np.uint32(16)).view(np.float32)
        return array.astype(dtype.newbyteorder("="), copy=False) if self.header.big_endian else array


def list_variables(
    path: str | os.PathLike, skip: str | re.Pattern | None = None
) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """{name: (shape, numpy dtype)} of a checkpoint (prefix, `.index` file or folder)."""
    return TFCheckpointReader(path).list_variables(skip)


def load_variable(path: str | os.PathLike, name: str, verify_crc: bool = True) -> np.ndarray:
    """One variable of a checkpoint as a numpy array."""
    return TFCheckpointReader(path, verify_crc).load_variable(name)


def load_all(
    path: str | os.PathLike, skip: str | re.Pattern | None = None, verify_crc: bool = True
) -> dict[str, np.ndarray]:
    """All variables of a checkpoint whose names do not match the regex `skip` (re.search)."""
    return TFCheckpointReader(path, verify_crc).load_all(skip)
