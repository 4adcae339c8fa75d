"""Token-id batches on the host: each tensor copied off the device once, samples as flat spans.

A batch arrives as a padded 2-D tensor (with an attention mask, left or right padding) or as a
list of 1-D tensors / lists of ints. Either way it becomes one private, compact numpy array per
field (int32 ids, bool masks) plus, per sample, a ``(start, length)`` into it: the training thread
then only takes views, never a per-sample device copy. torch is imported only for torch inputs;
objects with ``.to_local()`` (AReaL's ``RTensor``) are localized first.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Layout", "host_array", "host_column", "layout_of", "field_layout", "is_tensor"]


def _is_torch(x: Any) -> bool:
    torch = sys.modules.get("torch")  # a torch tensor exists only if torch was imported
    return torch is not None and isinstance(x, torch.Tensor)


def is_tensor(x: Any) -> bool:
    """A torch tensor or a numpy array (anything with a shape), not a Python list."""
    return _is_torch(x) or isinstance(x, np.ndarray)


def _local(x: Any) -> Any:
    to_local = getattr(x, "to_local", None)
    if to_local is not None and callable(to_local) and not isinstance(x, np.ndarray):
        return to_local()
    return x


def host_array(x: Any, dtype: Any) -> np.ndarray:
    """``x`` as a private host array of ``dtype``: one device→host copy, converted on the device.

    A CPU tensor or numpy array is copied too, so that a framework reusing its buffers in place
    cannot change what was recorded.
    """
    x = _local(x)
    if _is_torch(x):
        import torch

        t = x.detach()
        if t.device.type == "cpu" and t.dtype not in (torch.bfloat16, torch.float16):
            host = t.numpy()  # shares memory: one converting copy below, never the caller's buffer
            return np.not_equal(host, 0) if dtype is np.bool_ else np.array(host, dtype=dtype, copy=True)
        if dtype is np.bool_:
            t = t != 0
        else:  # converted on the device: a smaller device→host copy
            t = t.to({np.int32: torch.int32, np.int64: torch.int64, np.float64: torch.float64}[dtype])
        return t.cpu().numpy()
    if isinstance(x, np.ndarray):
        return (x != 0) if dtype is np.bool_ else x.astype(dtype, copy=True)
    arr = np.asarray(x)
    return (arr != 0) if dtype is np.bool_ else arr.astype(dtype, copy=False)


def host_view(x: Any, dtype: Any) -> np.ndarray:
    """``x`` on the host without a copy where it already is there (a CPU tensor, a numpy
    array: shared with the caller, in its own dtype), else as ``host_array``. For values read
    before the recording call returns: what outlives it must be copied from the view."""
    x = _local(x)
    if dtype is not np.bool_:
        if isinstance(x, np.ndarray) and x.dtype.kind in "iu":
            return x
        if _is_torch(x):
            import torch

            t = x.detach()
            if t.device.type == "cpu" and t.dtype in (torch.int64, torch.int32, torch.int16, torch.uint8):
                return t.numpy()
    return host_array(x, dtype)


def host_column(x: Any) -> list[Any] | None:
    """A per-sample column (rewards, group ids…) as a Python list, one host copy per batch."""
    if x is None:
        return None
    x = _local(x)
    if _is_torch(x):
        t = x.detach()
        if t.is_floating_point():
            import torch

            t = t.to(torch.float64)
        return t.cpu().tolist()
    if isinstance(x, np.ndarray):
        return x.tolist()
    return list(x)


@dataclass
class Layout:
    """Samples as ``flat[starts[i] : starts[i] + lengths[i]]`` (padding already left out)."""

    flat: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray
    width: int | None = None  # the padded width of a 2-D batch
    last_column: np.ndarray | None = None  # 2-D: column of each sample's last token
    inside: np.ndarray | None = None  # flat bool: positions that belong to a sample (None: all)
    row_lengths: np.ndarray | None = None  # ragged + attention mask: each item's untrimmed length


def _ranges(attention: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """First column, count and contiguity of the attended tokens of each row (vectorized)."""
    width = attention.shape[1]
    counts = np.count_nonzero(attention, axis=1)
    first = attention.argmax(axis=1)
    last = width - 1 - attention[:, ::-1].argmax(axis=1)
    contiguous = (counts == 0) | (counts == last - first + 1)
    return first, counts, last, contiguous


def _ragged(items: list[Any], dtype: Any) -> tuple[np.ndarray, np.ndarray]:
    """One flat host array and per-item lengths; device tensors are joined on the device first."""
    if items and all(_is_torch(t) for t in items):
        import torch

        parts = [t.detach().reshape(-1) for t in items]
        lengths = np.array([p.shape[0] for p in parts], dtype=np.int64)
        try:
            joined = torch.cat(parts) if parts else torch.empty(0)
        except RuntimeError:  # tensors on different devices: one copy each, still not per token
            joined = torch.cat([p.cpu() for p in parts])
        return host_array(joined, dtype), lengths
    arrays = [host_array(item, dtype).reshape(-1) for item in items]
    lengths = np.array([a.shape[0] for a in arrays], dtype=np.int64)
    flat = np.concatenate(arrays) if arrays else np.zeros(0, dtype=dtype)
    return flat, lengths


def _is_flat_ints(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and (not x or isinstance(x[0], (int, np.integer)))


def layout_of(input_ids: Any, attention_mask: Any, *, view: bool = False) -> tuple[Layout, dict[int, str]]:
    """The layout of ``input_ids``; returns it and the samples refused, with reasons.
    ``view``: a 2-D batch already on the host is not copied (see ``host_view``)."""
    refused: dict[int, str] = {}
    ids = _local(input_ids)
    if is_tensor(ids) and len(ids.shape) == 2:
        arr = host_view(ids, np.int32) if view else host_array(ids, np.int32)
        batch, width = arr.shape
        if attention_mask is None:
            attention = np.ones((batch, width), dtype=bool)
        else:
            attention = host_array(attention_mask, np.bool_)
            if attention.shape != arr.shape:
                reason = f"attention_mask has shape {tuple(attention.shape)} but input_ids {tuple(arr.shape)}"
                for i in range(batch):
                    refused[i] = f"sample {i}: {reason}"
                attention = np.zeros((batch, width), dtype=bool)
        first, counts, last, contiguous = _ranges(attention)
        for i in np.flatnonzero(~contiguous).tolist():
            refused[i] = f"sample {i}: attention_mask is not one contiguous run of tokens"
        starts = np.arange(batch, dtype=np.int64) * width + first
        inside = None if attention_mask is None else attention.reshape(-1)
        return Layout(arr.reshape(-1), starts, counts.astype(np.int64), width, last, inside), refused
    if is_tensor(ids) and len(ids.shape) == 1 or _is_flat_ints(ids):
        ids = [ids]  # one sequence
    items = list(ids)
    flat, lengths = _ragged(items, np.int32)
    starts = np.zeros(len(items), dtype=np.int64)
    if len(items) > 1:
        starts[1:] = np.cumsum(lengths)[:-1]
    if attention_mask is None:
        return Layout(flat, starts, lengths), refused
    full = lengths.copy()
    if attention_mask is not None:
        masks = list(_local(attention_mask)) if not (is_tensor(attention_mask) and len(attention_mask.shape) == 1) else [attention_mask]
        if len(masks) != len(items):
            for i in range(len(items)):
                refused[i] = f"sample {i}: attention_mask has {len(masks)} rows but input_ids {len(items)}"
        else:
            for i, m in enumerate(masks):
                m = host_array(m, np.bool_).reshape(-1)
                if m.shape[0] != lengths[i]:
                    refused[i] = f"sample {i}: attention_mask has {m.shape[0]} tokens but input_ids has {lengths[i]}"
                    continue
                if not m.any():
                    lengths[i] = 0
                    continue
                lo, hi = int(m.argmax()), int(m.shape[0] - m[::-1].argmax())
                if int(m.sum()) != hi - lo:
                    refused[i] = f"sample {i}: attention_mask is not one contiguous run of tokens"
                starts[i] += lo
                lengths[i] = hi - lo
    return Layout(flat, starts, lengths, row_lengths=full), refused


def field_layout(name: str, value: Any, ids: Layout, dtype: Any, refused: dict[int, str], *,
                 view: bool = False) -> Layout | None:
    """A per-token field (loss mask, versions…) laid out like ``ids``; mismatches are refused.
    ``view``: a 2-D field already on the host is not copied (see ``host_view``)."""
    batch = len(ids.starts)
    value = _local(value)
    if is_tensor(value) and len(value.shape) == 2:
        if ids.width is None or tuple(value.shape) != (batch, ids.width):
            shape = "ragged" if ids.width is None else f"({batch}, {ids.width})"
            for i in range(batch):
                refused.setdefault(i, f"sample {i}: {name} has shape {tuple(value.shape)} but input_ids {shape}")
            return None
        flat = (host_view(value, dtype) if view else host_array(value, dtype)).reshape(-1)
        if dtype is np.bool_ and ids.inside is not None:
            flat &= ids.inside  # a mask says nothing about padding
        return Layout(flat, ids.starts, ids.lengths, ids.width, ids.last_column, ids.inside)
    if is_tensor(value) and len(value.shape) == 1 or _is_flat_ints(value):
        value = [value]
    items = list(value)
    if len(items) != batch:
        for i in range(batch):
            refused.setdefault(i, f"sample {i}: {name} has {len(items)} rows but input_ids {batch}")
        return None
    flat, lengths = _ragged(items, dtype)
    starts = np.zeros(batch, dtype=np.int64)
    if batch > 1:
        starts[1:] = np.cumsum(lengths)[:-1]
    out_lengths = lengths.copy()
    base = np.zeros(batch, dtype=np.int64)
    if batch > 1 and ids.width is None:
        base[1:] = np.cumsum(ids.row_lengths if ids.row_lengths is not None else ids.lengths)[:-1]
    for i in range(batch):
        n = int(ids.lengths[i])
        row = ids.width if ids.width is not None else (
            int(ids.row_lengths[i]) if ids.row_lengths is not None else n)
        if lengths[i] == row and row != n:  # an untrimmed row: cut like the ids
            offset = int(ids.starts[i] - i * ids.width) if ids.width is not None else int(ids.starts[i] - base[i])
            starts[i] += offset
            out_lengths[i] = n
            continue
        if lengths[i] == n:
            continue
        refused.setdefault(i, f"sample {i}: {name} has {int(lengths[i])} tokens but input_ids has {n}")
    trimmed = ids.row_lengths is not None and not np.array_equal(ids.row_lengths, ids.lengths)
    return Layout(flat, starts, out_lengths, row_lengths=ids.row_lengths if trimmed else None)
