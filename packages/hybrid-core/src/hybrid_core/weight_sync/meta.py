"""What a receiver must know of each tensor before the bytes arrive: name, dtype and shape."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import ConfigError


@dataclass(frozen=True)
class TensorMeta:
    """Plain and picklable (it travels through Ray); ``dtype`` is the torch name without ``torch.``, e.g. "bfloat16"."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        _ = self.torch_dtype  # validates the name early (the property raises)

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorMeta:
        return cls(name, dtype_name(tensor.dtype), tuple(tensor.shape))

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ConfigError(
                "TensorMeta.dtype",
                f"{self.dtype!r} (tensor {self.name!r}) is not a torch dtype name.",
                'Use names such as "bfloat16", "float32" (TensorMeta.of(name, tensor) does this).',
            )
        return dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        itemsize: int = self.torch_dtype.itemsize
        return self.numel * itemsize


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
