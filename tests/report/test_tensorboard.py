import pytest

from mpifl.errors import MpiflError
from mpifl.report import tensorboard
from mpifl.report.runs import find_runs

from .synthetic import write_run


@pytest.fixture
def run(tmp_path):
    write_run(tmp_path / "run", {"mono": [0.2, 0.5], "paper": [0.4, 0.6]}, [0.1, 0.2], algo="fedavg", rounds=2)
    return find_runs([tmp_path / "run"])[0]


def test_scalars_per_round_cover_accuracy_loss_bytes_and_time(run):
    tags = {(tag, step): value for tag, value, step, _ in tensorboard.scalars(run)}
    assert tags[("global/test_acc/mono", 2)] == pytest.approx(50.0)
    assert tags[("global/test_acc/mean", 1)] == pytest.approx(30.0)
    assert tags[("global/test_loss/paper", 2)] == pytest.approx(0.5)
    assert tags[("global/val_acc/mean", 2)] == pytest.approx(20.0)
    assert tags[("bytes/down", 2)] == 2000 and tags[("seconds/round", 1)] == 0.5
    assert tags[("train/loss", 1)] == 2.0


def test_a_clocked_runs_scalars_carry_its_simulated_time(tmp_path):
    write_run(tmp_path / "run", {"mono": [0.2, 0.5]}, [0.1, 0.2], algo="fedbuff", rounds=2, sim=[3.0, 7.5])
    stamped = {(tag, step): (value, simulated) for tag, value, step, simulated in
               tensorboard.scalars(find_runs([tmp_path / "run"])[0])}
    assert stamped[("global/test_acc/mono", 2)] == (pytest.approx(50.0), 7.5)
    assert stamped[("sim/time", 1)] == (3.0, 3.0) and stamped[("sim/seconds", 2)] == (4.5, 7.5)


def test_missing_package_gives_a_clear_one_line_message(run, tmp_path, monkeypatch):
    monkeypatch.setattr(tensorboard, "available", lambda: False)
    with pytest.raises(MpiflError, match=r"pip install 'mpifl\[tensorboard\]'") as info:
        tensorboard.write_tensorboard([run], tmp_path / "out")
    assert "\n" not in str(info.value)


def test_writer_when_the_package_is_installed(run, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (log_dir,) = tensorboard.write_tensorboard([run], tmp_path / "out", ["my run"])
    assert log_dir == tmp_path / "out" / "tensorboard" / "my_run"
    events = EventAccumulator(str(log_dir))
    events.Reload()
    values = [(e.step, e.value) for e in events.Scalars("global/test_acc/mono")]
    assert values == [(1, pytest.approx(20.0)), (2, pytest.approx(50.0))]


def test_report_stops_before_writing_anything_without_the_package(run, tmp_path, monkeypatch):
    from mpifl.report import build_report

    monkeypatch.setattr(tensorboard, "available", lambda: False)
    with pytest.raises(MpiflError, match="--tensorboard needs the tensorboard package"):
        build_report([run.path], tmp_path / "out", tensorboard=True)
    assert not (tmp_path / "out").exists()


def test_a_segmentation_runs_scalars_are_its_dice(tmp_path):
    write_run(tmp_path / "seg", {"flat": [0.2, 0.5]}, [0.1, 0.2], metric="dice", algo="fedavg", rounds=2)
    tags = {(tag, step): value for tag, value, step, _ in tensorboard.scalars(find_runs([tmp_path / "seg"])[0])}
    assert tags[("global/test_dice/flat", 2)] == pytest.approx(50.0) and tags[("train/dice", 1)] == pytest.approx(10.0)
    assert not any(tag.endswith("_acc/flat") for tag, _ in tags)
