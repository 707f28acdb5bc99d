import pytest

from medfed.data.partition_csv import read_partition_csv, write_partition_csv
from medfed.errors import DataError


def test_round_trip(tmp_path):
    mapping = {"case_b": 2, "case_a": 1, "case_c": 2}
    path = tmp_path / "partitioning.csv"
    write_partition_csv(path, mapping)
    assert path.read_text().splitlines()[0] == "Partition_ID,Subject_ID"
    assert read_partition_csv(path) == mapping


@pytest.mark.parametrize(
    "text, message",
    [
        ("Site,Case\n1,a\n", "expected the header"),
        ("Partition_ID,Subject_ID\nx,a\n", "must be an integer"),
        ("Partition_ID,Subject_ID\n1,a\n2,a\n", "listed twice"),
        ("Partition_ID,Subject_ID\n", "no subjects"),
    ],
)
def test_bad_files_name_the_file(tmp_path, text, message):
    path = tmp_path / "p.csv"
    path.write_text(text)
    with pytest.raises(DataError, match=message) as info:
        read_partition_csv(path)
    assert str(path) in str(info.value)
