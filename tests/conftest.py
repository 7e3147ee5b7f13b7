import sys
from pathlib import Path

# Rank processes unpickle test functions by module name: keep tests/ importable.
sys.path.insert(0, str(Path(__file__).parent))
