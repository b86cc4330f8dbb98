"""Running a tool on two ranks that share the one GPU, as the GPU tests do
(torchrun, each rank set up by tpfuser.dist.sharegpu)."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_on_ranks(script: str, args: list[str], ranks: int = 2, env: dict | None = None, shim: bool = False,
                 timeout_s: float = 300) -> subprocess.CompletedProcess:
    """tools/<script> ARGS on `ranks` ranks sharing GPU 0 (shim: the default-stream
    shim preloaded, which nvFuser 0.2.36's host IR needs there)."""
    from tpfuser.dist.sharegpu import SHARED_GPU_MARK, SHIM_VARIABLE, build_default_stream_shim
    env = dict(os.environ if env is None else env)
    env[SHARED_GPU_MARK] = "1"
    if shim:
        env[SHIM_VARIABLE] = build_default_stream_shim()
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
           "-m", "tpfuser.dist.sharegpu", "--script", os.path.join(ROOT, "tools", script), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
