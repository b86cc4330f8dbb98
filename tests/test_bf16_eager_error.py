"""tools/probes/bf16_eager_error.py: eager bf16's own error, the yardstick of bf16 bounds (CPU)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "probes"))
import bf16_eager_error  # noqa: E402


def test_eager_bf16_is_off_by_bf16_rounding_and_grows_with_the_block():
    tiny, nano = (bf16_eager_error.eager_bf16_error(n) for n in ("tiny", "nanogpt"))
    assert 1e-4 < tiny["out"] < nano["out"] < 1e-2   # measured: 2.4e-3 and 3.6e-3
    assert nano["branch_over_x"] > 10 * tiny["branch_over_x"]   # e = 1600 against 64: a larger branch
