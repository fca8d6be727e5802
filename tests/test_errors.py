"""How entry points end: bad input and I/O errors as one ``error:`` line, a failure of
the program's own computation as a traceback to report."""

from __future__ import annotations

import pytest
import tensorflow as tf

from official.utils.misc import errors


def test_a_path_the_file_system_rejects_is_one_error_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        with errors.exit_on_user_errors():
            tf.io.gfile.exists("gs://")  # an InvalidArgumentError of the file system
    assert exit_.value.code == 1
    assert capsys.readouterr().err == "error: GCS path doesn't contain a bucket name: gs://\n"
    with pytest.raises(SystemExit) as exit_:
        with errors.exit_on_user_errors():
            tf.io.gfile.GFile(str(tmp_path / "missing")).read()
    assert exit_.value.code == 1
    assert capsys.readouterr().err == f"error: {tmp_path / 'missing'}; No such file or directory\n"


@pytest.mark.parametrize("traced", [True, False])
def test_an_op_given_an_index_out_of_range_stays_a_traceback(traced):
    rows = tf.Variable(tf.zeros([3]))

    def gather(index):
        return tf.gather(rows, index)

    with pytest.raises(tf.errors.InvalidArgumentError, match=r"indices\[0\] = 5 is not in"):
        with errors.exit_on_user_errors(ValueError):
            (tf.function(gather) if traced else gather)(tf.constant([5]))
