"""Evaluation metrics shared by every model family: pluggable pieces the LightningModules compose."""
