"""Train–inference mismatch: the engine's token logprobs against the trainer's.

The inference engine (vLLM, SGLang) and the trainer (FSDP, Megatron) compute different
probabilities for the same sampled tokens; frameworks carry both to correct for it. Per
generation and per episode we keep a few numbers over the generated tokens the loss mask counts
(``conventions.RL_MISMATCH_*``): with Δ = trainer logprob − engine logprob and the importance
ratio r = exp(Δ), the mean and max |Δ|, a KL estimate, r's min and max, and how many tokens' r
leaves a band.

The KL estimate is Schulman's k2, ½·mean(Δ²): an estimate of KL(π_rollout ‖ π_train) from the
rollout's own tokens, never negative, equal to the true KL to second order in Δ (the regime a
healthy run is in) and growing quadratically past it. The unbiased k3 (r − 1 − log r) needs an
``exp`` per token, which alone costs more than all the other statistics of a 4M-token batch
together on the training thread (15 ms against 8 ms on the machine the README's figures come
from); the ratio's extremes,
which k3 would weigh most, are reported exactly beside it.

Statistics are computed in one vectorised pass over a whole batch (``row_totals``): a handful of
array operations on the host arrays, no Python object per token or per dropped sample. The
tokens themselves (the worst ones by |Δ|, ``TokenView``) are rendered only for a kept episode, at
export.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from otel_rollouts import conventions as c
from otel_rollouts._core.content import Entry, call_user, type_name

if TYPE_CHECKING:
    import numpy as np

__all__ = ["MismatchOptions", "Totals", "RowTotals", "TokenView", "float_array", "read_array",
           "read_tokens", "totals_of", "row_totals"]

MAX_TOP_TOKENS = 256


@dataclass(frozen=True)
class MismatchOptions:
    """How train–inference mismatch is summarised.

    ``band``: (low, high) of the importance ratio π_train/π_rollout; tokens outside it are counted
    (``rl.mismatch.tokens_outside``; truncated / masked importance sampling clip or drop them).
    Default (0.5, 2.0). ``top_tokens``: how many of a kept generation's worst tokens (by |Δ|) are
    shown, at most 256 (default 16; 0: none)."""

    band: tuple[float, float] = (0.5, 2.0)
    top_tokens: int = 16

    def __post_init__(self) -> None:
        try:
            low, high = (float(v) for v in self.band)
        except (TypeError, ValueError):
            raise ValueError(f"MismatchOptions(band): expected (low, high), got {self.band!r}") from None
        if not (0.0 < low <= 1.0 <= high < math.inf):
            raise ValueError(f"MismatchOptions(band): expected 0 < low <= 1 <= high, got ({low}, {high})")
        object.__setattr__(self, "band", (low, high))
        top = self.top_tokens
        if type(top) is not int or not 0 <= top <= MAX_TOP_TOKENS:
            raise ValueError(f"MismatchOptions(top_tokens): expected an int in 0..{MAX_TOP_TOKENS}, got {top!r}")

    @classmethod
    def of(cls, value: object) -> MismatchOptions:
        """The options from ``configure(mismatch=...)``: None is the defaults."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        raise TypeError(f"mismatch: expected otr.MismatchOptions, got {type(value).__name__}")

    @property
    def log_band(self) -> tuple[float, float]:
        return math.log(self.band[0]), math.log(self.band[1])


def float_array(value: object) -> np.ndarray | None:
    """``value`` as a host float array (1-D or 2-D), without a copy where it already is one (a
    CPU float32/float64 tensor or numpy array); half-precision or device tensors are converted
    once. None for None; a ValueError naming the problem for what is not numbers."""
    import numpy as np

    if value is None:
        return None
    to_local = getattr(value, "to_local", None)  # a DTensor
    if callable(to_local) and not isinstance(value, np.ndarray):
        value = to_local()
    if isinstance(value, np.ndarray):
        if value.dtype.kind == "f":
            return value
        return value.astype(np.float32)
    detach = getattr(value, "detach", None)
    if callable(detach) and hasattr(value, "device"):  # torch
        import torch

        t = detach()
        if t.dtype not in (torch.float32, torch.float64):
            t = t.to(torch.float32)
        if t.device.type != "cpu":
            t = t.cpu()
        return t.numpy()
    return np.asarray(value, dtype=np.float32)


def read_array(value: object, field: str) -> tuple[np.ndarray | None, str | None]:
    """``float_array(value)`` contained: (array, None), or (None, a reason naming ``field``)
    whatever the value raises (a hostile ``__float__`` included)."""
    array, exc = call_user(float_array, value)
    if exc is not None:
        return None, f"{field}: not per-token numbers ({type_name(exc)})"
    return array, None


def read_tokens(value: object, field: str) -> tuple[np.ndarray | None, str | None]:
    """``read_array`` for one sequence (a generation's, a sample's): one value per token, so a
    1-D array. Anything else (a ``[1, R]`` row, a ``[B, R]`` batch given to one generation, a
    nested list, a scalar) is refused with a reason naming ``field`` and the shape: flattening
    it would measure tokens of other sequences (or padding) as this one's."""
    array, problem = read_array(value, field)
    if array is not None and array.ndim != 1:
        return None, (f"{field}: expected one value per token (1-D), got shape "
                      f"{tuple(int(n) for n in array.shape)} (no mismatch recorded)")
    return array, problem


# --- sums over tokens ---------------------------------------------------------------------------
class Totals:
    """The sums the statistics are made of, over one generation's or one episode's tokens; two
    add up (an episode's are its generations')."""

    __slots__ = ("n", "abs_sum", "sq_sum", "d_min", "d_max", "outside")

    def __init__(self, n: int = 0, abs_sum: float = 0.0, sq_sum: float = 0.0,
                 d_min: float = math.inf, d_max: float = -math.inf, outside: int = 0) -> None:
        self.n, self.abs_sum, self.sq_sum = n, abs_sum, sq_sum
        self.d_min, self.d_max, self.outside = d_min, d_max, outside

    def add(self, other: Totals) -> None:
        self.n += other.n
        self.abs_sum += other.abs_sum
        self.sq_sum += other.sq_sum
        self.d_min = min(self.d_min, other.d_min)
        self.d_max = max(self.d_max, other.d_max)
        self.outside += other.outside

    def attributes(self, options: MismatchOptions) -> dict[str, object]:
        """The ``rl.mismatch.*`` attributes (none when no token was compared)."""
        if self.n <= 0:
            return {}
        return {
            c.RL_MISMATCH_TOKENS: self.n,
            c.RL_MISMATCH_ABS_MEAN: self.abs_sum / self.n,
            c.RL_MISMATCH_ABS_MAX: max(abs(self.d_min), abs(self.d_max)),
            c.RL_MISMATCH_KL: 0.5 * self.sq_sum / self.n,
            c.RL_MISMATCH_RATIO_MIN: _exp(self.d_min),
            c.RL_MISMATCH_RATIO_MAX: _exp(self.d_max),
            c.RL_MISMATCH_OUTSIDE: self.outside,
            c.RL_MISMATCH_BAND: list(options.band),
        }


def _exp(x: float) -> float:
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def totals_of(rollout: np.ndarray, trainer: np.ndarray, mask: np.ndarray | None,
              options: MismatchOptions) -> Totals:
    """One sequence's sums: tokens where ``mask`` is set and both logprobs are finite."""
    import numpy as np

    d = np.subtract(trainer, rollout, dtype=np.float32)  # as the batch path computes it
    valid = np.isfinite(d)
    if mask is not None:
        valid &= mask
    if not valid.all():
        d = d[valid]
    if not d.size:
        return Totals()
    low, high = options.log_band
    a = np.abs(d)
    outside = np.count_nonzero(a > high) if math.isclose(low, -high) else np.count_nonzero((d < low) | (d > high))
    return Totals(int(d.size), float(a.sum()), float(np.dot(d, d)), float(d.min()), float(d.max()), int(outside))


class RowTotals:
    """``Totals`` of every row of a batch, as arrays (one value per row)."""

    __slots__ = ("n", "abs_sum", "sq_sum", "d_min", "d_max", "outside")

    def __init__(self, n: np.ndarray, abs_sum: np.ndarray, sq_sum: np.ndarray, d_min: np.ndarray,
                 d_max: np.ndarray, outside: np.ndarray) -> None:
        self.n, self.abs_sum, self.sq_sum = n, abs_sum, sq_sum
        self.d_min, self.d_max, self.outside = d_min, d_max, outside

    def row(self, i: int) -> Totals:
        return Totals(int(self.n[i]), float(self.abs_sum[i]), float(self.sq_sum[i]),
                      float(self.d_min[i]), float(self.d_max[i]), int(self.outside[i]))

    def columns(self) -> dict[str, np.ndarray]:
        """Per-row statistics by attribute name, float64, NaN for a row with no token compared
        (what the sampler and the step's percentiles read)."""
        import numpy as np

        n = self.n.astype(np.float64)
        none = n <= 0
        n[none] = np.nan
        with np.errstate(over="ignore", invalid="ignore"):
            out = {
                c.RL_MISMATCH_ABS_MEAN: self.abs_sum / n,
                c.RL_MISMATCH_ABS_MAX: np.maximum(np.abs(self.d_min), np.abs(self.d_max)).astype(np.float64),
                c.RL_MISMATCH_KL: 0.5 * self.sq_sum / n,
                c.RL_MISMATCH_RATIO_MIN: np.exp(self.d_min.astype(np.float64)),
                c.RL_MISMATCH_RATIO_MAX: np.exp(self.d_max.astype(np.float64)),
                c.RL_MISMATCH_OUTSIDE: self.outside.astype(np.float64),
            }
        for column in out.values():
            column[none] = np.nan
        return out


# rows are reduced a block at a time, each block's arrays this many bytes or so: the dozen passes
# over a block then read it from the CPU's cache, not from memory (measured: half the time of
# whole-batch passes at 4,096 x 1,024)
BLOCK_BYTES = 1 << 20


def row_totals(rollout: np.ndarray, trainer: np.ndarray, mask: np.ndarray,
               options: MismatchOptions, starts: np.ndarray | None = None) -> RowTotals:
    """``Totals`` of each row, vectorised over the batch.

    2-D arrays ``[B, W]`` (``starts`` None): a row is a sample. Flat arrays with ``starts``: sample
    ``i`` is ``[starts[i], starts[i + 1])`` (non-decreasing). Tokens count where ``mask`` is set
    and both logprobs are finite. The common case is a handful of passes in C over blocks of rows
    small enough to stay in cache; what costs more is paid only by the rows that need it:
    counting tokens outside the band (rows whose extremes leave it), extremes that may be a masked
    token's 0 (rows whose compared tokens are all on one side of 0), a non-finite logprob (that
    row recomputed on its own)."""
    import numpy as np

    size = len(mask) if starts is None else len(starts)
    out = RowTotals(np.zeros(size, dtype=np.int64), np.zeros(size), np.zeros(size), np.zeros(size),
                    np.zeros(size), np.zeros(size, dtype=np.int64))
    if starts is None:
        width = max(int(rollout.shape[1]), 1)
        rows = max(1, BLOCK_BYTES // (4 * width))
        scratch = np.empty((min(rows, size), rollout.shape[1]), dtype=np.float32)
        for lo in range(0, size, rows):
            hi = min(lo + rows, size)
            _block(rollout[lo:hi], trainer[lo:hi], mask[lo:hi], scratch[: hi - lo], out, lo, options)
    else:
        unsure = _flat(rollout, trainer, mask, starts, out, options)
    empty = out.n == 0
    out.abs_sum[empty] = out.sq_sum[empty] = 0
    out.outside[empty] = 0
    out.d_min[empty], out.d_max[empty] = math.inf, -math.inf
    # rows redone exactly on their own: a non-finite logprob (NaN·0 is NaN)
    redo = ~(np.isfinite(out.sq_sum) & np.isfinite(out.abs_sum)) & ~empty
    if starts is not None:
        redo[unsure] = True  # extremes _flat could not tell from a masked 0
    rows_list = np.flatnonzero(redo & ~empty).tolist()
    if rows_list:
        flat_r, flat_t, flat_m = (x.reshape(-1) for x in (rollout, trainer, mask))
        width = rollout.shape[1] if starts is None else 0
        ends = None if starts is None else np.append(starts[1:], len(flat_m))
        for i in rows_list:
            lo, hi = (i * width, (i + 1) * width) if ends is None else (int(starts[i]), int(ends[i]))  # type: ignore[index]
            t = totals_of(flat_r[lo:hi], flat_t[lo:hi], flat_m[lo:hi], options)
            out.n[i], out.abs_sum[i], out.sq_sum[i] = t.n, t.abs_sum, t.sq_sum
            out.d_min[i], out.d_max[i], out.outside[i] = t.d_min, t.d_max, t.outside
    return out


def _block(rollout: np.ndarray, trainer: np.ndarray, mask: np.ndarray, d: np.ndarray, out: RowTotals,
           at: int, options: MismatchOptions) -> None:
    """The sums of rows ``at .. at + len(rollout)`` into ``out``; ``d`` is scratch space."""
    import numpy as np

    end = at + len(rollout)
    # (einsum's row sums and a float mask: the fastest of numpy's ways, measured)
    counted = mask.astype(np.float32)
    out.n[at:end] = np.einsum("ij->i", counted)
    with np.errstate(invalid="ignore", over="ignore"):  # non-finite rows are redone afterwards
        np.subtract(trainer, rollout, out=d, dtype=np.float32)
        d *= counted  # masked tokens are 0 (a NaN or inf stays non-finite)
        out.sq_sum[at:end] = np.einsum("ij,ij->i", d, d)
        d_max = np.maximum.reduce(d, axis=1).astype(np.float64)
        d_min = np.minimum.reduce(d, axis=1).astype(np.float64)
        low, high = options.log_band
        symmetric = math.isclose(low, -high)
        beyond = (d_max > high) | (d_min < low)
        if not symmetric and beyond.any():  # a masked 0 is inside the band: d counts as it is
            rows = np.flatnonzero(beyond)
            part = d[rows]
            out.outside[at + rows] = np.count_nonzero((part > high) | (part < low), axis=1)
        np.abs(d, out=d)
        abs_sum = np.einsum("ij->i", d).astype(np.float64)
        out.abs_sum[at:end] = abs_sum
        if symmetric and beyond.any():
            rows = np.flatnonzero(beyond)
            out.outside[at + rows] = np.count_nonzero(d[rows] > high, axis=1)
    # an extreme of 0 may be a masked token's 0 rather than a compared token's Δ (unless every
    # compared Δ is 0): those rows' extremes are taken again over their compared tokens only
    moved = abs_sum > 0
    for extreme, fill, reduce in ((d_max, -np.inf, np.maximum), (d_min, np.inf, np.minimum)):
        rows = np.flatnonzero((extreme == 0) & moved)
        if rows.size:
            signed = np.subtract(trainer[rows], rollout[rows], dtype=np.float32)
            np.copyto(signed, fill, where=~mask[rows])
            extreme[rows] = reduce.reduce(signed, axis=1)
    out.d_max[at:end] = d_max
    out.d_min[at:end] = d_min


def _flat(rollout: np.ndarray, trainer: np.ndarray, mask: np.ndarray, starts: np.ndarray,
          out: RowTotals, options: MismatchOptions) -> np.ndarray:
    """The sums of ragged rows (flat arrays, row ``i`` from ``starts[i]``) into ``out``; returns
    the rows whose extremes may be a masked 0 (``row_totals`` redoes them)."""
    import numpy as np

    size = len(mask)
    # reduceat gives an empty segment its next element: only the non-empty rows are reduced
    # (each up to the next non-empty row's start, i.e. its own end), the empty ones stay 0
    filled = np.flatnonzero(np.diff(np.append(starts, size)) > 0)
    at = starts[filled]
    if not len(at):
        return filled
    with np.errstate(invalid="ignore", over="ignore"):
        d = np.subtract(trainer, rollout, dtype=np.float32)
        d *= mask
        out.n[filled] = np.add.reduceat(mask.view(np.uint8), at, dtype=np.int64)
        out.sq_sum[filled] = np.add.reduceat(d * d, at, dtype=np.float64)
        d_max = np.maximum.reduceat(d, at).astype(np.float64)
        d_min = np.minimum.reduceat(d, at).astype(np.float64)
        low, high = options.log_band
        out.outside[filled] = np.add.reduceat(((d > high) | (d < low)).view(np.uint8), at, dtype=np.int64)
        np.abs(d, out=d)
        out.abs_sum[filled] = abs_sum = np.add.reduceat(d, at, dtype=np.float64)
    out.d_max[filled], out.d_min[filled] = d_max, d_min
    return filled[((d_max == 0) | (d_min == 0)) & (abs_sum > 0)]


# --- the tokens that disagree most (kept episodes, export thread) --------------------------------
_WORST_KEYS = (c.RL_MISMATCH_WORST_POSITION, c.RL_MISMATCH_WORST_TOKEN, c.RL_MISMATCH_WORST_ROLLOUT,
               c.RL_MISMATCH_WORST_TRAINER)


class TokenView:
    """One generation's logprobs, held (private copies) until its episode is rendered; then its
    ``top`` worst tokens by |Δ| as the ``rl.mismatch.worst.*`` parallel arrays, largest first.

    ``tokens``: the generation's token texts, or token ids with ``decode`` (ids -> texts, run
    for the worst few only, on the export thread); neither: the ids / positions are shown."""

    __slots__ = ("rollout", "trainer", "mask", "tokens", "decode", "top", "_worst")

    def __init__(self, rollout: np.ndarray, trainer: np.ndarray, mask: np.ndarray | None,
                 top: int, tokens: Sequence[int | str] | np.ndarray | None = None,
                 decode: Callable[[list[int]], list[str]] | None = None) -> None:
        self.rollout, self.trainer, self.mask, self.top = rollout, trainer, mask, top
        self.tokens, self.decode = tokens, decode
        self._worst: dict[str, list[object]] | None = None

    def attributes(self) -> dict[str, object]:
        """The four attributes, each a Deferred read from one computation."""
        return {key: Entry(self.worst, key) for key in _WORST_KEYS} if self.top > 0 else {}

    def worst(self) -> dict[str, list[object]]:
        if self._worst is None:
            self._worst = self._compute()
        return self._worst

    def _compute(self) -> dict[str, list[object]]:
        import numpy as np

        d = np.subtract(self.trainer, self.rollout, dtype=np.float64)
        a = np.abs(d)
        ok = np.isfinite(a)
        if self.mask is not None:
            ok &= self.mask
        ok &= a > 0  # a token both sides agree on is not a worst one
        a[~ok] = -1.0
        k = min(self.top, int(np.count_nonzero(ok)))
        if k <= 0:
            return {key: [] for key in _WORST_KEYS}
        pick = np.argpartition(-a, k - 1)[:k]
        pick = pick[np.lexsort((pick, -a[pick]))]  # largest |Δ| first, then the earlier token
        positions = pick.tolist()
        return {
            c.RL_MISMATCH_WORST_POSITION: positions,
            c.RL_MISMATCH_WORST_TOKEN: self._texts(positions),
            c.RL_MISMATCH_WORST_ROLLOUT: [float(v) for v in self.rollout[pick].tolist()],
            c.RL_MISMATCH_WORST_TRAINER: [float(v) for v in self.trainer[pick].tolist()],
        }

    def _texts(self, positions: list[int]) -> list[str]:
        tokens = self.tokens
        if tokens is None or len(tokens) < len(self.rollout):
            return [f"#{p}" for p in positions]
        picked = [tokens[p] for p in positions]
        if self.decode is not None:
            try:
                return [str(t) for t in self.decode([int(t) for t in picked])]
            except Exception:  # noqa: BLE001 - an undecodable id is shown as the id
                pass
        return [t if isinstance(t, str) else str(int(t)) for t in picked]
