"""The two KV-cache layouts an engine binds (manifest field `kv_layout`).

Both take the engine's one IO binding and keep the cache on the engine's device. `ensure(total, keep)`
makes room for `total` positions keeping the first `keep`; `bind_past(start)` binds what a call with
`start` cached positions reads and returns the names of the outputs it bound, in binding order;
`after_run(outputs)` takes what it wrote (outputs by name); `truncate(n)` drops all but the first n
positions.
"""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np
import onnxruntime as ort

from edge_sd.manifest import WHOLE_PREFIX, EngineManifest


def _layer_names(m: EngineManifest) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    past = [(m.past_key_template.format(i=i), m.past_value_template.format(i=i)) for i in range(m.num_layers)]
    present = [(m.present_key_template.format(i=i), m.present_value_template.format(i=i))
               for i in range(m.num_layers)]
    return past, present


class ConcatKV:
    """optimum's layout: `present` is past plus the new positions, a fresh tensor every call.

    Cutting back copies the kept positions (the only copy; it goes through host memory).
    """

    def __init__(self, m: EngineManifest, io: Any, device: str, dtype: type, capacity: int):
        self.capacity = m.max_context
        self._io = io
        self._device = device
        self._past, self._present = _layer_names(m)
        empty: np.ndarray = np.zeros((1, m.num_kv_heads, 0, m.head_dim), dtype=dtype)
        self._empty = ort.OrtValue.ortvalue_from_numpy(empty, device)
        self._cache: list[tuple[Any, Any]] = [(self._empty, self._empty)] * m.num_layers

    def ensure(self, total: int, keep: int) -> None:
        pass  # each call allocates its own present tensors

    def bind_past(self, start: int) -> list[str]:
        for (k_name, v_name), (k, v) in zip(self._past, self._cache, strict=True):
            self._io.bind_ortvalue_input(k_name, k)
            self._io.bind_ortvalue_input(v_name, v)
        for k_name, v_name in self._present:
            self._io.bind_output(k_name, self._device)
            self._io.bind_output(v_name, self._device)
        return [name for pair in self._present for name in pair]

    def after_run(self, outputs: dict[str, Any]) -> None:
        self._cache = [(outputs[k], outputs[v]) for k, v in self._present]

    def truncate(self, n: int) -> None:
        if n == 0:
            self._cache = [(self._empty, self._empty)] * len(self._cache)
            return
        self._cache = [
            tuple(ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(x.numpy()[:, :, :n]), self._device)
                  for x in pair)
            for pair in self._cache
        ]


def _mapped_zeros(shape: tuple[int, ...], dtype: type) -> tuple[np.ndarray, mmap.mmap]:
    """Zeros in a mapping of their own, and the mapping: pages are committed only as positions are
    written, and all of it goes back to the system when the tensor is dropped (or a range of it, by
    `SharedKV.release`). np.zeros may instead take them from the heap (once the allocator has raised
    its threshold for mapping, which freeing any large block does), where a regrown cache leaves
    holes that resident memory never gives back."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if hasattr(mmap, "MAP_PRIVATE"):  # private: a released range then reads as zeros and holds no memory
        mapping = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE)
    else:  # Windows
        mapping = mmap.mmap(-1, max(nbytes, 1))
    return np.frombuffer(mapping, dtype=dtype, count=int(np.prod(shape))).reshape(shape), mapping


class SharedKV:
    """The model builder's layout: per layer one buffer of `capacity` positions, bound once as both
    past and present. A call writes its new positions in place; the attention mask's length tells the
    graph how many are valid, so cutting back costs nothing and never leaves the device.
    """

    def __init__(self, m: EngineManifest, io: Any, device: str, dtype: type, capacity: int):
        self._m = m
        self._io = io
        self._device = device
        self._dtype = dtype
        self._past, self._present = _layer_names(m)
        self._host: list[np.ndarray] = []  # CPU: the numpy arrays the OrtValues share memory with
        self._maps: list[mmap.mmap] = []  # ... and the mappings that hold them
        self._values: list[Any] = []
        # Per group of layers `view` binds: where their views start in their buffers, and the
        # OrtValues of those views (bound: kept alive here).
        self._offsets: dict[tuple[int, ...], int] = {}
        self._views: dict[tuple[int, ...], list[Any]] = {}
        self._whole: tuple[int, list[Any]] = (0, [])  # bind_whole's length and OrtValues
        # Positions below this in the buffers of these layers were given back to the system (`release`):
        # they read as zeros, and no forward from a view at or past it reads them.
        self.released = 0
        self._released_layers: set[int] = set()
        self.capacity = 0
        self._allocate(capacity, keep=0)

    def _allocate(self, capacity: int, keep: int) -> None:
        m = self._m
        shape = (1, m.num_kv_heads, capacity, m.head_dim)
        cpu = self._device == "cpu"
        old_host: list[Any] = self._host if cpu else [v.numpy() for v in self._values]
        old_values: list[Any] = self._values
        self._host, self._values = [], []  # the old tensors are held by old_host and old_values alone
        host, maps, values = [], [], []
        for i, (past, present) in enumerate(zip(self._past, self._present, strict=True)):
            # Released positions are zeros in the new buffers too: not copied, so never committed there.
            first = self.released if i in self._released_layers else 0
            for j in range(2):
                k = 2 * i + j
                if cpu or keep:
                    arr, mapping = _mapped_zeros(shape, self._dtype)
                    if keep > first:
                        arr[:, :, first:keep] = old_host[k][:, :, first:keep]
                    value = ort.OrtValue.ortvalue_from_numpy(arr, self._device)
                    if cpu:
                        host.append(arr)  # the OrtValue borrows this memory: keep it alive
                        maps.append(mapping)
                else:
                    value = ort.OrtValue.ortvalue_from_shape_and_type(shape, self._dtype, self._device, 0)
                values.append(value)
                self._io.bind_ortvalue_input(past[j], value)
                self._io.bind_ortvalue_output(present[j], value)
                if old_values:
                    # Bound no more: its memory goes back before the next tensor is copied, so that a
                    # regrowth never holds the whole cache twice.
                    old_host[k] = old_values[k] = None
        self._host, self._maps, self._values, self.capacity = host, maps, values, capacity
        self._offsets, self._views, self._whole = {}, {}, (0, [])  # every layer bound whole again

    def ensure(self, total: int, keep: int) -> None:
        if total > self.capacity:
            # Doubling keeps the number of regrowths (each a copy) logarithmic in the length.
            self._allocate(min(self._m.max_context, max(total, 2 * self.capacity)), keep)

    def view(self, offset: int, layers: list[int]) -> None:
        """Bind these layers' past and present to their buffers from `offset` positions in (0: whole),
        on the CPU, for buffers of one head (from an offset, one block of memory)."""
        group = tuple(layers)
        if offset == self._offsets.get(group, 0):
            return
        views = []
        for i in layers:
            for j in range(2):
                value = self._values[2 * i + j]
                if offset:
                    value = ort.OrtValue.ortvalue_from_numpy(self._host[2 * i + j][:, :, offset:], self._device)
                    views.append(value)
                self._io.bind_ortvalue_input(self._past[i][j], value)
                self._io.bind_ortvalue_output(self._present[i][j], value)
        self._offsets[group], self._views[group] = offset, views

    def bind_whole(self, n: int, layers: list[int]) -> None:
        """Bind these layers' buffers again, as the inputs `whole.<past input>` (manifest
        `grouped_attention`): their first n positions on the CPU (one block of memory: one head),
        the whole buffer elsewhere."""
        if self._device != "cpu":
            n = self.capacity
        if n == self._whole[0]:
            return
        values = []
        for i in layers:
            for j in range(2):
                if self._device == "cpu":
                    value = ort.OrtValue.ortvalue_from_numpy(self._host[2 * i + j][:, :, :n], self._device)
                else:
                    value = self._values[2 * i + j]
                values.append(value)
                self._io.bind_ortvalue_input(WHOLE_PREFIX + self._past[i][j], value)
        self._whole = (n, values)

    def release(self, below: int, layers: list[int]) -> None:
        """Give the memory of positions below `below` in these layers' buffers back to the system (on
        the CPU, for buffers of one head, where positions are consecutive rows): the sliding-window
        layers' positions that every view from `below` on leaves out. Whole pages only; a page
        shared with a kept position stays until a later release covers it."""
        if below <= self.released or not self._maps or not hasattr(mmap, "MADV_DONTNEED"):
            return
        row = self._m.head_dim * np.dtype(self._dtype).itemsize
        # From the page the last release stopped in (pages below it went then) to the last whole page.
        start, end = (n * row // mmap.PAGESIZE * mmap.PAGESIZE for n in (self.released, below))
        if end > start:
            for i in layers:
                for j in range(2):
                    self._maps[2 * i + j].madvise(mmap.MADV_DONTNEED, start, end - start)
        self.released = below
        self._released_layers = set(layers)

    def bind_past(self, start: int) -> list[str]:
        return []  # bound once, in _allocate (a bound OrtValue is not returned again)

    def after_run(self, outputs: dict[str, Any]) -> None:
        pass  # written in place

    def truncate(self, n: int) -> None:
        # Positions past n are simply not covered by the next call's attention mask; emptied, the
        # buffers are written again from the start and nothing in them counts as released.
        if n == 0:
            self.released, self._released_layers = 0, set()


def window_offset(start: int, window: int, granule: int) -> int:
    """Where a forward whose first new position is `start` may have its sliding-window layers read
    their cache from: the largest multiple of `granule` at most start - window - 1 (0 below it, or
    with granule 0). Every row of the forward, and the previous position it reads back, then attends
    within the view, and over more than `window` + 1 positions of it, so that the kernel applies the
    window as it does over the whole cache."""
    if granule <= 0:
        return 0
    return max(0, (start - window - 1) // granule * granule)
