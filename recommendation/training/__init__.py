"""Offline NCF training: the flags and the frozen configs built from them, the
train/eval cycles, model selection on validation, pre-training, and reporting."""
