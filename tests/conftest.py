import os
import sys

# Spawned ranks import the test modules by name, so tests/ must be importable.
sys.path.insert(0, os.path.dirname(__file__))
