"""The offline API, the checkpoint reader and the sampler: bad input, formats, seeds, text, aborts."""

from __future__ import annotations

import json
import os

import engine_support as es
import pytest
import torch
from safetensors.torch import load_file, save_file
from unipage.scheduler import PromptTooLongError, Request, SchedulerConfig

import unipage.runner as runner_module
from unipage import LLM, SamplingParams
from unipage.config import LoRAConfig, PoolConfig
from unipage.engine import Engine
from unipage.errors import AdapterBusyError, CheckpointError, UnknownAdapterError
from unipage.models.weights import Checkpoint
from unipage.sampling import filter_logits, make_generator, sample, sample_tokens

GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return es.qwen3_moe(tmp_path_factory.mktemp("moe"))


@pytest.fixture(scope="module")
def llm(moe):
    return LLM(moe.model_dir, moe.adapters, device="cpu", pool=PoolConfig(num_pages=512),
               lora=LoRAConfig(max_rank=32), scheduler=SchedulerConfig(max_model_len=64))


# -- bad input ---------------------------------------------------------------


def test_unknown_adapter_is_refused_before_anything_runs(llm):
    with pytest.raises(UnknownAdapterError, match="nope"):
        llm.generate([[1, 2], [3, 4]], GREEDY, adapters=[None, "nope"])
    assert not llm.engine.has_unfinished()


def test_prompt_too_long(llm):
    with pytest.raises(PromptTooLongError, match="max_model_len=64"):
        llm.generate([1] * 64, GREEDY)
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("kwargs", [{"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"top_k": -2}])
def test_bad_sampling_values(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)


def test_token_outside_the_vocabulary(llm):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([5, 128], GREEDY)


def test_text_prompt_without_a_tokenizer(llm):
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate("hello", GREEDY)


def test_per_prompt_lists_must_match(llm):
    with pytest.raises(ValueError, match="adapters has 1 entries for 2 prompts"):
        llm.generate([[1], [2]], GREEDY, adapters=["fused-r4"])


def test_busy_adapter_cannot_be_removed(moe):
    engine = Engine(moe.model_dir, device="cpu", pool=PoolConfig(num_pages=512))
    engine.add_adapter("a", moe.adapters["fused-r4"])
    engine.add_request(Request("r", [1, 2, 3], adapter="a", sampling=GREEDY, max_tokens=4))
    engine.step()
    with pytest.raises(AdapterBusyError, match="'a'"):
        engine.remove_adapter("a")
    assert engine.abort("r")
    engine.step()
    engine.remove_adapter("a")
    assert "a" not in engine.memory.adapters


def test_abort_mid_run_frees_everything(moe):
    engine = Engine(moe.model_dir, device="cpu", pool=PoolConfig(num_pages=512))
    engine.add_adapter("a", moe.adapters["expert-r8"])
    for i in range(4):
        engine.add_request(Request(f"r{i}", [1, 2, 3, 4, 5] * (i + 1), adapter="a" if i % 2 else None,
                                   sampling=GREEDY, max_tokens=20))
    for _ in range(3):
        engine.step()
    for i in range(4):
        engine.abort(f"r{i}")
    engine.step()
    assert not engine.has_unfinished() and not engine.runner.seqs
    assert engine.memory.occupancy()["kv"] == 0
    engine.memory.check()


def test_adapter_effects_run_once_the_forward_pass_is_launched(moe, monkeypatch):
    """A step performs its adapter effects inside ``execute``, after the forward pass and before sampling,
    also when nothing runs; the request on the adapter runs in the step after its load.  Only a step that
    may start page copies (effects, or loads in flight) marks the stream for them first."""
    engine = Engine(moe.model_dir, device="cpu", pool=PoolConfig(num_pages=512))
    engine.add_adapter("a", moe.adapters["expert-r8"])
    events = []

    def logged(name, fn):
        def call(*args, **kwargs):
            events.append(name)
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(engine.model, "forward", logged("forward", engine.model.forward))
    monkeypatch.setattr(engine, "_perform", logged("effects", engine._perform))
    monkeypatch.setattr(runner_module, "sample_tokens", logged("sample", runner_module.sample_tokens))
    monkeypatch.setattr(engine.storage, "mark_step", logged("mark", engine.storage.mark_step))
    engine.add_request(Request("r", [1, 2, 3], adapter="a", sampling=GREEDY, max_tokens=2))
    engine.step()  # the load starts (and completes, on CPU); nothing runs
    assert events == ["mark", "effects"] and engine.memory.adapters.get("a").loaded
    events.clear()
    engine.add_request(Request("s", [4, 5, 6], sampling=GREEDY, max_tokens=2))
    engine.step()
    assert events == ["forward", "effects", "sample"]
    assert len(engine.last_step.sampled) == 2  # r (on the adapter) and s ran
    while engine.has_unfinished():
        engine.step()
    engine.memory.check()


@pytest.mark.parametrize("where", ["forward", "start_reads"])
def test_a_failed_step_leaves_the_engine_usable(moe, monkeypatch, where):
    """The forward pass (or, once it is launched, the submission of the step's file reads) raises once: the
    step raises, its adapter effects are still performed, its requests are preempted, and the next steps
    finish every request with the tokens of a run without the fault."""
    def run(fail_at):
        engine = Engine(moe.model_dir, device="cpu", pool=PoolConfig(num_pages=512))
        engine.add_adapter("a", moe.adapters["expert-r8"])
        target = engine.model if where == "forward" else engine.storage
        calls, original = [0], getattr(target, where)

        def flaky(*args, **kwargs):
            calls[0] += 1
            if calls[0] == fail_at:
                raise RuntimeError("injected fault")
            return original(*args, **kwargs)

        monkeypatch.setattr(target, where, flaky)
        for i in range(3):
            engine.add_request(Request(f"r{i}", [1 + i, 2, 3, 4], adapter="a" if i != 1 else None, sampling=GREEDY,
                                       max_tokens=5))
        tokens, faults = {}, 0
        while engine.has_unfinished():
            try:
                outputs = engine.step()
            except RuntimeError as err:
                assert "injected fault" in str(err)
                faults += 1
                continue
            for out in outputs:
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        engine.step()  # the runner drops the last finished request
        assert not engine.runner.seqs and engine.memory.occupancy()["kv"] == 0
        engine.memory.check()
        return tokens, faults

    clean, none = run(fail_at=0)
    faulty, one = run(fail_at=1 if where == "start_reads" else 3)  # start_reads: the step that loads "a"
    assert (none, one) == (0, 1) and faulty == clean and all(len(t) == 5 for t in clean.values())


# -- sampling ----------------------------------------------------------------


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    seeded = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=7)
    alone = llm.generate([3, 1, 4], seeded, max_tokens=12)[0].token_ids
    mixed = llm.generate([[9, 9], [3, 1, 4], [2, 7]], [SamplingParams(temperature=1.0), seeded, GREEDY],
                         max_tokens=12)
    assert mixed[1].token_ids == alone


def test_top_k_one_and_tiny_top_p_are_greedy(llm):
    greedy = llm.generate([5, 6, 7], GREEDY, max_tokens=8)[0].token_ids
    assert llm.generate([5, 6, 7], SamplingParams(temperature=2.0, top_k=1), max_tokens=8)[0].token_ids == greedy
    assert llm.generate([5, 6, 7], SamplingParams(temperature=2.0, top_p=1e-6), max_tokens=8)[0].token_ids == greedy


def test_filter_logits_keeps_the_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = filter_logits(logits, top_k=0, top_p=0.7).isfinite().tolist()
    assert kept == [True, True, False, False]  # 0.5 < 0.7, 0.5 + 0.3 reaches it
    assert filter_logits(logits, top_k=3, top_p=1.0).isfinite().tolist() == [True, True, True, False]


def test_filter_logits_matches_masking_the_sorted_tail():
    """The nucleus is cut without reading anything back on the host: the same as dropping, in sorted order,
    every token whose predecessors' mass reaches top_p."""
    gen = torch.Generator().manual_seed(3)
    for _ in range(20):
        logits = torch.randn(50, generator=gen) * 3
        top_p = float(torch.rand((), generator=gen))
        probs = torch.softmax(logits, dim=-1)
        order = torch.argsort(logits, descending=True)
        before = torch.cumsum(probs[order], dim=-1) - probs[order]
        keep = set(order[(before < top_p) | (torch.arange(50) == 0)].tolist())
        got = filter_logits(logits, top_k=0, top_p=top_p)
        assert {i for i in range(50) if got[i].isfinite()} == keep
        assert torch.equal(got[sorted(keep)], logits[sorted(keep)])


def test_sample_tokens_gives_sample_as_a_tensor():
    """`sample_tokens` (what the runner feeds to a decode step run ahead) is `sample` before the host reads
    it: greedy and seeded rows alike."""
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, seed=5, top_p=0.9),
              SamplingParams(temperature=1.2, seed=6, top_k=4), SamplingParams(temperature=0)]
    tokens = sample_tokens(logits, params, [make_generator(p, torch.device("cpu")) for p in params])
    assert tokens.dtype == torch.int64 and tokens.shape == (4,)
    assert tokens.tolist() == sample(logits, params, [make_generator(p, torch.device("cpu")) for p in params])
    assert tokens[0] == logits[0].argmax() and tokens[3] == logits[3].argmax()


def test_sampler_draws_from_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    params = SamplingParams(temperature=1.0, seed=0)
    gen = make_generator(params, torch.device("cpu"))
    counts = torch.bincount(torch.tensor([sample(logits, [params], [gen])[0] for _ in range(3000)]), minlength=3)
    assert torch.allclose(counts / 3000, torch.tensor([0.7, 0.2, 0.1]), atol=0.03)


def test_stop_token_ends_generation(llm):
    first = llm.generate([8, 8, 8], GREEDY, max_tokens=6)[0].token_ids
    out = llm.generate([8, 8, 8], GREEDY, max_tokens=6, stop_token_ids=(first[2],))[0]
    assert out.finish_reason == "stop" and out.token_ids == first[:first.index(first[2]) + 1]


# -- checkpoints ---------------------------------------------------------------


def _copy_config(src: str, dst) -> None:
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)


def test_sharded_and_fused_checkpoints_read_the_same(moe, tmp_path):
    tensors = load_file(os.path.join(moe.model_dir, "model.safetensors"))
    fused = {k: v for k, v in tensors.items() if ".experts." not in k}
    for layer in range(2):
        p = f"model.layers.{layer}.mlp.experts"
        gate = torch.stack([tensors[f"{p}.{e}.gate_proj.weight"] for e in range(4)])
        up = torch.stack([tensors[f"{p}.{e}.up_proj.weight"] for e in range(4)])
        fused[f"{p}.gate_up_proj"] = torch.cat([gate, up], dim=1)
        fused[f"{p}.down_proj"] = torch.stack([tensors[f"{p}.{e}.down_proj.weight"] for e in range(4)])
    names = sorted(fused)
    shards = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2:]}
    _copy_config(moe.model_dir, tmp_path)
    for shard, keys in shards.items():
        save_file({k: fused[k].contiguous() for k in keys}, str(tmp_path / shard))
    index = {"weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    cpu = torch.device("cpu")
    per_expert = Checkpoint(moe.model_dir, torch.float32, cpu).expert_weights("model.layers.1", 4, 64, 32)
    sharded = Checkpoint(str(tmp_path), torch.float32, cpu).expert_weights("model.layers.1", 4, 64, 32)
    assert per_expert[0] == sharded[0] == "model.layers.1.mlp"
    assert torch.equal(per_expert[1], sharded[1]) and torch.equal(per_expert[2], sharded[2])
    prompt = [4, 8, 15, 16, 23, 42]
    a = LLM(moe.model_dir, device="cpu", pool=PoolConfig(num_pages=64)).generate(prompt, GREEDY, max_tokens=6)
    b = LLM(str(tmp_path), device="cpu", pool=PoolConfig(num_pages=64)).generate(prompt, GREEDY, max_tokens=6)
    assert a[0].token_ids == b[0].token_ids


def test_bad_checkpoints(moe, tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        LLM(str(tmp_path), device="cpu")
    _copy_config(moe.model_dir, tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(CheckpointError, match="pickled"):
        LLM(str(tmp_path), device="cpu")
    config = json.loads((tmp_path / "config.json").read_text()) | {"model_type": "gpt2"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({"x": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="'gpt2' is not supported"):
        LLM(str(tmp_path), device="cpu")


# -- text ------------------------------------------------------------------------


def test_text_in_text_out_with_a_tokenizer(moe, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<eos>", "<unk>"] + [f"w{i}" for i in range(126)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    for name in os.listdir(moe.model_dir):
        os.symlink(os.path.join(moe.model_dir, name), tmp_path / name)
    tok.save(str(tmp_path / "tokenizer.json"))
    llm = LLM(str(tmp_path), {"a": moe.adapters["attn-r16"]}, device="cpu", pool=PoolConfig(num_pages=256))
    out = llm.generate("w5 w6 w7", GREEDY, adapter="a", max_tokens=5, ignore_eos=True)[0]
    assert out.prompt_token_ids == [7, 8, 9]
    assert out.text == " ".join(f"w{t - 2}" if t >= 2 else "<unk>" for t in out.token_ids if t != 0)


def test_random_checkpoint_loads_in_transformers_with_the_same_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    from unipage.config import ModelConfig
    from unipage.models.random_checkpoint import write_random_checkpoint

    model = ModelConfig(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, num_experts=4,
                        top_k=2, expert_intermediate_size=32, intermediate_size=96, mlp_only_layers=(1,),
                        dtype="float32")
    path = write_random_checkpoint(tmp_path / "m", model, vocab=100)
    out = LLM(path, device="cpu", pool=PoolConfig(num_pages=64)).generate([1, 2, 3], GREEDY, max_tokens=5,
                                                                         return_logits=True)[0]
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(path)(torch.tensor([[1, 2, 3, *out.token_ids]])).logits[0]
    assert (torch.stack(out.logits) - ref[2:7]).abs().max().item() <= 1e-4


@pytest.mark.parametrize("family", ["olmoe", "qwen2", "mistral"])
def test_other_families_match_transformers(family, tmp_path):
    """OLMoE (q/k norm over the whole projection), Qwen2 (q/k/v bias), Mistral: base-model logits."""
    import transformers as tf

    classes = {"olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {"intermediate_size": 32, "num_experts": 4,
                                                               "num_experts_per_tok": 2}),
               "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"intermediate_size": 96}),
               "mistral": ("MistralConfig", "MistralForCausalLM", {"intermediate_size": 96})}
    config_name, model_name, extra = classes[family]
    torch.manual_seed(0)
    model = getattr(tf, model_name)(getattr(tf, config_name)(**es.pf.TINY, **extra, eos_token_id=None))
    model.save_pretrained(tmp_path)
    out = LLM(str(tmp_path), device="cpu", pool=PoolConfig(num_pages=64)).generate(
        [1, 2, 3, 4], GREEDY, max_tokens=6, return_logits=True)[0]
    with torch.no_grad():
        ref = model(torch.tensor([[1, 2, 3, 4, *out.token_ids]])).logits[0][3:9]
    assert (torch.stack(out.logits) - ref).abs().max().item() <= 1e-4


def test_seeded_requests_sample_the_same_tokens_when_preempted(moe):
    name = "fused-r4"
    prompts = [[(5 * i + j) % 120 + 1 for j in range(33 + i)] for i in range(6)]
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=i) for i in range(6)]
    names = [name, None] * 3

    def run(pages):
        llm = LLM(moe.model_dir, {name: moe.adapters[name]}, device="cpu", pool=PoolConfig(num_pages=pages),
                  lora=LoRAConfig(max_rank=32), scheduler=SchedulerConfig(max_model_len=128))
        outs = llm.generate(prompts, params, adapters=names, max_tokens=24)
        return [o.token_ids for o in outs], llm.engine.scheduler.stats.preemptions

    roomy, none = run(512)
    adapter_pages = LLM(moe.model_dir, {name: moe.adapters[name]}, device="cpu",
                        pool=PoolConfig(num_pages=512)).engine.memory.adapters.get(name).num_pages
    tight, preemptions = run(adapter_pages + 12)
    assert none == 0 and preemptions > 0
    assert tight == roomy


def test_tiny_temperatures_sample_greedily():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, -1.0, 0.5]])
    params = [SamplingParams(temperature=1e-30), SamplingParams(temperature=1e-6, top_p=0.5)]
    gens = [make_generator(p, torch.device("cpu")) for p in params]
    assert gens == [None, None]
    assert sample(logits, params, gens) == [1, 0]


def test_dense_lora_tables_keep_their_shape_as_adapters_come_and_go(tmp_path):
    """A dense model's LoRA tables hold a slot for every adapter the pool could hold from the start, so
    loads and evictions never change their shape (the decode graphs over them stay valid); an MoE
    model's grow on demand."""
    fam = es.llama(tmp_path)
    llm = LLM(fam.model_dir, fam.adapters, device="cpu", pool=PoolConfig(num_pages=96),
              lora=LoRAConfig(max_rank=32), scheduler=SchedulerConfig(max_model_len=64))
    tables = llm.engine.runner.lora
    generations = set()
    first = next(iter(fam.adapters))
    for name in [*fam.adapters, None, first]:
        llm.generate([1, 2, 3], GREEDY, adapter=name, max_tokens=2)
        generations.add(tables.generation)
        if name == first and len(generations) == 1:
            llm.remove_adapter(first)  # evicted: a slot freed
            llm.add_adapter(first, fam.adapters[first])
    assert tables.num_slots == 128 and len(generations) == 1  # next power of two >= 96 pages
    moe = LLM(es.qwen3_moe(tmp_path / "moe").model_dir, device="cpu", pool=PoolConfig(num_pages=96))
    assert moe.engine.runner.lora.num_slots == 8
