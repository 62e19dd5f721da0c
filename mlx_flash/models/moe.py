"""Mixture-of-experts graph: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE (EdgeMoE's target models), and
dense Llama-family models split into experts by `tools/moefy.py` (model_type moefied_llama,
MoEfication, see moe/moefication.py), whose chosen experts add up unweighted, as the pieces of the
dense FFN they are.

Attention is the Llama family's (llama.py). The FFN of every layer is a router over E experts, each
a SwiGLU FFN of `moe_intermediate_size` neurons; the top-k experts of each token are computed and
summed with their router weights. Qwen2-MoE adds a shared expert (resident) scaled by a sigmoid gate.

Routing (ops.route: softmax, top-k, weights) is computed where the graph is. When the source holds
every expert and the backend has the grouped kernel (the CPU kernels over stored matrices), the
layer's routed experts are one operation over the routing as computed (ops.moe_experts): no host
round trip. Otherwise the routing comes to the host, since the engine must know which experts a
token needs before it can read them (once per layer), and `ffn.waves(layer, ids)` (an ExpertSource)
supplies every expert the routing names, in ascending order, in waves held at once (read from flash
through an expert cache, where a streaming source also follows each token's path to preload the next
layer's likely experts); a wave's experts are one grouped operation, or one call set per expert
(`routed_experts`, the reference the grouped kernel equals to the bit). Either way each routed
expert is computed once over all the tokens routed to it, experts in ascending order.
Shapes: B batch, T tokens, D d_model, E experts, K experts per token, N = B*T.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ModelFileError, UnsupportedModelError
from ..ffn_source import ExpertSource, FFNWeights
from . import llama

LAYER = llama.LAYER
GATE = llama.GATE_ACTIVATION  # every expert is a SwiGLU FFN
GGUF = llama.GGUF  # the expert stacks' names are shared by every MoE architecture (convert/gguf_source.py)
# Mixtral names its block differently; the store uses the Qwen/OLMoE names for every family.
_MIXTRAL_NAMES = {
    "block_sparse_moe.gate.": "mlp.gate.",
    "block_sparse_moe.experts.": "mlp.experts.",
    ".w1.": ".gate_proj.",
    ".w3.": ".up_proj.",
    ".w2.": ".down_proj.",
}


@dataclass
class ModelArgs(llama.ModelArgs):
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalize the top-k router weights to sum to 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: one always-on expert with a sigmoid gate
    unit_router_weights: bool = False  # MoE-fied dense models: the chosen experts add up unscaled


def normalize_config(hf: dict, where: str) -> dict:
    cfg = llama.normalize_config(hf, where)
    kind = hf["model_type"]
    try:
        if kind == "mixtral":
            moe = {
                "num_experts": int(hf["num_local_experts"]),
                "moe_intermediate_size": int(hf["intermediate_size"]),
                "norm_topk_prob": True,
            }
        else:
            moe = {
                "num_experts": int(hf["num_experts"] if "num_experts" in hf else hf["num_local_experts"]),
                "moe_intermediate_size": int(hf.get("moe_intermediate_size") or hf["intermediate_size"]),
                "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
            }
        moe["num_experts_per_tok"] = int(hf["num_experts_per_tok"])
    except (KeyError, TypeError, ValueError) as e:
        raise UnsupportedModelError(f"{where}: MoE config lacks or mangles a required field ({e})") from None
    if not 0 < moe["num_experts_per_tok"] <= moe["num_experts"]:
        raise UnsupportedModelError(
            f"{where}: num_experts_per_tok {moe['num_experts_per_tok']} is not in 1..num_experts ({moe['num_experts']})"
        )
    if int(hf.get("decoder_sparse_step", 1)) != 1 or hf.get("mlp_only_layers"):
        raise UnsupportedModelError(
            f"{where}: MoE models with dense layers between sparse ones "
            f"(decoder_sparse_step / mlp_only_layers) are not supported yet"
        )
    if kind == "qwen2_moe":
        moe["shared_expert_intermediate_size"] = int(hf.get("shared_expert_intermediate_size") or 0)
    if kind == "olmoe":
        moe["qk_norm_full"] = True
        if hf.get("clip_qkv") is not None:
            raise UnsupportedModelError(f"{where}: OLMoE clip_qkv is not supported yet")
    if kind == "moefied_llama":  # its router picks pieces of one dense FFN, which add up unscaled
        moe["unit_router_weights"] = True
    cfg.update(moe)
    cfg["intermediate_size"] = moe["num_experts"] * moe["moe_intermediate_size"]  # every expert's neurons
    return cfg


def canonical_tensors(tensors: dict, config: dict, where: str) -> dict:
    """One name per expert linear, `model.layers.L.mlp.experts.E.{gate,up,down}_proj.*`: Mixtral's
    `block_sparse_moe` names are renamed, and stacked experts (mlx-community `switch_mlp.*` [E, ...],
    transformers' fused `experts.gate_up_proj` [E, 2F, D] / `experts.down_proj` [E, D, F]) split.
    Expert counts must match the config's."""
    out = {}
    for k, v in llama.canonical_tensors(tensors, config, where).items():
        if "block_sparse_moe" in k:
            for a, b in _MIXTRAL_NAMES.items():
                k = k.replace(a, b)
        if ".mlp.switch_mlp." in k:  # [E, ...] per tensor
            base, rest = k.split(".switch_mlp.")
            for e in range(v.shape[0]):
                out[f"{base}.experts.{e}.{rest}"] = v[e]
        elif k.endswith(".mlp.experts.gate_up_proj") or k.endswith(".mlp.experts.down_proj"):
            base = k.rsplit(".", 1)[0]
            for e in range(v.shape[0]):
                if k.endswith("gate_up_proj"):
                    n = v.shape[1] // 2
                    out[f"{base}.{e}.gate_proj.weight"], out[f"{base}.{e}.up_proj.weight"] = v[e, :n], v[e, n:]
                else:
                    out[f"{base}.{e}.down_proj.weight"] = v[e]
        else:
            out[k] = v
    _check_expert_count(out, config, where)
    return out


def _check_expert_count(tensors: dict, config: dict, where: str) -> None:
    E = config["num_experts"]
    for i in range(config["num_hidden_layers"]):
        p = LAYER.format(i) + "mlp."
        found = {
            int(k[len(p + "experts.") :].split(".")[0])
            for k in tensors
            if k.startswith(p + "experts.") and k[len(p + "experts.") :].split(".")[0].isdigit()
        }
        router = tensors.get(p + "gate.weight")
        rows = None if router is None else int(router.shape[0])
        if found != set(range(E)) or rows not in (None, E):
            have = f"{len(found)} experts" + (f" and a router over {rows}" if rows is not None else "")
            raise ModelFileError(f"{where}: layer {i} has {have}, but the config says num_experts={E}")


def expert_parts(config: dict, layer: int) -> list[dict]:
    """Per expert: role -> linear name. The store keeps expert e's neurons as rows
    [e * moe_intermediate_size, (e + 1) * moe_intermediate_size) of the layer's bundle region."""
    p = LAYER.format(layer) + "mlp.experts.{}."
    return [
        {"gate": p.format(e) + "gate_proj", "up": p.format(e) + "up_proj", "down": p.format(e) + "down_proj"}
        for e in range(config["num_experts"])
    ]


def ffn_parts(config: dict, layer: int) -> dict:
    return expert_parts(config, layer)[0]


def build(ops, args: ModelArgs, get) -> dict:
    w = llama.build(ops, args, get)
    for i, lw in enumerate(w["layers"]):
        p = LAYER.format(i) + "mlp."
        lw["router"] = get(p + "gate")
        if args.shared_expert_intermediate_size:
            lw["shared"] = FFNWeights(
                gate_up=get([p + "shared_expert.gate_proj", p + "shared_expert.up_proj"]),
                down=get(p + "shared_expert.down_proj"),
            )
            lw["shared_gate"] = get(p + "shared_expert_gate")
    return w


def route(logits: np.ndarray, k: int, renormalize: bool, unit: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Router logits [N, E] -> (experts [N, K] int64, weights [N, K] float32): softmax over all
    experts, the k largest (ties to the lower id), optionally renormalized over those k, or all 1
    (`unit`). The plain-ops reference of the backends' ops.route, which the graph calls."""
    z = logits.astype(np.float32)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ids = np.argsort(-p, axis=-1, kind="stable")[:, :k]
    wts = np.take_along_axis(p, ids, -1)
    if unit:
        wts = np.ones_like(wts)
    elif renormalize:
        wts = wts / wts.sum(-1, keepdims=True)
    return ids, wts.astype(np.float32)


def expert_groups(ids: np.ndarray, wts: np.ndarray) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """Expert-major order: (expert, its token rows, their weights) for each expert any token chose,
    by ascending expert id, so resident and streamed experts sum in the same order."""
    groups = []
    for e in np.unique(ids):
        rows, slot = np.nonzero(ids == e)
        groups.append((int(e), rows, wts[rows, slot]))
    return groups


def routed_experts(ops, args: ModelArgs, xf, out, wave: dict, groups: dict):
    """out plus the experts of `wave` (id -> weights), one call set each, ascending: each expert's
    tokens gathered (groups: id -> (token rows, their weights)), its SwiGLU FFN, the weighted output
    added to those rows (the reference the grouped kernel equals)."""
    for e in sorted(wave):
        if e not in groups:
            raise RuntimeError(f"expert source gave expert {e}, which no token routed to")
        rows, w = groups[e]
        r = ops.array(rows.astype(np.int64))
        y = llama.mlp(ops, args, wave[e], ops.take_rows(xf, r))  # one expert: a SwiGLU FFN
        out = ops.add_rows(out, r, y * ops.reshape(ops.array(w), (-1, 1)))
    return out


def moe_block(ops, args: ModelArgs, lw: dict, i: int, x, ffn: ExpertSource):
    """x [B, T, D] -> [B, T, D]: the routed experts' weighted sum (plus the shared expert)."""
    B, T, D = x.shape
    xf = ops.reshape(x, (B * T, D))
    routing = ops.route(
        ops.linear(xf, lw["router"]), args.num_experts_per_tok, args.norm_topk_prob, args.unit_router_weights
    )
    out = ops.zeros((B * T, D), xf)
    every = ffn.every_expert(i)
    grouped = None if every is None else ops.moe_experts(GATE, xf, *routing, out, every, args.num_experts)
    if grouped is not None:
        out = grouped
    else:
        ids, wts = ops.routing_to_host(*routing)
        groups = {e: (rows, w) for e, rows, w in expert_groups(ids, wts)}
        # The source yields the routed experts by ascending id in waves (more than one when they do
        # not all fit its cache); each expert runs once over all its tokens.
        for wave, more in ffn.waves(i, ids):
            y = ops.moe_experts(GATE, xf, *routing, out, wave, args.num_experts)
            out = y if y is not None else routed_experts(ops, args, xf, out, wave, groups)
            if more:  # the next wave may refill the memory this one reads
                ops.evaluate(out)
    if args.shared_expert_intermediate_size:
        g = ops.sigmoid(ops.linear(xf, lw["shared_gate"]))
        out = out + g * llama.mlp(ops, args, lw["shared"], xf)
    return ops.reshape(out, (B, T, D))


embed, head = llama.embed, llama.head


def block(ops, args: ModelArgs, lw: dict, i: int, h, cache, ffn: ExpertSource):
    """Layer i on h [B, T, D]: attention with its cache, then the experts `ffn.experts` supplies."""
    eps = args.rms_norm_eps
    h = h + llama.attention(ops, args, lw, ops.rms_norm(h, lw["attn_norm"], eps), cache)
    return h + moe_block(ops, args, lw, i, ops.rms_norm(h, lw["ffn_norm"], eps), ffn)


def forward(ops, args: ModelArgs, w: dict, tokens, caches, ffn: ExpertSource, all_logits: bool = False):
    """tokens [B, T] -> logits [B, T or 1, vocab]; `ffn.waves(i, ids)` supplies layer i's experts."""
    h = embed(ops, args, w, tokens, caches)
    for i, lw in enumerate(w["layers"]):
        h = block(ops, args, lw, i, h, caches[i], ffn)
    return head(ops, args, w, h, all_logits)
