"""NeuMF: its hyper-parameters, the network, the step's row kernels, the optimisers,
and the Estimator-style ``model_fn`` the runner calls (`neumf_model`)."""
