import json

import pytest

from mpifl.plan.config import Option, RunConfig, check, read_config_file, resolve
from mpifl.errors import MpiflError

MU = {"mu": Option("mu", float, 0.01, "prox")}


def test_defaults_then_file_then_cli():
    cfg = resolve({"rounds": 7, "lr": 0.5, "mu": 0.2}, {"lr": 0.1}, MU)
    assert cfg.rounds == 7 and cfg.lr == 0.1 and cfg.opt("mu") == 0.2
    assert cfg.batch_size == RunConfig().batch_size


def test_algorithm_option_default_when_unset():
    assert resolve({}, {}, MU).opt("mu") == 0.01


def test_yaml_and_json_files_with_dashed_keys(tmp_path):
    (tmp_path / "a.yaml").write_text("local-epochs: 3\nalgo: fedprox\n")
    (tmp_path / "b.json").write_text(json.dumps({"batch_size": 8}))
    assert read_config_file(tmp_path / "a.yaml") == {"local_epochs": 3, "algo": "fedprox"}
    assert read_config_file(tmp_path / "b.json") == {"batch_size": 8}


def test_bad_files_and_keys_are_one_line_errors(tmp_path):
    with pytest.raises(MpiflError, match="not found"):
        read_config_file(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{rounds: ")
    with pytest.raises(MpiflError, match="cannot parse") as info:
        read_config_file(tmp_path / "bad.json")
    assert "\n" not in str(info.value)
    with pytest.raises(MpiflError, match="unknown option"):
        resolve({"roundz": 3}, {}, MU)
    with pytest.raises(MpiflError, match="rounds must be int"):
        resolve({"rounds": "many"}, {}, MU)
    with pytest.raises(MpiflError, match="rounds must be int"):
        resolve({"rounds": 2.5}, {}, MU)


def test_range_checks():
    with pytest.raises(MpiflError, match="--fraction"):
        check(RunConfig(fraction=0))
    with pytest.raises(MpiflError, match="--device"):
        check(RunConfig(device="tpu"))
    with pytest.raises(MpiflError, match="either --num-clients or --clients-per-domain"):
        check(RunConfig(num_clients=10, clients_per_domain=2))
    check(RunConfig())


def test_flat_round_trip():
    cfg = resolve({}, {"seed": 4}, MU)
    again = resolve(cfg.to_flat(), {}, MU)
    assert again == cfg
