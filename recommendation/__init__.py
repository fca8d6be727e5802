"""NCF (NeuMF) on MovieLens, MLPerf style, and online training from event streams."""

import official  # noqa: F401 (quiets TensorFlow's INFO lines before anything imports it)
