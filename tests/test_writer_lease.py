"""One writer per model_dir and per export folder: a second trainer (or export) refused,
a dead holder taken over, a holder whose lease was taken over stopping before it
writes."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import tensorflow as tf
from conftest import ROOT, TINY_NCF_MAIN_FLAGS, run_module, the_error_line, tiny_runner

from official.core import writer_lease
from official.core.model_dir import ModelDirError
from official.core.writer_lease import LEASE_FILE
from recommendation.online.state import versioned_export
from recommendation.serving import export_files

HOST = socket.gethostname()
SINCE = r"since \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC"


def _write_lease(folder, name: str = LEASE_FILE, **fields) -> dict:
    """A lease file `name` in `folder` as another process would have left it."""
    now = time.time()
    lease = {
        "program": "ncf-online",
        "host": HOST,
        "boot_id": writer_lease._boot_id(),
        "pid": 1,
        "pid_started": writer_lease._start_time(1),
        "since": now - 30,
        "renewed": now,
        "token": "theirs",
        **fields,
    }
    (folder / name).write_text(json.dumps(lease))
    return lease


def _exited_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


@pytest.mark.integration
def test_a_live_holder_on_this_host_refuses_a_second_writer(tmp_path):
    _write_lease(tmp_path)  # pid 1 runs, and started when it says
    with pytest.raises(ModelDirError) as refused:
        writer_lease.hold(str(tmp_path), "ncf-main").__enter__()
    assert re.fullmatch(
        rf"--model_dir {tmp_path} is in use by ncf-online \(pid 1 on host {HOST}, {SINCE}\), "
        r"lease renewed 0 s ago: stop that process first or give this run another "
        r"--model_dir \(it is released as soon as that process ends\)",
        str(refused.value),
    )
    assert json.loads((tmp_path / LEASE_FILE).read_text())["token"] == "theirs"


@pytest.mark.integration
@pytest.mark.parametrize(
    "fields, reason",
    [
        ({"pid": "exited"}, "its process is gone"),
        # Another process with the holder's pid: it started at another time.
        ({"pid_started": 0}, "its process is gone"),
        ({"boot_id": "an-earlier-boot"}, "its machine has restarted since"),
        ({"host": "elsewhere", "renewed_ago": 3600}, r"it has not renewed its lease for 36\d\d s"),
    ],
)
def test_a_dead_holder_is_taken_over_with_a_warning(tmp_path, caplog, fields, reason):
    if fields.get("pid") == "exited":
        fields = {"pid": _exited_pid(), "pid_started": None}
    if "renewed_ago" in fields:
        ago = fields["renewed_ago"]
        fields = {"host": fields["host"], "renewed": time.time() - ago}
    theirs = _write_lease(tmp_path, **fields)
    with writer_lease.hold(str(tmp_path), "ncf-main") as lease:
        held = json.loads((tmp_path / LEASE_FILE).read_text())
        assert held["token"] == lease.token and held["pid"] == os.getpid()
        assert held["program"] == "ncf-main" and held["host"] == HOST
    assert not (tmp_path / LEASE_FILE).exists()  # released at the end
    [warning] = [r.getMessage() for r in caplog.records if "taking over" in r.getMessage()]
    assert re.fullmatch(
        rf"taking over --model_dir {tmp_path} from ncf-online \(pid {theirs['pid']} on host "
        rf"{theirs['host']}, {SINCE}\): {reason}",
        warning,
    )


def test_a_holder_on_another_host_is_waited_for_until_its_lease_expires(tmp_path):
    _write_lease(tmp_path, host="elsewhere", renewed=time.time() - 50)
    with pytest.raises(ModelDirError, match="free 60 s after its last renewal"):
        writer_lease.hold(str(tmp_path), "ncf-main").__enter__()
    with writer_lease.hold(str(tmp_path), "ncf-main", expire_seconds=40):
        pass


def test_clean_empties_a_folder_it_holds_but_another_live_runs_export_folder(tmp_path, caplog):
    (tmp_path / "ckpt-1.index").write_text("a checkpoint")
    # Export folders in it: another live run's, a dead run's and this run's own.
    for name in ("theirs", "dead", "ours"):
        (tmp_path / name / "1").mkdir(parents=True)
    _write_lease(tmp_path, "theirs.writer_lease.json")
    _write_lease(tmp_path, "dead.writer_lease.json", boot_id="an-earlier-boot")
    with (
        writer_lease.hold(str(tmp_path), "ncf-main") as lease,
        writer_lease.hold_export(str(tmp_path / "ours"), "ncf-main"),
    ):
        lease.clear_folder()
        assert sorted(os.listdir(tmp_path)) == [
            "ours.writer_lease.json",
            "theirs",
            "theirs.writer_lease.json",
            LEASE_FILE,
        ]
    assert os.listdir(tmp_path / "theirs") == ["1"]
    [warning] = [r.getMessage() for r in caplog.records if "--clean" in r.getMessage()]
    assert re.fullmatch(
        rf"--clean leaves {tmp_path / 'theirs'} alone: ncf-online \(pid 1 on host {HOST}, "
        rf"{SINCE}\) writes it",
        warning,
    )


def test_the_lease_is_renewed_while_held(tmp_path):
    with writer_lease.hold(str(tmp_path), "ncf-online", renew_seconds=0.05) as lease:
        first = lease.record["renewed"]
        deadline = time.monotonic() + 30
        while json.loads((tmp_path / LEASE_FILE).read_text())["renewed"] == first:
            assert time.monotonic() < deadline, "never renewed"
            time.sleep(0.01)


def test_a_holder_whose_lease_was_taken_over_stops_before_its_next_checkpoint(tmp_path):
    runner = tiny_runner(str(tmp_path))
    with writer_lease.hold(str(tmp_path), "ncf-main"):
        first = runner.save_checkpoint()
        # Another host took the folder over (this process looked dead to it).
        theirs = _write_lease(tmp_path, host="elsewhere")
        with pytest.raises(ModelDirError) as stopped:
            runner.save_checkpoint()
        # Not even in a folder below it (Runner.save_best's).
        with pytest.raises(ModelDirError):
            writer_lease.check_held(str(tmp_path / "best"))
    assert re.fullmatch(
        rf"--model_dir {tmp_path} was taken over by ncf-online \(pid 1 on host elsewhere, "
        rf"{SINCE}\) while this run held it \(this one went without renewing its lease for "
        r"longer than 60 s: paused or cut off\); it stops without writing there: that "
        r"folder is the other run's now",
        str(stopped.value),
    )
    assert tf.train.get_checkpoint_state(str(tmp_path)).all_model_checkpoint_paths == [first]
    # Theirs stays: the holder that lost it does not remove it on the way out.
    assert json.loads((tmp_path / LEASE_FILE).read_text()) == theirs


@pytest.mark.parametrize("versions", [True, False], ids=["ncf-online", "ncf-main"])
def test_an_exporter_whose_lease_was_taken_over_stops_before_its_next_export(tmp_path, versions):
    module = tf.Module()
    module.v = tf.Variable(1.0)
    signatures = {"serving_default": tf.function(lambda: {"v": module.v}, input_signature=[])}
    export = tmp_path / "export"
    exporter = versioned_export.Exporter(str(export), module, signatures)

    def write(step: int) -> None:
        if versions:
            exporter.export(step, {})
        else:
            export_files.write_saved_model(str(export), module, signatures)

    with writer_lease.hold_export(str(export), "ncf-online"):
        write(1)
        exported = sorted(os.listdir(export))
        theirs = _write_lease(tmp_path, "export.writer_lease.json", host="elsewhere")
        with pytest.raises(ModelDirError) as stopped:
            write(2)
    assert re.fullmatch(
        rf"--export_dir {export} was taken over by ncf-online \(pid 1 on host elsewhere, "
        rf"{SINCE}\) while this run held it \(this one went without renewing its lease for "
        r"longer than 60 s: paused or cut off\); it stops without writing there: that "
        r"folder is the other run's now",
        str(stopped.value),
    )
    assert sorted(os.listdir(export)) == exported
    assert json.loads((tmp_path / "export.writer_lease.json").read_text()) == theirs


def test_one_process_holds_a_folder_once(tmp_path):
    with writer_lease.hold(str(tmp_path), "ncf-online"):
        with pytest.raises(ModelDirError, match=rf"in use by ncf-online \(pid {os.getpid()} "):
            writer_lease.hold(str(tmp_path / "."), "ncf-online").__enter__()


@pytest.mark.integration
def test_of_processes_starting_together_one_wins(tmp_path):
    # Four processes race for one folder from the same instant (each waits, TensorFlow
    # imported, for the go file): one takes the lease, three are refused.
    go = tmp_path / "go"
    script = (
        "import os, sys, time\n"
        "from official.core import writer_lease\n"
        "from official.core.model_dir import ModelDirError\n"
        "print('ready', flush=True)\n"
        "while not os.path.exists(sys.argv[2]):\n"
        "    time.sleep(0.001)\n"
        "try:\n"
        "    writer_lease.WriterLease(sys.argv[1], 'racer').acquire()\n"
        "except ModelDirError:\n"
        "    sys.exit(3)\n"
        "print('won', flush=True)\n"
        "sys.stdin.read()\n"
    )
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(tmp_path / "model"), str(go)],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    (tmp_path / "model").mkdir()
    assert [racer.stdout.readline() for racer in racers] == ["ready\n"] * 4
    go.write_text("")
    deadline = time.monotonic() + 120
    while sum(racer.poll() is not None for racer in racers) < 3:
        assert time.monotonic() < deadline, "the losers did not stop"
        time.sleep(0.05)
    for racer in racers:
        racer.stdin.close()  # the winner lets go
    results = [(racer.wait(timeout=120), racer.stdout.read()) for racer in racers]
    assert sorted(code for code, _ in results) == [0] + [3] * 3, results
    assert [out for _, out in results if out] == ["won\n"]


def _online(tmp_path, name: str, *flags: str, model: str = "model") -> subprocess.Popen:
    events = tmp_path / "events"
    events.mkdir(exist_ok=True)
    (events / "a.csv").write_text("".join(f"{u},{u % 7},{u}\n" for u in range(300)))
    return subprocess.Popen(
        [sys.executable, "-m", "recommendation.online_main", f"--events_dir={events}"]
        + [f"--model_dir={tmp_path / model}", "--num_factors=4", "--layers=8,4"]
        + ["--user_capacity=512", "--item_capacity=64", "--batch_size=64", *flags],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_a_checkpoint(model, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while tf.train.latest_checkpoint(str(model)) is None:
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "no checkpoint written"
        time.sleep(0.05)


def _error_line(process: subprocess.Popen) -> str:
    out, err = process.communicate(timeout=120)
    return the_error_line(subprocess.CompletedProcess(process.args, process.returncode, out, err))


@pytest.mark.integration
def test_a_second_online_trainer_is_refused_and_a_killed_one_is_taken_over(tmp_path):
    lease_file = tmp_path / "model" / LEASE_FILE
    first = _online(tmp_path, "first", "--max_seconds=600", "--checkpoint_every_steps=1")
    _wait_for_a_checkpoint(tmp_path / "model", first)
    second = _online(tmp_path, "second", "--idle_timeout_secs=1")
    assert re.fullmatch(
        rf"error: --model_dir {tmp_path / 'model'} is in use by ncf-online \(pid {first.pid} "
        rf"on host {HOST}, {SINCE}\), lease renewed \d+ s ago: stop that process first or "
        r"give this run another --model_dir \(it is released as soon as that process ends\)",
        _error_line(second),
    )
    holder = json.loads(lease_file.read_text())
    assert holder["pid"] == first.pid and holder["program"] == "ncf-online"
    first.kill()  # kill -9: the lease stays behind
    first.wait()
    third = _online(tmp_path, "third", "--idle_timeout_secs=1")
    out, err = third.communicate(timeout=240)
    assert third.returncode == 0, err[-3000:]
    assert (
        f"taking over --model_dir {tmp_path / 'model'} from ncf-online (pid {first.pid} "
        f"on host {HOST}, since " in err
    ) and "its process is gone" in err
    # The full checkpoint of step 1, or a delta after it.
    assert re.match(rf"restored {tmp_path / 'model'}/(ckpt|delta)-\d+: ", out), out
    assert not lease_file.exists()
    assert out.splitlines()[-1].startswith("online: ")


@pytest.mark.integration
def test_ncf_main_on_a_model_dir_in_use_is_refused_and_leaves_it_alone(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "ckpt-1.index").write_text("the holder's checkpoint")
    # The holder: this test's own process, alive on this host.
    _write_lease(model, pid=os.getpid(), pid_started=writer_lease._start_time(os.getpid()))
    result = subprocess.run(
        [sys.executable, "-m", "recommendation.ncf_main", *TINY_NCF_MAIN_FLAGS]
        + [f"--data_dir={tmp_path / 'data'}", f"--model_dir={model}", "--clean"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert re.fullmatch(
        rf"error: --model_dir {model} is in use by ncf-online \(pid {os.getpid()} on host "
        rf"{HOST}, {SINCE}\), lease renewed \d+ s ago: stop that process first or give this "
        r"run another --model_dir \(it is released as soon as that process ends\)",
        the_error_line(result),
    )
    assert sorted(os.listdir(model)) == ["ckpt-1.index", LEASE_FILE]  # --clean did nothing


def _in_use(flag: str, folder, program: str, pid: int) -> str:
    """The `error:` line of a run refused `folder`, which `program` (`pid`) writes."""
    return (
        rf"error: {flag} {folder} is in use by {program} \(pid {pid} on host {HOST}, "
        rf"{SINCE}\), lease renewed \d+ s ago: stop that process first or give this run "
        rf"another {flag} \(it is released as soon as that process ends\)"
    )


@pytest.mark.integration
def test_a_second_online_trainer_on_an_export_folder_in_use_is_refused(tmp_path):
    # The README's layout: the export folder inside the first trainer's model_dir, which
    # --clean empties (its own exports too) without losing the export folder's lease.
    export = tmp_path / "first" / "export"
    first = _online(
        tmp_path,
        "first",
        f"--export_dir={export}",
        "--export_every_steps=1",
        "--max_seconds=600",
        "--clean",
        model="first",
    )
    deadline = time.monotonic() + 120
    while not versioned_export.versions(str(export)):
        assert first.poll() is None, first.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "no version exported"
        time.sleep(0.05)
    second = _online(
        tmp_path, "second", f"--export_dir={export}", "--idle_timeout_secs=1", model="second"
    )
    assert re.fullmatch(
        _in_use("--export_dir", export, "ncf-online", first.pid), _error_line(second)
    )
    assert os.listdir(tmp_path / "second") == []  # nothing trained, nothing held
    first.send_signal(signal.SIGINT)
    out, err = first.communicate(timeout=120)
    assert first.returncode == 0, err[-3000:]
    assert versioned_export.versions(str(export)) and out.splitlines()[-1].startswith("online: ")
    assert not (tmp_path / "first" / "export.writer_lease.json").exists()  # released


@pytest.mark.integration
def test_ncf_main_and_the_export_command_on_an_export_folder_in_use_are_refused(tmp_path):
    export = tmp_path / "export"
    paths = [f"--data_dir={tmp_path / 'data'}", f"--export_dir={export}"]
    with open(tmp_path / "first.log", "w") as log:
        first = subprocess.Popen(
            [sys.executable, "-m", "recommendation.ncf_main", *TINY_NCF_MAIN_FLAGS, *paths]
            + [f"--model_dir={tmp_path / 'first'}", "--train_epochs=10000"],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "export.writer_lease.json").exists():
            assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the export folder's lease was never taken"
            time.sleep(0.05)
        # Paused, it holds both folders (its pid runs) and leaves the CPU to the others.
        first.send_signal(signal.SIGSTOP)
        second = run_module(
            "recommendation.ncf_main",
            *TINY_NCF_MAIN_FLAGS,
            *paths,
            f"--model_dir={tmp_path / 'second'}",
        )
        refused = _in_use("--export_dir", export, "ncf-main", first.pid)
        assert re.fullmatch(refused, the_error_line(second))
        assert os.listdir(tmp_path / "second") == []  # refused before training
        exported = run_module(
            "recommendation.export",
            *TINY_NCF_MAIN_FLAGS,
            *paths,
            f"--model_dir={tmp_path / 'first'}",
        )
        assert re.fullmatch(refused, the_error_line(exported))
        assert os.listdir(export) == []  # prepared by the first run, which exports at its end
    finally:
        first.send_signal(signal.SIGINT)
        first.send_signal(signal.SIGCONT)
        first.wait(timeout=120)
    assert first.returncode == 128 + signal.SIGINT, (tmp_path / "first.log").read_text()[-3000:]
    assert not (tmp_path / "export.writer_lease.json").exists()
