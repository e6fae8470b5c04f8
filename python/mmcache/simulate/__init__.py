"""``mmcache simulate``: a real multi-process serving pipeline that shows what the caches save.

>>> from mmcache.simulate import SimulationConfig, run_modes
>>> (shm,) = run_modes(SimulationConfig(requests=50, catalogue=20), ["shm"])  # doctest: +SKIP
>>> shm.wrong_tensors  # doctest: +SKIP
0

:mod:`.workload` makes the requests and does the processing, :mod:`.processes` starts and
supervises P0 (:mod:`.frontend`), P1 and the workers (:mod:`.engine`), which talk through
:mod:`.wire`; :mod:`.report` presents the figures.
"""

from mmcache.factory import MODES
from mmcache.simulate.config import (
    ConfigError,
    RunMetrics,
    SimulationConfig,
    SimulationError,
)
from mmcache.simulate.processes import run_config, run_configs, run_modes

__all__ = [
    "MODES",
    "ConfigError",
    "RunMetrics",
    "SimulationConfig",
    "SimulationError",
    "run_config",
    "run_configs",
    "run_modes",
]
