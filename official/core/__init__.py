"""What both trainers are built on: the Estimator-style runner, model_dir and its
checkpoints, the one-writer lease, precision policies, distribution strategies and
stop signals."""
