"""NeuMF: the network, its loss and metrics, lazy Adam, and the Estimator-style
``model_fn`` the runner calls."""
