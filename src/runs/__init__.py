"""A run's life on top of the house: train (``src.train``), evaluate (``src.evaluate``) and sample
(``src.sample``) a run, and load a finished one back from its checkpoint."""
