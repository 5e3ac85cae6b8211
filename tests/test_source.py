"""The code fingerprint in every start record (turnopd.core.source)."""

import hashlib

from turnopd.core.source import PACKAGE, code_fingerprint


def test_the_fingerprint_hashes_each_files_path_and_bytes_in_path_order_without_bytecode(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__pycache__").mkdir()
    (package / "sub" / "b.py").write_bytes(b"y = 2\n")
    (package / "a.py").write_bytes(b"x = 1\n")
    (package / "__pycache__" / "a.cpython-312.pyc").write_bytes(b"\x00bytecode")
    # by hand: "a.py" sorts before "sub/b.py"; each entry is path NUL bytes NUL
    expected = hashlib.sha256(b"a.py\0x = 1\n\0sub/b.py\0y = 2\n\0").hexdigest()[:16]
    assert code_fingerprint(package) == expected
    (package / "__pycache__" / "a.cpython-312.pyc").write_bytes(b"other bytecode")  # caches do not count
    code_fingerprint.cache_clear()
    assert code_fingerprint(package) == expected
    (package / "a.py").write_bytes(b"x = 3\n")  # one changed byte does
    code_fingerprint.cache_clear()
    assert code_fingerprint(package) != expected
    (package / "a.py").write_bytes(b"x = 1\n")
    (package / "sub" / "b.py").rename(package / "sub" / "c.py")  # and so does a renamed file
    code_fingerprint.cache_clear()
    assert code_fingerprint(package) != expected


def test_the_installed_package_is_fingerprinted_from_its_own_folder():
    assert (PACKAGE / "core" / "source.py").is_file()
    assert len(code_fingerprint()) == 16 and int(code_fingerprint(), 16) >= 0
