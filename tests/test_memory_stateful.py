"""Random walks over the whole bookkeeping, with every invariant checked after each step.

Drives KV allocations with shared prefixes (so prefix hits happen), adapter
requests, load completions and failures, pins, unpins, explicit evictions,
frees — on a pool small enough that reclaim runs all the time — under every
eviction policy.
"""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from unipage.adapter_info import synthetic_info
from unipage.adapters import LoadAdapter, Residency
from unipage.config import LoRAConfig, ModelConfig, PoolConfig, UnipageConfig
from unipage.errors import AdapterError
from unipage.eviction import POLICIES
from unipage.memory import UnifiedMemory

MODEL = ModelConfig(num_layers=1, hidden_size=64, num_heads=1, num_kv_heads=1, head_dim=64,
                    intermediate_size=64, dtype="float32")
RANKS = {"a": 1, "b": 2, "c": 3, "d": 4, "twin": 2}
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [7] * 12]
# The built-in policies: one registered elsewhere (the simulator's Belady, once unipage.sim is imported by
# another test module) may need more than the bookkeeping.
BUILT_IN = sorted(name for name, cls in POLICIES.items() if cls.__module__ == "unipage.eviction")


class MemoryMachine(RuleBasedStateMachine):
    @initialize(policy=st.sampled_from(BUILT_IN), pages=st.integers(6, 14))
    def setup(self, policy, pages):
        config = UnipageConfig(MODEL, PoolConfig(block_tokens=4, num_pages=pages),
                               LoRAConfig(max_rank=8, eviction_policy=policy, host_cache_bytes=6000))
        self.memory = UnifiedMemory(config)
        for name, rank in RANKS.items():
            digest = "digest-b" if name == "twin" else f"digest-{name}"
            self.memory.adapters.register(name, synthetic_info(MODEL, rank, digest=digest))
        self.seqs = {}  # seq id -> (adapter or None, tokens)
        self.loading = []
        self.next_id = 0

    # -- adapters --------------------------------------------------------
    @rule(name=st.sampled_from(sorted(RANKS)), protect=st.booleans())
    def request(self, name, protect):
        guard = frozenset(("adapter", n) for n in self.memory.adapters.resident()) if protect else frozenset()
        state = self.memory.adapters.request(name, guard)
        for effect in self.memory.adapters.take_effects():
            if isinstance(effect, LoadAdapter):
                self.loading.append(effect.name)
        assert state in Residency

    @precondition(lambda self: self.loading)
    @rule(index=st.integers(0, 10), ok=st.booleans())
    def finish_load(self, index, ok):
        name = self.loading.pop(index % len(self.loading))
        if self.memory.adapters.get(name).resident:
            (self.memory.adapters.load_done if ok else self.memory.adapters.load_failed)(name)

    @rule(name=st.sampled_from(sorted(RANKS)))
    def evict(self, name):
        record = self.memory.adapters.get(name)
        try:
            self.memory.adapters.evict(name)
        except AdapterError:
            assert not record.resident or record.pins or not record.loaded
        self.memory.adapters.take_effects()

    # -- sequences -------------------------------------------------------
    @rule(prefix=st.sampled_from(range(len(PREFIXES))), extra=st.integers(0, 9),
          adapter=st.sampled_from([None] + sorted(RANKS)))
    def open_sequence(self, prefix, extra, adapter):
        adapters, kv = self.memory.adapters, self.memory.kv
        if adapter is not None:
            record = adapters.get(adapter)
            if not (record.resident and record.loaded):
                return
            adapters.pin(adapter)
        tokens = PREFIXES[prefix] + [100 + extra] * extra
        seq_id, self.next_id = self.next_id, self.next_id + 1
        salt = adapters.get(adapter).info.digest if adapter else ""
        kv.open(seq_id, tokens, salt, max_cached_tokens=len(tokens) - 1)
        self.seqs[seq_id] = (adapter, tokens)
        if kv.grow(seq_id, len(tokens)):
            kv.commit(seq_id, tokens)
        else:
            self._finish(seq_id)

    @precondition(lambda self: self.seqs)
    @rule(index=st.integers(0, 100), new=st.integers(1, 6))
    def decode(self, index, new):
        seq_id = sorted(self.seqs)[index % len(self.seqs)]
        adapter, tokens = self.seqs[seq_id]
        grown = tokens + [200 + seq_id % 7] * new
        if self.memory.kv.grow(seq_id, len(grown)):
            self.seqs[seq_id] = (adapter, grown)
            self.memory.kv.commit(seq_id, grown)

    @precondition(lambda self: self.seqs)
    @rule(index=st.integers(0, 100))
    def finish(self, index):
        self._finish(sorted(self.seqs)[index % len(self.seqs)])

    def _finish(self, seq_id):
        adapter, _ = self.seqs.pop(seq_id)
        self.memory.kv.free(seq_id)
        if adapter is not None:
            self.memory.adapters.unpin(adapter)
        self.memory.adapters.take_effects()

    @invariant()
    def consistent(self):
        if hasattr(self, "memory"):
            self.memory.check()
            assert sum(self.memory.occupancy().values()) == self.memory.pool.num_pages


TestMemoryMachine = MemoryMachine.TestCase
TestMemoryMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_the_bookkeeping_imports_no_torch():
    import subprocess
    import sys

    code = ("import sys, unipage.memory, unipage.adapter_info, unipage.host_cache; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
