"""A GGUF's stacked expert tensors as one matrix per expert, under transformers' per-expert names.

llama.cpp's converter stores a mixture-of-experts layer's experts as three 3-D tensors,
`blk.N.ffn_{gate,up,down}_exps` ([experts, rows, cols], one quantized matrix per expert laid
end to end), and the router as `blk.N.ffn_gate_inp` ([experts, hidden], F32); gpt-oss's also their biases
(`.bias`, [experts, rows] in F32). Each expert's
matrix is a run of consecutive rows of the stacked tensor, so it is cut out as the file's own
blocks (no copy of the others) and named as a transformers checkpoint names it
(`model.layers.N.mlp.experts.E.gate_proj`): from there it loads like any dense MLP's matrix,
on the native kernels where its format runs there.
"""

from __future__ import annotations

from dataclasses import replace

from transformers import PretrainedConfig

from engine.model.quant.gguf_file import GgufTensorInfo

# GGUF architectures with stacked experts (their router: the MoE module's `mlp.gate`)
MOE_ARCHS = ("qwen3moe", "gpt-oss")
_EXPERT_TENSORS = {
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
}


def num_experts(config: PretrainedConfig) -> int:
    return int(getattr(config, "num_experts", None) or config.num_local_experts)


def split_experts(tensors: list[GgufTensorInfo], experts: int) -> list[GgufTensorInfo]:
    """Each stacked `blk.N.ffn_X_exps.weight` as `experts` tensors `blk.N.ffn_X_exps.E.weight`."""
    out = []
    for tensor in tensors:
        base, _, suffix = tensor.name.rpartition(".")
        if base.rpartition(".")[2] not in _EXPERT_TENSORS:
            out.append(tensor)
            continue
        rows = tensor.data.shape[0] // experts  # of one expert's matrix
        row_bytes = tensor.data.strides[0]
        for e in range(experts):
            data = tensor.data[e * rows : (e + 1) * rows]
            data = data.reshape(-1) if suffix == "bias" else data  # gpt-oss's [E, rows] biases
            name = f"{base}.{e}.{suffix}"
            out.append(
                replace(tensor, name=name, data=data, offset=tensor.offset + e * rows * row_bytes)
            )
    return out


def expert_names(arch: str, num_layers: int, experts: int) -> dict[str, str]:
    """GGUF base names of the split experts, the router (and gpt-oss's sinks) -> transformers
    base names."""
    if arch not in MOE_ARCHS:
        return {}
    names = {f"blk.{i}.ffn_gate_inp": f"model.layers.{i}.mlp.gate" for i in range(num_layers)}
    if arch == "gpt-oss":  # read back as `self_attn.sinks` (moe.split_gpt_oss_experts)
        names |= {
            f"blk.{i}.attn_sinks": f"model.layers.{i}.self_attn.sinks" for i in range(num_layers)
        }
    for i in range(num_layers):
        for gguf_name, hf_name in _EXPERT_TENSORS.items():
            for e in range(experts):
                names[f"blk.{i}.{gguf_name}.{e}"] = f"model.layers.{i}.mlp.experts.{e}.{hf_name}"
    return names
