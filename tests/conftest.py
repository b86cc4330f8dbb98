import json
import os
import signal

import pytest
import torch

# The signal tests send SIGINT and SIGHUP to processes they start, which inherit this
# process's dispositions: a suite started in the background (nohup, or `&` without job
# control) has them ignored, and its children would never see them. Their defaults,
# for every process the suite starts.
for _sig, _handler in ((signal.SIGINT, signal.default_int_handler), (signal.SIGHUP, signal.SIG_DFL)):
    if signal.getsignal(_sig) == signal.SIG_IGN:
        signal.signal(_sig, _handler)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run tools/gpu_suite.sh on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def record(request):
    """record(**figures): appends the test's measured figures, as one JSON line,
    to $TPFUSER_GPU_RECORD when set (tools/gpu_suite.sh sets it), so that the
    numbers behind a pass are kept, not only the pass."""
    def write(**figures):
        path = os.environ.get("TPFUSER_GPU_RECORD")
        if path:
            with open(path, "a") as f:
                f.write(json.dumps({"test": request.node.name, **figures}) + "\n")
    return write


@pytest.fixture
def no_tf32():
    """fp32 tolerances assume full-precision matmuls."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
