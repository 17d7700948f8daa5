"""
Safetensors, read and written without a library: an 8-byte little-endian header length, a JSON header
{name: {dtype, shape, data_offsets}}, then the raw little-endian tensors.
"""
import json
import struct
from pathlib import Path

import torch

from errors import CheckpointError

SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool}
DTYPE_NAMES = {v: k for k, v in SAFETENSORS_DTYPES.items()}


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    raw = path.read_bytes()
    try:
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + n])
        header.pop("__metadata__", None)
        tensors = {}
        for name, info in header.items():
            dtype, (begin, end) = SAFETENSORS_DTYPES[info["dtype"]], info["data_offsets"]
            numel = 1
            for d in info["shape"]:
                numel *= d
            if not 0 <= begin <= end <= len(raw) - 8 - n or end - begin != numel * dtype.itemsize:
                raise ValueError(f"tensor {name}: offsets {begin}..{end} do not fit its shape or the file")
            data = bytearray(raw[8 + n + begin : 8 + n + end])  # a copy: the tensor owns its memory
            tensors[name] = torch.frombuffer(data, dtype=dtype).reshape(info["shape"]) if numel else \
                torch.empty(info["shape"], dtype=dtype)
    except (struct.error, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        detail = f"unknown dtype {e}" if isinstance(e, KeyError) else e
        raise CheckpointError(f"{path} is not a readable safetensors file: {detail}") from None
    return tensors


def write_safetensors(tensors: dict[str, torch.Tensor], path: Path):
    header, offset = {"__metadata__": {"format": "pt"}}, 0  # transformers reads "pt" as PyTorch's layout
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the tensors start 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for t in tensors.values():
            f.write(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
