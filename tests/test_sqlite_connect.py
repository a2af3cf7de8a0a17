"""Several connections opening one fresh SQLite file at once all get it in WAL mode; a file
that cannot be opened because its directory is missing says which directory."""

from __future__ import annotations

import io
import sqlite3
import threading
from pathlib import Path

import pytest

from fallback_mw.cli import main
from fallback_mw.store.sqlite_connect import connect_wal


def test_racing_openers_of_a_fresh_file_all_succeed(tmp_path: Path) -> None:
    # Plain sqlite3.connect + PRAGMA journal_mode=WAL failed 18 times in 600 such openers.
    errors: list[BaseException] = []

    def opener(path: Path, barrier: threading.Barrier) -> None:
        barrier.wait()
        try:
            conn = connect_wal(path, check_same_thread=False)
            try:
                conn.execute("BEGIN IMMEDIATE")
                conn.execute("CREATE TABLE IF NOT EXISTS t (x INTEGER)")
                conn.execute("COMMIT")
                assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
            finally:
                conn.close()
        except BaseException as exc:
            errors.append(exc)

    for trial in range(150):
        path = tmp_path / f"race-{trial}.db"
        barrier = threading.Barrier(3)
        threads = [threading.Thread(target=opener, args=(path, barrier)) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert errors == []


def test_a_file_in_a_missing_directory_names_the_directory_and_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `store = "sqlite:///data/gw.db"` run from a directory without data/: SQLite said only
    # "unable to open database file", naming neither the directory nor where a relative
    # path had been resolved from.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(sqlite3.OperationalError) as relative:
        connect_wal("data/gw.db")
    assert str(relative.value) == (
        f"unable to open database file: directory {tmp_path / 'data'} does not exist "
        f"(the relative path is resolved against the working directory {tmp_path})"
    )
    with pytest.raises(sqlite3.OperationalError) as absolute:
        connect_wal(tmp_path / "nowhere" / "gw.db")
    assert str(absolute.value) == (
        f"unable to open database file: directory {tmp_path / 'nowhere'} does not exist"
    )


def test_every_verb_names_the_missing_directory_of_its_sqlite_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "gw.toml"
    config.write_text('[gateway]\nstore = "sqlite:///data/gw.db"\n')
    missing = f"directory {tmp_path / 'data'} does not exist"
    for verb in (["routes", "list"], ["faults", "list"], ["budgets", "show"], ["usage"]):
        out, err = io.StringIO(), io.StringIO()
        status = main([*verb, "--config", str(config)], stdout=out, stderr=err)
        assert status == 1, (verb, err.getvalue())
        assert missing in err.getvalue(), (verb, err.getvalue())
        assert len(err.getvalue().splitlines()) == 1, err.getvalue()


def test_every_verb_says_when_its_sqlite_store_is_a_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `store = "sqlite:///data"` (the directory meant to hold gw.db): every verb said only
    # "unable to open database file", as if the path were missing or unreadable.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    config = tmp_path / "gw.toml"
    config.write_text('[gateway]\nstore = "sqlite:///data"\n')
    said = f"unable to open database file: {tmp_path / 'data'} is a directory, not a file"
    for verb in (["routes", "list"], ["faults", "list"], ["budgets", "show"], ["usage"]):
        out, err = io.StringIO(), io.StringIO()
        status = main([*verb, "--config", str(config)], stdout=out, stderr=err)
        assert status == 1, (verb, err.getvalue())
        assert said in err.getvalue(), (verb, err.getvalue())
        assert len(err.getvalue().splitlines()) == 1, err.getvalue()
