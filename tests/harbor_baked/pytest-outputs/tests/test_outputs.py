from pathlib import Path

FIB = Path("/app/fib.txt")


def test_file_exists():
    assert FIB.is_file()


def test_first_ten_fibonacci_numbers():
    assert [int(x) for x in FIB.read_text().split()] == [0, 1, 1, 2, 3, 5, 8, 13, 21, 34]
