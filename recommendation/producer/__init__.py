"""The negative-sampling producer: a separate process that writes training cycles and
the evaluation set as TFRecord shards behind ready files (`data_async_generation`,
its sampling primitives in `stat_utils`), the run-folder protocol both sides share
(`run_folder`), and the trainer's side of it (`data_pipeline`)."""
