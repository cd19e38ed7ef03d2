import json
import math

import pytest
from click.testing import CliRunner

from mpifl.algorithms import ALGORITHMS, all_options, get_algorithm
from mpifl.data import KNOWN_DATASETS
from mpifl.data import camelyon, cifar, digits, fairface, isic, prostate
from mpifl.data.__main__ import PREPARERS
from mpifl.data.benchmarks import BENCHMARKS
from mpifl.errors import MpiflError
from mpifl.job.cli import configuration
from mpifl.models import MODEL_NAMES
from mpifl.plan.config import CORE_KEYS, check, resolve
from mpifl.plan.optim import round_lr
from mpifl.presets import all_presets, apply_preset, load_preset, preset_names, variant_names
from mpifl.run import main

#: each converter's domain ids (the shard names a preset's paper numbers must use)
DOMAINS = {
    "digits": list(digits.DOMAINS),
    **{name: [d.id for d in spec.domains] for name, spec in BENCHMARKS.items()},
    "cifar10": ["cifar10"],
    "cifar10c": list(cifar.CORRUPTIONS),
    "camelyon17": [camelyon.domain_id(i) for i in range(5)],
    "isic2019": [isic.domain_id(i) for i in range(len(isic.CENTERS))],
    "fairface": sorted(fairface.RACES.values()),
    "prostate": list(prostate.SITES),
}

PRESETS = preset_names()
VARIANTS = variant_names()  # NAME:VARIANT


def test_there_are_presets_for_every_seed_paper():
    prefixes = {name.split("-")[0] for name in PRESETS}
    assert prefixes == {"fedwon", "fedrdn", "fednn", "fedstein", "gperxan"}
    for wanted in ("fedwon-t1-digits", "fedwon-t1-office", "fedwon-t1-domainnet", "fedwon-t2-office-b1",
                   "fedwon-t2-office-b2", "fedwon-t3-digits-c0.1", "fedwon-t3-digits-c0.2", "gperxan-t2-pacs",
                   "fedstein-t1-digits", "fedrdn-t1-office", "fednn-t2-pacs"):
        assert wanted in PRESETS


@pytest.mark.parametrize("name", PRESETS + VARIANTS)
def test_preset_resolves_to_a_valid_config_for_each_of_its_methods(name):
    preset = load_preset(name)
    assert preset.data in KNOWN_DATASETS and preset.data in PREPARERS  # a converter exists
    assert preset.model in MODEL_NAMES
    for algo in preset.algos:
        assert algo in ALGORITHMS
        declared = {o.name: o for o in get_algorithm(algo).options}
        values = preset.values(algo)
        assert set(values) <= set(CORE_KEYS) | set(declared), f"{name}/{algo}: {set(values) - set(CORE_KEYS)}"
        cfg = resolve(values, {"algo": algo}, declared)
        check(cfg)
        assert cfg.preset == name and cfg.data == preset.data and cfg.model == preset.model
    for algo, options in preset.overrides.items():
        declared = {o.name for o in get_algorithm(algo).options}
        assert set(options) <= set(CORE_KEYS) | declared, f"{name}: {algo} does not declare {options}"
    for key in preset.options:
        assert key in CORE_KEYS or key in all_options(), key


@pytest.mark.parametrize("name", PRESETS)
def test_paper_numbers_use_the_converters_domain_names_and_are_consistent(name):
    preset = load_preset(name)
    for row in preset.results:
        assert set(row.domains) <= set(DOMAINS[preset.data]), (row.method, row.domains)
        assert set(row.std) <= set(row.acc)
        assert all(0 <= v <= 100 for v in row.acc.values()) and all(0 <= v < 10 for v in row.std.values())
        if row.domains and "mean" in row.acc:
            # the papers' own rounding and a few of their averages (e.g. FedStein's FedBN on Digits-Five,
            # 87.2 for domains averaging 85.9) differ from the mean of the domains; a misread column does more
            mean = sum(row.acc[d] for d in row.domains) / len(row.domains)
            assert abs(mean - row.acc["mean"]) < 1.5, (row.method, mean, row.acc["mean"])
    assert preset.source["file"] and preset.source["table"] and preset.results


def test_numbers_copied_from_the_papers():
    # spot checks against the paper texts (/work/shared/papers)
    won = load_preset("fedwon-t1-domainnet")
    assert won.result_for({"algo": "fedwon"}).acc == {"clipart": 57.2, "infograph": 28.1, "painting": 43.7,
                                                     "quickdraw": 69.2, "real": 56.5, "sketch": 51.9, "mean": 51.1}
    assert won.result_for({"algo": "fedbn"}).std["sketch"] == 6.7  # Table 22
    assert won.values("fedbn")["lr"] == 0.05 and won.values("fedavg")["lr"] == 0.01  # Table 8
    stein = load_preset("fedstein-t1-digits").result_for({"algo": "fedbn"})
    assert stein.acc["mnistm"] == 78.6  # FedStein's FedBN column differs from FedWon's (84.6)
    rdn = load_preset("fedrdn-t1-office")
    assert rdn.result_for({"algo": "scaffold", "aug": "fedrdn"}).acc["amazon"] == 65.10
    gp = load_preset("gperxan-t2-pacs").result_for({"algo": "gperxan"})
    assert gp.acc == {"photo": 97.27, "art_painting": 86.52, "cartoon": 84.68, "sketch": 83.28, "mean": 87.94}
    assert load_preset("fednn-t2-pacs").result_for({"algo": "fednn", "fednn_base": "fedavg"}).acc == {"mean": 90.06}
    small = load_preset("fedwon-t2-office-b1")
    assert small.values("fedwon")["lr"] == 0.005 and small.options["batch_size"] == 1  # Table 9


def test_paper_row_is_the_most_specific_match():
    rdn = load_preset("fedrdn-t1-office")
    assert rdn.result_for({"algo": "fedavg"}).method == "FedAvg"  # aug defaults to none
    assert rdn.result_for({"algo": "fedavg", "aug": "none", "input_norm": "imagenet"}).method == "FedAvg + norm"
    assert rdn.result_for({"algo": "fedmix", "aug": "fedrdn"}) is None
    nn = load_preset("fednn-t2-digits")
    assert nn.result_for({"algo": "fednn", "fednn_base": "fedprox"}).method == "FedProx+Ours (FedNN)"


@pytest.mark.parametrize("name", ["fedrdn-t1-office", "fedrdn-t1-domainnet"])
def test_fedrdn_presets_make_their_rows_and_augment_as_the_authors_code(name):
    """fedavg_with_preprocess.py: '+ norm' is ImageNet's mean/std (preprocess_way 'base'), not the client's own
    statistics; its training images are flipped and rotated in [-30, 30] degrees."""
    preset = load_preset(name)
    assert preset.options["train_transforms"] == "flip,rotate"
    norm_rows = [r for r in preset.results if r.method.endswith("+ norm")]
    assert len(norm_rows) == 8 and all(r.run == {"algo": r.algo, "aug": "none", "input_norm": "imagenet"}
                                       for r in norm_rows)
    assert preset.result_for({"algo": "fedbn", "aug": "norm"}) is None  # own statistics: no row of the table


def test_method_options_apply_only_to_methods_declaring_them():
    won = load_preset("fedwon-t1-digits")
    assert won.values("fedavg")["uniform_weights"] is True and won.values("fedprox")["mu"] == 0.01
    assert "mu" not in won.values("fedavg") and "uniform_weights" not in won.values("singleset")


def test_precedence_defaults_preset_config_file_command_line(tmp_path):
    values, warnings = apply_preset("fedwon-t1-office", "fedwon", {"rounds": 5})
    assert values["rounds"] == 5 and values["lr"] == 0.1 and values["batch_size"] == 32 and not warnings
    (tmp_path / "exp.yaml").write_text("rounds: 7\nlr: 0.2\n")
    cfg, warnings = configuration(["--preset", "fedwon-t1-office", "--algo", "fedwon", "--config",
                                          str(tmp_path / "exp.yaml"), "--lr", "0.3"])
    assert (cfg.rounds, cfg.lr, cfg.batch_size, cfg.data, cfg.model) == (7, 0.3, 32, "office_caltech",
                                                                          "alexnet-dropout")
    assert cfg.preset == "fedwon-t1-office" and cfg.opt("uniform_weights") is True and not warnings
    assert json.loads(json.dumps(cfg.to_flat()))["preset"] == "fedwon-t1-office"  # config.json keeps it


def test_input_norm_auto_is_imagenet_with_pretrained_weights_else_pooled_and_an_explicit_mode_wins(tmp_path):
    weights = tmp_path / "w.pt"
    for argv, expected in (([], "pooled"), (["--pretrained", str(weights)], "imagenet"),
                           (["--pretrained", str(weights), "--input-norm", "domain"], "domain")):
        assert configuration(argv)[0].input_norm == expected  # config.json stores it resolved


def test_algo_outside_the_preset_warns_and_unknown_preset_is_an_error():
    cfg, warnings = configuration(["--preset", "gperxan-t2-pacs", "--algo", "scaffold"])
    assert cfg.holdout == "all" and cfg.lr == 0.002
    assert warnings == ["--preset gperxan-t2-pacs has no paper numbers for --algo scaffold (it has: fedavg, "
                        "mixstyle, rsc, elcfs, ccst, copa, feddg-ga, gperxan); running with the preset's settings anyway"]
    with pytest.raises(MpiflError, match="unknown preset 'nope'; see `python -m mpifl.run --list-presets`"):
        load_preset("nope")


@pytest.mark.parametrize("algo, guide", [("fedavg", 0.0), ("elcfs", 0.0), ("gperxan", 0.5)])
def test_gperxan_presets_guide_only_gperxan(algo, guide):
    """The table's baselines run unguided; gPerXAN with its own lambda 0.5."""
    for name in ("gperxan-t2-pacs", "gperxan-t2-officehome", "gperxan-t3-camelyon17"):
        cfg, _ = configuration(["--preset", name, "--algo", algo])
        assert cfg.opt("guide_lambda") == guide, name


@pytest.mark.parametrize("algo", ["fedavg", "copa", "gperxan"])
def test_gperxan_presets_anneal_and_keep_the_optimizer_as_the_authors_client(algo):
    """source/main/client.py: one SGD optimizer per client for the whole run, CosineAnnealingLR(T_max = rounds)
    stepped before each round: round r trains at lr (1 + cos(pi r / R)) / 2."""
    for name in ("gperxan-t2-pacs", "gperxan-t2-officehome", "gperxan-t3-camelyon17"):
        cfg, _ = configuration(["--preset", name, "--algo", algo])
        assert (cfg.lr_schedule, cfg.lr_min, cfg.keep_optimizer, cfg.horizon) == ("cosine", 0.0, True, 100), name
        assert round_lr(cfg, 1) == pytest.approx(0.002 * (1 + math.cos(math.pi / 100)) / 2)
        assert round_lr(cfg, 100) == 0.0


def test_list_presets_shows_every_preset_with_its_source():
    result = CliRunner().invoke(main, ["--list-presets"])
    assert result.exit_code == 0, result.output
    for preset in all_presets():
        assert f"{preset.name}: {preset.title}" in result.output
    assert "Without Normalization, Table 1 (standard deviations: Table 22; learning rates: Table 8)" in result.output


@pytest.mark.parametrize("name", [n for n in preset_names() if n.startswith("fednn-")])
def test_fednn_presets_decay_and_clip_every_method_as_the_authors_code(name):
    for algo in ("fedavg", "scaffold", "fednn"):
        values, _ = apply_preset(name, algo, {})
        assert (values["lr_schedule"], values["lr_gamma"], values["max_grad_norm"]) == ("exp", 0.998, 10.0)


def test_prostate_base_rows_feed_unscaled_intensities_as_fedfas_and_harmofls_loaders():
    """FedFA's and HarmoFL's Prostate loaders feed torch.Tensor(uint8 slice): 0..255, no normalization."""
    import torch

    from mpifl.plan.normalize import fixed
    from mpifl.data.registry import FIXED_NORMALIZATION

    assert load_preset("fedrdn-t2-prostate").options["input_norm"] == "fixed"
    scale, shift = fixed(*FIXED_NORMALIZATION["prostate"]).eval()
    pixels = torch.tensor([0.0, 1.0, 128.0, 255.0]).reshape(1, 1, 4, 1).expand(1, 3, 4, 1)
    assert torch.equal(pixels * scale + shift, pixels)


def test_gperxan_camelyon17_puts_perxan_in_the_first_dense_block_and_its_transition_not_the_stem():
    """Section 4.2: 'BN layers in the first dense block and the following transition block are replaced by PerXAN'
    (the authors' public code has no DenseNet); the stem's norm0 stays plain BN."""
    cfg, _ = configuration(["--preset", "gperxan-t3-camelyon17", "--algo", "gperxan"])
    model = get_algorithm("gperxan").network(cfg, num_classes=2, in_channels=3, image_size=(96, 96))
    modules = dict(model.named_modules())
    kinds = [type(modules[f"features.{n}"]).__name__
             for n in ("norm0", "denseblock1.denselayer6.norm2", "transition1.norm", "denseblock2.denselayer1.norm1")]
    assert kinds == ["BatchNorm2d", "PerXAN", "PerXAN", "BatchNorm2d"]


def test_prostate_augments_as_fedfas_and_harmofls_loaders():
    """pyfed/dataset/dataset.py and utils/dataset.py, Prostate.__getitem__: RandomRotate90, then RandomFlip."""
    assert load_preset("fedrdn-t2-prostate").options["train_transforms"] == "rot90-flip"


@pytest.mark.parametrize("name", PRESETS + VARIANTS)
def test_a_run_of_the_preset_keeps_every_setting_it_names(name):
    """The report compares a run's config.json with the preset's values (changed_settings): a value the config
    stores otherwise (PyYAML reads ``1e-05``, without a dot, as a string) would mark every run as changed."""
    from mpifl.report.tables import changed_settings

    preset = load_preset(name)
    for algo in preset.algos:
        cfg = resolve(preset.values(algo), {"algo": algo}, {o.name: o for o in get_algorithm(algo).options})
        assert changed_settings(preset, json.loads(json.dumps(cfg.to_flat()))) == {}, algo


def _config(argv: list[str]):
    return configuration(argv)[0]


def test_fedrdn_office_offers_the_authors_code_and_the_papers_sizes_as_variants():
    plain, code, sizes = (load_preset(n) for n in ("fedrdn-t1-office", "fedrdn-t1-office:code",
                                                    "fedrdn-t1-office:paper-sizes"))
    assert {"fedrdn-t1-office:code", "fedrdn-t1-office:paper-sizes"} <= set(VARIANTS)
    # the plain preset: every training image, sample-size weights, the last round
    assert plain.selection == "last" and not {"samples_per_client", "percent", "uniform_weights"} & set(plain.options)
    # fedavg_with_preprocess.py: the first int(0.5 x 125) = 62 images per client, weights n_k / n (equal),
    # range(1, 100) = 99 rounds, the best round reported
    assert (code.selection, code.options["samples_per_client"], code.options["rounds"]) == ("best", 62, 99)
    assert code.values("fedavg")["uniform_weights"] is True and "uniform_weights" not in code.values("fedproto")
    assert sizes.selection == "last" and sizes.options["percent"] == 0.665
    for variant in (code, sizes):
        assert variant.results == plain.results and variant.overrides == plain.overrides  # the same paper rows
        assert variant.notes[:len(plain.notes)] == plain.notes and len(variant.notes) > len(plain.notes)
        assert variant.title.startswith(plain.title) and variant.name in variant.values("fedbn")["preset"]
    cfg = _config(["--preset", "fedrdn-t1-office:code", "--algo", "fedavg", "--aug", "fedrdn"])
    assert (cfg.preset, cfg.samples_per_client, cfg.rounds, cfg.opt("uniform_weights"), cfg.local_epochs) == \
        ("fedrdn-t1-office:code", 62, 99, True, 5)
    assert code.result_for(cfg.to_flat()).method == "FedAvg + FedRDN"
    assert _config(["--preset", "fedrdn-t1-office:code", "--algo", "fedavg", "--rounds", "3"]).rounds == 3


def test_fedrdn_office_paper_sizes_variant_trains_on_table_6s_sizes_but_one_dslr_image():
    """Table 6: 459/538/75/141 training images.  The office_caltech converter's 72/8/20 split of the 2,533 images
    (958/1123/157/295) has 690/809/114/212 training images; --percent 0.665 keeps 459/538/76/141 of them."""
    from mpifl.data.manifest import DatasetManifest
    from mpifl.plan.clients import make_clients

    train = {"amazon": 690, "caltech": 809, "dslr": 114, "webcam": 212}
    manifest = DatasetManifest(name="office_caltech", domains=list(train), classes=[str(k) for k in range(10)],
                               image_size=(64, 64), channels=3, splits={d: {"train": n, "val": 1, "test": 1}
                                                                        for d, n in train.items()},
                               normalize={}, shards={}, source="fake", protocol={})
    percent = load_preset("fedrdn-t1-office:paper-sizes").options["percent"]
    for seed in (0, 1):
        clients = make_clients(manifest, 1, seed, percent=percent)
        assert [c.num_train for c in clients] == [459, 538, 76, 141]
    assert [len(c.rows["train"]) for c in make_clients(manifest, 1, 0, samples_per_client=62)] == [62] * 4


def test_a_variant_that_does_not_exist_is_a_one_line_error_naming_those_that_do():
    with pytest.raises(MpiflError, match=r"^preset fedrdn-t1-office has no variant 'nope'; its variants: "
                                         r"fedrdn-t1-office:code, fedrdn-t1-office:paper-sizes, or run --preset "
                                         r"fedrdn-t1-office$"):
        load_preset("fedrdn-t1-office:nope")
    with pytest.raises(MpiflError, match=r"^preset fedwon-t1-office has no variant ''; it has no variants"):
        load_preset("fedwon-t1-office:")
    with pytest.raises(MpiflError, match="^unknown preset 'nope'"):
        load_preset("nope:code")


@pytest.mark.parametrize("variant, problem", [
    ({"title": "t", "options": {"rounds": 1}, "selection": "first"}, "selection must be one of"),
    ({"title": "t", "options": {"rounds": 1}, "rows": []}, r"unknown keys \['rows'\] in variant 'v'"),
    ({"title": "t"}, "variant 'v' has no options"),
    ({"options": {"rounds": 1}}, "KeyError: 'title'"),
])
def test_a_malformed_variant_is_a_one_line_error(tmp_path, monkeypatch, variant, problem):
    import yaml

    import mpifl.presets as presets

    raw = yaml.safe_load((presets.PRESET_DIR / "fedrdn-t1-office.yaml").read_text())
    raw["variants"] = {"v": variant}
    (tmp_path / "fedrdn-t1-office.yaml").write_text(yaml.safe_dump(raw))
    monkeypatch.setattr(presets, "PRESET_DIR", tmp_path)
    with pytest.raises(MpiflError, match=f"^preset file .* is malformed: .*{problem}") as refused:
        load_preset("fedrdn-t1-office:v")
    assert "\n" not in str(refused.value)


def test_list_presets_shows_each_variant_and_the_round_each_compares():
    output = CliRunner().invoke(main, ["--list-presets"]).output
    assert "    compares: our last round with the paper's" in output
    assert ("    variant fedrdn-t1-office:code: the authors' code: 62 training images per client, equal weights, 99 "
            "rounds, best round (samples_per_client=62, uniform_weights=True, rounds=99; compares our "
            "best-validation round)") in output
    assert "    variant fedrdn-t1-office:paper-sizes: " in output
