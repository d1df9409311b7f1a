"""Synthetic task data: sampling axes, generation (``tmax gen``), and what follows it."""
