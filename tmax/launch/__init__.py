"""Running TMax work on Slurm: job arrays of one function (``tmax.launch.array``)."""
