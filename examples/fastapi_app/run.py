"""One command, offline: the mock upstreams and this example on uvicorn (see README.md).

python examples/fastapi_app/run.py [--port 8000]      # --port 0 picks a free port
"""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # examples/mock_upstreams.py

from mock_upstreams import example_main  # noqa: E402

if __name__ == "__main__":
    example_main("app:app", HERE, own_route="/health", needs={"fastapi": "fastapi"})
