"""Task-attributed, in-process py-spy profiling for dask."""

from dask_pyspy import config as _config  # noqa: F401  (registers the `pyspy` dask config namespace)
from dask_pyspy._native import __version__
from dask_pyspy.client import dump, get_memory, get_profile, get_stalls, profile, pyspy_report
from dask_pyspy.local import PySpyProfiler
from dask_pyspy.memory import MemoryProfile
from dask_pyspy.model import Profile
from dask_pyspy.options import SamplerOptions
from dask_pyspy.protocol import StackDump
from dask_pyspy.sampler import Sampler
from dask_pyspy.server.preload import dask_setup, dask_teardown
from dask_pyspy.server.scheduler import PySpyPlugin
from dask_pyspy.server.worker import PySpyWorkerPlugin

__all__ = [
    "MemoryProfile",
    "PySpyPlugin",
    "PySpyProfiler",
    "PySpyWorkerPlugin",
    "Profile",
    "Sampler",
    "SamplerOptions",
    "StackDump",
    "__version__",
    "dask_setup",
    "dask_teardown",
    "dump",
    "get_memory",
    "get_profile",
    "get_stalls",
    "profile",
    "pyspy_report",
]
