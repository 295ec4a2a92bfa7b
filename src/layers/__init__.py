"""Layers shared by the DEQ maps (``src.deq``) and the models (``src.models``): the recomputing instance norm."""
