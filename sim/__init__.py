"""unipage.sim — a discrete-event simulator on the real scheduler and pool (``unipage-sim``).

    from unipage.sim import load_config, simulate, make_record

    config = load_config("study.toml", {"rate": 8.0, "eviction": "belady"})
    result = simulate(config)          # the real Scheduler + UnifiedMemory on a simulated clock
    record = make_record(result)       # one JSON-ready dict: config, seed, metrics, occupancy

Modules: ``config`` (TOML -> SimConfig), ``workload`` (synthetic streams and
trace replay), ``profile`` (the cost model's coefficients), ``engine`` (the
simulated executor and event loop), ``belady`` (the offline eviction bound,
registered as the pool policy ``belady`` on import), ``metrics`` (records),
``sweep`` (grids over cores), ``report`` (tables, CSV, JSON lines, plots),
``study`` (docs/sim_study.md's runs), ``cli`` (``unipage-sim``).
See docs/sim.md.
"""

from unipage.sim import belady as _belady  # noqa: F401 - registers the "belady" eviction policy
from unipage.sim.config import SimConfig, build_config, load_config
from unipage.sim.engine import ClosedLoop, SimResult, Simulation, simulate
from unipage.sim.errors import SimInputError, SimulationError
from unipage.sim.metrics import make_record, summarize
from unipage.sim.profile import BUILTIN_PROFILES, CostProfile
from unipage.sim.workload import Trace, load_trace

__all__ = ["BUILTIN_PROFILES", "ClosedLoop", "CostProfile", "SimConfig", "SimInputError", "SimResult", "Simulation",
           "SimulationError", "Trace", "build_config", "load_config", "load_trace", "make_record", "simulate",
           "summarize"]
