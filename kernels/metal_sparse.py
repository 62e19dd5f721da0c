"""The Metal member of the sparse FFN kernels (sparse_ffn.py states the protocol): two kernel bodies,
metal/sparse_gate_up.metal and metal/sparse_down.metal (helpers in metal/sparse_common.h),
compiled at run time through mx.fast.metal_kernel, each equal to the plain-ops reference
sparse_ffn_ref.py. The grids are sized for the slab's S slots and the kernels read `count` from a
device buffer, so a call never waits for the host.

The launch arguments (template, grid, threadgroup, output shapes) come from the framework-neutral
functions below, which the tests also hand to metal_cpu.py to run the same bodies on a CPU.
Nothing here imports mlx at module level.
"""

from __future__ import annotations

from importlib import resources

from mlx_flash.errors import KernelUnavailableError

from .slab_spec import DownLayout, SlabSpec

MAX_TOKENS = 8  # per launch (register accumulators); more tokens run as several launches
SIMD = 32
GATE_UP_SIMDGROUPS = 4  # SIMD groups (rows) per sparse_gate_up threadgroup
GATE_UP_MAX_ROWS = 16384  # SIMD groups launched at most; each loops over rows past that
DOWN_SIMDGROUPS = 8  # SIMD groups splitting the bundles in a sparse_down threadgroup

KERNELS = {  # name -> (input names, output names)
    "sparse_gate_up": (("x", "slab", "idx", "count"), ("h",)),
    "sparse_down": (("h", "slab", "idx", "count"), ("y",)),
}
HEADER = "sparse_common.h"


def metal_source(name: str) -> str:
    """A file of the metal/ folder shipped in this package."""
    return resources.files("mlx_flash.kernels").joinpath("metal", name).read_text()


def check_spec(spec: SlabSpec) -> None:
    """The kernels read uint32 words and scales where they lie: every offset and the row stride must
    be 4-byte aligned (the store aligns its fields so)."""
    offsets = [getattr(getattr(spec, m), f) for m in ("gate", "up", "down") for f in ("w", "s", "b")]
    if spec.row_bytes % 4 or any(o % 4 for o in offsets):
        raise ValueError(
            f"the Metal sparse kernels need 4-byte aligned rows and fields (row {spec.row_bytes} B, offsets {offsets})"
        )


def _common(spec: SlabSpec, tokens: int) -> list[tuple[str, int]]:
    if not 1 <= tokens <= MAX_TOKENS:
        raise ValueError(f"one launch takes 1 to {MAX_TOKENS} tokens (got {tokens})")
    return [
        ("T", tokens),
        ("D", spec.d_model),
        ("BLOCK", spec.block),
        ("ROW_BYTES", spec.row_bytes),
        ("ST", int(spec.scale_type)),
    ]


def gate_up_launch(spec: SlabSpec, tokens: int, slots: int, max_rows: int = GATE_UP_MAX_ROWS) -> dict:
    """Call arguments of sparse_gate_up for x [tokens, D] over a slab of `slots` rows (but the output
    dtype): one SIMD group per neuron row, at most max_rows of them."""
    g, u = spec.gate, spec.up
    template = _common(spec, tokens) + [
        ("GBITS", g.bits),
        ("GGROUP", g.group),
        ("GW", g.w),
        ("GS", g.s),
        ("GB", g.b),
        ("UBITS", u.bits),
        ("UGROUP", u.group),
        ("UW", u.w),
        ("US", u.s),
        ("UB", u.b),
    ]
    rows = max(1, min(slots * spec.block, max_rows))
    return {
        "template": template,
        "grid": (SIMD, rows, 1),
        "threadgroup": (SIMD, GATE_UP_SIMDGROUPS, 1),
        "output_shapes": [(tokens, slots * spec.block)],
        "init_value": 0.0,
    }


def down_launch(spec: SlabSpec, tokens: int, slots: int, simdgroups: int = DOWN_SIMDGROUPS) -> dict:
    """Call arguments of sparse_down for h [tokens, >= slots*block] (but the output dtype): a thread
    per output row (block layout) or column word (column layout), `simdgroups` SIMD groups splitting
    the bundles."""
    d = spec.down
    per = 1 if spec.down_layout is DownLayout.BLOCK else 32 // d.bits
    template = _common(spec, tokens) + [
        ("DBITS", d.bits),
        ("DGROUP", d.group),
        ("DW", d.w),
        ("DS", d.s),
        ("DB", d.b),
        ("LAYOUT", int(spec.down_layout)),
        ("SG", simdgroups),
    ]
    units = -(-spec.d_model // per)
    return {
        "template": template,
        "grid": (SIMD * -(-units // SIMD), simdgroups, 1),
        "threadgroup": (SIMD, simdgroups, 1),
        "output_shapes": [(tokens, spec.d_model)],
        "init_value": None,
    }


def token_slices(tokens: int) -> list[slice]:
    """The launches of `tokens` tokens, MAX_TOKENS at most each."""
    return [slice(i, min(i + MAX_TOKENS, tokens)) for i in range(0, tokens, MAX_TOKENS)]


_kernels: dict[str, object] = {}  # name -> mx.fast.metal_kernel object, built once per process


def built_kernel(name: str, inputs, outputs, header: str):
    """The mx.fast.metal_kernel of metal/<name>.metal with `header`, built once per process."""
    if name not in _kernels:
        import mlx.core as mx

        _kernels[name] = mx.fast.metal_kernel(
            name=name,
            input_names=list(inputs),
            output_names=list(outputs),
            source=metal_source(f"{name}.metal"),
            header=metal_source(header),
            ensure_row_contiguous=True,
        )
    return _kernels[name]


def _metal_kernel(name: str):
    return built_kernel(name, *KERNELS[name], HEADER)


class MetalSparseFFN:
    """The Metal member: gate_up and down over mx.arrays on the GPU (count an int32 mx.array [1],
    read by the kernels, never by the host)."""

    name = "metal"

    def __init__(self, spec: SlabSpec):
        import mlx.core as mx

        if not mx.metal.is_available():
            raise KernelUnavailableError(
                "the Metal sparse FFN kernels need a Metal GPU (mx.metal.is_available() "
                "is false); use the CPU kernel (sparse_ffn.CpuSparseFFN)"
            )
        check_spec(spec)
        self.spec = spec

    def _run(self, name, launch, a, slab, idx, count):
        import mlx.core as mx

        if slab.dtype != mx.uint8 or slab.ndim != 2 or slab.shape[1] != self.spec.row_bytes:
            raise ValueError(
                f"slab must be a uint8 [slots, {self.spec.row_bytes}] array (got {slab.dtype} {slab.shape})"
            )
        a = a.astype(mx.float32)
        idx, count = idx.astype(mx.int32), count.astype(mx.int32).reshape(1)
        k, S = _metal_kernel(name), slab.shape[0]
        outs = [
            k(inputs=[a[s], slab, idx, count], output_dtypes=[mx.float32], **launch(self.spec, s.stop - s.start, S))[0]
            for s in token_slices(a.shape[0])
        ]
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)

    def gate_up(self, x, slab, idx, count):
        """x [T, D] -> h [T, S*block]: h[t, j*block + r] = silu(x·gate_r) * (x·up_r) of bundle idx[j]
        for j < count, 0 past count."""
        return self._run("sparse_gate_up", gate_up_launch, x, slab, idx, count)

    def down(self, h, slab, idx, count):
        """h [T, >= count*block] -> y [T, D] = sum over j < count of down(idx[j]) · h[:, j*block:(j+1)*block]."""
        return self._run("sparse_down", down_launch, h, slab, idx, count)
