"""`unipage.dense_pack`: a dense adapter packed a target at a time is the general path's buffer, bit for bit;
adapters it does not take (experts, a target laid out differently in different layers) go to the general
path."""

from __future__ import annotations

import peft_factory as pf
import pytest
import torch

from unipage.adapter_pack import pack_adapter
from unipage.adapter_reader import read_and_pack
from unipage.config import LoRAConfig
from unipage.dense_pack import pack_dense
from unipage.errors import AdapterFormatError
from unipage.lora_layout import build_layout
from unipage.peft_io import inspect_adapter, load_adapter_weights

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
PAGE_ELEMS = 256
LORA = LoRAConfig(max_rank=64)


def _both(adapter, dtype: torch.dtype):
    """(pack_dense's buffer or None, the general path's buffer) of ``adapter`` packed as ``dtype``."""
    info = inspect_adapter(adapter.path, adapter.model, LORA)
    layout = build_layout(adapter.model, list(info.layers))
    general = pack_adapter(layout, load_adapter_weights(info, adapter.model), PAGE_ELEMS, dtype)
    return pack_dense(info, layout, adapter.model, PAGE_ELEMS, dtype), general, info, layout


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


@pytest.mark.parametrize("kwargs, file_dtype, pool_dtype", [
    ({"r": 8, "lora_alpha": 16}, None, torch.bfloat16),
    ({"r": 8, "lora_alpha": 5, "use_rslora": True}, None, torch.bfloat16),  # scaling 5 / sqrt(8): not exact
    ({"r": 3, "lora_alpha": 7, "target_modules": pf.ATTENTION}, torch.bfloat16, torch.bfloat16),
    ({"r": 4, "lora_alpha": 3}, torch.float16, torch.bfloat16),
    ({"r": 4, "lora_alpha": 3}, None, torch.float16),
    ({"r": 4, "lora_alpha": 8, "layers_to_transform": [1], "rank_pattern": {"q_proj": 2},
     "alpha_pattern": {"o_proj": 3, "mlp.up_proj": 7}}, None, torch.float32),
    ({"r": 4, "lora_alpha": 8, "alpha_pattern": {"model.layers.1.self_attn.k_proj": 5}}, None, torch.bfloat16),
])
def test_dense_adapters_pack_as_the_general_path_does(tmp_path, kwargs, file_dtype, pool_dtype):
    """Random PEFT adapters of the tiny Llama (2 layers): ranks, alphas (per layer too), rslora, and the
    adapter files' and the pool's dtypes varied."""
    adapter = pf.dense_adapter(tmp_path / "a", seed=3, dtype=file_dtype, **kwargs)
    fast, general, info, layout = _both(adapter, pool_dtype)
    assert fast is not None
    assert fast.shape == general.shape and fast.dtype == general.dtype
    assert torch.equal(_bits(fast), _bits(general))
    assert general.abs().sum() > 0  # random weights, not zeros
    packed = read_and_pack(info, layout, adapter.model, PAGE_ELEMS, pool_dtype)
    assert torch.equal(_bits(packed), _bits(general))


@pytest.mark.parametrize("make", [
    # q_proj of rank 4 in layer 0 and 8 in layer 1: its blocks (and those after it) differ by layer
    lambda path: pf.dense_adapter(path, r=4, rank_pattern={"model.layers.1.self_attn.q_proj": 8}),
    lambda path: pf.fused_moe_adapter(path, r=2),  # experts
], ids=["ranks-differ-by-layer", "experts"])
def test_other_adapters_take_the_general_path(tmp_path, make):
    adapter = make(tmp_path / "a")
    fast, general, info, layout = _both(adapter, torch.bfloat16)
    assert fast is None
    assert torch.equal(_bits(read_and_pack(info, layout, adapter.model, PAGE_ELEMS, torch.bfloat16)),
                       _bits(general))


def test_files_changed_since_inspection_are_refused(tmp_path):
    adapter = pf.dense_adapter(tmp_path / "a", r=4)
    info = inspect_adapter(adapter.path, adapter.model, LORA)
    layout = build_layout(adapter.model, list(info.layers))
    pf.dense_adapter(tmp_path / "a", seed=9, r=4)  # same shapes, other weights
    with pytest.raises(AdapterFormatError, match="changed since they were inspected"):
        pack_dense(info, layout, adapter.model, PAGE_ELEMS, torch.bfloat16)
