"""The device table: which devices this server owns, each with its own CachingPool.

A device is named as torch names it ("cpu", "cuda:0") and configured on the
command line as ``NAME[=LIMIT]`` (``cpu=8GiB``, ``cuda:0=40GiB``).  A backend
is chosen by the device type through :data:`BACKEND_FACTORIES`, so the CUDA
backend plugs in as one more row when it lands.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from tensord.errors import FailedPreconditionError

from tensord_server.devices.memory import Backend
from tensord_server.devices.shm import SharedHostBackend
from tensord_server.pool import CachingPool

DEFAULT_DEVICE = "cpu"

# Binary and decimal units a LIMIT may carry; a bare number is bytes.
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")
_DEVICE_RE = re.compile(r"^(cpu|cuda)(?::(\d+))?$")


def parse_bytes(text: str) -> int:
    """``"8GiB"`` -> 8589934592; ``"1.5GB"``, ``"512MiB"``, ``"1024"`` likewise."""
    match = _SIZE_RE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"invalid size {text!r}: expected a number with an optional unit like 8GiB"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def canonical_device(name: str) -> str:
    """torch's device string, canonical: "" -> "cpu", "cuda" -> "cuda:0", "cpu:0" -> "cpu"."""
    name = name.strip() or DEFAULT_DEVICE
    match = _DEVICE_RE.match(name)
    if match is None:
        raise FailedPreconditionError(f"unknown device {name!r}: expected cpu or cuda:N")
    kind, index = match.groups()
    if kind == "cpu":
        return "cpu"
    return f"cuda:{int(index or 0)}"


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """One ``--device`` argument: a device name and an optional pool capacity in bytes.

    ``pinned`` (cpu only): the host pool's memory is page-locked, which a server
    owning a GPU wants for one-DMA cpu<->cuda copies (see :func:`resolve_specs`).
    """

    name: str
    capacity: int | None = None
    pinned: bool = False


def parse_device_spec(text: str) -> DeviceSpec:
    """``"cpu"``, ``"cpu=8GiB"``, ``"cuda:0=40GiB"`` -> DeviceSpec."""
    name, _, limit = text.partition("=")
    try:
        device = canonical_device(name)
    except FailedPreconditionError as exc:
        raise ValueError(str(exc)) from None
    return DeviceSpec(device, parse_bytes(limit) if limit else None)


def gpu_count() -> int:
    """The GPUs CuPy sees; 0 without CuPy (never imports it then) or without a working driver."""
    if importlib.util.find_spec("cupy") is None:
        return 0
    try:
        import cupy  # deferred: CuPy is an optional extra

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no driver, no libcuda: CuPy raises several kinds of error here
        return 0


def resolve_specs(
    devices: Iterable[str] | None = None, *, pinned_host: bool = True
) -> list[DeviceSpec]:
    """The devices ``tensord serve`` owns: the ``--device`` arguments, or by default
    ``cpu`` plus every GPU CuPy sees.  With a GPU among them the cpu pool is
    pinned unless ``pinned_host`` is false (``--no-pinned-host``)."""
    if devices:
        specs = [parse_device_spec(d) for d in devices]
    else:
        specs = [DeviceSpec(DEFAULT_DEVICE)]
        specs += [DeviceSpec(f"cuda:{i}") for i in range(gpu_count())]
    has_gpu = any(s.name.startswith("cuda") for s in specs)
    # without CuPy the cuda device itself fails with the clear error; the cpu pool stays pageable
    if pinned_host and has_gpu and importlib.util.find_spec("cupy") is not None:
        specs = [dataclasses.replace(s, pinned=True) if s.name == "cpu" else s for s in specs]
    return specs


def _host_backend(spec: DeviceSpec) -> Backend:
    if spec.pinned:
        from tensord_server.devices.cuda import PinnedHostBackend

        return PinnedHostBackend(device=spec.name)
    # every segment a memfd that same-host clients may map (see shm.py, exports.py)
    return SharedHostBackend(device=spec.name)


def _cuda_backend(spec: DeviceSpec) -> Backend:
    # CuPy is an optional extra: without it, say what to install instead of an ImportError.
    if importlib.util.find_spec("cupy") is None:
        raise FailedPreconditionError(
            f"device {spec.name} needs CuPy: pip install 'tensord[cuda12]' (or [cuda13])"
        )
    import cupy

    from tensord_server.devices.cuda import CudaBackend

    try:
        backend: Backend = CudaBackend(device=spec.name, total_bytes=spec.capacity)
    except ValueError as exc:  # no such GPU on this machine
        raise FailedPreconditionError(str(exc)) from None
    except cupy.cuda.runtime.CUDARuntimeError as exc:  # CuPy without a usable driver or GPU
        raise FailedPreconditionError(
            f"device {spec.name}: CUDA is not usable on this machine ({exc})"
        ) from None
    return backend


# Device type -> backend factory.  A new device type is one more row.
BACKEND_FACTORIES: dict[str, Callable[[DeviceSpec], Backend]] = {
    "cpu": _host_backend,
    "cuda": _cuda_backend,
}

_DESCRIPTIONS = {"cpu": "host memory"}


@dataclass(frozen=True, slots=True)
class Device:
    """A device the server owns: its name, backend and pool."""

    name: str
    pool: CachingPool
    description: str

    @property
    def backend(self) -> Backend:
        return self.pool.backend

    @property
    def xp(self) -> Any:
        """The backend's array module (numpy, cupy): what the copy kernels compute with."""
        return self.pool.backend.xp

    def activate(self) -> contextlib.AbstractContextManager[Any]:
        """The context kernels on this device run in: nothing for host memory; for a GPU
        its CUDA device and the backend's one server stream (whose order makes reusing
        freed blocks safe, see cuda_backend.py)."""
        backend = self.pool.backend
        stream = getattr(backend, "stream", None)
        if stream is None:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(self.xp.cuda.Device(backend.index))  # type: ignore[attr-defined]
        stack.enter_context(stream)
        return stack


def activate(*devices: Device) -> contextlib.AbstractContextManager[Any]:
    """Every distinct device's context at once (a cross-device copy needs both)."""
    if len(devices) == 1:  # most ops: that device's own context, without a stack around it
        return devices[0].activate()
    stack = contextlib.ExitStack()
    seen: set[str] = set()
    for device in devices:
        if device.name not in seen:
            seen.add(device.name)
            stack.enter_context(device.activate())
    return stack


def open_device(spec: DeviceSpec) -> Device:
    kind = spec.name.partition(":")[0]
    backend = BACKEND_FACTORIES[kind](spec)
    pool = CachingPool(backend, capacity=spec.capacity)
    description = getattr(backend, "description", _DESCRIPTIONS.get(kind, spec.name))
    return Device(spec.name, pool, description)


class DeviceTable:
    """The devices of one server, by canonical name.  Immutable after construction."""

    def __init__(self, specs: Iterable[DeviceSpec | str]) -> None:
        self._devices: dict[str, Device] = {}
        for spec in specs:
            spec = parse_device_spec(spec) if isinstance(spec, str) else spec
            if spec.name in self._devices:
                raise ValueError(f"device {spec.name} given twice")
            self._devices[spec.name] = open_device(spec)
        if not self._devices:
            raise ValueError("a server needs at least one device")

    def get(self, name: str) -> Device:
        """The device a request names ("" means cpu); FailedPreconditionError if not here."""
        canonical = canonical_device(name)
        try:
            return self._devices[canonical]
        except KeyError:
            have = ", ".join(self._devices)
            raise FailedPreconditionError(
                f"device {canonical} is not present on this server (it has: {have})"
            ) from None

    def __iter__(self) -> Iterator[Device]:
        return iter(self._devices.values())

    def __len__(self) -> int:
        return len(self._devices)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._devices)
