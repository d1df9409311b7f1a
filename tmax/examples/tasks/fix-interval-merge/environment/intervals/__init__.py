from .merge import merge_intervals, total_covered

__all__ = ["merge_intervals", "total_covered"]
