"""The backend op set as a declared Protocol: what the model graphs, FFN sources, caches and the
engine call on `ops` (MLX names and semantics), which `MLXOps` (backends/mlx.py) and `TorchOps`
(backends/torch.py) both implement. tests/backends/test_ops_protocol.py checks both classes against
it (names, parameters, defaults) and that every `ops.<name>` the package uses is declared here.

Arrays are the backend's own (mx.array or torch.Tensor), written "array" below; shapes use B batch
rows, T tokens, S keys, H heads, hd head width, D model width. A weight is the backend's Weight.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np

    from ..kernels.qmatmul import Arith
    from .arithmetic import ArithmeticChoice

    from ..ffn_source import GateActivation
    from ..quant_spec import QuantSpec
    from ..slot_turns import SlotTurns


@runtime_checkable
class Ops(Protocol):
    """The op set both backends implement; a model graph is written once against it."""

    # ---- what the backend is ---------------------------------------------------------------------
    name: str  # "mlx" or "torch": messages and per-backend choices
    act_dtype: Any  # the activations' dtype (float32 on a CPU; MLX's GPU float16)
    kernel_threads: int  # threads the CPU kernels run on
    arithmetic: ArithmeticChoice  # what its quantized products compute, and why (backends/arithmetic.py)
    arith: Arith  # arithmetic.arith: what it passes the kernels

    @property
    def lazy(self) -> bool:
        """Whether a product runs when the graph is evaluated (MLX on a CPU), not when it is called:
        a lazy backend also implements LazyOps."""

    @property
    def in_place_kernel(self) -> bool:
        """Whether kernel_weight() works here (quantized linears run the CPU kernel)."""

    def describe(self) -> str:
        """One line naming the framework, its version, the device and how linears run."""

    # ---- arrays in and out -----------------------------------------------------------------------
    def array(self, a: np.ndarray, dtype: str | None = None, cast: bool = True) -> Any:
        """numpy -> a backend array on its device ("bfloat16" dtype: a uint16 view); floats become
        act_dtype unless cast=False."""

    def to_numpy(self, x: Any) -> np.ndarray:
        """A backend array -> a float32 numpy copy on the host (evaluates a lazy graph)."""

    def tokens(self, ids) -> Any:
        """Token ids [T] (one sequence) or [B, T] -> an int array [1 or B, T]."""

    def index(self, ids) -> Any:
        """A 1-D integer array to index with (x[:, idx] gathers, x[:, idx] = y scatters)."""

    def mask(self, keep: np.ndarray) -> Any:
        """A boolean numpy mask [B, 1, T, S] (True: attend) as sdpa takes it."""

    def positions(self, offset, T: int) -> Any:
        """Token positions [1 or B, T] from `offset` (an int, or int numpy [B] per row)."""

    def materialize(self, *arrays) -> None:
        """Compute lazy arrays now (a no-op on an eager backend)."""

    def inference(self) -> AbstractContextManager:
        """Context for model calls (torch: inference_mode, no autograd bookkeeping)."""

    # ---- weights: stored bytes to backend weights ------------------------------------------------
    def weight(self, parts: dict, quant: QuantSpec | None, transposed: bool = False, dtypes: dict | None = None) -> Any:
        """A linear's Weight from its stored numpy parts ("weight", and "scales"/"biases" when
        quantized, "bias"); transposed: stored [in, out]; dtypes: a part's stored dtype by key."""

    def kernel_weight(self, matrix, quant: QuantSpec) -> Any:
        """A Weight the CPU kernel multiplies where its bytes lie (a StoredMatrix or BlockMatrix over
        laid-out rows); not an embedding. Only where in_place_kernel."""

    def matmul_only(self, w: Any) -> Any:
        """The weight without what only an embedding lookup needs (it is only multiplied)."""

    def thresholded(self, w: Any, threshold: float, every_row: bool) -> Any:
        """`w` behind an activation threshold (backends/thresholded.py: a Thresholded, which `linear`
        takes): input channels with |x| <= threshold count as zero, in one-row steps (every row with
        `every_row`); over the channel-major kernel where the backend has it for `w` (the layout then
        replaces the stored one), else the masked reference."""

    # ---- products over stored bytes and pointwise ops --------------------------------------------
    def linear(self, x: Any, w: Any) -> Any:
        """x [.., in] @ w -> [.., out] (+ its bias), over the weight as stored."""

    def embedding(self, w: Any, ids: Any) -> Any:
        """Rows `ids` of an embedding table -> [.., D] in act_dtype (quantized rows dequantized)."""

    def rms_norm(self, x: Any, weight: Any, eps: float) -> Any:
        """RMSNorm over the last axis, scaled by `weight`."""

    def layer_norm(self, x: Any, weight: Any, bias: Any, eps: float) -> Any:
        """LayerNorm over the last axis, with `weight` and `bias`."""

    def rope(self, x: Any, dims: int, traditional: bool, base: float, offset, scale: float = 1.0, freqs=None) -> Any:
        """mx.fast.rope: rotate the first `dims` features of x [B, H, T, hd] from position `offset`
        (an int, or int numpy [B]); freqs: inverse frequencies [dims / 2] replacing base's."""

    def silu(self, x: Any) -> Any:
        """x * sigmoid(x)."""

    def relu(self, x: Any) -> Any:
        """max(x, 0)."""

    def gelu(self, x: Any, approximate: bool = False) -> Any:
        """GELU, exact (erf) or with the tanh approximation."""

    def sigmoid(self, x: Any) -> Any:
        """1 / (1 + exp(-x))."""

    def gated(self, act: GateActivation, gate: Any, up: Any) -> Any:
        """act(gate) * up: a gated FFN's activations (the one place every path takes them)."""

    def gated_ffn(self, act: GateActivation, gate_up, down, x: Any) -> Any | None:
        """down(act(gate) * up) of x as one kernel call where the backend has one for these weights,
        else None (the caller composes linear and gated)."""

    def route(self, logits: Any, k: int, renormalize: bool, unit: bool) -> tuple[Any, Any]:
        """Router logits [N, E] -> (experts int32 [N, K], weights float32 [N, K]) as backend arrays:
        softmax over every expert, the k largest (ties to the lower id), optionally renormalized over
        those k, or all 1 (`unit`). In the graph where the backend is lazy; models/moe.py's `route`
        is the plain-ops reference."""

    def routing_to_host(self, ids: Any, weights: Any) -> tuple[np.ndarray, np.ndarray]:
        """`route`'s two arrays on the host in one transfer."""

    def moe_experts(
        self, act: GateActivation, x: Any, ids: Any, weights: Any, total: Any, experts: dict, n_experts: int
    ):
        """total [N, Dout] plus the routed experts' gated FFNs of x [N, D] times their router weights
        (ids int32 and weights float32 [N, K], backend arrays; experts: id -> FFNWeights of the experts
        in this call, a routed one not among them adding nothing), experts ascending, as one kernel
        call where the backend has one for these weights, else None (the caller runs each expert)."""

    def evaluate(self, x: Any) -> None:
        """Compute x now: memory it reads is about to be refilled (eager backends have it already)."""

    # ---- the sparse FFN (LLM in a flash) ---------------------------------------------------------
    def sparse_kernel(self, spec, act: GateActivation) -> Any | None:
        """The sparse FFN kernel for slabs laid out as `spec` (a SlabSpec), or None where none applies."""

    def sparse_ffn(self, call, x: Any, act: GateActivation) -> Any:
        """x [.., D] -> the FFN output over `call`'s active bundles (an ffn_source.SparseCall)."""

    # ---- shapes and indexing ---------------------------------------------------------------------
    def reshape(self, x: Any, shape) -> Any:
        """x with the given shape."""

    def transpose(self, x: Any, axes) -> Any:
        """x with its axes permuted as `axes`."""

    def zeros(self, shape, like: Any) -> Any:
        """Zeros of `shape` with like's dtype (and device)."""

    def split(self, x: Any, sizes) -> Any:
        """The last axis split into consecutive pieces of the given sizes (a sequence of arrays)."""

    def concatenate(self, xs, axis: int) -> Any:
        """The arrays joined along `axis`."""

    def take(self, x: Any, idx: Any) -> Any:
        """Entries idx (an int array from index()) of the last axis."""

    def take_tokens(self, x: Any, idx: Any) -> Any:
        """Entries idx of axis 1: tokens of a KV array [H, N, hd]."""

    def take_rows(self, x: Any, idx: Any) -> Any:
        """Rows idx of x [N, ...]."""

    def add_rows(self, x: Any, idx: Any, y: Any) -> Any:
        """x with y added to its rows idx (distinct), as a new array."""

    def last_token(self, x: Any) -> Any:
        """x [B, T, D] -> its last token [B, 1, D]."""

    # ---- attention and caches --------------------------------------------------------------------
    def sdpa(self, q: Any, k: Any, v: Any, scale: float, mask=None) -> Any:
        """Attention: q [B, Hq, T, hd], k/v [B, Hkv, S, hd] (grouped heads) -> [B, Hq, T, hd]; mask:
        None, "causal" (last query aligned with last key) or a boolean mask from mask()."""

    def sdpa_coded(self, q: Any, k: Any, v: Any, scale: float, codes: Any, fmt, coded: int) -> Any:
        """Causal attention of one sequence whose first `coded` keys and values are in `codes` (uint8
        [blocks, fmt.nbytes]: models/kv_coded_blocks.BlockFormat blocks, read where they lie by
        kernels/cpu/attention.cpp mf_attention_coded, backends/coded_blocks.py) and the rest the float
        k, v [1, Hkv, R, hd]. CPU kernels only."""

    def sdpa_slots(self, q: Any, k: Any, v: Any, scale: float, block_tokens: int, table, kv_len, q_pos) -> Any:
        """Attention of B rows whose keys and values lie in a pool of chunks: k, v one pool layer
        [Hkv, slots * block_tokens, hd], row b's chunks the slots table[b] (int32 numpy [B, max
        chunks]) in order, holding kv_len[b] keys, its first query at position q_pos[b] (int32 numpy
        [B]); -> [B, Hq, T, hd]. Reads the pool where it lies on a CPU (backends/slot_attention.py)."""

    def sdpa_mixed(
        self,
        q: Any,
        k: Any,
        v: Any,
        scale: float,
        block_tokens: int,
        table,
        classes,
        codes: Any,
        layouts,
        kv_len,
        q_pos,
    ) -> Any:
        """sdpa_slots over chunks of mixed widths: block i of row b is the pool's float chunk
        table[b, i] where classes[b, i] is 0, else the compressed chunk at block table[b, i] of the
        uint8 buffer `codes`, read through layouts[classes[b, i] - 1] (a keys', values' pair of
        kernels/kv_codes.CodedLayout; kernels/cpu/attention.cpp mf_attention_mixed). CPU kernels only."""

    def attention_columns(self, q: Any, k: Any, scale: float) -> Any:
        """Causal attention mass each key receives, summed over heads and queries: q [1, Hq, T, hd],
        k [1, Hkv, S, hd] -> [S] float32 (KV compression's information density)."""

    def top_k_mask(self, q: Any, k: Any, scale: float, mask, keep: float) -> Any:
        """Each query's top `keep` share of the keys it may see, as a bool mask [B, Hq, T, S] for sdpa."""

    def write_tokens(self, buffer: Any, x: Any, offset: int) -> Any:
        """A KV cache's append: buffer [B, H, cap, hd] with x [B, H, T, hd] written at tokens
        offset.. (in place where the backend can); returns the buffer."""

    # ---- memory accounting -----------------------------------------------------------------------
    def host_buffer(self, nbytes: int) -> np.ndarray:
        """A writable, page-aligned uint8 numpy view of `nbytes` for reads from the store, in memory
        the backend's kernels take in place."""

    def host_array(self, view: np.ndarray, after: Any = None, gate=None) -> Any:
        """A backend array over `view` (a float32 or uint8 numpy view of host_buffer memory) without a copy, so
        that what the backend writes there (write_tokens) numpy reads and what a read puts there the
        backend takes. On a lazy backend with `gate` (slot_turns.SlotGate), the array is its bytes once
        that claim's read is done, after `after` is computed; an eager one waited before the call."""

    def held_bytes(self, tree) -> int:
        """Bytes of memory the arrays of a weights tree hold as this backend keeps them (each buffer
        counted once)."""


@runtime_checkable
class LazyOps(Ops, Protocol):
    """What a backend adds where `lazy` may be true (MLXOps): streamed slots take turns inside the
    graph, fenced. The callers ask for these only after checking `ops.lazy` (TorchOps is eager)."""

    host_syncs: int  # times a lazy array was turned into host memory (a graph evaluated and waited for)

    def slot_turns(self, name: str) -> SlotTurns:
        """Turns of a set of streamed slots over this backend's fences (slot_turns.SlotTurns)."""

    def gate_weights(self, tree, gate) -> None:
        """Make every product over the weights of `tree` (a layer's) wait for `gate`'s turn."""
