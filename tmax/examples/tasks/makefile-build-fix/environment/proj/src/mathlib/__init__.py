"""mathlib: small statistics helpers."""
from ._version import __version__
from .stats import mean, median, variance

__all__ = ["__version__", "mean", "median", "variance"]
