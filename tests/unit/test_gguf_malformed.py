"""Malformed GGUF files: each defect is named in one GGUFFormatError, found before any large
allocation or long loop. Small files are built byte by byte here; the fuzz test mutates the headers
of the two real models.

A long fuzz run is one command:
    FOLIO_FUZZ_EXAMPLES=20000 .venv/bin/pytest tests/unit/test_gguf_malformed.py -k fuzz
"""

from __future__ import annotations

import os
import struct
import time
import tracemalloc
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from folio.loaders.gguf_file import GGUFFile, GGUFFormatError


def u32(value: int) -> bytes:
    return struct.pack("<I", value)


def u64(value: int) -> bytes:
    return struct.pack("<Q", value)


def gstr(text: str) -> bytes:
    raw = text.encode()
    return u64(len(raw)) + raw


def kv(key: str, vtype: int, payload: bytes) -> bytes:
    return gstr(key) + u32(vtype) + payload


def tensor_info(name: str, dims: list[int], ggml_type: int, offset: int) -> bytes:
    return gstr(name) + u32(len(dims)) + b"".join(u64(d) for d in dims) + u32(ggml_type) + u64(offset)


ARCH = kv("general.architecture", V.STRING, gstr("llama"))
# Two tensors: f32 [2, 8] at offset 0 (64 bytes), one Q8_0 block of 32 at offset 64 (34 bytes).
TENSORS = [tensor_info("a.weight", [8, 2], Q.F32, 0), tensor_info("b.weight", [32], Q.Q8_0, 64)]
DATA = bytes(range(98))


def build(kvs: list[bytes] | None = None, infos: list[bytes] | None = None, data: bytes = DATA,
          version: int = 3, tensor_count: int | None = None, kv_count: int | None = None,
          alignment: int = 32) -> bytes:  # fmt: skip
    """A GGUF file from raw parts; the counts default to the parts' own."""
    kvs = [ARCH] if kvs is None else kvs
    infos = TENSORS if infos is None else infos
    head = b"GGUF" + u32(version) + u64(len(infos) if tensor_count is None else tensor_count)
    head += u64(len(kvs) if kv_count is None else kv_count) + b"".join(kvs) + b"".join(infos)
    return head + bytes(-len(head) % alignment) + data


def expect_error(tmp_path: Path, content: bytes, pattern: str) -> str:
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(GGUFFormatError, match=pattern) as info:
        GGUFFile(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ") and "\n" not in message
    return message


def test_the_builder_makes_a_valid_file(tmp_path: Path) -> None:
    path = tmp_path / "good.gguf"
    path.write_bytes(build())
    gguf = GGUFFile(path)
    assert gguf.architecture == "llama" and list(gguf.tensors) == ["a.weight", "b.weight"]
    assert gguf.tensors["a.weight"].shape == (2, 8) and bytes(gguf.tensors["a.weight"].data) == DATA[:64]
    assert gguf.tensors["b.weight"].ggml_type == Q.Q8_0 and bytes(gguf.tensors["b.weight"].data) == DATA[64:]
    path.write_bytes(build(infos=[], data=b""))  # metadata only, like a vocabulary file
    assert GGUFFile(path).tensors == {}


# -- the file as a whole ---------------------------------------------------------------------------


def test_empty_file(tmp_path: Path) -> None:
    expect_error(tmp_path, b"", r"empty file \(0 bytes\)")


def test_file_shorter_than_the_header(tmp_path: Path) -> None:
    expect_error(tmp_path, build()[:10], "10 bytes, shorter than the 24-byte GGUF header")
    expect_error(tmp_path, b"GGU", "shorter than the 24-byte GGUF header")
    expect_error(tmp_path, b"PK\x03", r"not a GGUF file \(bad magic\)")


def test_bad_magic(tmp_path: Path) -> None:
    expect_error(tmp_path, b"GGML" + build()[4:], r"not a GGUF file \(bad magic\)")


@pytest.mark.parametrize("version", [0, 1, 4, 0x03000000])
def test_unsupported_version(tmp_path: Path, version: int) -> None:
    message = expect_error(tmp_path, build(version=version), f"GGUF version {version}.* is not supported")
    assert ("big-endian" in message) == (version == 0x03000000)


def test_truncated_inside_the_metadata(tmp_path: Path) -> None:
    name = kv("general.name", V.STRING, gstr("x" * 200))
    file_type = kv("general.file_type", V.UINT32, u32(0))
    cut = 24 + len(ARCH) + len(name) + len(gstr("general.file_type")) + 2  # inside its value type
    content = build([ARCH, name, file_type])[:cut]
    expect_error(tmp_path, content, f"truncated: the file ends at byte {cut} inside metadata key 'general.file_type'")
    cut = 24 + len(ARCH) - 2  # inside the architecture's name
    content = build(infos=[], data=b"")[:cut]
    expect_error(tmp_path, content, "a string of 5 bytes in metadata key 'general.architecture' runs past the end")


def test_truncated_inside_the_tensor_directory(tmp_path: Path) -> None:
    cut = 24 + len(ARCH) + len(TENSORS[0]) + len(gstr("b.weight")) + 6  # inside its dims
    expect_error(tmp_path, build()[:cut], "truncated: the file ends at byte .* inside tensor 'b.weight'")


def test_truncated_tensor_data(tmp_path: Path) -> None:
    expect_error(tmp_path, build()[:-1], r"tensor 'b.weight' \(bytes .*\) runs past the end of the file .*truncated")


# -- counts the file could not hold ----------------------------------------------------------------


@pytest.mark.parametrize("count", [2**16, 2**32 - 1, 2**63 - 1, 2**64 - 1])
def test_absurd_metadata_count(tmp_path: Path, count: int) -> None:
    expect_error(tmp_path, build(kv_count=count), f"the metadata count is {count}, more than the .* bytes left")


@pytest.mark.parametrize("count", [2**16, 2**64 - 1])
def test_absurd_tensor_count(tmp_path: Path, count: int) -> None:
    expect_error(tmp_path, build(tensor_count=count), f"the tensor count is {count}, more than")


def test_tensor_count_checked_against_what_follows_the_metadata(tmp_path: Path) -> None:
    # Plausible against the whole file, but not against the bytes left once a big array is read.
    big = kv("filler", V.ARRAY, u32(V.UINT8) + u64(4000) + bytes(4000))
    expect_error(tmp_path, build([ARCH, big], tensor_count=100), "the tensor count is 100, more than")


@pytest.mark.parametrize(("elem_type", "count"), [(V.STRING, 2**40), (V.STRING, 2**64 - 1), (V.UINT32, 2**62),
                                                  (V.ARRAY, 2**50)])  # fmt: skip
def test_absurd_array_length(tmp_path: Path, elem_type: int, count: int) -> None:
    tokens = kv("tokenizer.ggml.tokens", V.ARRAY, u32(elem_type) + u64(count) + gstr("a"))
    pattern = f"the length of an array in metadata key 'tokenizer.ggml.tokens' is {count}, more than"
    expect_error(tmp_path, build([ARCH, tokens]), pattern)


@pytest.mark.parametrize("length", [10**6, 2**63 - 1, 2**64 - 1])
def test_string_longer_than_the_file(tmp_path: Path, length: int) -> None:
    expect_error(tmp_path, build([u64(length) + b"general.name"]), f"a string of {length} bytes in metadata entry 0")
    tokens = kv("tokenizer.ggml.tokens", V.ARRAY, u32(V.STRING) + u64(2) + gstr("a") + u64(length) + b"b")
    expect_error(tmp_path, build([tokens]), f"a string of {length} bytes in metadata key 'tokenizer.ggml.tokens'")


def test_deeply_nested_arrays(tmp_path: Path) -> None:
    def nested(depth: int) -> bytes:  # an array of one array of ... of one uint8
        return (u32(V.ARRAY) + u64(1)) * (depth - 1) + u32(V.UINT8) + u64(1) + b"\x07"

    path = tmp_path / "nested.gguf"
    path.write_bytes(build([ARCH, kv("deep", V.ARRAY, nested(8))]))
    value = GGUFFile(path).metadata["deep"]
    for _ in range(7):
        (value,) = value
    assert value.tolist() == [7]
    expect_error(tmp_path, build([ARCH, kv("deep", V.ARRAY, nested(9))]), "arrays nested more than 8 deep in")
    # Far deeper than Python's recursion limit: the bound stops it long before.
    expect_error(tmp_path, build([ARCH, kv("deep", V.ARRAY, nested(5000))]), "arrays nested more than 8 deep")


# -- types and values ------------------------------------------------------------------------------


def test_unknown_value_type(tmp_path: Path) -> None:
    expect_error(tmp_path, build([ARCH, kv("odd", 99, u32(0))]), "unknown value type 99 in metadata key 'odd'")
    array = kv("odd", V.ARRAY, u32(2**32 - 1) + u64(1) + u32(0))
    expect_error(tmp_path, build([ARCH, array]), f"unknown value type {2**32 - 1} in metadata key 'odd'")


def test_duplicate_metadata_key(tmp_path: Path) -> None:
    expect_error(tmp_path, build([ARCH, ARCH]), "duplicate metadata key 'general.architecture'")


@pytest.mark.parametrize(
    "value",
    [
        kv("general.alignment", V.UINT32, u32(0)),
        kv("general.alignment", V.UINT32, u32(48)),
        kv("general.alignment", V.INT32, struct.pack("<i", -32)),
        kv("general.alignment", V.FLOAT32, struct.pack("<f", 32.0)),
        kv("general.alignment", V.BOOL, b"\x01"),
        kv("general.alignment", V.STRING, gstr("32")),
        kv("general.alignment", V.ARRAY, u32(V.UINT32) + u64(1) + u32(32)),
    ],
)
def test_bad_alignment(tmp_path: Path, value: bytes) -> None:
    expect_error(tmp_path, build([ARCH, value]), "general.alignment is .*; it must be a power of two")


def test_other_alignment_is_honoured(tmp_path: Path) -> None:
    path = tmp_path / "aligned.gguf"
    infos = [tensor_info("a.weight", [8, 2], Q.F32, 0), tensor_info("b.weight", [32], Q.Q8_0, 64)]
    path.write_bytes(build([ARCH, kv("general.alignment", V.UINT32, u32(64))], infos, alignment=64))
    assert bytes(GGUFFile(path).tensors["b.weight"].data) == DATA[64:]


# -- the tensor directory --------------------------------------------------------------------------


def with_tensor(tmp_path: Path, info: bytes, pattern: str, data: bytes = DATA) -> None:
    expect_error(tmp_path, build(infos=[TENSORS[0], info], data=data), pattern)


def test_too_many_dimensions(tmp_path: Path) -> None:
    with_tensor(tmp_path, tensor_info("b.weight", [32, 1, 1, 1, 1], Q.Q8_0, 64), "'b.weight' has 5 dimensions")
    with_tensor(tmp_path, gstr("b.weight") + u32(2**32 - 1), f"has {2**32 - 1} dimensions; GGUF allows at most 4")


def test_negative_dimension(tmp_path: Path) -> None:
    with_tensor(tmp_path, tensor_info("b.weight", [32, 2**64 - 1], Q.Q8_0, 64), "'b.weight' has a negative dimension")


def test_element_count_overflow(tmp_path: Path) -> None:
    dims = [2**32, 2**31, 2]  # each fits int64, the product does not
    with_tensor(tmp_path, tensor_info("b.weight", dims, Q.F32, 64), "'b.weight' has dimensions .* overflows int64")


@pytest.mark.parametrize("ggml_type", [4, 5, 99, 2**32 - 1])  # 4 and 5 were Q4_2/Q4_3, long removed
def test_unknown_ggml_type(tmp_path: Path, ggml_type: int) -> None:
    with_tensor(tmp_path, tensor_info("b.weight", [32], ggml_type, 64), f"'b.weight' has unknown ggml type {ggml_type}")


def test_rows_not_a_multiple_of_the_block_size(tmp_path: Path) -> None:
    pattern = "'b.weight' has rows of 33 elements, not a multiple of the Q8_0 block size 32"
    with_tensor(tmp_path, tensor_info("b.weight", [33], Q.Q8_0, 64), pattern)
    with_tensor(tmp_path, tensor_info("b.weight", [16, 2], Q.Q8_0, 64), "rows of 16 elements")  # 32 in all


def test_misaligned_offset(tmp_path: Path) -> None:
    with_tensor(tmp_path, tensor_info("b.weight", [32], Q.Q8_0, 65), "'b.weight' has offset 65, not a multiple of 32")


def test_overlapping_tensors(tmp_path: Path) -> None:
    with_tensor(tmp_path, tensor_info("b.weight", [32], Q.Q8_0, 32), "'b.weight' overlaps tensor 'a.weight'")


@pytest.mark.parametrize("offset", [2**64 - 32, 2**63, 2**32])
def test_offset_past_the_end(tmp_path: Path, offset: int) -> None:
    with_tensor(tmp_path, tensor_info("b.weight", [32], Q.Q8_0, offset), "'b.weight' .* runs past the end of the file")


def test_huge_tensor_past_the_end(tmp_path: Path) -> None:
    dims = [2**31, 2**31]  # fits int64 elements, but not this file
    with_tensor(tmp_path, tensor_info("b.weight", dims, Q.F32, 64), "'b.weight' .* runs past the end of the file")


def test_duplicate_tensor_name(tmp_path: Path) -> None:
    with_tensor(tmp_path, tensor_info("a.weight", [32], Q.Q8_0, 64), "duplicate tensor name 'a.weight'")


def test_long_garbage_names_stay_on_one_short_line(tmp_path: Path) -> None:
    name = "x\n" * 5000
    message = expect_error(tmp_path, build([ARCH, kv(name, 77, b"")]), "unknown value type 77 in metadata key")
    assert len(message) < len(str(tmp_path)) + 200


# -- fuzzing the real headers ----------------------------------------------------------------------

EXTREMES = [0, 1, 2, 3, 4, 8, 9, 13, 32, 0x7F, 0xFF, 0xFFFF, 2**31 - 1, 2**32 - 1, 2**32, 2**63 - 1, 2**64 - 1]
MEMORY_HEADROOM = 64 * 2**20
ARRAY_KEEP = 600  # metadata arrays are cut to this many entries; see real_header()
DATA_KEPT = 4096  # bytes of tensor data kept after the header


def _value_end(header: bytes, pos: int, vtype: int) -> int:
    """The end of a string or scalar value starting at pos."""
    if vtype == V.STRING:
        return pos + 8 + struct.unpack_from("<Q", header, pos)[0]
    return pos + {V.UINT8: 1, V.INT8: 1, V.BOOL: 1, V.UINT16: 2, V.INT16: 2, V.UINT32: 4, V.INT32: 4,
                  V.FLOAT32: 4, V.UINT64: 8, V.INT64: 8, V.FLOAT64: 8}[V(vtype)]  # fmt: skip


def real_header(path: Path, keep: int = ARRAY_KEEP) -> tuple[bytes, int]:
    """The file's header (magic to the end of the tensor directory) with every metadata array cut to
    its first `keep` items, and the number of bytes after the header in the real file. Under
    tracemalloc a whole 262k-token vocabulary takes seconds to parse; cut, every structure of the
    file is still there and the mutations land on structure more often than on token text."""
    with open(path, "rb") as f:
        header = f.read(16 << 20)
    _, _, tensor_count, kv_count = struct.unpack_from("<4sIQQ", header, 0)
    out, pos = bytearray(header[:24]), 24
    for _ in range(kv_count):
        key_end = pos + 8 + struct.unpack_from("<Q", header, pos)[0]
        (vtype,) = struct.unpack_from("<I", header, key_end)
        if vtype != V.ARRAY:
            end = _value_end(header, key_end + 4, vtype)
            out += header[pos:end]
            pos = end
            continue
        elem_type, count = struct.unpack_from("<IQ", header, key_end + 4)
        start = item = kept_end = key_end + 16
        for index in range(count):
            item = _value_end(header, item, elem_type)
            kept_end = item if index < keep else kept_end
        kept = struct.pack("<IQ", elem_type, min(count, keep)) + header[start:kept_end]
        out += header[pos : key_end + 4] + kept
        pos = item
    for _ in range(tensor_count):
        name_end = pos + 8 + struct.unpack_from("<Q", header, pos)[0]
        (n_dims,) = struct.unpack_from("<I", header, name_end)
        end = name_end + 4 + 8 * n_dims + 12
        out += header[pos:end]
        pos = end
    return bytes(out), path.stat().st_size - pos


def apply(header: bytes, edits: list[tuple[int, int, int]], cut: int | None) -> bytes:
    """Each edit (offset, width, value) writes `value` little-endian over `width` bytes, or, with
    width 0, flips bit `value % 8` of one byte; `cut` truncates the result."""
    data = bytearray(header)
    for offset, width, value in edits:
        offset %= len(data)
        if width == 0:
            data[offset] ^= 1 << (value % 8)
        else:
            data[offset : offset + width] = (value % (1 << (8 * width))).to_bytes(width, "little")[: len(data) - offset]
    return bytes(data if cut is None else data[:cut])


edits = st.lists(
    st.tuples(
        st.one_of(st.integers(0, 64), st.integers(0, 2**32)),  # the fixed header often, anywhere else too
        st.sampled_from([0, 1, 2, 4, 8]),
        st.one_of(st.sampled_from(EXTREMES), st.integers(0, 2**64 - 1)),
    ),
    max_size=6,
)


def test_the_cut_real_headers_are_valid(smollm2_gguf: Path, gemma3_gguf: Path, tmp_path: Path) -> None:
    """The fuzz test's starting points parse when given their real data size (sparse: free on disk)."""
    for source in (smollm2_gguf, gemma3_gguf):
        header, data_bytes = real_header(source)
        path = tmp_path / source.name
        path.write_bytes(header)
        os.truncate(path, len(header) + data_bytes + 32)  # room for the shorter header's new padding
        gguf, real = GGUFFile(path), GGUFFile(source)
        assert gguf.metadata.keys() == real.metadata.keys() and len(gguf.metadata["tokenizer.ggml.tokens"]) == 600
        assert [(t.name, t.shape, t.ggml_type) for t in gguf.tensors.values()] == [
            (t.name, t.shape, t.ggml_type) for t in real.tensors.values()
        ]


@pytest.mark.parametrize("fixture", ["smollm2_gguf", "gemma3_gguf"])
def test_fuzz_real_headers(fixture: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """Mutated real headers (plus a little of the tensor data) either parse or raise GGUFFormatError,
    in under 2 s and within 64 MiB of memory beyond the file's own size."""
    source = request.getfixturevalue(fixture)
    header, _ = real_header(source)
    with open(source, "rb") as f:  # the header is shorter now, so this lands a little off: as good
        f.seek(len(header))
        header += f.read(DATA_KEPT)
    path = tmp_path / "fuzz.gguf"

    @settings(max_examples=int(os.environ.get("FOLIO_FUZZ_EXAMPLES", "150")), deadline=2000, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip
    @given(edits, st.one_of(st.none(), st.integers(0, len(header))))
    def parse_mutated(edit_list: list[tuple[int, int, int]], cut: int | None) -> None:
        content = apply(header, edit_list, cut)
        path.write_bytes(content)
        tracemalloc.start()
        try:
            start = time.perf_counter()
            try:
                gguf = GGUFFile(path)
                gguf.quantization_summary()
                del gguf
            except GGUFFormatError as exc:
                message = str(exc)
                assert message.startswith(f"{path}: ") and "\n" not in message and len(message) < 1000
            assert time.perf_counter() - start < 2.0
            assert tracemalloc.get_traced_memory()[1] < len(content) + MEMORY_HEADROOM
        finally:
            tracemalloc.stop()

    parse_mutated()
