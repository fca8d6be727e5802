"""Serving a trained NeuMF: the SavedModel behind raw-id signatures
(`serving_module`), its files written atomically and read back (`export_files`), its
ONNX twin (`onnx_model`), and the export of a trained model or checkpoint
(`neumf_export`); ``python -m recommendation.export`` and ``recommend`` are the
commands over them."""
