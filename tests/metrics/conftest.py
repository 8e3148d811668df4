"""Makes tests/otlp_receiver.py importable and its fixture available to the metrics tests."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from otlp_receiver import otlp_receiver  # noqa: E402,F401  (a pytest fixture)
