"""The default-stream shim (tpfuser/dist/shim/default_stream.c): built with the
machine's C compiler, preloaded, it hands c10::cuda::getDefaultCUDAStream an
index past the visible devices as -1 (the current device). Checked on the CPU
against a stand-in for libc10_cuda (one device); skipped without a compiler."""
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from tpfuser.dist.sharegpu import SHIM_NAME, SHIM_VARIABLE, build_default_stream_shim, rank_environment

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None,
                                reason="needs a C compiler")

FAKE_C10 = """
typedef struct { unsigned long device; long id; } cuda_stream;
signed char _ZN3c104cuda12device_countEv(void) { return 1; }
cuda_stream _ZN3c104cuda20getDefaultCUDAStreamEa(signed char index) {   /* id: 1000 + the index it got */
  cuda_stream s = {1, 1000 + index};
  return s;
}
"""

CALL = textwrap.dedent("""
    import ctypes, sys
    class Stream(ctypes.Structure):
        _fields_ = [("device", ctypes.c_uint64), ("id", ctypes.c_int64)]
    ctypes.CDLL(sys.argv[1])     # the stand-in c10, loaded after the shim and privately, as torch loads c10
    f = ctypes.CDLL(None)._ZN3c104cuda20getDefaultCUDAStreamEa  # what the process resolves: the shim's
    f.restype, f.argtypes = Stream, [ctypes.c_int8]
    print(" ".join(str(f(i).id - 1000) for i in (0, 1, 5, -1)))
""")


def _compiler():
    return shutil.which("gcc") or shutil.which("cc")


def test_an_index_past_the_devices_becomes_the_current_device(tmp_path):
    shim = build_default_stream_shim(str(tmp_path))
    assert os.path.basename(shim) == SHIM_NAME
    (tmp_path / "fake.c").write_text(FAKE_C10)
    (tmp_path / "c10").mkdir()
    fake = str(tmp_path / "c10" / "libc10_cuda.so")   # c10's soname: the shim finds it by that name
    subprocess.run([_compiler(), "-shared", "-fPIC", "-Wl,-soname,libc10_cuda.so", "-o", fake,
                    str(tmp_path / "fake.c")], check=True)
    run = subprocess.run([sys.executable, "-c", CALL, fake], capture_output=True, text=True,
                         env={**os.environ, "LD_PRELOAD": shim, "TPFUSER_SHIM_LOG": "1"})
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["0", "-1", "-1", "-1"]      # 0 passes, 1 and 5 (of 1 device) become -1
    assert run.stderr.count("-> the current device") == 2


def test_in_a_torch_process_the_shim_finds_c10s_own_function(tmp_path):
    """torch loads libc10_cuda privately: the shim must look it up by name
    (before, it found nothing and aborted on its first call)."""
    shim = build_default_stream_shim(str(tmp_path))
    probe = ("import ctypes, torch, nvfuser_direct; "
             "print(ctypes.CDLL(None).tpfuser_shim_resolved())")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         env={**os.environ, "LD_PRELOAD": shim})
    assert run.returncode == 0 and run.stdout.split()[-1] == "1", run.stderr[-400:]


def test_built_once_and_again_when_the_source_changes(tmp_path):
    from tpfuser.dist import sharegpu
    source = os.path.join(os.path.dirname(sharegpu.__file__), "shim", "default_stream.c")
    first = build_default_stream_shim(str(tmp_path))
    made = os.path.getmtime(first)
    assert build_default_stream_shim(str(tmp_path)) == first and os.path.getmtime(first) == made
    older = os.path.getmtime(source) - 1
    os.utime(first, (older, older))                             # older than the source: rebuilt
    build_default_stream_shim(str(tmp_path))
    assert os.path.getmtime(first) > older


def test_a_rank_preloads_the_shim_it_is_given_and_knows_it(tmp_path):
    shim = build_default_stream_shim(str(tmp_path))
    env = rank_environment({"RANK": "1", SHIM_VARIABLE: shim, "LD_PRELOAD": "/x/other.so"})
    assert env["LD_PRELOAD"] == f"{shim} /x/other.so"
    assert "LD_PRELOAD" not in rank_environment({"RANK": "1"})
    probe = ("from tpfuser.dist.sharegpu import check_host_ir_device; check_host_ir_device(1, 1); "
             "print('allowed')")
    preloaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                               env={**os.environ, "LD_PRELOAD": shim})
    assert preloaded.stdout.strip() == "allowed", preloaded.stderr[-400:]
    plain = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert plain.returncode != 0 and "need the default-stream shim preloaded" in plain.stderr
