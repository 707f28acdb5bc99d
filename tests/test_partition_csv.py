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


def test_a_byte_order_mark_is_read_as_excel_meant_it_and_latin1_is_one_line(tmp_path):
    path = tmp_path / "partitioning.csv"
    path.write_bytes(b"\xef\xbb\xbfPartition_ID,Subject_ID\r\n1,FeTS_001\r\n2,FeTS_002\r\n")
    assert read_partition_csv(path) == {"FeTS_001": 1, "FeTS_002": 2}
    path.write_bytes("Partition_ID,Subject_ID\n1,FeTS_001\n2,Fété_002\n".encode("latin-1"))
    with pytest.raises(DataError, match=rf"^{path}, line 3: not UTF-8 text \(byte 0xe9"):
        read_partition_csv(path)
