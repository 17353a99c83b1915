"""Tiny saved checkpoints, PEFT adapters and the transformers + PEFT oracle for engine tests.

Each family fixture saves a random fp32 base model with ``save_pretrained``
(per-expert keys on disk for MoE, as transformers writes them) and four or
more PEFT adapters with different ranks and formats: fused 3D expert
parameters, per-expert modules (trained on a v4-named module tree), rslora,
``alpha != r``, ``rank_pattern``, and one on attention only.  The oracle runs
transformers with PEFT's own loader on each adapter alone.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field

import peft_factory as pf
import pytest
import torch
from peft import PeftModel
from unipage.scheduler import Request, SamplingParams
from transformers import (
    AutoModelForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)


@dataclass
class Family:
    name: str
    model_dir: str
    adapters: dict[str, str] = field(default_factory=dict)  # name -> PEFT directory


def _save(model, directory: str) -> str:
    model.save_pretrained(directory)
    return directory


def qwen3_moe(root) -> Family:
    base, _ = pf.qwen3_moe_base(0)
    fam = Family("qwen3_moe", _save(base, os.path.join(root, "base")))
    ad = fam.adapters
    ad["fused-r4"] = pf.fused_moe_adapter(os.path.join(root, "fused-r4"), seed=1).path
    ad["expert-r8"] = pf.per_expert_adapter(os.path.join(root, "expert-r8"), seed=2, r=8, lora_alpha=24).path
    ad["fused-r6-rslora"] = pf.fused_moe_adapter(os.path.join(root, "fused-r6"), seed=3, r=6, lora_alpha=3,
                                                 use_rslora=True, rank_pattern={"k_proj": 2}).path
    ad["attn-r16"] = pf.fused_moe_adapter(os.path.join(root, "attn-r16"), seed=4, r=16, lora_alpha=32,
                                          target_parameters=None).path
    return fam


def mixtral(root) -> Family:
    config = MixtralConfig(**pf.TINY, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    fam = Family("mixtral", _save(MixtralForCausalLM(config), os.path.join(root, "base")))
    ad = fam.adapters
    ad["w-r4"] = pf.per_expert_adapter(os.path.join(root, "w-r4"), style="mixtral", seed=1).path

    def mixtral_base():  # get_peft_model wraps its module in place: a fresh one per adapter
        return MixtralForCausalLM(config), pf.model_config(config)

    ad["fused-r8-rslora"] = pf.make_adapter(os.path.join(root, "fused-r8"), mixtral_base(), seed=2, r=8,
                                            lora_alpha=4, use_rslora=True, target_modules=pf.ATTENTION,
                                            target_parameters=pf.FUSED_EXPERTS).path
    ad["w-r2"] = pf.per_expert_adapter(os.path.join(root, "w-r2"), style="mixtral", seed=3, r=2,
                                       lora_alpha=8).path
    ad["attn-r12"] = pf.make_adapter(os.path.join(root, "attn-r12"), mixtral_base(), seed=4, r=12, lora_alpha=12,
                                     target_modules=["q_proj", "v_proj"]).path
    return fam


def llama(root) -> Family:
    base, _ = pf.llama_base(0)
    fam = Family("llama", _save(base, os.path.join(root, "base")))
    ad = fam.adapters
    ad["all-r8"] = pf.dense_adapter(os.path.join(root, "all-r8"), seed=1).path
    ad["all-r4-rslora"] = pf.dense_adapter(os.path.join(root, "all-r4"), seed=2, r=4, lora_alpha=16,
                                           use_rslora=True).path
    ad["mlp-r16"] = pf.dense_adapter(os.path.join(root, "mlp-r16"), seed=3, r=16, lora_alpha=8,
                                     target_modules=["gate_proj", "up_proj", "down_proj"]).path
    ad["attn-r2"] = pf.dense_adapter(os.path.join(root, "attn-r2"), seed=4, r=2, lora_alpha=4,
                                     target_modules=pf.ATTENTION).path
    return fam


def qwen3_dense(root) -> Family:
    config = Qwen3Config(**pf.TINY, intermediate_size=96)
    torch.manual_seed(0)
    fam = Family("qwen3", _save(Qwen3ForCausalLM(config), os.path.join(root, "base")))
    targets = pf.ATTENTION + ["gate_proj", "up_proj", "down_proj"]
    for i, (rank, alpha) in enumerate(((4, 8), (8, 2), (12, 24), (2, 2))):
        base = (Qwen3ForCausalLM(config), pf.model_config(config))  # a fresh module: PEFT wraps it in place
        path = os.path.join(root, f"q3-r{rank}")
        fam.adapters[f"q3-r{rank}"] = pf.make_adapter(path, base, seed=i + 1, r=rank, lora_alpha=alpha,
                                                      target_modules=targets).path
    return fam


def gptoss_config():
    from transformers import GptOssConfig

    return GptOssConfig(**pf.TINY, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                        sliding_window=8, layer_types=["sliding_attention", "full_attention"])


def gptoss(root) -> Family:
    """GPT-OSS: a sliding (window 8) and a full layer, random biases and sinks, three fused-format adapters."""
    from transformers import GptOssForCausalLM

    config = gptoss_config()
    torch.manual_seed(0)
    model = GptOssForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                param.normal_(0, 0.5)
    fam = Family("gpt_oss", _save(model, os.path.join(root, "base")))

    def base():  # PEFT wraps its module in place: a fresh one per adapter
        return GptOssForCausalLM(config), pf.model_config(config)

    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    fam.adapters["all-r4"] = pf.make_adapter(os.path.join(root, "all-r4"), base(), seed=1, r=4, lora_alpha=8,
                                             target_modules=pf.ATTENTION, target_parameters=experts).path
    fam.adapters["experts-r8-rslora"] = pf.make_adapter(os.path.join(root, "experts-r8"), base(), seed=2, r=8,
                                                        lora_alpha=4, use_rslora=True, target_modules=[],
                                                        target_parameters=experts).path
    fam.adapters["attn-r16"] = pf.make_adapter(os.path.join(root, "attn-r16"), base(), seed=3, r=16,
                                               lora_alpha=16, target_modules=pf.ATTENTION).path
    return fam


FAMILIES = {"qwen3_moe": qwen3_moe, "mixtral": mixtral, "llama": llama, "qwen3": qwen3_dense, "gpt_oss": gptoss}


def family_fixture(names, cuda: bool = False):
    """A module-scoped ``family`` fixture over ``names`` (keys of `FAMILIES`): each family's checkpoint and
    adapters, made once per module; ``cuda``: skipped without a GPU."""
    @pytest.fixture(scope="module", params=list(names))
    def family(request, tmp_path_factory):
        if cuda and not torch.cuda.is_available():
            pytest.skip("needs CUDA")
        return FAMILIES[request.param](tmp_path_factory.mktemp(request.param))
    return family


def oracle_fixture():
    """A module-scoped ``oracle`` fixture: transformers + PEFT for the module's ``family``, in fp32 on the CPU."""
    @pytest.fixture(scope="module")
    def oracle(family):
        return Oracle(family)
    return oracle


class Oracle:
    """transformers + PEFT, one model per adapter, each adapter alone."""

    def __init__(self, fam: Family, dtype=torch.float32, device="cpu") -> None:
        self.fam, self.dtype, self.device = fam, dtype, device
        self._models: dict = {}

    def model(self, adapter: str | None):
        if adapter not in self._models:
            base = AutoModelForCausalLM.from_pretrained(self.fam.model_dir, dtype=self.dtype).to(self.device)
            model = base if adapter is None else PeftModel.from_pretrained(base, self.fam.adapters[adapter])
            self._models[adapter] = model.eval()
        return self._models[adapter]

    @torch.no_grad()
    def logits(self, adapter: str | None, token_ids: list[int]) -> torch.Tensor:
        """``[len(token_ids), V]`` float32 logits of the whole sequence."""
        ids = torch.tensor([token_ids], device=self.device)
        return self.model(adapter)(ids).logits[0].float()

    @torch.no_grad()
    def greedy(self, adapter: str | None, prompt: list[int], count: int) -> list[int]:
        tokens = list(prompt)
        for _ in range(count):
            tokens.append(int(self.logits(adapter, tokens)[-1].argmax()))
        return tokens[len(prompt):]


def generated_logits_error(oracle: Oracle, completion) -> float:
    """Max abs difference between the engine's logits for each generated token and the oracle's."""
    full = completion.prompt_token_ids + completion.token_ids
    want = oracle.logits(completion.adapter, full)
    n = len(completion.prompt_token_ids)
    got = torch.stack(completion.logits).to(want.device)
    return (got - want[n - 1: n - 1 + len(completion.token_ids)]).abs().max().item()


def common_prefix(got, want, tokens: int) -> int:
    """Tokens two completions share from the start, their logits there checked close (mean difference
    at most 1 % of the mean logit): bf16 runs of two equal computations may part at a near tie."""
    same = 0
    while same < tokens and got.token_ids[same] == want.token_ids[same]:
        same += 1
    if same:
        diff = (torch.stack(got.logits[:same]) - torch.stack(want.logits[:same])).abs()
        scale = torch.stack(want.logits[:same]).abs().mean()
        assert diff.mean() <= 0.01 * scale, f"{got.adapter}: mean logit difference {diff.mean():.4g}"
    return same


@dataclass(frozen=True)
class Comings:
    """A workload of requests coming and going (`drive_comings_and_goings`)."""

    seed: int
    first: int  # requests added before the first step
    join_at: int  # step before which four more join
    abort_at: int  # step before which r0 (60 tokens at most) is aborted
    prompt: tuple[int, int]  # prompt lengths, a range
    tokens: tuple[int, int]  # max_tokens of all but r0, a range
    stop_every: int  # requests 1, 5, 9, ... stop on every token id in range(0, 128, stop_every)


def drive_comings_and_goings(engine, names: list, w: Comings) -> tuple[dict, bool]:
    """Step ``engine`` to the end over ``w``'s requests, round-robin over ``names`` and the base model, r3
    seeded at temperature 0.9, the rest greedy; returns request id -> (tokens, finish reason) and whether
    the abort found r0 live."""
    rng, choices, greedy = random.Random(w.seed), [*names, None], SamplingParams(temperature=0)

    def request(i: int) -> Request:
        sampling = SamplingParams(temperature=0.9, seed=11) if i == 3 else greedy
        stop = tuple(range(0, 128, w.stop_every)) if i % 4 == 1 else ()
        return Request(f"r{i}", [rng.randrange(1, 128) for _ in range(rng.randrange(*w.prompt))],
                       choices[i % len(choices)], sampling, max_tokens=60 if i == 0 else rng.randrange(*w.tokens),
                       stop_token_ids=stop)

    for i in range(w.first):
        engine.add_request(request(i))
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, object] = {}
    step, aborted = 0, False
    while engine.has_unfinished():
        step += 1
        if step == w.join_at:
            for i in range(w.first, w.first + 4):
                engine.add_request(request(i))
        if step == w.abort_at:
            aborted = engine.abort("r0")
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                reasons[out.request_id] = out.finish_reason
    return {rid: (tokens[rid], reasons.get(rid)) for rid in tokens}, aborted
