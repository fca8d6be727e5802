"""The negative-sampling producer: a separate process that writes training cycles and
the evaluation set as TFRecord shards behind ready files (`data_async_generation`;
what it generates in `negative_sampling`, how it writes in `shard_writing`, its
sampling primitives in `stat_utils`), the run-folder protocol both sides share
(`run_folder`), and the trainer's side of it (`data_pipeline`)."""
