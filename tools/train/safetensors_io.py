"""Reading and writing safetensors files (no such package in Debian 12; the format is a u64
header length, a JSON header and the raw little-endian tensor bytes)."""
import json
import struct

import numpy as np
import torch

_DTYPES = {"F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32}


def load(path):
    """name -> torch tensor (BF16 is widened to float32)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
        data = f.read()
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        raw = data[begin:end]
        if info["dtype"] == "BF16":
            bits = np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16
            array = bits.view(np.float32)
        else:
            array = np.frombuffer(raw, dtype=_DTYPES[info["dtype"]])
        tensors[name] = torch.from_numpy(array.copy().reshape(info["shape"]))
    return tensors


def metadata(path):
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(length)).get("__metadata__", {})


def save(path, tensors, meta=None):
    """Writes float32 tensors, in name order."""
    header, chunks, offset = {}, [], 0
    if meta:
        header["__metadata__"] = {k: str(v) for k, v in meta.items()}
    for name in sorted(tensors):
        array = tensors[name].detach().to(torch.float32).cpu().contiguous().numpy()
        raw = array.tobytes()
        header[name] = {"dtype": "F32", "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for raw in chunks:
            f.write(raw)
