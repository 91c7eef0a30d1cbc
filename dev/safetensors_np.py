"""A small numpy reader/writer for safetensors files (the pip package is not needed).

Layout: u64 little-endian N | N bytes of JSON header | data buffer. The header maps each tensor
name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative to the data buffer)
and may hold "__metadata__": {str: str}. The reader checks that the tensors tile the buffer
exactly, like the reference implementation; the writer pads the header with spaces to 8 bytes
and orders tensors by dtype size (largest first), as model/safetensors.h does.
"""
import json
import struct

import numpy as np

DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),  # raw bits; load() widens it to float32
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I8": np.dtype("i1"), "U8": np.dtype("u1"),
}
NAMES = {np.dtype("<f8"): "F64", np.dtype("<f4"): "F32", np.dtype("<f2"): "F16",
         np.dtype("<i8"): "I64", np.dtype("<i4"): "I32", np.dtype("i1"): "I8", np.dtype("u1"): "U8"}


def load(path):
    """Returns (tensors: dict name -> np.ndarray, metadata: dict str -> str)."""
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 8:
        raise ValueError(f"{path}: {len(raw)} bytes, too short for the 8-byte header length")
    (n,) = struct.unpack("<Q", raw[:8])
    if 8 + n > len(raw):
        raise ValueError(f"{path}: header length {n} runs past the end of the file ({len(raw)} bytes)")
    header = json.loads(raw[8:8 + n].decode("utf-8"))
    data = memoryview(raw)[8 + n:]
    metadata = header.pop("__metadata__", {}) or {}
    tensors, spans = {}, []
    for name, info in header.items():
        if info["dtype"] not in DTYPES:
            raise ValueError(f"{path}: tensor {name}: unknown dtype {info['dtype']}")
        dtype = DTYPES[info["dtype"]]
        shape = tuple(int(d) for d in info["shape"])
        begin, end = (int(o) for o in info["data_offsets"])
        count = int(np.prod(shape, dtype=np.int64))
        if end - begin != count * dtype.itemsize or end > len(data) or begin < 0:
            raise ValueError(f"{path}: tensor {name}: offsets [{begin}, {end}) do not fit shape "
                             f"{list(shape)} of {info['dtype']} in a {len(data)}-byte buffer")
        a = np.frombuffer(data[begin:end], dtype=dtype).reshape(shape).copy()
        if info["dtype"] == "BF16":
            a = (a.astype(np.uint32) << 16).view(np.float32)
        tensors[name] = a
        spans.append((begin, end, name))
    position = 0
    for begin, end, name in sorted(spans):
        if begin != position:
            raise ValueError(f"{path}: tensor {name} starts at {begin}, expected {position} (gap or overlap)")
        position = end
    if position != len(data):
        raise ValueError(f"{path}: tensors end at {position} but the data buffer holds {len(data)} bytes")
    return tensors, metadata


def save(path, tensors, metadata=None):
    """Writes dict name -> np.ndarray (F64/F32/F16/I64/I32/I8/U8) with optional str metadata."""
    arrays = {name: np.ascontiguousarray(a) for name, a in tensors.items()}
    for name, a in arrays.items():
        if a.dtype.newbyteorder("<") not in NAMES:
            raise ValueError(f"tensor {name}: dtype {a.dtype} has no safetensors name here")
    order = sorted(arrays, key=lambda name: -arrays[name].dtype.itemsize)  # stable: keeps insertion order
    header, offset = {}, 0
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for name in order:
        a = arrays[name]
        header[name] = {"dtype": NAMES[a.dtype.newbyteorder("<")], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name in order:
            f.write(arrays[name].astype(arrays[name].dtype.newbyteorder("<"), copy=False).tobytes())
