"""Launch configuration of the CuPy kernels: pure Python, no CuPy, unit-tested on CPU.

Everything the host decides before a launch lives here: how many threads share a row
(:func:`group_size`), whether rows are read as 16-byte vectors (:func:`can_vectorize`),
the fused or split backward (:func:`backward_config`), grid sizes, and the occupancy model
(:func:`occupancy`, a transcription of CUDA's ``cuda_occupancy.h`` for the limits that
matter here) that both the grid sizing and the compile check's table use.

The block sizes and per-thread register caches are read from the ``#define PYNORM_*``
lines of ``kernels/common.cuh`` (:data:`DEFS`), so the kernels and this module cannot
disagree.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Literal

from ...errors import DTypeError, ShapeError
from ._loader import TYPE_NAMES, acc_of, defines, param_types

__all__ = [
    "ARCH_LIMITS",
    "DEFS",
    "BackwardConfig",
    "Limits",
    "Occupancy",
    "RowConfig",
    "TypePlan",
    "backward_config",
    "bwd_items",
    "can_vectorize",
    "chunk_grid",
    "forward_config",
    "group_size",
    "launch_bound",
    "occupancy",
    "type_plan",
    "vector_width",
]

#: constants shared with the kernels (``#define PYNORM_<NAME>`` in common.cuh, prefix dropped)
DEFS: dict[str, int] = {k.removeprefix("PYNORM_"): v for k, v in defines().items()}

ITEM_BYTES = DEFS["ITEM_BYTES"]
#: block size of warp-mode launches (G <= 32: several rows per block)
WARP_MODE_BLOCK = 256
#: the largest hidden size the kernels index with 32-bit ints (items never reach 2**31)
MAX_HIDDEN = 2**30
#: grid.y limit (the split backward's column tiles)
MAX_GRID_Y = 65535
MAX_GRID_X = 2**31 - 1
#: split backward: blocks of the apply kernel aimed at per SM (row chunks x column tiles)
APPLY_BLOCKS_PER_SM = 8


@dataclass(frozen=True)
class Limits:
    """The per-SM limits of a GPU that decide occupancy (names as in ``cudaDeviceProp``)."""

    name: str
    major: int
    minor: int
    sm_count: int
    max_threads_per_sm: int = 2048
    max_blocks_per_sm: int = 32
    regs_per_sm: int = 65536
    regs_per_block: int = 65536
    smem_per_sm: int = 233472
    smem_per_block_optin: int = 232448
    reserved_smem_per_block: int = 1024
    warp_size: int = 32


#: sm_80 (A100: 164 KiB shared memory per SM, 163 KiB per block) and sm_90 (H100/H200: 228/227 KiB).
ARCH_LIMITS: dict[str, Limits] = {
    "sm_80": Limits("sm_80", 8, 0, 108, smem_per_sm=167936, smem_per_block_optin=166912),
    "sm_90": Limits("sm_90", 9, 0, 132, smem_per_sm=233472, smem_per_block_optin=232448),
}


@dataclass(frozen=True)
class Occupancy:
    """Resident blocks and warps per SM for one kernel and block size, and what limits them."""

    blocks_per_sm: int
    warps_per_sm: int
    fraction: float  # of the SM's warp slots
    limiter: str  # "warps", "blocks", "registers" or "shared memory"; "none" if it cannot launch


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@functools.lru_cache(maxsize=4096)  # (pure: a call's fixed cost)
def occupancy(regs: int, static_smem: int, block: int, limits: Limits, dynamic_smem: int = 0) -> Occupancy:
    """Occupancy of a kernel using ``regs`` registers per thread (``cudaOccMaxActiveBlocksPerMultiprocessor``).

    Registers are allocated per warp in units of 256, from four sub-partitions; shared
    memory per block is rounded up to 128 bytes plus the 1 KiB the driver reserves; the
    preferred carveout is taken as the largest (what CUDA picks for smem-heavy kernels).
    """
    if block < 1 or block > 1024:
        raise ValueError(f"block size {block} is outside 1..1024")
    warps_per_block = -(-block // limits.warp_size)
    max_warps = limits.max_threads_per_sm // limits.warp_size
    by = {"warps": max_warps // warps_per_block, "blocks": limits.max_blocks_per_sm}
    if regs > 0:
        per_warp = _round_up(regs * limits.warp_size, 256)
        if regs > 255 or per_warp * _round_up(warps_per_block, 4) > limits.regs_per_block:
            by["registers"] = 0
        else:
            warps_per_sub = (limits.regs_per_sm // 4) // per_warp
            by["registers"] = (warps_per_sub * 4) // warps_per_block
    smem = _round_up(static_smem + dynamic_smem + limits.reserved_smem_per_block, 128)
    if static_smem + dynamic_smem > limits.smem_per_block_optin:
        by["shared memory"] = 0
    else:
        by["shared memory"] = limits.smem_per_sm // smem
    limiter = min(by, key=lambda k: by[k])
    blocks = by[limiter]
    if blocks == 0:
        return Occupancy(0, 0, 0.0, "none")
    warps = blocks * warps_per_block
    return Occupancy(blocks, warps, warps / max_warps, limiter)


def launch_bound(kernel: str) -> int:
    """``__launch_bounds__`` (max threads per block) of a kernel, by its template name."""
    base = kernel.split("<", 1)[0].rsplit("::", 1)[-1]
    if base.startswith(("quant_", "intype_")):  # one block per row
        return DEFS["QUANT_THREADS"]
    if base.startswith("ew_"):
        return DEFS["APPLY_THREADS"]
    if base.startswith("col_"):
        return DEFS["COLUMN_THREADS"]
    if base.endswith("_fwd"):
        return DEFS["FWD_THREADS"]
    if base.endswith("_bwd"):
        # the prologue policy sets it: the residual ops' fused backward holds h, dh and dres too
        return DEFS["BWD_RESIDUAL_THREADS"] if "Residual<" in kernel else DEFS["BWD_THREADS"]
    if base.endswith("_bwd_stats"):
        return DEFS["STATS_THREADS"]
    if base.endswith("_bwd_apply"):
        return DEFS["APPLY_THREADS"]
    if base == "reduce_partials":
        return DEFS["REDUCE_THREADS"]
    if base == "cast_values":
        return DEFS["CAST_THREADS"]
    raise KeyError(f"unknown kernel {kernel!r}")


def row_block(hidden: int) -> int:
    """Threads of a one-block-per-row kernel (quantize.cu, intype.cu): a power of two from 32 to
    ``PYNORM_QUANT_THREADS``, about one per 4 elements."""
    t = 32
    while t < DEFS["QUANT_THREADS"] and t * 4 < hidden:
        t *= 2
    return t


# ---------------------------------------------------------------------------
# row layout


def vector_width(itemsize: int) -> int:
    """Elements per item (one 16-byte vector): 8 for float16/bfloat16, 4 for float32, 2 for float64."""
    if itemsize not in (2, 4, 8):
        raise ValueError(f"unsupported element size {itemsize}")
    return ITEM_BYTES // itemsize


def can_vectorize(hidden: int, itemsize: int, addresses: tuple[int, ...]) -> bool:
    """Whether every row of every array can be read/written as 16-byte vectors.

    True when the hidden size is a multiple of the vector width (so each row starts
    16-byte aligned if the array does) and every base address is 16-byte aligned. Any
    other case takes the scalar path (coalesced element accesses, masked tail).
    """
    return hidden % vector_width(itemsize) == 0 and all(a % ITEM_BYTES == 0 for a in addresses)


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def group_size(hidden: int, itemsize: int, items_per_thread: int, max_threads: int) -> int:
    """Threads per row: the power of two giving each thread at most ``items_per_thread`` items, capped.

    1 for tiny rows (one thread per row), <= 32 several rows per warp, up to ``max_threads``
    (a whole block per row) for large ones.
    """
    n_items = -(-hidden // vector_width(itemsize))
    return min(max_threads, _pow2_ceil(-(-n_items // items_per_thread)))


def items_per_thread(hidden: int, itemsize: int, group: int) -> int:
    """Items each thread of a ``group``-thread row owns: ``ceil(H / (G * V))`` (kernels compute the same)."""
    return -(-hidden // (group * vector_width(itemsize)))


def _items_for(itemsize: int, acc_itemsize: int, budget_bytes: int) -> tuple[int, bool]:
    # ItemsFor<T, A, BYTES> in common.cuh
    elems = budget_bytes // acc_itemsize
    v = vector_width(itemsize)
    return (elems // v, True) if elems >= v else (1, False)


def fwd_items(itemsize: int, acc_itemsize: int) -> int:
    """Items of its row each forward thread keeps in registers (``FwdItems<T, A>``)."""
    return _items_for(itemsize, acc_itemsize, DEFS["FWD_ACC_BYTES"])[0]


def bwd_items(itemsize: int, acc_itemsize: int) -> int:
    """Items per thread of the fused backward (``BwdItems<T, A>``); 0 where there is no fused path."""
    k, fits = _items_for(itemsize, acc_itemsize, DEFS["BWD_ACC_BYTES"])
    return k if fits else 0


@dataclass(frozen=True)
class RowConfig:
    """Launch of a row kernel (forward, fused backward, backward statistics).

    ``group`` threads share a row (``log2g`` = log2 of it); a block of ``block`` threads
    holds ``block // group`` rows at a time; ``grid`` blocks stride over the rows.
    ``over_smem``: bytes of dynamic shared memory for the forward's items beyond the
    register cache (0: none, or re-read from global memory).
    """

    group: int
    block: int
    grid: int
    vec: bool
    items: int
    over_smem: int = 0

    @property
    def log2g(self) -> int:
        return self.group.bit_length() - 1

    @property
    def rows_per_block(self) -> int:
        return self.block // self.group


def _block_for(group: int) -> int:
    return group if group > 32 else max(WARP_MODE_BLOCK, group)


def _grid(rows: int, rows_per_block: int, resident_blocks: int) -> int:
    """Enough blocks for every row, at most what is resident at once (blocks then stride over rows)."""
    need = -(-rows // rows_per_block)
    return max(0, min(need, max(1, resident_blocks), MAX_GRID_X))


def _check_hidden(hidden: int) -> None:
    if not 1 <= hidden <= MAX_HIDDEN:
        raise ValueError(f"hidden size {hidden} is outside the supported range 1..{MAX_HIDDEN}")


@functools.lru_cache(maxsize=4096)  # (pure: a call's fixed cost)
def forward_config(
    rows: int,
    hidden: int,
    itemsize: int,
    acc_itemsize: int,
    vec: bool,
    limits: Limits,
    regs: int = 0,
    static_smem: int = 0,
    overflow: Literal["smem", "global"] | None = None,
    row_itemsize: int | None = None,
) -> RowConfig:
    """Forward launch: group size, block, grid, and where items beyond the registers go.

    Each thread keeps ``fwd_items`` items of its row in registers; the group is the
    power of two that covers the row with them, up to ``FWD_THREADS`` threads. Longer
    rows give each thread further items, kept in dynamic shared memory when they fit
    in a block's opt-in limit, else re-read from global memory (L2) on each pass
    (``overflow`` forces either; tests use it). ``row_itemsize``: the element size of the normalized
    row when it is not x (a pre-norm sum wider than x: its items are that much larger).
    """
    _check_hidden(hidden)
    g = group_size(hidden, itemsize, fwd_items(itemsize, acc_itemsize), DEFS["FWD_THREADS"])
    block = _block_for(g)
    nk = items_per_thread(hidden, itemsize, g)
    item_bytes = vector_width(itemsize) * (row_itemsize or itemsize)
    over = max(0, nk - fwd_items(itemsize, acc_itemsize)) * g * (block // g) * item_bytes
    if over:
        fits = over + static_smem <= limits.smem_per_block_optin
        if overflow == "smem" and not fits:
            raise ValueError(f"{over} bytes of row items do not fit the shared memory of a block")
        if overflow == "global" or not fits:
            over = 0
    occ = occupancy(regs, static_smem, block, limits, over)
    grid = _grid(rows, block // g, occ.blocks_per_sm * limits.sm_count)
    return RowConfig(g, block, grid, vec, nk, over)


@dataclass(frozen=True)
class BackwardConfig:
    """Backward launch plan.

    ``kind == "fused"``: one kernel (``rows`` config), rows in registers, one partial
    row of dweight/dbias per block (``partials = rows.grid``).
    ``kind == "split"`` (rows too long for the registers): ``rows`` configures the
    statistics kernel; the apply kernel runs on a ``(chunks, tiles)`` grid of ``apply_block``
    threads, each block owning ``rows_per_chunk`` rows and one item per thread of a
    column tile (``partials = chunks``).
    """

    kind: Literal["fused", "split"]
    rows: RowConfig
    partials: int
    apply_block: int = 0
    tiles: int = 0
    chunks: int = 0
    rows_per_chunk: int = 0


def backward_kind(
    hidden: int,
    itemsize: int,
    acc_itemsize: int,
    force: Literal["fused", "split"] | None = None,
    max_threads: int = 0,
) -> Literal["fused", "split"]:
    """``"fused"`` when a row fits in the registers of ``max_threads`` threads (the fused kernel's
    ``__launch_bounds__``: ``BWD_THREADS`` by default), else ``"split"``.

    ``force`` picks a path (tests run both); forcing ``"fused"`` where it cannot run raises.
    """
    _check_hidden(hidden)
    k = bwd_items(itemsize, acc_itemsize)
    fits = k > 0 and group_size(hidden, itemsize, k, 1 << 30) <= (max_threads or DEFS["BWD_THREADS"])
    if force == "fused" and not fits:
        raise ValueError(
            f"hidden size {hidden} (itemsize {itemsize}, accumulator {acc_itemsize}) has no fused backward"
        )
    if force is not None:
        return force
    return "fused" if fits else "split"


@functools.lru_cache(maxsize=4096)  # (pure: a call's fixed cost)
def backward_config(
    rows: int,
    hidden: int,
    itemsize: int,
    acc_itemsize: int,
    vec: bool,
    limits: Limits,
    kind: Literal["fused", "split"],
    regs: int = 0,
    static_smem: int = 0,
    max_threads: int = 0,
) -> BackwardConfig:
    """Backward launch for the path ``kind`` (see :func:`backward_kind`).

    ``regs``/``static_smem`` describe the kernel that runs over rows (the fused kernel,
    or the split path's statistics kernel) and size its persistent grid; ``max_threads`` is the
    fused kernel's ``__launch_bounds__`` (``BWD_THREADS`` by default).
    """
    _check_hidden(hidden)
    if kind == "fused":
        k = bwd_items(itemsize, acc_itemsize)
        g = group_size(hidden, itemsize, max(k, 1), max_threads or DEFS["BWD_THREADS"])
        nk = items_per_thread(hidden, itemsize, g)
        if k == 0 or nk > k:
            raise ValueError(f"hidden size {hidden} does not fit the fused backward")
        block = _block_for(g)
        occ = occupancy(regs, static_smem, block, limits)
        grid = _grid(rows, block // g, occ.blocks_per_sm * limits.sm_count)
        return BackwardConfig("fused", RowConfig(g, block, grid, vec, nk), partials=grid)
    # split: the statistics kernel streams rows of any length ...
    g = group_size(hidden, itemsize, fwd_items(itemsize, acc_itemsize), DEFS["STATS_THREADS"])
    block = _block_for(g)
    occ = occupancy(regs, static_smem, block, limits)
    grid = _grid(rows, block // g, occ.blocks_per_sm * limits.sm_count)
    rc = RowConfig(g, block, grid, vec, items_per_thread(hidden, itemsize, g))
    # ... then the apply kernel: (row chunks) x (column tiles of one item per thread)
    chunks, tiles, rpc = chunk_grid(rows, hidden, itemsize, limits)
    return BackwardConfig(
        "split", rc, partials=chunks, apply_block=DEFS["APPLY_THREADS"], tiles=tiles, chunks=chunks, rows_per_chunk=rpc
    )


def chunk_grid(rows: int, hidden: int, itemsize: int, limits: Limits) -> tuple[int, int, int]:
    """``(chunks, tiles, rows_per_chunk)`` of a (row chunks) x (column tiles) launch of ``APPLY_THREADS``
    threads owning one item each (the split backward's apply kernel, the element-wise family): about
    ``APPLY_BLOCKS_PER_SM`` blocks per SM, ``rows_per_chunk`` consecutive rows per chunk."""
    _check_hidden(hidden)
    tiles = items_per_thread(hidden, itemsize, DEFS["APPLY_THREADS"])
    if tiles > MAX_GRID_Y:
        raise ValueError(f"hidden size {hidden} needs {tiles} column tiles (> {MAX_GRID_Y})")
    target = APPLY_BLOCKS_PER_SM * limits.sm_count
    chunks = max(1, min(rows, -(-target // tiles))) if rows > 0 else 0
    rpc = -(-rows // chunks) if chunks else 0
    chunks = -(-rows // rpc) if rpc else 0
    return chunks, tiles, rpc


def reduce_grid(hidden: int, segments: int = 1) -> tuple[tuple[int, int], tuple[int, int]]:
    """``(grid, block)`` of ``reduce_partials``: 32 columns x 8 slices per block, one grid row per segment."""
    x, y = DEFS["REDUCE_X"], DEFS["REDUCE_Y"]
    if not 1 <= segments <= MAX_GRID_Y:
        raise ValueError(f"{segments} segments: the reduction handles 1..{MAX_GRID_Y}")
    return (-(-hidden // x), segments), (x, y)


def acc_itemsize(*itemsizes: int | None) -> int:
    """Accumulation type size: 8 (double) when any operand is float64, else 4 (float)."""
    return 8 if any(s == 8 for s in itemsizes if s is not None) else 4


# ---------------------------------------------------------------------------
# dtype dispatch


def _dtype_name(dtype: Any) -> str:
    return str(getattr(dtype, "name", dtype))


def cuda_type(dtype: Any) -> str:
    """The CUDA C type of a float dtype (``float16`` -> ``__half``, ``bfloat16`` -> ``__nv_bfloat16``...)."""
    name = _dtype_name(dtype)
    if name not in TYPE_NAMES:
        raise DTypeError(f"the cupy backend supports float16, bfloat16, float32 and float64, got {name}")
    return TYPE_NAMES[name]


_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


@dataclass(frozen=True)
class TypePlan:
    """Template arguments and conversions for one call.

    ``T`` is x's CUDA type, ``W`` the parameters' (``T`` or ``acc``); ``acc`` the accumulation type
    (``"double"`` when x, a parameter or an extra operand -- a pre-norm sum, a residual -- is float64,
    else ``"float"``), which is also the dtype of the saved mean/rstd. ``casts[i]``: parameter ``i``
    is first cast to ``acc`` (exactly: the kernels convert every parameter to ``acc`` anyway), which
    happens when the parameters' dtypes differ or are neither ``T`` nor ``acc``.
    """

    T: str
    W: str
    acc: str
    casts: tuple[bool, ...] = ()

    @property
    def acc_dtype(self) -> str:
        return "float64" if self.acc == "double" else "float32"

    @property
    def acc_itemsize(self) -> int:
        return 8 if self.acc == "double" else 4


def type_plan(x_dtype: Any, *param_dtypes: Any, extra: tuple[Any, ...] = ()) -> TypePlan:
    """Pick the kernel instantiation for these dtypes (a param dtype of None: no such parameter;
    ``extra``: dtypes of other operands that need double accumulation when float64)."""
    t = cuda_type(x_dtype)
    names = [None if d is None else _dtype_name(d) for d in param_dtypes]
    types = [None if n is None else cuda_type(n) for n in names]
    for d in extra:
        cuda_type(d)
    wide = [t, *(c for c in types if c is not None), *(cuda_type(d) for d in extra)]
    acc = "double" if "double" in wide else "float"
    present = {c for c in types if c is not None}
    if not present:
        return TypePlan(t, t if acc_of(t, t) == acc else acc, acc, tuple(False for _ in types))
    if len(present) == 1:
        (w,) = present
        if w in param_types(t) and acc_of(t, w) == acc:
            return TypePlan(t, w, acc, tuple(False for _ in types))
    return TypePlan(t, acc, acc, tuple(c is not None and c != acc for c in types))


def check_input(x: Any) -> tuple[int, int]:
    """``(rows, hidden)`` of a kernel input: what the kernels themselves need (a 2-D array, a hidden
    size they can index); everything else is validated once, from the op's spec, before dispatch."""
    if getattr(x, "ndim", None) != 2:
        raise ShapeError(f"x must be a 2-D (rows, hidden) array, got shape {tuple(getattr(x, 'shape', ()))}")
    rows, hidden = (int(d) for d in x.shape)
    if not 1 <= hidden <= MAX_HIDDEN:
        raise ShapeError(f"hidden size {hidden} is outside the cupy backend's range 1..{MAX_HIDDEN}")
    return rows, hidden
