"""Evaluation beyond the sampled protocol: full-catalogue ranking metrics, the
baselines scored by them, and paired comparisons of two models' per-user results."""
