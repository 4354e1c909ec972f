"""Task-attributed, in-process py-spy profiling for dask."""

from dask_pyspy._native import __version__
from dask_pyspy.profile import Profile
from dask_pyspy.sampler import Sampler

__all__ = ["Profile", "Sampler", "__version__"]
