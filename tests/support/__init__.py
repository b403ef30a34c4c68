"""What the tests share: paths, servers, HTTP checks, model families, reliability figures.

Imported as `tests.support.<module>` (the repository root is on sys.path under pytest), never by a
bare name."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
