"""The version, in a module of its own so that the modules which record it import nothing else."""

__version__ = "0.1.0"
