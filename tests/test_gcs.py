"""Every path on gs://: ncf-main, recommend and ncf-online against a real GCS JSON API
server (the `gcs` fixture: fake-gcs-server behind a TLS proxy, reached by TensorFlow's
own GCS filesystem), each compared with the same run on local paths.

The runs on gs:// happen in subprocesses in the fixture's mount namespace; what they
wrote is read back from the server's API directly, not through TensorFlow.
"""

from __future__ import annotations

import json
import os
import re
import sys
import zlib

import numpy as np
import pytest
import tensorflow as tf
from conftest import ROOT, TINY_NCF_MAIN_FLAGS, run_module

from recommendation import recommend
from recommendation.online.state import versioned_export

NCF_FLAGS = [
    *TINY_NCF_MAIN_FLAGS,
    "--train_epochs=2",
    "--noenable_xla",
    "--output_ml_perf_compliance_logging",
    "--mlperf_submission_division=open",
    "--nomlperf_clear_caches",
]
USERS = [1, 7, 42, 150]


def _ncf_paths(root: str) -> list[str]:
    return [
        f"--data_dir={root}/data",
        f"--model_dir={root}/model",
        f"--export_dir={root}/export",
        f"--benchmark_log_dir={root}/bench",
    ]


def _python(gcs, *args: str):
    result = gcs.run([sys.executable, *args], cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _download(gcs, prefix: str, local: str) -> str:
    """Copies every object under `prefix` into folder `local` (through the server's API)."""
    for name in _files(gcs, prefix):
        path = os.path.join(local, os.path.relpath(name, prefix))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as out:
            out.write(gcs.read(name))
    return local


def _metrics(summary_line: str) -> str:
    """The summary line up to its throughput (which is timing)."""
    return re.sub(r", [\d,.]+ training examples/s.*", "", summary_line, flags=re.DOTALL)


def _evaluations(jsonl: str) -> list[tuple]:
    records = [json.loads(line) for line in jsonl.splitlines() if line.strip()]
    return [
        (r["epoch"], r["hr"], r["ndcg"], r["loss"]) for r in records if r["kind"] == "evaluation"
    ]


def _mlperf_keys(log: str) -> list[str]:
    """The keys logged, sorted (the producer's interleave with the trainer's by time)."""
    return sorted(re.findall(r'"key": "(\w+)"', log))


def _files(gcs, prefix: str) -> list[str]:
    """The objects under `prefix` but folder markers (``name/``, from makedirs)."""
    return [name for name in gcs.objects(prefix) if not name.endswith("/")]


def _written_last(gcs, prefix: str, marker: str) -> bool:
    """Whether object `prefix/marker` was created after every other object under `prefix`."""
    created = {name: int(gcs.metadata(name)["generation"]) for name in _files(gcs, prefix + "/")}
    last = max(created.values())
    return created[f"{prefix}/{marker}"] == last and sorted(created.values()).count(last) == 1


@pytest.fixture(scope="module")
def ncf_runs(gcs, tmp_path_factory):
    """ncf-main with the same flags and seed on local paths and on gs://bucket/ncf."""
    local = tmp_path_factory.mktemp("local")
    on_local = run_module("recommendation.ncf_main", *NCF_FLAGS, *_ncf_paths(str(local)))
    assert on_local.returncode == 0, on_local.stderr[-3000:]
    on_gcs = gcs.run(
        [
            sys.executable,
            "-m",
            "recommendation.ncf_main",
            *NCF_FLAGS,
            *_ncf_paths("gs://bucket/ncf"),
        ],
        cwd=ROOT,
    )
    assert on_gcs.returncode == 0, on_gcs.stderr[-3000:]
    return local, on_local, on_gcs


def test_ncf_main_on_gcs_trains_like_a_local_run(gcs, ncf_runs):
    local, on_local, on_gcs = ncf_runs
    assert _metrics(on_gcs.stdout) == _metrics(on_local.stdout)
    assert on_gcs.stdout.startswith("best HR@10=")
    local_log = open(local / "bench" / "benchmark.jsonl").read()
    gcs_log = gcs.read("ncf/bench/benchmark.jsonl").decode()
    assert _evaluations(gcs_log) == _evaluations(local_log) and len(_evaluations(gcs_log)) == 2
    names = gcs.objects("ncf/")
    model = [n[len("ncf/model/") :] for n in names if n.startswith("ncf/model/")]
    assert "checkpoint" in model and any(re.fullmatch(r"ckpt-\d+\.index", n) for n in model)
    assert any(n.startswith("events.out.tfevents.") for n in model)  # TensorBoard
    assert {"ncf/data/synthetic/ncf_cache.npz", "ncf/data/synthetic/ncf_cache.json"} <= set(names)
    # The producer's run folder (its shards, ready files and log) is gone again.
    assert not [n for n in names if n.startswith("ncf/data/synthetic/runs/ncf_run_")]
    assert not [n for n in names if ".tmp-" in n or ".old-" in n]  # no temporaries left
    # The MLPerf log, the producer's part merged in, holds what the local one holds.
    gcs_mlperf = gcs.read("ncf/model/mlperf_compliance.log").decode()
    local_mlperf = open(local / "model" / "mlperf_compliance.log").read()
    assert _mlperf_keys(gcs_mlperf) == _mlperf_keys(local_mlperf)
    assert "input_step_train_neg_gen" in _mlperf_keys(gcs_mlperf)


def test_the_export_on_gcs_is_the_local_one_with_its_saved_model_pb_written_last(gcs, ncf_runs):
    local, _, _ = ncf_runs
    local_files = sorted(
        os.path.relpath(os.path.join(folder, name), local / "export")
        for folder, _, names in os.walk(local / "export")
        for name in names
    )
    gcs_files = [n[len("ncf/export/") :] for n in _files(gcs, "ncf/export/")]
    assert gcs_files == local_files and "saved_model.pb" in gcs_files
    # A reader of gs:// trusts saved_model.pb (tf.saved_model.contains_saved_model):
    # it must appear only once every other file of the export is there.
    assert _written_last(gcs, "ncf/export", "saved_model.pb")


def test_recommend_reads_an_export_and_writes_its_csv_on_gcs(gcs, ncf_runs, tmp_path):
    local, _, _ = ncf_runs
    gcs.write("rec/users.txt", "".join(f"{user}\n" for user in USERS).encode())
    on_gcs = gcs.run(
        [
            sys.executable,
            "-m",
            "recommendation.recommend",
            "--export_dir=gs://bucket/ncf/export",
            "--users_file=gs://bucket/rec/users.txt",
            "--output=gs://bucket/rec/recs.csv",
            "--k=5",
        ],
        cwd=ROOT,
    )
    assert on_gcs.returncode == 0, on_gcs.stderr[-3000:]
    assert "wrote 20 recommendations for 4 users to gs://bucket/rec/recs.csv" in on_gcs.stdout
    # The same from the local export of the same run, in this process.
    item_ids, scores = recommend.Recommender(str(local / "export"))(np.array(USERS), 5)
    recommend.write_csv(str(tmp_path / "recs.csv"), USERS, item_ids, scores, None)
    assert gcs.read("rec/recs.csv").decode() == (tmp_path / "recs.csv").read_text()


ONLINE_FLAGS = [
    "--num_factors=4",
    "--layers=8,4",
    "--user_capacity=512",
    "--item_capacity=256",
    "--prequential_negatives=9",
    "--batch_size=64",
    "--sink_size=1",
    "--linger_seconds=5",
    "--seed=1",
    # Step cadences only (the seconds far away), so both runs end with the same version
    # (those before it are written on a thread of their own: one due while another is
    # written waits for it, so which steps they hold is timing).
    "--checkpoint_every_steps=4",
    "--checkpoint_every_secs=1000",
    "--export_every_steps=4",
    "--export_every_secs=1000",
    "--keep_exports=2",
    "--idle_timeout_secs=1",
]


def _online_paths(root: str) -> list[str]:
    return [
        f"--events_dir={root}/events",
        f"--model_dir={root}/model",
        f"--export_dir={root}/export",
        f"--summary_file={root}/summary.json",
        f"--trained_events_log={root}/trained.txt",
    ]


def _event_lines(count: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    users = rng.integers(0, 300, count)
    items = users % 40 + rng.integers(0, 20, count)
    return "".join(f"{u},{i},{t}\n" for t, (u, i) in enumerate(zip(users, items, strict=True)))


def _scores(export_dir: str) -> np.ndarray:
    served = tf.saved_model.load(export_dir).signatures["serving_default"]
    users = tf.constant(np.arange(0, 300, 7), tf.int64)
    return served(user_id=users, item_id=users % 40)["scores"].numpy()


def _version_folders(names: list[str]) -> list[int]:
    """The numeric folders of ``online/export/`` among object `names`."""
    folders = {name.split("/")[2] for name in names if name.count("/") >= 3}
    return sorted(int(folder) for folder in folders if folder.isdigit())


def _online_main(gcs, root: str):
    args = ["recommendation.online_main", *ONLINE_FLAGS, *_online_paths(root)]
    if root.startswith("gs://"):
        result = gcs.run([sys.executable, "-m", *args], cwd=ROOT)
    else:
        result = run_module(*args)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_online_training_on_gcs_checkpoints_exports_and_resumes_like_a_local_run(gcs, tmp_path):
    local = tmp_path / "local"
    (local / "events").mkdir(parents=True)
    first, more = _event_lines(640, seed=1), _event_lines(256, seed=2)
    (local / "events" / "a.csv").write_text(first)
    gcs.write("online/events/a.csv", first.encode())
    _online_main(gcs, str(local))
    _online_main(gcs, "gs://bucket/online")
    gcs_summary = json.loads(gcs.read("online/summary.json"))
    local_summary = json.loads((local / "summary.json").read_text())
    for key in ("events", "steps", "dead_letters", "stopped_by"):
        assert gcs_summary[key] == local_summary[key], key
    trained = gcs.read("online/trained.txt").decode().split()
    assert trained == (local / "trained.txt").read_text().split() and len(trained) == 640
    names = gcs.objects("online/export/")
    local_versions = versioned_export.versions(str(local / "export"))
    assert _version_folders(names)[-1] == local_versions[-1] == 10
    # The publications between versions, beside them (whole objects, no temporaries).
    assert [n for n in names if n.startswith("online/export/publications/")]
    version = str(local_versions[-1])
    served = _download(gcs, f"online/export/{version}/", str(tmp_path / "served"))
    np.testing.assert_array_equal(_scores(served), _scores(str(local / "export" / version)))

    # Events appended: the restarted trainer resumes from its gs:// checkpoint.
    gcs.write("online/events/a.csv", (first + more).encode())
    resumed = _online_main(gcs, "gs://bucket/online").stdout
    # A full checkpoint at step 4, deltas at 8 and at the end (10): on gs:// too.
    assert f"restored gs://bucket/online/model/delta-{gcs_summary['steps']}" in resumed
    assert json.loads(gcs.read("online/summary.json"))["events"] == 256  # not redone
    trained = gcs.read("online/trained.txt").decode().split()
    assert len(trained) == len(set(trained)) == 640 + 256  # every event once
    names = gcs.objects("online/export/")
    assert not [n for n in names if ".tmp-" in n or ".old-" in n]
    kept = _version_folders(names)
    assert len(kept) == 2 and kept[-1] > local_versions[-1]
    for version in kept:
        assert _written_last(gcs, f"online/export/{version}", versioned_export.INFO_FILE)
    info = json.loads(gcs.read(f"online/export/{kept[-1]}/{versioned_export.INFO_FILE}"))
    assert info["position"]["offsets"] == {"a.csv": len(first + more)}


def test_an_event_file_rewritten_on_gcs_is_read_again_and_one_replaced_to_append_is_not(gcs):
    """No inode on gs://: the size and the checksum before the offset tell a file
    rewritten from one replaced by a longer copy of itself (how an object grows)."""
    script = """
import json, tensorflow as tf
from recommendation.online import sources
from recommendation.online.sources.dead_letters import DeadLetterFile
folder = "gs://bucket/events"
def write(users):
    with tf.io.gfile.GFile(folder + "/a.csv", "w") as out:
        out.write("".join(f"{u},{u},{u}\\n" for u in users))
def read_all(source):
    users, position = [], None
    while (chunk := source.read(100, 0.0)) is not None:
        users, position = users + chunk.users.tolist(), chunk.position
    return [users, position]
write(range(10, 50))
source = sources.DirectorySource(folder, DeadLetterFile("gs://bucket/dead.jsonl"))
read = [read_all(source)]
for users in (range(10, 60), range(100, 150), range(100, 105)):
    write(users)
    read.append(read_all(source))
print(json.dumps([read, source.rewritten_files]))
"""
    result = _python(gcs, "-c", script)
    read, rewritten_files = json.loads(result.stdout.strip().splitlines()[-1])
    expected = [range(10, 50), range(50, 60), range(100, 150), range(100, 105)]
    assert [users for users, _ in read] == [list(users) for users in expected]
    assert rewritten_files == 2
    appended = "".join(f"{u},{u},{u}\n" for u in range(10, 60)).encode()
    assert read[1][1]["offsets"] == {"a.csv": len(appended)}
    fingerprint = {"size": len(appended), "crc32": zlib.crc32(appended), "version": 1}
    assert read[1][1]["files"] == {"a.csv": fingerprint}  # no inode on gs://
    replaced = 50 * len("100,100,100\n")
    assert read[2][1]["offsets"] == {"a.csv": replaced}
    assert result.stderr.count("was rewritten") == 2
    assert (
        "was rewritten (its bytes before byte 450 changed): reading it again from its start, "
        "as version 2 of it"
    ) in result.stderr
    assert f"was rewritten (now 60 bytes, shorter than the {replaced} read)" in result.stderr


def test_an_event_file_rotated_by_rename_on_gcs_is_found_by_its_bytes_and_read_to_its_end(gcs):
    """A rename on gs:// is a copy: the file read before is found under its new name by
    its size and the checksum before the offset, and its tail read before the new file."""
    script = """
import json, tensorflow as tf
from recommendation.online import sources
from recommendation.online.sources.dead_letters import DeadLetterFile
folder = "gs://bucket/rotated"
def write(name, users):
    with tf.io.gfile.GFile(f"{folder}/{name}", "w") as out:
        out.write("".join(f"{u},{u},{u}\\n" for u in users))
write("a.csv", range(10, 50))
source = sources.DirectorySource(folder, DeadLetterFile("gs://bucket/dead2.jsonl"))
while source.read(100, 0.0) is not None:
    pass
write("a.csv", range(10, 60))  # 10 more, not read yet
tf.io.gfile.rename(f"{folder}/a.csv", f"{folder}/a.csv.1")
write("a.csv", range(100, 105))
ids = []
while (chunk := source.read(4, 0.0)) is not None:
    ids += chunk.ids
print(json.dumps([ids, source.rotated_files, source.rewritten_files]))
"""
    result = _python(gcs, "-c", script)
    ids, rotated, rewritten = json.loads(result.stdout.strip().splitlines()[-1])
    old_line, new_line = len("10,10,10\n"), len("100,100,100\n")
    assert ids == [f"a.csv:{old_line * k}" for k in range(40, 50)] + [
        f"a.csv#2:{new_line * k}" for k in range(5)
    ]
    assert (rotated, rewritten) == (1, 0)
    assert "was renamed to a.csv.1 (rotated): reading the rest of it, from byte 360" in (
        result.stderr
    )


def test_versions_on_gcs_are_those_whose_info_file_is_there(gcs):
    """On gs:// a version folder shows while it is copied into place: a reader must
    ignore one without its ``export_info.json`` (written last); the next export numbers
    above it and removes it, and a folder replaced there gets its markers last."""
    script = """
import json, sys, tensorflow as tf
from official.utils.misc import atomic
from recommendation.online.state import versioned_export
def write(path, data):
    with tf.io.gfile.GFile(path, "w") as out:
        out.write(data)
base = "gs://bucket/versions"
write(base + "/5/saved_model.pb", "partial")
write(base + "/3/" + versioned_export.INFO_FILE, json.dumps({"version": 3}))
found = [versioned_export.versions(base), versioned_export.latest_export(base)]
module = tf.Module()
module.v = tf.Variable(1.0)
serve = tf.function(lambda: {"v": module.v}, input_signature=[])
versioned_export.Exporter(base, module, {"serving_default": serve}, keep=1).export(1, {})
after = [versioned_export.versions(base), sorted(tf.io.gfile.listdir(base))]
for contents in ("old", "new"):
    with atomic.replace_folder("gs://bucket/folder", markers=("DONE",)) as temp:
        write(temp + "/data", contents)
        write(temp + "/DONE", contents)
folder = sorted(tf.io.gfile.listdir("gs://bucket/"))
data = tf.io.gfile.GFile("gs://bucket/folder/data").read()
print(json.dumps([found, after, folder, data]))
"""
    printed = _python(gcs, "-c", script).stdout.strip().splitlines()[-1]
    found, after, folder, data = json.loads(printed)
    assert found == [[3], "gs://bucket/versions/3"]
    assert after == [[6], ["6/"]]  # above the partial 5, which is removed with 3
    assert [name for name in folder if "folder" in name] == ["folder/"] and data == "new"
    assert _written_last(gcs, "folder", "DONE")


def test_a_second_writer_of_a_gcs_model_dir_is_refused(gcs):
    """No file locks on gs://: the lease is written, read back after a settling wait,
    and found there by a second process, which is refused; released, it is taken."""
    script = """
import json, subprocess, sys, tensorflow as tf
from official.core import writer_lease
from official.core.model_dir import ModelDirError
folder = "gs://bucket/leased"
hold = (
    "import sys\\n"
    "from official.core import writer_lease\\n"
    "with writer_lease.hold(sys.argv[1], 'ncf-online'):\\n"
    "    print('held', flush=True)\\n"
    "    sys.stdin.read()\\n"
)
holder = subprocess.Popen(
    [sys.executable, "-c", hold, folder], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
)
assert holder.stdout.readline() == "held\\n"
try:
    writer_lease.WriterLease(folder, "ncf-online").acquire()
    refused = None
except ModelDirError as error:
    refused = str(error)
holder.stdin.close()
holder.wait()
try:  # read, not stat: the GCS client caches what it learnt of a path for 5 s
    left = tf.io.gfile.GFile(folder + "/" + writer_lease.LEASE_FILE).read()
except tf.errors.NotFoundError:
    left = None
with writer_lease.hold(folder, "ncf-main"):
    with tf.io.gfile.GFile(folder + "/" + writer_lease.LEASE_FILE) as stream:
        program = json.load(stream)["program"]
print(json.dumps([refused, holder.pid, left, program]))
"""
    printed = _python(gcs, "-c", script).stdout.strip().splitlines()[-1]
    refused, pid, left, program = json.loads(printed)
    assert refused.startswith(
        f"--model_dir gs://bucket/leased is in use by ncf-online (pid {pid} on host "
    ), refused
    assert left is None and program == "ncf-main"  # released, then taken
