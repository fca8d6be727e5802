"""A hash embedding's rows split over parameter-server tasks: row r on shard r mod N.

Row numbers are dense (the live rows are ``1..size``, `hash_embedding`), so
interleaving them puts ``size / N`` rows, to one row, on each of N tasks, whatever the
stream, while the id-to-row index stays in one place (the coordinator). Each shard is
one variable on its task that grows and shrinks with the table; reads and writes go
to the shard holding each row (a gather or scatter runs on the variable's task, so
only the rows a step uses cross the network).

The shards' variables have an unknown rank: a variable of partly known shape ([None,
width]) captured by a function that `ClusterCoordinator` schedules aborts the worker
process in TensorFlow 2.21 (``tensor_shape.cc: Check failed: size >= 0``); reads put
the width back (`tf.ensure_shape`).

A variable's length is read from its shape (`variable_shape`), never from its value:
once a sparse op touched a variable, TensorFlow copies all of it on every dense read,
and ``tf.shape(variable)`` is one (134 MB a step at 2^24 stamps).

`gather`, `resize` and `shard_variables` take either a `RowShards` or one ordinary
variable (the rows of a table in one process), and both have ``scatter_update``, so
the table's code is the same for both.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf


def variable_shape(variable: tf.Variable) -> tf.Tensor:
    """`variable`'s shape (int64) as it is now, without reading its value."""
    return tf.raw_ops.VariableShape(input=variable.handle, out_type=tf.int64)


class RowShards(tf.Module):
    """Rows of one table on `devices`, row r on ``devices[r % N]`` at ``r // N``.

    Args:
        initial: The first rows, `(rows, ...)`.
        name: Prefix of the shards' variable names.
        devices: One device per shard (``/job:ps/replica:0/task:i/device:CPU:0``).
        trainable: Whether the variables are trainable (what gradients are taken to).
    """

    def __init__(
        self, initial: tf.Tensor, name: str, devices: Sequence[str], trainable: bool = False
    ) -> None:
        super().__init__(name=name)
        if not devices:
            raise ValueError("RowShards needs at least one device")
        self.row_shape = initial.shape[1:]
        self.dtype = initial.dtype
        self.devices = list(devices)
        self.shards = []
        for index, device in enumerate(self.devices):
            with tf.device(device):
                self.shards.append(
                    tf.Variable(
                        initial[index :: len(self.devices)],
                        shape=tf.TensorShape(None),
                        trainable=trainable,
                        name=f"{name}_{index}",
                    )
                )

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    @property
    def shape(self) -> tf.TensorShape:
        return tf.TensorShape([None]).concatenate(self.row_shape)

    def _split(self, slots: tf.Tensor) -> tuple[list[tf.Tensor], list[tf.Tensor]]:
        """Per shard: the positions in `slots` of its rows, and their local numbers."""
        shard = tf.cast(slots % self.num_shards, tf.int32)
        positions = tf.dynamic_partition(tf.range(tf.size(slots)), shard, self.num_shards)
        local = tf.dynamic_partition(slots // self.num_shards, shard, self.num_shards)
        return positions, local

    def gather(self, slots: tf.Tensor) -> tf.Tensor:
        """Rows `slots` (`(n,)`), `(n, ...)`; a differentiable read of each shard."""
        if self.num_shards == 1:
            return tf.ensure_shape(tf.gather(self.shards[0], slots), self.shape)
        positions, local = self._split(slots)
        parts = [tf.gather(shard, rows) for shard, rows in zip(self.shards, local, strict=True)]
        return tf.ensure_shape(tf.dynamic_stitch(positions, parts), self.shape)

    def scatter_update(self, slices: tf.IndexedSlices) -> None:
        """Writes ``slices.values`` into rows ``slices.indices``."""
        positions, local = self._split(slices.indices)
        for shard, where, rows in zip(self.shards, positions, local, strict=True):
            shard.scatter_update(tf.IndexedSlices(tf.gather(slices.values, where), rows))

    def resize(self, rows: tf.Tensor) -> None:
        """Makes the table `rows` rows long: rows past it are dropped, new ones zeros."""
        rows = tf.cast(rows, tf.int64)
        for index, shard in enumerate(self.shards):
            held = tf.maximum((rows - index + self.num_shards - 1) // self.num_shards, 0)
            # On the shard's task, so that the rows kept do not cross the network.
            with tf.device(shard.device):
                _resize_variable(shard, held)

    def rows_held(self) -> list[int]:
        """Rows allocated on each shard (eagerly)."""
        return [int(variable_shape(shard)[0].numpy()) for shard in self.shards]


def gather(rows: tf.Variable | RowShards, slots: tf.Tensor) -> tf.Tensor:
    """Rows `slots` of `rows` (one variable or shards)."""
    if isinstance(rows, RowShards):
        return rows.gather(slots)
    return tf.gather(rows, slots)


def resize(rows: tf.Variable | RowShards, num_rows: tf.Tensor) -> None:
    """Makes `rows` `num_rows` long: rows past it are dropped, new ones zeros."""
    if isinstance(rows, RowShards):
        rows.resize(num_rows)
        return
    _resize_variable(rows, tf.cast(num_rows, tf.int64))


def _resize_variable(variable: tf.Variable, num_rows: tf.Tensor) -> None:
    """Makes one variable `num_rows` rows long. To shrink, the rows kept are gathered
    straight into its new value: a slice of a variable that was written sparsely reads
    it whole first, and each fresh buffer of a table costs page faults (trimming 10^7 of
    2^24 rows of 40 floats for a full checkpoint, while training waits: 5.4 s by slice
    and concatenation, 1.2 s by gather)."""
    shape = variable_shape(variable)

    def shrink():
        variable.assign(tf.gather(variable, tf.range(num_rows)))
        return tf.constant(True)

    def grow():
        pad = tf.concat([[num_rows - shape[0]], shape[1:]], 0)
        variable.assign(tf.concat([variable.read_value(), tf.zeros(pad, variable.dtype)], 0))
        return tf.constant(True)

    tf.cond(
        num_rows < shape[0],
        shrink,
        lambda: tf.cond(num_rows > shape[0], grow, lambda: tf.constant(False)),
    )


def shard_variables(rows: tf.Variable | RowShards) -> list[tf.Variable]:
    """The variables holding `rows`."""
    return list(rows.shards) if isinstance(rows, RowShards) else [rows]


def shards_in_checkpoint(reader: tf.train.CheckpointReader, rows_path: str) -> int:
    """How many shards a checkpoint holds of the rows at `rows_path` (its object
    path, ``network/user_embedding/embeddings``): 0 for one variable."""
    keys = reader.get_variable_to_shape_map()
    if f"{rows_path}/.ATTRIBUTES/VARIABLE_VALUE" in keys:
        return 0
    count = 0
    while f"{rows_path}/shards/{count}/.ATTRIBUTES/VARIABLE_VALUE" in keys:
        count += 1
    return count


def num_shards(rows: tf.Variable | RowShards) -> int:
    """0 for one variable, else the number of shards (as `shards_in_checkpoint`)."""
    return rows.num_shards if isinstance(rows, RowShards) else 0
