"""What a running process needs, below every other package: atomic files, checkpoint files, RNG states, progress of
long phases, the run directory, the float environment. Imports nothing of ``src``."""
