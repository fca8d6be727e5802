"""Offline NCF training: the flags and the frozen configs built from them."""
