"""Host-device crossings of a stage call: the two sanctioned ways across, and a counter that
finds, on the CPU, what would make a GPU wait for the host.

A stage call may read from the device once, for what the host must know (sampled tokens,
codes, PCM): `fetch`. What the host hands the device goes through `upload`, a copy from pinned
memory that does not wait (on a CUDA device), so the host keeps launching work while earlier
work runs. Anything else that crosses blocks: a value read from a device tensor (`.item()`,
`bool(t)`, `.tolist()`, `.cpu()`), a boolean mask index (a `nonzero` in disguise), a host
tensor (one built from a list or an array) moved or used as an operand where the device works.

`SyncCounter` counts those as they happen, on any device. On the CPU nothing syncs, and every
tensor is on the same device, so it tells host tensors from device ones the way a GPU would
place them: a tensor built from host data (`torch.tensor(list)`, `torch.from_numpy`) or by a
factory given no device is on the host, and so is anything computed from host tensors alone;
the model's weights, what `upload` returns and anything computed from them are on the device.
A 0-dim host tensor is a scalar, which device kernels take by value.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

_local = threading.local()


def _counter() -> SyncCounter | None:
    return getattr(_local, "counter", None)


def upload(values: Sequence | np.ndarray, device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Host values as a tensor on `device`, copied without waiting for the device: from pinned
    memory, whose block the caching host allocator keeps until the copy has run."""
    counter = _counter()
    with _quiet(counter):
        # A copy on the CPU too: the device's tensor never aliases host memory the caller
        # goes on changing (a codec state's frame counts).
        host = torch.tensor(np.asarray(values), dtype=dtype)
        if torch.device(device).type == "cuda":
            out = host.pin_memory().to(device, non_blocking=True)
        else:
            out = host
    if counter is not None:
        counter.uploads += 1
        counter.on_device(out)
    return out


def sent(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor its caller copied to the device itself without waiting, from pinned buffers it
    keeps in a ring (`models.paged_kv`'s per-forward metadata): counted as an upload, and on the
    device from here on."""
    counter = _counter()
    if counter is not None:
        counter.uploads += 1
        counter.on_device(tensor)
    return tensor


def fetch(tensor: torch.Tensor) -> np.ndarray:
    """A device tensor's values on the host: the one read a stage call makes."""
    counter = _counter()
    if counter is not None:
        counter.record("fetch", "fetch")
    with _quiet(counter):
        return tensor.detach().cpu().numpy()


class _quiet:
    """Nothing counted inside (the sanctioned crossings count themselves)."""

    def __init__(self, counter: SyncCounter | None, host: bool = False) -> None:
        self.counter, self.host = counter, host

    def __enter__(self) -> None:
        if self.counter is not None:
            self.counter.quiet += 1
            self.counter.hosting += self.host

    def __exit__(self, *exc) -> None:
        if self.counter is not None:
            self.counter.quiet -= 1
            self.counter.hosting -= self.host


def on_host() -> _quiet:
    """A block of host-only torch work that names the CPU as its device (a feature extractor's):
    what it makes stays on the host, and nothing in it counts."""
    return _quiet(_counter(), host=True)


@dataclass(frozen=True)
class Sync:
    kind: str
    """fetch (the sanctioned read), read (values read from a device tensor), nonzero (a mask
    index or other size read), copy (host data moved to the device, or used there)."""
    op: str
    site: str
    """The innermost frame of this project (models/ or duplex/) that caused it."""
    origin: str
    """The innermost frame outside torch (the library code that synced, if not ours)."""


_ROOT = str(Path(__file__).resolve().parents[1])
_OURS = (f"{_ROOT}/models/", f"{_ROOT}/duplex/")
_TORCH = str(Path(torch.__file__).resolve().parent)


def _where(frame) -> str:
    name = frame.f_code.co_filename
    return f"{'/'.join(name.split('/')[-2:])}:{frame.f_lineno} {frame.f_code.co_name}"


def _site() -> tuple[str, str]:
    """(the innermost frame of this project, the innermost frame outside torch and here)."""
    frame, origin = sys._getframe(2), ""
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(_OURS) and name != __file__:
            return _where(frame), origin or _where(frame)
        if not origin and not name.startswith(_TORCH) and name != __file__:
            origin = _where(frame)
        frame = frame.f_back
    return "?", origin


_READS = {aten._local_scalar_dense.default, aten.equal.default}
_SIZE_READS = {aten.nonzero.default, aten.masked_select.default, aten.argwhere.default,
               aten.unique_consecutive.default, aten._unique2.default,
               aten.repeat_interleave.Tensor}
_INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
             aten._index_put_impl_.default}
_FACTORIES = {"zeros", "ones", "empty", "full", "arange", "range", "linspace", "eye", "rand",
              "randn", "randint", "randperm", "tensor", "as_tensor", "asarray", "from_numpy",
              "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like"}
_READ_METHODS = {"tolist", "numpy", "cpu", "__array__"}


def _tensors(args, kwargs) -> list[torch.Tensor]:
    """The tensors among an op's arguments (aten takes them bare or in flat lists)."""
    found = []
    for arg in (*args, *kwargs.values()):
        if isinstance(arg, torch.Tensor):
            found.append(arg)
        elif isinstance(arg, (list, tuple)):
            found += [a for a in arg if isinstance(a, torch.Tensor)]
    return found


class _Dispatch(TorchDispatchMode):
    def __init__(self, owner: SyncCounter) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        owner = self.owner
        tensors = _tensors(args, kwargs)
        # A 0-dim host tensor (a scalar) is taken by value; any other crosses.
        host = [t for t in tensors if t.dim() and owner.is_host(t)]
        device = [t for t in tensors if not owner.is_host(t)]
        if func is aten.lift_fresh.default or owner.hosting or (tensors and not device):
            # Host data, and host arithmetic (scalars included), stays on the host.
            for t in _tensors((out,), {}):
                owner.on_host(t)
            return out
        if owner.quiet:
            return out
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
            if owner.is_host(dst) and not owner.is_host(src):
                owner.record("read", "copy_ from the device")
            elif not owner.is_host(dst) and host and blocking:
                owner.record("copy", "copy_ of host data")
        elif host:
            owner.record("copy", f"{func} with a host operand")
        elif func in _READS:
            owner.record("read", str(func))
        elif func in _SIZE_READS:
            owner.record("nonzero", str(func))
        elif func in _INDEXING:
            indices = args[1] if len(args) > 1 else ()
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices):
                owner.record("nonzero", f"{func} with a boolean mask")
        return out


class _Function(TorchFunctionMode):
    def __init__(self, owner: SyncCounter) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        owner = self.owner
        name = getattr(func, "__name__", "")
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        crossing = None
        if name in _READ_METHODS and first is not None and not owner.is_host(first):
            crossing = "read"
        elif name in ("to", "cuda") and first is not None and owner.is_host(first) \
                and _names_device(name, args, kwargs):
            crossing = None if kwargs.get("non_blocking") else "copy"
        if crossing and not owner.quiet:
            owner.record(crossing, f"Tensor.{name}")
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out is first and name in ("to", "cuda", "cpu"):
            # On the CPU a move returns the tensor itself; a GPU would return another one.
            out = out.detach()
        if owner.hosting:
            if isinstance(out, torch.Tensor):
                owner.on_host(out)
            return out
        if name in _FACTORIES and "device" in kwargs and kwargs["device"] is not None:
            if name in ("tensor", "as_tensor", "asarray") and not owner.quiet \
                    and _host_data(args[0] if args else kwargs.get("data")):
                owner.record("copy", f"torch.{name} of host data on a device")
            owner.on_device(out)
        elif name in _FACTORIES and not name.endswith("_like") and isinstance(out, torch.Tensor):
            if not (name in ("tensor", "as_tensor", "asarray") and args
                    and isinstance(args[0], torch.Tensor) and not owner.is_host(args[0])):
                owner.on_host(out)
        elif name in ("cpu", "numpy") and isinstance(out, torch.Tensor):
            owner.on_host(out)
        elif name in ("to", "cuda") and first is not None and owner.is_host(first) \
                and isinstance(out, torch.Tensor) and _names_device(name, args, kwargs):
            owner.on_device(out)
        return out


def _names_device(name: str, args, kwargs) -> bool:
    """Whether a `to` names a device (on the CPU every device is the same one, so naming it is
    what would move a host tensor on a GPU)."""
    if name == "cuda" or "device" in kwargs:
        return True
    return any(isinstance(a, (str, torch.device)) for a in args[1:])


def _host_data(data) -> bool:
    """Whether `torch.tensor(data, device=...)` copies host values over (an empty list copies
    nothing; a device tensor is no host data)."""
    if isinstance(data, torch.Tensor):
        return False
    if isinstance(data, (np.ndarray, list, tuple)):
        return len(data) > 0
    return True


class SyncCounter:
    """Counts, while active on this thread, what would make a GPU wait for the host; `syncs`
    lists them, `uploads` counts the non-blocking copies to the device.

        with SyncCounter() as counter:
            adapter.thinker_decode(states)
        assert counter.total <= 1
    """

    def __init__(self) -> None:
        self.syncs: list[Sync] = []
        self.uploads = 0
        self.quiet = 0
        self.hosting = 0
        self._host: dict[int, weakref.ref] = {}
        self._modes = (_Function(self), _Dispatch(self))

    def record(self, kind: str, op: str) -> None:
        self.syncs.append(Sync(kind, op, *_site()))

    def is_host(self, tensor: torch.Tensor) -> bool:
        ref = self._host.get(id(tensor))
        return ref is not None and ref() is tensor

    def on_host(self, tensor: torch.Tensor) -> None:
        key = id(tensor)
        self._host[key] = weakref.ref(tensor, lambda _, key=key: self._host.pop(key, None))

    def on_device(self, tensor: torch.Tensor) -> None:
        self._host.pop(id(tensor), None)

    @property
    def total(self) -> int:
        return len(self.syncs)

    def by_site(self) -> Counter[tuple[str, str, str]]:
        return Counter((s.kind, s.site, s.origin) for s in self.syncs)

    def __enter__(self) -> SyncCounter:
        if _counter() is not None:
            raise RuntimeError("a SyncCounter is already counting on this thread")
        _local.counter = self
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        _local.counter = None
