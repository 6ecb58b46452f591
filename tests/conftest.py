import sys
from pathlib import Path

# tests/models.py is a plain helper module, not an installed package.
sys.path.insert(0, str(Path(__file__).parent))
