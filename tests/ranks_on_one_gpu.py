"""Running a tool on ranks that share the one GPU, as the GPU tests do: torchrun
as `tpfuser --share-gpu` starts it (launch.torchrun_command: nvFuser's store on a
port free now, no variable of this process's own world of one inherited; each
rank set up by tpfuser.dist.sharegpu), bounded as it bounds it
(launch.run_bounded_all: past the bound the ranks print their stacks, and every
process is ended, none left on the GPU)."""
from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Done:
    returncode: int | None   # None: still running at the bound, then ended
    output: str              # every rank's standard output and error, and torchrun's

    def story(self) -> list[str]:
        """The ranks' own lines: their stages ("[rank N +t s] ...") and results ("rank N: ...")."""
        return [line for line in self.output.splitlines() if re.match(r"\[?rank \d+[ :]", line)]

    def tail(self, chars: int = 2000) -> str:
        said = "ran past its bound and was ended; " if self.returncode is None else f"exit {self.returncode}; "
        return (said + "the ranks' lines:\n" + "\n".join(self.story()[-40:])
                + "\noutput's end:\n" + (self.output[-chars:] if chars else ""))


def run_on_ranks(script: str, args: list[str], ranks: int = 2, env: dict | None = None, shim: bool = False,
                 timeout_s: float = 240) -> Done:
    """tools/<script> ARGS on `ranks` ranks sharing GPU 0 (shim: the default-stream
    shim preloaded, which nvFuser 0.2.36's host IR needs there)."""
    from tpfuser.config import Layout
    from tpfuser.dist.launch import run_bounded_all, torchrun_command
    from tpfuser.dist.sharegpu import SHIM_VARIABLE, build_default_stream_shim
    environ = dict(os.environ if env is None else env)
    if shim:
        environ[SHIM_VARIABLE] = build_default_stream_shim()
    environ["PYTHONPATH"] = os.pathsep.join([ROOT, environ.get("PYTHONPATH", "")])
    cmd, environ = torchrun_command(Layout(1, ranks), ["--script", os.path.join(ROOT, "tools", script), *args],
                                    environ, shared_gpus=1)
    with tempfile.TemporaryFile("w+") as log:
        code = run_bounded_all([cmd], environ, timeout_s, stdouts=[log], merge_stderr=True)[0]
        log.seek(0)
        return Done(code, log.read())
