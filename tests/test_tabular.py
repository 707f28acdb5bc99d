import os

import numpy as np
import pytest
from sklearn.datasets import load_breast_cancer

from medfed.data.tabular import (
    check_sites_have_both_classes,
    fit_minmax,
    read_tabular_csv,
    scale_to_unit_interval,
    write_breast_cancer_csv,
)
from medfed.errors import DataError
from medfed.options.tasks import BREAST_CANCER_POSITIVE, BREAST_CANCER_TARGET

RECORDS = """patient,age,bleeding,hospital,creatinine
p1,71,yes,A,1.2
p2,,no,A,NA
p3,65.5,no,B,NaN

p4,80,yes,B,n/a
p5,59,no,A,0.9
"""


def write(tmp_path, text, name="records.csv"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_round_trip_with_missing_values_filled_with_zero(tmp_path):
    path = write(tmp_path, RECORDS)
    data = read_tabular_csv(path, target="bleeding", positive="yes", site_column="hospital",
                            exclude_columns=("patient",))
    assert data.feature_names == ("age", "creatinine")
    assert data.features.dtype == np.float32 and data.labels.dtype == np.int64
    np.testing.assert_array_equal(
        data.features, np.array([[71, 1.2], [0, 0], [65.5, 0], [80, 0], [59, 0.9]], dtype=np.float32)
    )
    np.testing.assert_array_equal(data.labels, [1, 0, 0, 1, 0])
    assert data.sites.tolist() == ["A", "A", "B", "B", "A"]
    assert data.missing_per_column == {"age": 1, "creatinine": 3} and data.categories == {}
    assert data.n_missing == 4 and len(data) == 5


def test_numeric_positive_value_and_no_site_column(tmp_path):
    path = write(tmp_path, "x1,y\n0.5,1\n-2,0\n")
    data = read_tabular_csv(path, target="y", positive=1)
    assert data.sites is None
    np.testing.assert_array_equal(data.labels, [1, 0])
    np.testing.assert_array_equal(data.features, [[0.5], [-2.0]])


def test_scaling_maps_training_range_to_unit_interval():
    rng = np.random.default_rng(0)
    train = rng.normal(size=(50, 4)) * [1, 10, 100, 0] + [0, 5, -3, 7]  # last feature constant
    lo, hi = fit_minmax(train)
    np.testing.assert_array_equal(lo, train.min(axis=0))
    scaled = scale_to_unit_interval(train, lo, hi)
    assert scaled.dtype == np.float32
    np.testing.assert_allclose(scaled[:, :3].min(axis=0), -1.0)
    np.testing.assert_allclose(scaled[:, :3].max(axis=0), 1.0)
    np.testing.assert_array_equal(scaled[:, 3], 0.0)
    # hand computation for one value, and clipping of test rows outside the training range
    expected = 2 * (train[7, 1] - lo[1]) / (hi[1] - lo[1]) - 1
    assert scaled[7, 1] == pytest.approx(expected, rel=1e-6)
    test_rows = np.array([lo - 1.0, hi + 1.0])
    np.testing.assert_array_equal(scale_to_unit_interval(test_rows, lo, hi)[:, :3], [[-1, -1, -1], [1, 1, 1]])


def test_scaling_rejects_bad_shapes():
    with pytest.raises(ValueError, match="lo and hi"):
        scale_to_unit_interval(np.zeros((3, 2)), np.zeros(3), np.ones(3))
    with pytest.raises(ValueError, match="finite"):
        fit_minmax(np.array([[np.nan]]))


def test_breast_cancer_table_matches_scikit_learn_and_is_cached(tmp_path):
    path = write_breast_cancer_csv(tmp_path / "wdbc" / "breast_cancer.csv")
    reference = load_breast_cancer()
    data = read_tabular_csv(path, target=BREAST_CANCER_TARGET, positive=BREAST_CANCER_POSITIVE)
    np.testing.assert_array_equal(data.features, reference.data.astype(np.float32))
    assert data.feature_names == tuple(reference.feature_names)
    malignant = list(reference.target_names).index("malignant")
    np.testing.assert_array_equal(data.labels, (reference.target == malignant).astype(np.int64))
    assert data.labels.sum() == 212 and data.n_missing == 0

    os.utime(path, (1_000_000, 1_000_000))
    write_breast_cancer_csv(path)
    assert path.stat().st_mtime == 1_000_000  # same content: not rewritten
    path.write_text("stale\n")
    write_breast_cancer_csv(path)
    assert path.read_text().startswith("diagnosis,mean radius")
    assert [p.name for p in path.parent.iterdir()] == ["breast_cancer.csv"]  # no temporary left behind


@pytest.mark.parametrize(
    "text, kwargs, message",
    [
        ("a,b\n1,yes\n", dict(target="y", positive="yes"), "column 'y' not found"),
        ("a,y\n1,yes\n2,no\n", dict(target="y", positive="yes", site_column="site"), "column 'site' not found"),
        ("a,c,y\n1,2,yes\n2,x7,no\n3,4,no\n", dict(target="y", positive="yes"),
         "column 'c' mixes numbers and text: 1 of 3 values are not finite numbers, first 'x7' on line 3"),
        ("a,y\ninf,yes\n2,no\n", dict(target="y", positive="yes"),
         "column 'a' mixes numbers and text: 1 of 2 values are not finite numbers, first 'inf' on line 2"),
        ("a,c,y\n1,low,yes\n2,high,no\n3,7,no\n", dict(target="y", positive="yes"),
         "column 'c' mixes numbers and text: 1 of 3 values are numbers among text, first '7' on line 4"),
        ("a,id,y\n1,p1,yes\n2,p2,no\n3,,no\n", dict(target="y", positive="yes"),
         r"column 'id' is text with 2 distinct values \(a different one in every record\).*data\.exclude_columns"),
        ("a,c,y\n" + "".join(f"{i},v{i % 51},{'yes' if i % 2 else 'no'}\n" for i in range(102)),
         dict(target="y", positive="yes"), r"column 'c' is text with 51 distinct values, too many .*at most 50"),
        ("a,y\n1,yes\n2,no\n3,maybe\n", dict(target="y", positive="yes"), "exactly one other class"),
        ("a,y\n1,no\n2,no\n", dict(target="y", positive="yes"), "exactly one other class"),
        ("a,y\n1,yes\n2,\n", dict(target="y", positive="yes"), "column 'y' has 1 missing value"),
        ("a,y,s\n1,yes,A\n2,no,\n", dict(target="y", positive="yes", site_column="s"), "column 's' has 1 missing"),
        ("a,a,y\n1,2,yes\n", dict(target="y", positive="yes"), "duplicate column"),
        ("a,y\n1,yes\n2\n", dict(target="y", positive="yes"), "line 3: expected 2 fields"),
        ("y\nyes\nno\n", dict(target="y", positive="yes"), "no feature columns"),
        ("a,y\n", dict(target="y", positive="yes"), "no records"),
    ],
)
def test_bad_files_name_the_file_and_column(tmp_path, text, kwargs, message):
    path = write(tmp_path, text)
    with pytest.raises(DataError, match=message) as info:
        read_tabular_csv(path, **kwargs)
    assert str(path) in str(info.value)


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="not found"):
        read_tabular_csv(tmp_path / "absent.csv", target="y", positive=1)


def test_sites_need_both_classes():
    labels = np.array([1, 0, 1, 1, 0, 0])
    sites = np.array(["A", "A", "B", "B", "C", "C"])
    with pytest.raises(DataError, match="records.csv: .*B: 2 positive, 0 negative; C: 0 positive, 2 negative"):
        check_sites_have_both_classes(labels, sites, source="records.csv")
    check_sites_have_both_classes(labels[:2], sites[:2])  # site A alone has both: no error


def test_text_column_becomes_sorted_level_indicators_and_a_missing_cell_all_zeros(tmp_path):
    path = write(tmp_path, "age,gender,y,smoker\n50,female,1,no\n61,male,0,NA\n47,female,0,yes\n70,,1,no\n")
    data = read_tabular_csv(path, target="y", positive=1)
    assert data.feature_names == ("age", "gender=female", "gender=male", "smoker=no", "smoker=yes")
    assert data.categories == {"gender": ("female", "male"), "smoker": ("no", "yes")}
    assert data.missing_per_column == {"age": 0, "gender": 1, "smoker": 1} and data.n_missing == 2
    np.testing.assert_array_equal(
        data.features,
        np.array([[50, 1, 0, 1, 0], [61, 0, 1, 0, 0], [47, 1, 0, 0, 1], [70, 0, 0, 1, 0]], dtype=np.float32),
    )


def test_levels_are_sorted_as_text_whatever_the_order_of_the_file(tmp_path):
    path = write(tmp_path, "stage,y\nIIb,1\nI,0\nIIa,0\nI,1\nIIb,0\n")
    data = read_tabular_csv(path, target="y", positive=1)
    assert data.categories == {"stage": ("I", "IIa", "IIb")}
    np.testing.assert_array_equal(data.features.argmax(axis=1), [2, 0, 1, 0, 2])


def test_yes_no_target_matches_the_positive_value_as_text(tmp_path):
    path = write(tmp_path, "a,outcome\n1,Yes\n2,No\n3,No\n")
    np.testing.assert_array_equal(read_tabular_csv(path, target="outcome", positive="Yes").labels, [1, 0, 0])
    np.testing.assert_array_equal(read_tabular_csv(path, target="outcome", positive="No").labels, [0, 1, 1])


@pytest.mark.parametrize("positive, spelled", [(True, "Yes"), (False, "No")])
def test_a_boolean_positive_value_says_the_config_read_a_boolean_and_to_quote_it(tmp_path, positive, spelled):
    path = write(tmp_path, "a,outcome\n1,Yes\n2,No\n3,No\n")
    with pytest.raises(DataError) as info:
        read_tabular_csv(path, target="outcome", positive=positive)
    assert str(info.value) == (
        f"{path}: column 'outcome' must hold the positive value '{positive}' and exactly one other class, "
        f"found ['No', 'Yes']; the config read the positive value as the boolean {positive} (YAML reads an unquoted "
        f'true/false, and YAML 1.1 also yes/no/on/off, as booleans): quote it, e.g. data.positive: "{spelled}"'
    )


def test_a_boolean_positive_value_matches_a_column_of_true_and_false(tmp_path):
    path = write(tmp_path, "a,event\n1,True\n2,False\n")
    np.testing.assert_array_equal(read_tabular_csv(path, target="event", positive=True).labels, [1, 0])


# --- what hospitals' exports really hold (issue 24) ---------------------------------------------------


def test_excel_csv_utf8_with_a_byte_order_mark_reads_as_without(tmp_path):
    plain = tmp_path / "plain.csv"
    plain.write_bytes(RECORDS.encode("utf-8"))
    bom = tmp_path / "bom.csv"
    bom.write_bytes(b"\xef\xbb\xbf" + RECORDS.replace("\n", "\r\n").encode("utf-8"))  # Excel's "CSV UTF-8"
    kwargs = dict(target="bleeding", positive="yes", site_column="hospital", exclude_columns=("patient",))
    a, b = read_tabular_csv(plain, **kwargs), read_tabular_csv(bom, **kwargs)
    assert a.feature_names == b.feature_names == ("age", "creatinine")
    np.testing.assert_array_equal(a.features, b.features)
    np.testing.assert_array_equal(a.labels, b.labels)


def test_a_latin1_byte_is_one_line_naming_the_file_line_and_byte(tmp_path):
    path = tmp_path / "records.csv"
    path.write_bytes(RECORDS.replace("p3,65.5,no,B", "p3,65.5,no,Bègles").encode("latin-1"))
    with pytest.raises(DataError) as info:
        read_tabular_csv(path, target="bleeding", positive="yes", exclude_columns=("patient",))
    assert str(info.value).startswith(f"{path}, line 4: not UTF-8 text (byte 0xe8 at offset ")
    assert "\n" not in str(info.value)


def test_a_200_kb_cell_is_one_line_naming_the_file_and_line(tmp_path):
    path = tmp_path / "records.csv"
    path.write_text(RECORDS.replace("p4,80", "p4," + "8" * 200_000))
    with pytest.raises(DataError, match=rf"^{path}, line \d+: not a readable CSV row \(field larger than field limit"):
        read_tabular_csv(path, target="bleeding", positive="yes", exclude_columns=("patient",))


@pytest.mark.parametrize("value", ["1e300", "-3.5e38"])
def test_a_value_beyond_float32_is_refused_naming_column_and_line(tmp_path, value):
    path = tmp_path / "records.csv"
    path.write_text(RECORDS.replace("p5,59,no,A,0.9", f"p5,59,no,A,{value}"))
    with pytest.raises(DataError, match=rf"column 'creatinine' holds '{value}' on line 7, beyond float32's range"):
        read_tabular_csv(path, target="bleeding", positive="yes", exclude_columns=("patient",))


def test_the_largest_float32_value_is_kept(tmp_path):
    path = tmp_path / "records.csv"
    path.write_text(RECORDS.replace("p5,59,no,A,0.9", "p5,59,no,A,3.4e38"))
    data = read_tabular_csv(path, target="bleeding", positive="yes", exclude_columns=("patient", "hospital"))
    assert np.isfinite(data.features).all() and data.features.max() == np.float32(3.4e38)


@pytest.mark.parametrize("text, message", [
    # (issue 32, item 8: both were accepted, as the categories 'inf'/'-inf' and 'a\x00b')
    ("a,c,y\n1,inf,yes\n2,-inf,no\n3,inf,no\n",
     "column 'c' holds '-inf' on line 3, a number that is not finite (a missing value is empty or one of n/a, na, nan, null)"),
    ("a,c,y\n1,low,yes\n2,hi\x00gh,no\n3,low,no\n", "line 3: holds the control character U+0000 at offset 20 (a NUL or other control byte"),
])
def test_a_column_of_infinities_or_a_nul_byte_is_refused_naming_the_line_not_made_a_category(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(DataError) as info:
        read_tabular_csv(path, target="y", positive="yes")
    assert str(info.value).startswith(f"{path}") and message in str(info.value), info.value
