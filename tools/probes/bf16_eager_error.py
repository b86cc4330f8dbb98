"""How far eager PyTorch in bf16 is from the float32 reference, per preset (CPU,
dropout 0): the yardstick a bf16 check's bound grows to (check.tolerance).
Attention as a user's eager block runs it, through scaled_dot_product_attention
(softmax in float32: flash attention on a GPU, its CPU kernel here), as the
check's eager run replays flash attention. With nanoGPT's bf16 math attention
(scores and softmax in bf16; --math) gpt3 is twice as far: 1.9e-2 against 9.4e-3.

    python3 tools/probes/bf16_eager_error.py [--math] tiny nanogpt gpt3

Both runs see the same bf16-rounded weights and input (as oracle.reference
does); prints the output's relative L2 error, the branch's (out - x) and how
large the branch is against x. gpt3 takes about 2 minutes and 10 GiB here.
"""
from __future__ import annotations

import sys
import time

import torch

from tpfuser.verify.oracle import rel_l2
from tpfuser.config import preset
from tpfuser.verify.reference import make_block, make_input


def sdpa(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def eager_bf16_error(name: str, math: bool = False) -> dict[str, float]:
    cfg = preset(name, dtype="fp32", dropout=0.0)
    attention = None if math else sdpa
    with torch.no_grad():
        block = make_block(cfg)
        for p in block.parameters():
            p.copy_(p.bfloat16().float())
        x = make_input(cfg).bfloat16().float()
        ref = block(x, None, attention)
        out = block.bfloat16()(x.bfloat16(), None, attention).float()
        return {"out": rel_l2(out, ref), "branch": rel_l2(out - x, ref - x),
                "branch_over_x": (torch.linalg.vector_norm(ref - x) / torch.linalg.vector_norm(x)).item()}


def main(argv: list[str]) -> int:
    math = "--math" in argv
    for name in [a for a in argv if a != "--math"] or ["tiny", "nanogpt"]:
        start = time.time()
        e = eager_bf16_error(name, math)
        print(f"{name}{' (math attention)' if math else ''}: eager bf16 out rel err {e['out']:.3e}, branch {e['branch']:.3e}, "
              f"|branch|/|x| {e['branch_over_x']:.2f} ({time.time() - start:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
