import csv

import numpy as np
import pytest
import torch

from medfed.config import FederationConfig, LabelRatioConfig, parse_options
from medfed.data.label_ratio import site_ratios
from medfed.data.tabular import read_tabular_csv
from medfed.errors import ConfigError, DataError
from medfed.tasks.clinical import Options, build_federation

from holdout_checks import assert_validation_carved_from_training, validation_subjects

LABEL_RATIO = LabelRatioConfig(delta=2.0, spread=1.5)


def federation_of(options, n_sites=3, seed=0, label_ratio=LABEL_RATIO):
    return build_federation(options, FederationConfig(n_sites=n_sites, label_ratio=label_ratio), seed, progress=False)


@pytest.fixture
def breast_cancer(tmp_path):
    """The embedded default, written under tmp_path."""
    return Options(csv=str(tmp_path / "breast_cancer.csv"))


def write_records(path, rows, header=("hospital", "event", "a", "b")):
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def two_hospitals(path, extreme_row=3):
    """Hospital A with features in [0, 10], hospital B in [100, 200]; one A record holds an extreme value."""
    rng = np.random.default_rng(0)
    rows = []
    for hospital, low, high in (("A", 0, 10), ("B", 100, 200)):
        for i in range(20):
            rows.append([hospital, "yes" if i % 3 == 0 else "no", *np.round(rng.uniform(low, high, 2), 3)])
    rows[extreme_row][2] = 1e6
    return write_records(path, rows)


def test_default_is_the_real_breast_cancer_table(breast_cancer):
    federation = federation_of(breast_cancer, n_sites=5)
    assert federation.task == "clinical" and not federation.generated
    assert "REAL data" in federation.description and "breast-cancer" in federation.description
    assert federation.input_shape == (30,) and federation.num_classes == 2
    for site in federation.sites:
        x, y = site.train.tensors
        assert x.dtype == torch.float32 and x.shape[1] == 30 and y.dtype == torch.int64
        assert -1 <= x.min() and x.max() <= 1 and -1 <= site.test.tensors[0].min() and site.test.tensors[0].max() <= 1


@pytest.mark.parametrize("delta", [1.0, 2.0, 4.0])
def test_every_site_has_its_ratio_in_train_and_in_test_and_records_are_disjoint(breast_cancer, delta):
    label_ratio = LabelRatioConfig(delta=delta, spread=1.5)
    federation = federation_of(breast_cancer, n_sites=5, label_ratio=label_ratio)
    seen = set()
    for site, target in zip(federation.sites, site_ratios(delta, 5, 1.5)):
        train, test = set(site.info["train_records"]), set(site.info["test_records"])
        assert train.isdisjoint(test) and seen.isdisjoint(train | test)
        seen |= train | test
        assert len(train) == len(site.train) and len(test) == len(site.test)
        for split in (site.train, site.test):
            y = split.tensors[1]
            n_pos, n_neg = int(y.sum()), int((y == 0).sum())
            assert n_pos >= 1 and abs(n_neg - target * n_pos) <= 0.5


def test_seeded(breast_cancer):
    first, again, other = (federation_of(breast_cancer, seed=s) for s in (0, 0, 1))
    assert [s.info for s in first.sites] == [s.info for s in again.sites]
    assert all(torch.equal(a.train.tensors[0], b.train.tensors[0]) for a, b in zip(first.sites, again.sites))
    assert [s.info["test_records"] for s in first.sites] != [s.info["test_records"] for s in other.sites]


def test_scaling_uses_only_the_sites_own_training_records(tmp_path):
    path = two_hospitals(tmp_path / "records.csv")
    options = Options(csv=str(path), embedded=None, target="event", positive="yes", site_column="hospital")
    # a seed that puts the extreme A record (position 3) into A's test split, so a fit over test rows would show
    seed = next(s for s in range(100) if 3 in federation_of(options, 2, s, None).sites[0].info["test_records"])
    federation = federation_of(options, n_sites=2, seed=seed, label_ratio=None)
    raw = read_tabular_csv(path, target="event", positive="yes", site_column="hospital").features.astype(np.float64)
    for site, hospital in zip(federation.sites, ("A", "B")):
        assert site.info["source_site"] == hospital and "training records only" in site.info["scaling"]
        train_rows, test_rows = site.info["train_records"], site.info["test_records"]
        lo, hi = raw[train_rows].min(axis=0), raw[train_rows].max(axis=0)
        for split, rows in ((site.train, train_rows), (site.test, test_rows)):
            expected = np.clip(2 * (raw[rows] - lo) / (hi - lo) - 1, -1, 1)
            np.testing.assert_allclose(split.tensors[0].numpy(), expected, atol=1e-6)
        x_train = site.train.tensors[0]
        assert torch.equal(x_train.min(dim=0).values, -torch.ones(2))  # the site's own training range spans [-1, 1]
        assert torch.equal(x_train.max(dim=0).values, torch.ones(2))
    assert federation.sites[0].test.tensors[0].max() == 1.0  # the extreme test value is clipped, not fitted


def test_site_column_with_another_number_of_sites_is_a_config_error(tmp_path):
    options = Options(csv=str(two_hospitals(tmp_path / "r.csv")), embedded=None, target="event", positive="yes",
                      site_column="hospital")
    with pytest.raises(ConfigError, match="n_sites.*'hospital'.*2 sites"):
        federation_of(options, n_sites=3, label_ratio=None)


def test_missing_target_column_names_file_and_column(tmp_path):
    path = two_hospitals(tmp_path / "records.csv")
    with pytest.raises(DataError, match=r"records\.csv: column 'outcome' not found"):
        federation_of(Options(csv=str(path), embedded=None, target="outcome", positive="yes"), label_ratio=None)


def test_a_column_mixing_numbers_and_text_names_file_and_column(tmp_path):
    rows = [["A", "yes" if i % 2 else "no", i, "high" if i == 5 else i] for i in range(10)]
    path = write_records(tmp_path / "records.csv", rows)
    with pytest.raises(DataError, match=r"records\.csv: column 'b' mixes numbers and text: 1 of 10 .* 'high'"):
        federation_of(Options(csv=str(path), embedded=None, target="event", positive="yes",
                              exclude_columns=["hospital"]), n_sites=1)


def test_single_class_site_names_the_site(tmp_path):
    rows = [["A", "yes" if i % 2 else "no", i, i] for i in range(10)] + [["B", "no", i, i] for i in range(10)]
    path = write_records(tmp_path / "records.csv", rows)
    options = Options(csv=str(path), embedded=None, target="event", positive="yes", site_column="hospital")
    with pytest.raises(DataError, match=r"records\.csv, site column 'hospital'.*B: 0 positive, 10 negative"):
        federation_of(options, n_sites=2, label_ratio=None)


def test_site_with_too_few_records_of_a_class_for_a_split_names_the_site(tmp_path):
    rows = [["A", "yes" if i == 0 else "no", i, i] for i in range(10)]
    path = write_records(tmp_path / "records.csv", rows)
    with pytest.raises(DataError, match="site0 has 1 positive record"):
        federation_of(Options(csv=str(path), embedded=None, target="event", positive="yes",
                              exclude_columns=["hospital"]), n_sites=1, label_ratio=None)


def test_the_embedded_table_never_replaces_another_file(tmp_path):
    path = two_hospitals(tmp_path / "records.csv")
    before = path.read_bytes()
    with pytest.raises(DataError, match=r"records\.csv: exists and is not the embedded 'breast_cancer' table"):
        federation_of(Options(csv=str(path)))
    assert path.read_bytes() == before


def test_unknown_embedded_table_is_a_config_error():
    with pytest.raises(ConfigError, match="embedded"):
        Options(embedded="diabetes")


def test_validation_holdout_splits_training_records_by_class_and_seeded(breast_cancer):
    def build(seed, holdout, label_ratio=None):
        federation = FederationConfig(n_sites=5, label_ratio=label_ratio, holdout=holdout,
                                      validation_fraction=0.2 if holdout == "validation" else 0.0)
        return build_federation(breast_cancer, federation, seed, progress=False)

    on_test, on_validation = build(0, "test"), build(0, "validation")
    assert_validation_carved_from_training(on_test, on_validation, "records")
    for site in on_validation.sites:
        assert site.info["validation_records"] == sorted(site.info["validation_records"])
        assert len(site.test) == len(site.info["validation_records"]) and len(site.train) == len(site.info["train_records"])
        assert set(site.test.tensors[1].tolist()) == {0, 1}  # stratified: both classes in validation
        # the validation share of each class is round(0.2 * that class's training records)
        for label, name in ((1, "positive"), (0, "negative")):
            n_train_of_class = site.info[f"n_train_{name}"] + site.info[f"n_validation_{name}"]
            assert site.info[f"n_validation_{name}"] == round(0.2 * n_train_of_class)
    assert validation_subjects(build(0, "validation"), "records") == validation_subjects(on_validation, "records")
    assert validation_subjects(build(1, "validation"), "records") != validation_subjects(on_validation, "records")


def test_validation_records_get_the_label_ratio_and_test_records_stay_out(breast_cancer):
    federation = FederationConfig(n_sites=5, label_ratio=LABEL_RATIO, holdout="validation", validation_fraction=0.2)
    on_validation = build_federation(breast_cancer, federation, 0, progress=False)
    for site, target in zip(on_validation.sites, site_ratios(LABEL_RATIO.delta, 5, LABEL_RATIO.spread)):
        y = site.test.tensors[1]
        n_pos, n_neg = int(y.sum()), int((y == 0).sum())
        assert n_pos >= 1 and abs(n_neg - target * n_pos) <= 0.5
        assert site.info["n_validation_positive"] == n_pos and site.info["validation_ratio"] == pytest.approx(n_neg / n_pos)
        used = set(site.info["train_records"]) | set(site.info["validation_records"])
        assert used.isdisjoint(site.info["test_records"])


def test_a_text_column_is_one_hot_encoded_and_its_levels_reach_the_summary(tmp_path):
    rows = [["A" if i < 10 else "B", "yes" if i % 3 == 0 else "no", i, ["female", "male", ""][i % 3]] for i in range(20)]
    path = write_records(tmp_path / "records.csv", rows, header=("hospital", "event", "age", "gender"))
    options = Options(csv=str(path), embedded=None, target="event", positive="yes", site_column="hospital")
    federation = federation_of(options, n_sites=2, label_ratio=None)
    assert federation.input_shape == (3,)
    assert federation.summary()["features"] == {
        "names": ["age", "gender=female", "gender=male"],
        "categorical": {"gender": ["female", "male"]},
        "missing_per_column": {"age": 0, "gender": 6},
    }
    assert "3 features, 1 categorical column(s) one-hot encoded, 6 missing cells" in federation.description
    site = federation.sites[0]  # hospital A, records 0 .. 9; scaled per site: indicator 0 -> -1, 1 -> 1
    expected = [[1.0, -1.0] if i % 3 == 0 else [-1.0, 1.0] if i % 3 == 1 else [-1.0, -1.0] for i in site.info["train_records"]]
    np.testing.assert_array_equal(site.train.tensors[0][:, 1:].numpy(), expected)


def test_an_unquoted_yes_in_the_config_reaches_the_reader_as_a_boolean_and_the_error_says_to_quote_it(tmp_path):
    rows = [["A", "Yes" if i % 3 == 0 else "No", i, i] for i in range(12)]
    path = write_records(tmp_path / "records.csv", rows)
    values = {"csv": str(path), "embedded": None, "target": "event", "positive": True, "exclude_columns": ["hospital"]}
    options = parse_options(Options, values, "data")  # what YAML 1.1 makes of `positive: Yes`
    assert options.positive is True
    with pytest.raises(DataError, match=r"read the positive value as the boolean True .* data\.positive: \"Yes\""):
        federation_of(options, n_sites=1, label_ratio=None)
    quoted = federation_of(parse_options(Options, {**values, "positive": "Yes"}, "data"), n_sites=1, label_ratio=None)
    assert quoted.sites[0].info["n_train_positive"] + quoted.sites[0].info["n_test_positive"] == 4


def test_records_dropped_by_the_label_ratio_are_counted_and_a_site_losing_most_is_named(tmp_path, caplog):
    # hospital A: 4 positives in 40 records (natural ratio 9); delta 1 keeps 1 negative per positive
    rows = [[hospital, "yes" if i % 10 == 0 else "no", i, -i] for hospital in ("A", "B") for i in range(40)]
    path = write_records(tmp_path / "records.csv", rows)
    options = Options(csv=str(path), embedded=None, target="event", positive="yes", site_column="hospital")
    federation = federation_of(options, n_sites=2, label_ratio=LabelRatioConfig(delta=1.0, spread=1.0))
    for site in federation.sites:  # train 3 + 29 -> 3 + 3 kept; test 1 + 7 -> 1 + 1 kept
        assert (len(site.train), site.info["n_train_dropped"], len(site.test), site.info["n_test_dropped"]) == (6, 26, 2, 6)
    assert caplog.messages[-1].startswith(
        "federation.label_ratio (delta 1, spread 1) drops more than half of the records of site0 (32 of 40 dropped, "
        "its own ratio 9), site1 (32 of 40 dropped, its own ratio 9)"
    )


def test_weighted_site_sizes_deal_the_records_and_are_recorded(breast_cancer):
    federation = FederationConfig(n_sites=3, site_sizes=[1, 2, 5], validation_fraction=0.2)
    built = build_federation(breast_cancer, federation, 0, progress=False)
    # 569 * [1, 2, 5] / 8 = 71.125, 142.25, 355.625: floors 71, 142, 355 (568), +1 to site2
    assert built.summary()["site_sizes"] == {"setting": [1.0, 2.0, 5.0], "n_records": [71, 142, 356]}
    for site, n_records in zip(built.sites, [71, 142, 356]):  # no label ratio: every record is in a split
        splits = [site.info[f"{split}_records"] for split in ("train", "test", "validation")]
        assert sum(map(len, splits)) == n_records and len(set().union(*splits)) == n_records
        assert len(site.validation) == len(splits[2]) and set(site.validation.tensors[1].tolist()) == {0, 1}


def test_site_sizes_with_a_site_column_are_a_config_error(tmp_path):
    options = Options(csv=str(two_hospitals(tmp_path / "r.csv")), embedded=None, target="event", positive="yes",
                      site_column="hospital")
    federation = FederationConfig(n_sites=2, site_sizes="skewed")
    with pytest.raises(ConfigError, match=r"'federation\.site_sizes' = 'skewed': data\.site_column 'hospital' places the records"):
        build_federation(options, federation, 0, progress=False)
