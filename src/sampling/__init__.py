"""Sampling: how samples are drawn (annealed Langevin dynamics, NCSN) and written (PNG grids, loggers)."""
