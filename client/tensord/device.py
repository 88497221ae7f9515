"""torch's Size and device, and c10's device-string rules (no RPC, no tensors).

``tensord.Size`` is a tuple that prints as torch's; ``tensord.Device`` a string with
torch.device's ``type`` and ``index``; :func:`device_name` reads every form torch's
device arguments take, with c10::Device's errors word for word.
"""

from __future__ import annotations

import builtins
import math
import re
import sys
from typing import Any

from tensord import errors


class Size(tuple[int, ...]):
    """torch.Size: a tuple of ints that prints as ``tensord.Size([2, 3])``."""

    def numel(self) -> builtins.int:
        """Returns the number of elements a tensor with the given size would contain."""
        return math.prod(self)

    def __repr__(self) -> str:
        return f"tensord.Size([{', '.join(str(s) for s in self)}])"

    __str__ = __repr__


class Device(str):
    """torch.device as a string subclass: ``x.device == "cpu"``, ``x.device ==
    torch.device("cpu")`` and ``x.device.type`` all work, and torch's device arguments take
    it (they take strings)."""

    @property
    def type(self) -> str:
        """The device type: ``"cpu"`` or ``"cuda"`` (torch.device.type)."""
        return self.partition(":")[0]

    @property
    def index(self) -> builtins.int | None:  # type: ignore[override]  # torch.device.index
        """The device index (``1`` of ``"cuda:1"``), or None when the string names none."""
        _, sep, index = self.partition(":")
        return builtins.int(index) if sep else None

    def __eq__(self, other: object) -> builtins.bool:
        # a string, and equal both ways to the torch.device of its name (torch.device's ==
        # defers to this one); hashes as the string
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(other, torch.device):
            return str.__eq__(self, str(other))
        return str.__eq__(self, other)

    def __ne__(self, other: object) -> builtins.bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    __hash__ = str.__hash__

    def __repr__(self) -> str:
        if self.index is None:
            return f"device(type='{self.type}')"
        return f"device(type='{self.type}', index={self.index})"


def device_name(device: Any) -> str:
    """torch's device arguments (``"cuda"``, ``"cuda:1"``, ``1``, torch.device) -> ``"cuda:1"``.

    A malformed one raises torch's RuntimeError (c10::Device's parse); a well-formed one
    the server does not have is the server's to refuse (FailedPreconditionError)."""
    if isinstance(device, builtins.int) and not isinstance(device, builtins.bool):
        if device < 0:
            raise errors.TensordRuntimeError("Device index must not be negative")
        return f"cuda:{device}"
    name = str(device)
    if isinstance(device, str) and not isinstance(device, Device):
        check_device_string(name)
    if name == "cuda":
        return "cuda:0"  # torch resolves a bare "cuda" to the current device, 0 here
    if name == "cpu:0":
        return "cpu"
    return name


# c10::Device's device types, in its error text's order
_DEVICE_TYPES = (
    "cpu, cuda, ipu, xpu, mkldnn, opengl, opencl, ideep, hip, ve, fpga, maia, xla, lazy, "
    "vulkan, mps, meta, hpu, mtia, privateuseone"
)
_DEVICE_STRING = re.compile(r"([A-Za-z_]+)(?::(0|[1-9][0-9]*))?")


def check_device_string(name: str) -> None:
    """c10::Device(string)'s checks and texts: a type of letters and underscores, then an
    optional ``:index`` of digits with no leading zero, the type one torch knows."""
    if not name:
        raise errors.TensordRuntimeError("Device string must not be empty")
    parsed = _DEVICE_STRING.fullmatch(name)
    if parsed is None:
        raise errors.TensordRuntimeError(f"Invalid device string: '{name}'")
    index = parsed.group(2)
    if index is not None and builtins.int(index) > _STOI_MAX:
        raise errors.TensordRuntimeError(
            f"Could not parse device index '{index}' in device string '{name}'"
        )
    if parsed.group(1) not in _DEVICE_TYPES.split(", "):
        raise errors.TensordRuntimeError(
            f"Expected one of {_DEVICE_TYPES} device type at start of device string: {name}"
        )


_STOI_MAX = 2**31 - 1  # std::stoi's int
