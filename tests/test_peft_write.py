"""`write_random_adapter` writes what PEFT itself reads: PEFT loads each file
into the matching base model, and its live modules equal what unipage loads."""

import peft_factory as pf
import pytest
from peft import PeftModel
from test_peft_io import assert_matches_peft, peft_oracle, round_trip

from unipage.peft_write import write_random_adapter

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def written(directory, base, **kwargs) -> pf.Adapter:
    module, model = base
    path = write_random_adapter(directory, model, rank=4, alpha=12, seed=3, **kwargs)
    return pf.Adapter(path, PeftModel.from_pretrained(module, path), model)


@pytest.mark.parametrize("targets", [("q_proj", "v_proj", "experts"), ("experts",), ("k_proj", "o_proj")])
def test_fused_experts_load_in_peft(tmp_path, targets):
    adapter = written(tmp_path, pf.qwen3_moe_base(), targets=targets, expert_format="fused")
    _, layout, gathered = round_trip(adapter)
    assert_matches_peft(gathered, layout, peft_oracle(adapter.peft))


def test_per_expert_loads_in_peft(tmp_path):
    base = pf.v4_moe_base("qwen")
    base[0].prepare_inputs_for_generation = None  # the bare module tree is no generator; PEFT's CAUSAL_LM wrapper asks
    adapter = written(tmp_path, base, targets=("q_proj", "k_proj", "experts"),
                      expert_format="per_expert", use_rslora=True)
    _, layout, gathered = round_trip(adapter)
    assert_matches_peft(gathered, layout, peft_oracle(adapter.peft))


def test_dense_loads_in_peft(tmp_path):
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    adapter = written(tmp_path, pf.llama_base(), targets=targets)
    _, layout, gathered = round_trip(adapter)
    assert_matches_peft(gathered, layout, peft_oracle(adapter.peft))


def test_bad_arguments(tmp_path):
    _, model = pf.llama_base()
    with pytest.raises(ValueError, match="expert_format"):
        write_random_adapter(tmp_path, model, rank=4, alpha=4, expert_format="stacked")
    with pytest.raises(ValueError, match="rank"):
        write_random_adapter(tmp_path, model, rank=0, alpha=4)
