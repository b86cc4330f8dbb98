import pytest

from tpfuser.config import PRESETS, BlockConfig, Layout, preset


def test_presets():
    assert PRESETS["nanogpt"] == BlockConfig(16, 128, 1600, 25, 0.1, "bf16")
    assert PRESETS["gpt3"] == BlockConfig(1, 2048, 12288, 96, 0.1, "bf16")
    assert preset("tiny", dtype="fp32").dtype == "fp32"


@pytest.mark.parametrize("kwargs, message", [
    (dict(n_embd=1600, n_head=24), "n_embd=1600: must be divisible by n_head=24"),
    (dict(batch=0), "batch=0: must be a positive int"),
    (dict(seq=-3), "seq=-3: must be a positive int"),
    (dict(n_head=2.5), "n_head=2.5: must be a positive int"),
    (dict(dropout=1.0), "dropout=1.0: must be in [0, 1)"),
    (dict(dropout=-0.1), "dropout=-0.1: must be in [0, 1)"),
    (dict(dtype="fp16"), "dtype='fp16': must be one of ['bf16', 'fp32']"),
    (dict(n_embd=60, n_head=6), "head_dim=10: n_embd/n_head must be a multiple of 8 in bf16 "
                                "(flash attention's limit; fp32 has none)"),
    (dict(n_embd=512, n_head=1), "head_dim=512: n_embd/n_head must be at most 256 in bf16 "
                                 "(flash attention's limit; fp32 has none)"),
], ids=["heads", "batch", "seq", "float_heads", "dropout_one", "dropout_negative", "dtype", "flash_head_dim_8",
        "flash_head_dim_256"])
def test_config_errors_name_field_value_rule(kwargs, message):
    base = dict(batch=2, seq=8, n_embd=64, n_head=8)
    with pytest.raises(ValueError) as err:
        BlockConfig(**{**base, **kwargs})
    assert str(err.value) == message


def test_flash_limits_are_bf16_only():
    """fp32 writes attention out: any head size; bf16 takes flash attention's up to 256."""
    assert BlockConfig(2, 8, 60, 6, dtype="fp32").head_dim == 10
    assert BlockConfig(2, 8, 512, 1, dtype="fp32").head_dim == 512
    assert BlockConfig(2, 8, 512, 2, dtype="bf16").head_dim == 256


def test_unknown_preset():
    with pytest.raises(ValueError, match=r"preset='gpt4': must be one of \['gpt3', 'nanogpt', 'tiny'\]"):
        preset("gpt4")


@pytest.mark.parametrize("layout, message", [
    (Layout(1, 3), "n_head=8: must be divisible by tp=3 (each tp rank takes whole heads)"),
    (Layout(3, 1), "batch=4: must be divisible by dp=3 (the batch is split over dp)"),
], ids=["tp_heads", "dp_batch"])
def test_layout_errors(layout, message):
    with pytest.raises(ValueError) as err:
        layout.check(preset("tiny"))
    assert str(err.value) == message


def test_rank_coords():
    layout = Layout(2, 4)
    assert [layout.rank_coords(r) for r in (0, 3, 4, 7)] == [(0, 0), (0, 3), (1, 0), (1, 3)]
    with pytest.raises(ValueError, match="rank=8: must be in"):
        layout.rank_coords(8)
