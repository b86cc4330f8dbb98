"""A tp rank's parameter shard cut by hand from nanoGPT's layout, as Megatron-LM
splits it: an oracle for the runtime's slicing (parallel/shard.py) that shares
none of its code."""
import torch


def megatron_shard(state, name, cfg, tp, r):
    """Megatron-LM's shard of tp rank r, cut here by hand from nanoGPT's layout:
    c_attn keeps rank r's heads of q, k and v (each head's q rows, then its k,
    then its v: the fusion's order), c_fc its rows, the two c_proj weights their
    columns; LayerNorms and the c_proj biases whole."""
    t, e, h = state[name], cfg.n_embd, cfg.n_head
    d = e // h
    if name.startswith("attn.c_attn."):
        heads = range(r * h // tp, (r + 1) * h // tp)
        return torch.cat([t[part * e + head * d: part * e + (head + 1) * d] for head in heads for part in range(3)])
    if name.startswith("mlp.c_fc."):
        return t[r * 4 * e // tp: (r + 1) * 4 * e // tp]
    if name in ("attn.c_proj.weight", "mlp.c_proj.weight"):
        return t[:, r * t.shape[1] // tp: (r + 1) * t.shape[1] // tp]
    return t
